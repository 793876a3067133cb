"""The node-local all-reduce (``heatlike.core._nodereduce``), exercised without a GPU: host
tensors under ``force_staging`` and ``host_mode`` take the same protocol, their workspaces in an
MPI shared-memory window instead of device memory. It gives the rank-order sum (bitwise, on
every rank) at every shard boundary, in one shot and in two, for every dtype, layout and
completion path; it is taken exactly where it may be (not across the virtual cluster's nodes);
a set-up failure on one rank turns it off on every rank; DataParallel trains the same model
through it."""

import contextlib
import hashlib

import pytest
import torch
from _helpers import rank_order_sum, train_small_mlp
from mpi4py import MPI

import heatlike as hl
from heatlike.core import _nodereduce
from heatlike.core._buffers import force_staging

pytestmark = pytest.mark.mpi

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64, torch.uint8, torch.complex64]


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The path for buffers of every size (the tests' buffers are small)."""
    monkeypatch.setattr(_nodereduce, "MIN_BYTES", 0)


@pytest.fixture
def taken(monkeypatch):
    """Counts the node-local reductions built."""
    made = []
    real = _nodereduce.NodeAllreduce.__init__

    def spy(self, comm, src, dst):
        made.append(dst.numel())
        real(self, comm, src, dst)
    monkeypatch.setattr(_nodereduce.NodeAllreduce, "__init__", spy)
    return made


@contextlib.contextmanager
def _node_path():
    with force_staging(), _nodereduce.host_mode():
        yield


def _values(comm, n, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * comm.rank + salt)
    x = torch.randn(n, generator=g) * 3
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    if not dtype.is_floating_point:
        return (x * 10).to(torch.int64).remainder(50).to(dtype)
    return x.to(dtype)


def _one_node(comm):
    """Whether the ranks share one real node (the path applies); on the virtual cluster's nodes
    it does not, and the sums are staged."""
    shared = comm.handle.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return shared.Get_size() == comm.size
    finally:
        shared.Free()


def _assert_sum(got, expected, exact, msg=None):
    if exact or not (expected.is_floating_point() or expected.is_complex()):
        assert torch.equal(got, expected), msg
    else:
        torch.testing.assert_close(got, expected, msg=msg)


@pytest.fixture
def serial(comm):
    """A serial duplicate of the world for the test's non-blocking sums (its workspace serves
    them all, growing with them, and is freed with it)."""
    with comm.Dup(serial=True) as dup:
        yield dup


def _complete(comm, mode, sendbuf, recvbuf, serial):
    """The sum of ``sendbuf`` into ``recvbuf``: a blocking call on ``comm``, or a non-blocking
    one on ``serial`` completed by ``mode``."""
    if mode == "blocking":
        comm.Allreduce(sendbuf, recvbuf, MPI.SUM)
        return
    request = serial.Iallreduce(sendbuf, recvbuf, MPI.SUM)
    if mode == "Wait":
        request.Wait()
    elif mode == "Test":
        while not request.Test():
            pass
    else:
        hl.wait_all([request])


def _check_both_forms(comm, serial, mode, x, out, expected, exact):
    """In place and into ``out``, completed by ``mode``: the expected sum, the same in both
    forms, bitwise the same on every rank."""
    inplace = x.clone()
    _complete(comm, mode, hl.IN_PLACE, inplace, serial)
    _complete(comm, mode, x, out, serial)
    _assert_sum(inplace, expected, exact, (x.numel(), mode))
    assert torch.equal(out, inplace), (x.numel(), mode)
    digest = hashlib.sha1(inplace.view(torch.uint8).numpy().tobytes()).hexdigest()
    everyone = comm.handle.allgather(digest)
    assert all(d == everyone[0] for d in everyone), everyone


@pytest.mark.parametrize("shots", ["one", "two"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_node_sum_is_the_rank_order_sum_on_every_rank(comm, serial, taken, monkeypatch,
                                                          dtype, shots):
    """Sizes around the shard boundaries (fewer elements than ranks, one more, one less) and
    past the workspace's first size (it grows, collectively, by bytes: for one dtype of each
    summation kind); in place and not; a strided output; blocking and non-blocking on a serial
    communicator; in one shot and in two."""
    if shots == "two":
        monkeypatch.setattr(_nodereduce, "ONE_SHOT_BYTES", 0)
    P, one_node = comm.size, _one_node(comm)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [1, max(P - 1, 1), P, P + 1, 7 * P + 3]
    if dtype in (torch.float32, torch.bfloat16, torch.int64):
        sizes.append((2 ** 21) // itemsize + 5)
    for k, n in enumerate(sizes):
        x = _values(comm, n, dtype, salt=k)
        expected = rank_order_sum(comm, x)
        for mode in ("blocking", "Wait", "Test", "wait_all"):
            with _node_path():
                _check_both_forms(comm, serial, mode, x, torch.zeros(2 * n, dtype=dtype)[::2],
                                  expected, one_node)
    if P > 1:  # ranks on several nodes: staged, MPI's order of summation
        assert len(taken) == (len(sizes) * 4 * 2 if one_node else 0)


def test_two_ranks_give_mpi_s_bits(comm):
    """With two ranks the sum has one order: the result is bitwise MPI's own all-reduce."""
    x = _values(comm, 1001, torch.float32)
    expected = x.clone()
    comm.Allreduce(hl.IN_PLACE, expected, MPI.SUM)
    got = x.clone()
    with _node_path():
        comm.Allreduce(hl.IN_PLACE, got, MPI.SUM)
    if comm.size <= 2:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


def test_where_the_node_path_is_not_taken(comm, taken, monkeypatch):
    """Other ops, bool, non-blocking calls on an ordinary communicator (their phases could
    interleave with other operations), host buffers without staging, a one-rank communicator,
    buffers smaller than ``MIN_BYTES``, and the switch (HEATLIKE_NODE_REDUCE=0,
    ``enabled(False)``): staged or direct as before, same results."""
    x = _values(comm, 50, torch.float32)
    cases = [
        ("MAX", lambda b: comm.Allreduce(hl.IN_PLACE, b, MPI.MAX), MPI.MAX),
        ("ordinary non-blocking", lambda b: comm.Iallreduce(hl.IN_PLACE, b, MPI.SUM).Wait(),
         MPI.SUM),
    ]
    for name, call, op in cases:
        expected = x.clone()
        comm.Allreduce(hl.IN_PLACE, expected, op)
        got = x.clone()
        with _node_path():
            call(got)
        assert torch.equal(got, expected), name
    flags = torch.tensor([True, comm.rank == 0, False])
    with _node_path():
        comm.Allreduce(hl.IN_PLACE, flags, MPI.LOR)
    assert flags.tolist() == [True, True, False]
    with _nodereduce.host_mode():  # not staged: MPI reads the buffer directly
        got = x.clone()
        comm.Allreduce(hl.IN_PLACE, got, MPI.SUM)
    alone = comm.Split(color=comm.rank)
    try:
        with _node_path():
            solo = x.clone()
            alone.Allreduce(hl.IN_PLACE, solo, MPI.SUM)
        assert torch.equal(solo, x)
    finally:
        alone.Free()
    monkeypatch.setattr(_nodereduce, "MIN_BYTES", x.numel() * 4 + 1)  # small: staged
    got = x.clone()
    with _node_path():
        comm.Allreduce(hl.IN_PLACE, got, MPI.SUM)
    torch.testing.assert_close(got, rank_order_sum(comm, x), rtol=1e-6, atol=1e-5)
    monkeypatch.setattr(_nodereduce, "MIN_BYTES", 0)
    for switch in ("env", "context"):
        got = x.clone()
        with _node_path():
            if switch == "env":
                monkeypatch.setenv("HEATLIKE_NODE_REDUCE", "0")
                comm.Allreduce(hl.IN_PLACE, got, MPI.SUM)
                monkeypatch.delenv("HEATLIKE_NODE_REDUCE")
            else:
                with _nodereduce.enabled(False):
                    comm.Allreduce(hl.IN_PLACE, got, MPI.SUM)
        torch.testing.assert_close(got, rank_order_sum(comm, x), rtol=1e-6, atol=1e-5)
    assert taken == []


def test_a_set_up_failure_on_one_rank_turns_the_path_off_everywhere(comm, taken, monkeypatch):
    """Rank 0 cannot make its workspace: every rank learns it at the same collective, frees what
    it made, and sums through staging from then on (no hang, the right result)."""
    real = _nodereduce._Node._allocate

    def failing(self, slot):
        real(self, slot)
        if self.rank == 0:
            raise RuntimeError("no memory for the workspace")
    monkeypatch.setattr(_nodereduce._Node, "_allocate", failing)
    with comm.Dup() as fresh:
        x = _values(comm, 40, torch.float64)
        expected = rank_order_sum(comm, x)
        for _ in range(2):
            got = x.clone()
            with _node_path():
                fresh.Allreduce(hl.IN_PLACE, got, MPI.SUM)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        if comm.size > 1:
            assert fresh._hub.node is not None and not fresh._hub.node.usable
    assert taken == []


def test_workspaces_grow_together_and_are_freed_with_the_communicator(comm):
    with comm.Dup() as fresh:
        with _node_path():
            for n in (10, 2 ** 19 + 1, 100):
                fresh.Allreduce(hl.IN_PLACE, torch.ones(n), MPI.SUM)
        node = fresh._hub.node
        if comm.size > 1 and _one_node(comm):
            assert node.usable and node.slot_bytes == 2 ** 22  # (2^19 + 1) * 4 in 2 MiB steps
            assert len(node.views) == comm.size
        elif comm.size > 1:
            assert not node.usable and node.reason == "the ranks are on several nodes"
        hub = fresh._hub
    assert hub.node is None and (node is None or not node.views)


@pytest.mark.parametrize("shots", ["one", "two"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_data_parallel_sums_its_buckets_through_the_node(comm, taken, monkeypatch, blocking,
                                                         shots):
    """Gradient buckets that would be staged go through the node-local sum on the engine's
    private channel, one after the other, and train the same model as host buffers (exactly at
    two ranks; the rank-order sum differs from MPI's order in the last bits at more)."""

    if shots == "two":
        monkeypatch.setattr(_nodereduce, "ONE_SHOT_BYTES", 0)

    def train(node_path):
        return train_small_mlp(comm, blocking, _node_path() if node_path
                               else contextlib.nullcontext())

    plain = train(False)
    node = train(True)
    for a, b in zip(plain, node):
        if comm.size <= 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if comm.size > 1:
        assert len(taken) == (4 * 3 if _one_node(comm) else 0)


@pytest.mark.parametrize("name", ["powersgd-2", "distopt-half", "daso"])
def test_presets_with_several_sums_in_flight_train_as_staged(comm, taken, name):
    """Presets whose exchanges keep a small all-reduce (the bucket's use counters) in flight
    while the codec's own sums run, in half precision, or across emulated nodes: through the
    node-local sum they train the staged model (bitwise at two ranks; PowerSGD's
    orthogonalization magnifies the last bits of other summation orders at more). The sums'
    barriers run on their own communicator, one sum after the other, so they never pair with
    another operation's."""
    from heatlike import recipes

    def train(node_path):
        runners = []
        with contextlib.ExitStack() as scope:
            scope.enter_context(force_staging())
            if node_path:
                scope.enter_context(_nodereduce.host_mode())
            task = recipes.digits_task(0, None, (32, 16))
            result = recipes.train_task(name, comm, task, epochs=3, curve=False,
                                        on_runner=runners.append)
        params = [p.detach().clone() for p in runners[0].eval_model().parameters()]
        close = getattr(runners[0], "close", None)
        if close is not None:
            close()
        return params, result.accuracy

    (staged, acc_staged), (node, acc_node) = train(False), train(True)
    for a, b in zip(staged, node):
        if comm.size <= 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    assert abs(acc_staged - acc_node) <= 0.02
    if comm.size > 1 and _one_node(comm):
        assert taken


# ---------------------------------------------------------------------------- host buffers


def _host_path_applies(comm):
    """Where plain host buffers take the node-local sum: several ranks on one real node that no
    emulated layout (HEATLIKE_RANKS_PER_NODE / HEATLIKE_NODE_IDS) splits."""
    from heatlike.core.topology import detect_node_ids
    return comm.size > 1 and _one_node(comm) and len(set(detect_node_ids(comm))) == 1


@pytest.fixture
def small_host(monkeypatch):
    """Host buffers of 256 bytes and more take the path (the tests' buffers are small), which
    ``HEATLIKE_NODE_REDUCE_HOST=1`` turns on."""
    monkeypatch.setattr(_nodereduce, "HOST_MIN_BYTES", 256)
    monkeypatch.setenv("HEATLIKE_NODE_REDUCE_HOST", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64],
                         ids=str)
def test_host_buffers_are_summed_through_the_node(comm, taken, small_host, monkeypatch, serial,
                                                  dtype):
    """Plain host tensors (no staging) of ``HOST_MIN_BYTES`` and more: blocking calls and calls
    on a serial communicator take the shared-memory sum where the ranks share a node, and every
    rank gets the rank-order sum, bitwise the same everywhere, at every chunk boundary (one
    element less than a chunk, a chunk, one more, many chunks and a part; the shard boundaries
    inside a short last chunk); across nodes (the virtual cluster's, or emulated ones) MPI's
    all-reduce as before."""
    applies = _host_path_applies(comm)
    P = comm.size
    itemsize = torch.empty(0, dtype=dtype).element_size()
    chunk = 96  # elements
    monkeypatch.setattr(_nodereduce, "HOST_CHUNK_BYTES", chunk * itemsize)
    sizes = [256 // itemsize, chunk - 1, chunk, chunk + 1, chunk + P - 1, 7 * chunk + 3]
    sizes = [n for n in sizes if n * itemsize >= 256]
    for k, n in enumerate(sizes):
        x = _values(comm, n, dtype, salt=k)
        expected = rank_order_sum(comm, x)
        for mode in ("blocking", "Wait", "Test", "wait_all"):
            _check_both_forms(comm, serial, mode, x, torch.zeros(n, dtype=dtype), expected,
                              applies)
    assert len(taken) == (len(sizes) * 4 * 2 if applies else 0)


def test_large_host_sums_keep_two_chunks_of_shared_memory(comm, taken, monkeypatch):
    """A sum of three chunks (the default chunk) keeps the workspace at one chunk per slot and
    gives the rank-order sum."""
    monkeypatch.setenv("HEATLIKE_NODE_REDUCE_HOST", "1")
    chunk = _nodereduce.HOST_CHUNK_BYTES // 4
    with comm.Dup() as fresh:
        x = _values(comm, 3 * chunk + 1, torch.float32)
        expected = rank_order_sum(comm, x)
        fresh.Allreduce(hl.IN_PLACE, x, MPI.SUM)
        _assert_sum(x, expected, _host_path_applies(comm))
        if _host_path_applies(comm):
            assert fresh._hub.node.slot_bytes == _nodereduce.HOST_CHUNK_BYTES
            assert taken == [3 * chunk + 1]
        else:
            assert taken == []


def test_host_buffers_outside_the_path_go_to_mpi(comm, taken, small_host, monkeypatch):
    """Below ``HOST_MIN_BYTES``, non-blocking on an ordinary communicator, another op,
    ``HEATLIKE_NODE_REDUCE_HOST=0`` or unset (the default), ``HEATLIKE_NODE_REDUCE=0``,
    ``enabled(False)``: MPI's all-reduce, same sums."""
    x = _values(comm, 1000, torch.float32)
    expected = rank_order_sum(comm, x)

    def summed(call=None):
        got = x.clone()
        (call or (lambda b: comm.Allreduce(hl.IN_PLACE, b, MPI.SUM)))(got)
        return got

    monkeypatch.setattr(_nodereduce, "HOST_MIN_BYTES", 4001)
    torch.testing.assert_close(summed(), expected, rtol=1e-6, atol=1e-5)
    monkeypatch.setattr(_nodereduce, "HOST_MIN_BYTES", 256)
    torch.testing.assert_close(
        summed(lambda b: comm.Iallreduce(hl.IN_PLACE, b, MPI.SUM).Wait()), expected,
        rtol=1e-6, atol=1e-5)
    maxed = summed(lambda b: comm.Allreduce(hl.IN_PLACE, b, MPI.MAX))
    assert torch.equal(maxed, torch.stack(comm.handle.allgather(x)).amax(0))
    for var in ("HEATLIKE_NODE_REDUCE_HOST", "HEATLIKE_NODE_REDUCE"):
        monkeypatch.setenv(var, "0")
        torch.testing.assert_close(summed(), expected, rtol=1e-6, atol=1e-5)
        monkeypatch.setenv(var, "1")
    monkeypatch.delenv("HEATLIKE_NODE_REDUCE_HOST")  # off by default
    torch.testing.assert_close(summed(), expected, rtol=1e-6, atol=1e-5)
    with _nodereduce.enabled(False):
        torch.testing.assert_close(summed(), expected, rtol=1e-6, atol=1e-5)
    assert taken == []
    monkeypatch.setenv("HEATLIKE_NODE_REDUCE_HOST", "1")
    summed()  # and the path itself, once, where it applies
    assert len(taken) == (1 if _host_path_applies(comm) else 0)


def test_too_little_shared_memory_on_one_rank_turns_the_host_path_off_everywhere(
        comm, taken, small_host, monkeypatch):
    """A node whose /dev/shm cannot hold the workspaces (as in a container's default 64 MiB):
    one rank's shortfall is agreed before any window is made, every rank sums through MPI from
    then on, nothing hangs."""
    real = _nodereduce._shm_shortfall
    monkeypatch.setattr(_nodereduce, "_shm_shortfall",
                        lambda n: "/dev/shm has 1 MiB free" if comm.rank == 0 else real(n))
    with comm.Dup() as fresh:
        x = _values(comm, 1000, torch.float64)
        for _ in range(2):
            got = x.clone()
            fresh.Allreduce(hl.IN_PLACE, got, MPI.SUM)
            torch.testing.assert_close(got, rank_order_sum(comm, x), rtol=1e-12, atol=1e-12)
        node = fresh._hub.node
        if _host_path_applies(comm):
            assert node is not None and not node.usable and node.views == []
    assert taken == []


def test_shm_shortfall_reads_the_free_space(monkeypatch):
    """The reason names the free space and the need; none where twice the need is free."""
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))
    assert _nodereduce._shm_shortfall(16 << 20) == ""
    reason = _nodereduce._shm_shortfall(48 << 20)
    assert "64 MiB free" in reason and "48 MiB" in reason


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_data_parallel_sums_host_buckets_through_the_node(comm, taken, monkeypatch, blocking):
    """With the path on and nothing forced, DataParallel's host buckets take the shared-memory
    sum on one node (on the engine's private channels) and train the model that MPI's sums train
    (exactly at two ranks, where a sum has one order)."""
    monkeypatch.setattr(_nodereduce, "HOST_MIN_BYTES", 16)  # every bucket of the small model
    monkeypatch.setenv("HEATLIKE_NODE_REDUCE_HOST", "1")
    with _nodereduce.enabled(False):
        plain = train_small_mlp(comm, blocking, contextlib.nullcontext())
    assert taken == []
    node = train_small_mlp(comm, blocking, contextlib.nullcontext())
    for a, b in zip(plain, node):
        if comm.size <= 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(taken) == (4 * 3 if _host_path_applies(comm) else 0)


def test_one_emulated_node_reads_the_world_layout(comm, monkeypatch):
    """The emulated layout is the world's: all ranks on node 0 is one node, alternating nodes is
    several (where there are two ranks or more), and a layout of another length is not read as
    one node (no error: the path is only not taken)."""
    P = MPI.COMM_WORLD.Get_size()
    handle = comm.handle
    monkeypatch.setenv("HEATLIKE_NODE_IDS", ",".join(["0"] * P))
    assert _nodereduce._one_emulated_node(handle)
    monkeypatch.setenv("HEATLIKE_NODE_IDS", ",".join(str(r % 2) for r in range(P)))
    assert _nodereduce._one_emulated_node(handle) == (P == 1)
    monkeypatch.setenv("HEATLIKE_NODE_IDS", ",".join(["0"] * (P + 1)))
    assert not _nodereduce._one_emulated_node(handle)
    monkeypatch.delenv("HEATLIKE_NODE_IDS")
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "1")
    assert _nodereduce._one_emulated_node(handle) == (P == 1)
