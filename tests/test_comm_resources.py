"""Communicator management, and no leaked MPI communicators or datatypes.

Leaks are counted in the MPI library itself: it reuses the slots of freed objects, so the handles
of a batch of 32 new objects are the same before and after a loop that frees everything it
creates (give or take the few slots the loop's peak concurrency added), while every object the
loop leaked occupies one of those slots and pushes a new handle into the batch.
"""

import gc

import pytest
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core._buffers import force_staging
from heatlike.core.topology import Topology

pytestmark = pytest.mark.mpi

CALLS = 2_000


BATCH, SLACK = 32, 4


def _datatype_slots() -> set[int]:
    types = [MPI.INT.Create_contiguous(3).Commit() for _ in range(BATCH)]
    handles = {t.py2f() for t in types}
    for t in types:
        t.Free()
    return handles


def _comm_slots() -> set[int]:
    comms = [MPI.COMM_WORLD.Dup() for _ in range(BATCH)]
    handles = {c.py2f() for c in comms}
    for c in comms:
        c.Free()
    return handles


def _settle(comm) -> None:
    """Before a baseline: the objects of earlier tests collected, and the communicators the
    collector dropped freed (by a creation), not inside the measured loop."""
    gc.collect()
    comm.Dup().Free()
    comm.Barrier()


def _slots_moved_by(comm, loop) -> int:
    """How many of a batch of communicator slots free before ``loop()`` are taken after it (a
    leak of one communicator per iteration takes them all; a loop that frees everything moves
    only as many as it held at once)."""
    _settle(comm)
    before = _comm_slots()
    loop()
    _settle(comm)
    return len(_comm_slots() - before)


def _live_communicators() -> tuple[int, int, int]:
    """(heatlike communicators alive, dropped ones not freed yet, boards): what a leak of
    dropped models would grow. The slot count of ``_slots_moved_by`` does not fit them: their
    communicators are freed later, at a creation, so more of them are alive at once."""
    from heatlike.core import checks
    from heatlike.core.communication import unfreed_communicators

    return len(checks._HUBS), unfreed_communicators(), len(checks._BOARDS)


def _whole_up_to_three(comm, kept: bool) -> None:
    """Sweeps over many models: every case at up to three ranks (one and two ranks per
    emulated node, uneven nodes at three), the ``kept`` ones at four too (two nodes of two
    ranks, real ones in ``make test``), where a communicator is freed the same way, so that
    ``make test`` stays within its time."""
    if comm.size > 3 and not kept:
        pytest.skip("a sweep over many models: this case at up to three ranks")


def _assert_no_leak(before: set[int], after: set[int], what: str) -> None:
    moved = len(after - before)
    assert moved <= SLACK, f"{moved} of {BATCH} {what} slots are taken after the loop: a leak"


@pytest.mark.mpi_timeout(300)
def test_no_datatype_or_communicator_leak_in_data_paths(comm):
    """2,000 operations over strided, staged, half and v-collective paths create no MPI object
    that outlives them."""
    size = comm.size
    base = torch.zeros(2 * size, 3)
    strided = base[:, 1]
    bf = torch.ones(5, dtype=torch.bfloat16)
    counts = [1] * size
    out = torch.zeros(size)
    ops = [
        lambda: comm.Allreduce(hl.IN_PLACE, strided),
        lambda: comm.Iallreduce(torch.ones(3), torch.zeros(6)[::2]).wait(),
        lambda: comm.Allreduce(hl.IN_PLACE, bf),
        lambda: comm.Allgather(torch.ones(2), base[:, 0]),
        lambda: comm.Alltoallv((torch.ones(size), counts), (out, counts)),
        lambda: comm.Bcast(base.t()[2], root=0),
        lambda: comm.Reduce_scatter(torch.ones(size), out[:1], counts),
    ]
    for op in ops:  # the library allocates some objects once, on first use of a call
        op()
    _settle(comm)
    dt0, comm0 = _datatype_slots(), _comm_slots()
    for i in range(CALLS):
        if i % 3 == 0:
            with force_staging():
                ops[i % len(ops)]()
        else:
            ops[i % len(ops)]()
    _assert_no_leak(dt0, _datatype_slots(), "datatype")
    _assert_no_leak(comm0, _comm_slots(), "communicator")


@pytest.mark.mpi_timeout(300)
def test_no_communicator_leak_in_comm_management(comm):
    """2,000 communicator creations (Split, Split_type, Dup, Create_group, topologies; freed
    explicitly, by ``with``, or by dropping the wrapper) leave no communicator behind."""
    everyone = list(range(comm.size))

    def create(i):
        kind = i % 6
        if kind == 0:
            comm.Split(comm.rank % 2, comm.rank).Free()
        elif kind == 1:
            with comm.Dup() as dup:
                assert dup.size == comm.size
        elif kind == 2:
            comm.Split_type()  # dropped at once: freed by its finalizer
        elif kind == 3:
            sub = comm.Create_group(everyone[::-1])
            assert sub.rank == comm.size - 1 - comm.rank
            sub.Free()
            sub.Free()  # idempotent
        elif kind == 4:
            assert comm.Split(MPI.UNDEFINED) is None
        elif i % 60 == 5:
            Topology(comm).free()

    for i in range(6):  # the library allocates some objects once, on first use of a call
        create(i)
    _settle(comm)
    comm0 = _comm_slots()
    for i in range(CALLS):
        create(i)
    _settle(comm)
    _assert_no_leak(comm0, _comm_slots(), "communicator")


def _sweep_model(comm, kind: str, seed: int, steps: int, hidden: int = 8,
                 warmup_epochs: int = 1, last_batch: int = 2):
    """A point of a model sweep: ``kind`` "DataParallel" (non-blocking, a two-phase codec) or
    "DASO" (after ``warmup_epochs`` of gradient warmup, cycling), a 5-``hidden``-3 MLP trained
    ``steps`` steps of epochs of ``last_batch`` batches; returns (model, optimizer)."""
    from torch import nn

    from heatlike.nn import DataParallel, DataParallelMultiGPU
    from heatlike.optim import DASO, DataParallelOptimizer

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    if kind == "DataParallel":
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
        model = DataParallel(net, comm, optimizer=opt, codec="bf16")
    else:
        opt = DASO(torch.optim.SGD(net.parameters(), lr=0.1), total_epochs=4, comm=comm,
                   warmup_epochs=warmup_epochs, cooldown_epochs=0)
        model = DataParallelMultiGPU(net, opt)
        opt.last_batch = last_batch
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
    return model, opt


def _sweep_kind(i: int) -> str:
    return "DataParallel" if i % 2 else "DASO"


def _train_recipe(comm, name: str, seed: int):
    """An algorithm of heatlike.recipes built on a small MLP and trained two steps; its
    runner."""
    from heatlike import recipes

    net = recipes.mlp([64, 16, 10], seed)
    runner = recipes.make_runner(name, net, comm, lr=0.01)
    runner.start_epoch(2)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(2):
        runner.train_step(torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,),
                                                                           generator=g))
    runner.finish()
    return runner


@pytest.mark.mpi_timeout(300)
@pytest.mark.parametrize("nodes", [1, 2], ids=["one-rank-per-node", "two-ranks-per-node"])
def test_closed_models_leave_no_communicator_behind(comm, monkeypatch, nodes):
    """A sweep that builds and closes models (DataParallel with a two-phase codec, DASO through
    its gradient warmup and a cycling epoch) leaves no communicator behind: ``close()`` frees
    the private channels, DASO's node and cross-node communicators and the topologies cached on
    them. (Dropped without ``close()``, a DASO held about 11 communicators until MPI_Finalize.)"""
    _whole_up_to_three(comm, kept=nodes == 2)
    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(nodes))

    def sweep_point(i):
        model, opt = _sweep_model(comm, _sweep_kind(i), i, steps=4)
        model.close()
        if not i % 2:
            with pytest.raises(RuntimeError, match="closed"):
                opt.step()
        elif i == 1:  # DataParallel: a training forward raises; evaluation still works
            with pytest.raises(RuntimeError, match="closed"):
                model(torch.randn(4, 5))
            model.eval()
            assert model(torch.randn(4, 5)).shape == (4, 3)

    for i in range(4):  # the library allocates some objects once, on first use of a call
        sweep_point(i)
    # a DASO holds about a dozen communicators at once, which moves that many slots; a leak of
    # one per model would move all 32
    moved = _slots_moved_by(comm, lambda: [sweep_point(i) for i in range(36)])
    assert moved <= 14, f"{moved} of {BATCH} communicator slots are taken after the loop: a leak"


@pytest.mark.mpi_timeout(300)
@pytest.mark.parametrize("ending", ["closed", "dropped"])
def test_every_preset_leaves_no_communicator_behind(comm, monkeypatch, ending):
    """Every algorithm of heatlike.recipes, built and trained two steps on two emulated nodes,
    several times over, leaves no communicator behind, whether it is closed (``Runner.close``:
    the model's and the optimizer's ``close()``) or dropped without it (the garbage collector
    frees model and optimizer, and a later creation their communicators; before, the gradient
    hooks kept them alive, holding 3 communicators each). A closed one raises instead of
    training unsynchronized."""
    from heatlike import recipes

    _whole_up_to_three(comm, kept=ending == "dropped")
    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(max(1, comm.size // 2)))
    monkeypatch.setattr(recipes, "COMPRESSION_WARMUP", 1)
    names = [n for n in recipes.ALGORITHMS if n != "decentralized" or comm.size >= 3]

    def build_train_end(name, seed):
        runner = _train_recipe(comm, name, seed)
        if ending == "closed":
            runner.close()
            if seed == 0:  # a closed model or optimizer refuses to train, on every rank
                with pytest.raises(RuntimeError, match="closed"):
                    runner.train_step(torch.randn(4, 64), torch.randint(0, 10, (4,)))

    for name in names:  # the library allocates some objects once, on first use of a call
        build_train_end(name, 0)
    if ending == "dropped":
        _settle(comm)
        before = _live_communicators()
        for seed in range(1, 3):
            for name in names:
                build_train_end(name, seed)
        _settle(comm)
        assert _live_communicators() == before, "(communicators, unfreed, boards) grew"
        return
    moved = _slots_moved_by(comm, lambda: [build_train_end(name, seed)
                                           for seed in range(1, 3) for name in names])
    assert moved <= 14, f"{moved} of {BATCH} communicator slots are taken after the loop: a leak"


def test_split_create_group_and_forwarding(comm):
    size, rank = comm.size, comm.rank
    with comm.Split(color=rank % 2, key=-rank) as sub:
        members = [r for r in range(size) if r % 2 == rank % 2]
        assert sub.size == len(members)
        assert sub.rank == sorted(members, reverse=True).index(rank)
        x = torch.tensor([float(rank)])
        sub.Allreduce(hl.IN_PLACE, x)
        assert x.item() == sum(members)
    assert sub.freed
    evens = list(range(0, size, 2))
    group = comm.Create_group(evens)
    if rank % 2:
        assert group is None
    else:
        assert group.size == len(evens) and group.rank == evens.index(rank)
        assert group.allreduce(rank) == sum(evens)  # lower-case methods forward to mpi4py
        group.Free()
    assert comm.allgather(rank) == list(range(size))
    assert comm.Get_size() == size


def test_default_communicator_helpers(comm):
    assert hl.get_comm() is hl.MPI_WORLD
    try:
        hl.use_comm(hl.MPI_SELF)
        assert hl.get_comm() is hl.MPI_SELF
        assert hl.core.sanitize_comm(None) is hl.MPI_SELF
    finally:
        hl.use_comm(None)
    assert hl.get_comm() is hl.MPI_WORLD
    wrapped = hl.core.sanitize_comm(MPI.COMM_WORLD)
    assert wrapped.size == comm.size and wrapped.handle is MPI.COMM_WORLD
    with pytest.raises(TypeError):
        hl.core.sanitize_comm("world")
    assert hl.MPI_SELF.size == 1 and not hl.MPI_SELF.is_distributed()


def test_chunk_matches_heat_convention(comm):
    """The first n % P ranks hold one extra row (Heat's chunk)."""
    shape = (10, 3)
    offsets, rows = [], []
    for r in range(comm.size):
        off, lshape, slices = comm.chunk(shape, 0, rank=r)
        offsets.append(off)
        rows.append(lshape[0])
        assert lshape[1] == 3 and slices[0] == slice(off, off + lshape[0])
    base, extra = divmod(10, comm.size)
    assert rows == [base + (r < extra) for r in range(comm.size)]
    assert offsets == [sum(rows[:r]) for r in range(comm.size)]
    assert comm.chunk(shape, None) == (0, shape, (slice(0, 10), slice(0, 3)))
    assert comm.counts_displs(10) == (rows, offsets)
    counts, displs, out = comm.counts_displs_shape((4, 10, 3), 1)  # Heat's name and layout
    assert (list(counts), list(displs)) == (rows, offsets)
    assert out == (4, comm.size * rows[comm.rank], 3)
    assert comm.counts_displs_shape((10, 3), -2) == (counts, displs, (comm.size * rows[comm.rank],
                                                                       3))
    with pytest.raises(ValueError, match="axis"):
        comm.counts_displs_shape((10, 3), 2)
    with pytest.raises(TypeError, match="shape"):
        comm.counts_displs_shape((10.0, 3), 0)


def _drop_in_a_cycle(wrapper) -> MPI.Comm:
    """Drop ``wrapper`` inside a reference cycle (only the cyclic collector can free it);
    returns its MPI handle."""
    handle = wrapper.handle
    holder = {"comm": wrapper}
    holder["self"] = holder
    return handle


def test_a_communicator_the_cycle_collector_finds_is_freed_at_the_next_creation(comm):
    """A wrapper dropped by reference counting frees its communicator at once (the same point
    of every rank's program). One caught in a reference cycle is found by the cyclic collector
    at an arbitrary point, different on every rank; freeing it there once made a 4-rank DASO
    test hang (one rank in MPI_Comm_free waiting for ranks that waited for it in a collective).
    So it is kept, still a working communicator, and freed by the next communicator creation
    over its ranks, on every rank together."""
    from heatlike.core.communication import unfreed_communicators

    gc.collect()
    comm.Dup().Free()
    before = unfreed_communicators()
    dropped = comm.Dup()
    handle = dropped.handle
    del dropped
    assert handle == MPI.COMM_NULL, "a wrapper dropped by reference counting was not freed"
    handle = _drop_in_a_cycle(comm.Dup())
    gc.collect()
    assert unfreed_communicators() == before + 1
    assert handle != MPI.COMM_NULL and handle.Get_size() == comm.size  # not freed
    assert handle.allreduce(1) == comm.size  # and still a working communicator
    comm.Split(0, comm.rank).Free()  # any creation over its ranks frees it, on every rank
    assert handle == MPI.COMM_NULL
    assert unfreed_communicators() == before


def test_a_dropped_communicator_is_freed_once_every_member_dropped_it(comm, monkeypatch):
    """Rank 0's collector finds a dropped communicator before the others': the next creation
    runs the collector on every rank (at most every ``COLLECT_EVERY`` seconds; here always) and
    frees it on every rank together. One that some member
    still holds is kept (and still works) until a creation after that member dropped it too. A
    communicator of half the ranks is freed by a creation over that half; one made from a
    communicator the program created itself (heatlike cannot name it among the ranks) is left
    to MPI_Finalize."""
    from heatlike.core import communication
    from heatlike.core.communication import unfreed_communicators

    monkeypatch.setattr(communication, "COLLECT_EVERY", 0.0)
    gc.collect()
    gc.disable()
    try:
        handle = _drop_in_a_cycle(comm.Dup())
        if comm.rank == 0:
            gc.collect()
        comm.Dup().Free()
        assert handle == MPI.COMM_NULL

        kept = comm.Dup()
        handle = kept.handle
        if comm.rank != comm.size - 1:  # the last rank keeps its wrapper for now
            _drop_in_a_cycle(kept)
            del kept
        comm.Dup().Free()
        if comm.size > 1:
            assert handle != MPI.COMM_NULL, "freed before every member dropped it"
            assert handle.allreduce(comm.rank) == comm.size * (comm.size - 1) // 2
        if comm.rank == comm.size - 1:
            _drop_in_a_cycle(kept)
            del kept
        gc.collect()  # one rank: a creation runs no collector (no other rank to agree with)
        comm.Dup().Free()
        assert handle == MPI.COMM_NULL

        half = comm.Split(comm.rank % 2, comm.rank)
        handle = _drop_in_a_cycle(half.Dup())
        gc.collect()
        half.Dup().Free()
        assert handle == MPI.COMM_NULL
        half.Free()

        before = unfreed_communicators()
        own = hl.MPICommunication(MPI.COMM_WORLD.Dup())  # the program's, not heatlike's
        handle = _drop_in_a_cycle(own.Dup())
        gc.collect()
        own.Dup().Free()
        assert handle != MPI.COMM_NULL and unfreed_communicators() == before + 1
        own.handle.Free()
    finally:
        gc.enable()


@pytest.mark.mpi_timeout(300)
def test_dropped_models_leave_no_communicator_behind(comm, monkeypatch):
    """A sweep that drops its models without ``close()`` (DataParallel with a two-phase codec,
    DASO through its warmup), on two emulated nodes, with each rank's garbage collector running
    at other points (rank r collects every r + 1 models), does not run out of communicators:
    each model's communicators are freed at a later creation, once every rank dropped them.
    Before, a model's hooks kept it alive, and 300 dropped DataParallel models exhausted
    MPICH's communicators at 4 ranks."""
    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(max(1, comm.size // 2)))

    def sweep_point(i):
        _sweep_model(comm, _sweep_kind(i), i, steps=3)

    def sweep() -> None:
        gc.disable()
        try:
            for i in range(8):
                sweep_point(i)
                if i % (comm.rank + 1) == 0:
                    gc.collect()
        finally:
            gc.enable()

    for i in range(4):  # the library allocates some objects once, on first use of a call
        sweep_point(i)
    _settle(comm)
    before = _live_communicators()
    sweep()
    _settle(comm)
    assert _live_communicators() == before, "(communicators, unfreed, boards) grew"


@pytest.mark.mpi_timeout(120)
@pytest.mark.parametrize("kind", ["DataParallel", "DASO"])
def test_a_model_dropped_mid_exchange_never_blocks_the_collector(comm, monkeypatch, kind):
    """A model dropped while its exchanges are in flight (non-blocking updates pending, or a
    DASO synchronization between send and merge), collected on rank 0 while the other ranks
    already wait in a plain MPI barrier. The collector's finalizer used to wait there for the
    exchanges, whose next phases the other ranks issue only when they test them: rank 0 never
    reached the barrier (this hung a 4-rank test on two virtual-cluster nodes). Now the
    exchanges are kept, driven by later waits, and completed on every rank together before
    their communicators are freed."""
    from heatlike.core import checks, communication
    from heatlike.core.communication import unfreed_communicators

    monkeypatch.setattr(communication, "COLLECT_EVERY", 0.0)
    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(max(1, comm.size // 2)))
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_MIN_KB", "0")  # sums in many chunks: many phases
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_CHUNK_KB", "1")

    def train_and_drop() -> bool:
        model, opt = _sweep_model(comm, kind, 0, steps=3, hidden=64, warmup_epochs=0,
                                  last_batch=8)
        if kind == "DataParallel":
            return any(not r.done for r in model.grad_sync._requests.values())
        return any(not r.done for sync in opt._pending for r in sync.requests)

    _settle(comm)
    before = unfreed_communicators()
    gc.disable()
    try:
        in_flight = train_and_drop()
        if comm.rank == 0:
            gc.collect()
        MPI.COMM_WORLD.Barrier()
        gc.collect()
    finally:
        gc.enable()
    if kind == "DataParallel" and comm.size > 1:
        assert in_flight, "the test needs exchanges in flight when the model is dropped"
    comm.Dup().Free()  # frees the dropped model's communicators, its exchanges completed first
    assert unfreed_communicators() == before
    assert not checks.ORPHANS
