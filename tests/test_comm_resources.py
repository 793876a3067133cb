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

CALLS = 10_000


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


def _assert_no_leak(before: set[int], after: set[int], what: str) -> None:
    moved = len(after - before)
    assert moved <= SLACK, f"{moved} of {BATCH} {what} slots are taken after the loop: a leak"


@pytest.mark.mpi_timeout(300)
def test_no_datatype_or_communicator_leak_in_data_paths(comm):
    """10,000 operations over strided, staged, half and v-collective paths create no MPI object
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
    gc.collect()  # objects of earlier tests freed now, not inside the measured loop
    comm.Barrier()
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
    """10,000 communicator creations (Split, Split_type, Dup, Create_group, topologies; freed
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
    gc.collect()  # objects of earlier tests freed now, not inside the measured loop
    comm.Barrier()
    comm0 = _comm_slots()
    for i in range(CALLS):
        create(i)
    gc.collect()
    _assert_no_leak(comm0, _comm_slots(), "communicator")


@pytest.mark.mpi_timeout(300)
@pytest.mark.parametrize("nodes", [1, 2], ids=["one-rank-per-node", "two-ranks-per-node"])
def test_closed_models_leave_no_communicator_behind(comm, monkeypatch, nodes):
    """A sweep that builds and closes models (DataParallel with a two-phase codec, DASO through
    its gradient warmup and a cycling epoch) leaves no communicator behind: ``close()`` frees
    the private channels, DASO's node and cross-node communicators and the topologies cached on
    them. (Dropped without ``close()``, a DASO held about 11 communicators until MPI_Finalize.)"""
    from torch import nn

    from heatlike.nn import DataParallel, DataParallelMultiGPU
    from heatlike.optim import DASO, DataParallelOptimizer

    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(nodes))

    def sweep_point(i):
        torch.manual_seed(i)
        net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        if i % 2:
            opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
            model = DataParallel(net, comm, optimizer=opt, codec="bf16")
        else:
            opt = DASO(torch.optim.SGD(net.parameters(), lr=0.1), total_epochs=3, comm=comm,
                       warmup_epochs=1, cooldown_epochs=0)
            model = DataParallelMultiGPU(net, opt)
            opt.last_batch = 2
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 5)).sum().backward()
            opt.step()
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
    gc.collect()
    comm.Barrier()
    comm0 = _comm_slots()
    for i in range(60):
        sweep_point(i)
    gc.collect()
    # a DASO holds about a dozen communicators at once, which moves that many slots; a leak of
    # one per model would move all 32
    moved = len(_comm_slots() - comm0)
    assert moved <= 14, f"{moved} of {BATCH} communicator slots are taken after the loop: a leak"


@pytest.mark.mpi_timeout(300)
def test_every_closed_preset_leaves_no_communicator_behind(comm, monkeypatch):
    """Every algorithm of heatlike.recipes, built, trained two steps and closed
    (``Runner.close``: the model's and the optimizer's ``close()``) on two emulated nodes, five
    times over, leaves no communicator behind (dropped without it, most held 3); a closed one
    raises instead of training unsynchronized."""
    from heatlike import recipes

    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(max(1, comm.size // 2)))
    monkeypatch.setattr(recipes, "COMPRESSION_WARMUP", 1)
    names = [n for n in recipes.ALGORITHMS if n != "decentralized" or comm.size >= 3]

    def build_train_close(name, seed):
        net = recipes.mlp([64, 16, 10], seed)
        runner = recipes.make_runner(name, net, comm, lr=0.01)
        runner.start_epoch(2)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(2):
            runner.train_step(torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,),
                                                                               generator=g))
        runner.finish()
        runner.close()
        if seed == 0:  # a closed model or optimizer refuses to train, on every rank
            with pytest.raises(RuntimeError, match="closed"):
                runner.train_step(torch.randn(4, 64), torch.randint(0, 10, (4,)))

    for name in names:  # the library allocates some objects once, on first use of a call
        build_train_close(name, 0)
    gc.collect()
    comm.Barrier()
    comm0 = _comm_slots()
    for seed in range(1, 6):
        for name in names:
            build_train_close(name, seed)
    gc.collect()
    moved = len(_comm_slots() - comm0)  # peak: a DASO's dozen; a leak of one per build: all
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


def test_a_communicator_only_the_cycle_collector_finds_is_left_to_mpi_finalize(comm):
    """A wrapper dropped by reference counting frees its communicator at once (the same point
    of every rank's program). One caught in a reference cycle is found by the cyclic collector
    at an arbitrary point, different on every rank; freeing it there once made a 4-rank DASO
    test hang (one rank in MPI_Comm_free waiting for ranks that waited for it in a collective),
    so it is left to MPI_Finalize and counted."""
    from heatlike.core.communication import unfreed_communicators

    gc.collect()
    before = unfreed_communicators()
    dropped = comm.Dup()
    handle = dropped.handle
    del dropped
    assert handle == MPI.COMM_NULL, "a wrapper dropped by reference counting was not freed"
    cyclic = comm.Dup()
    handle = cyclic.handle
    holder = {"comm": cyclic}
    holder["self"] = holder
    del cyclic, holder
    gc.collect()
    assert unfreed_communicators() == before + 1
    assert handle != MPI.COMM_NULL and handle.Get_size() == comm.size  # not freed
    assert handle.allreduce(1) == comm.size  # and still a working communicator
