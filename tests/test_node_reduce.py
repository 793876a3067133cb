"""The node-local all-reduce (``heatlike.core._nodereduce``), exercised without a GPU: host
tensors under ``force_staging`` and ``host_mode`` take the same protocol, their workspaces in an
MPI shared-memory window instead of device memory. It gives the rank-order sum (bitwise, on
every rank) at every shard boundary, in one shot and in two, for every dtype, layout and
completion path; it is taken exactly where it may be (not across the virtual cluster's nodes);
a set-up failure on one rank turns it off on every rank; DataParallel trains the same model
through it."""

import contextlib

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


def _complete(comm, mode, sendbuf, recvbuf):
    if mode == "blocking":
        comm.Allreduce(sendbuf, recvbuf, MPI.SUM)
        return
    serial = comm.Dup(serial=True)
    try:
        request = serial.Iallreduce(sendbuf, recvbuf, MPI.SUM)
        if mode == "Wait":
            request.Wait()
        elif mode == "Test":
            while not request.Test():
                pass
        else:
            hl.wait_all([request])
    finally:
        serial.Free()


@pytest.mark.parametrize("shots", ["one", "two"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_node_sum_is_the_rank_order_sum_on_every_rank(comm, taken, monkeypatch, dtype,
                                                          shots):
    """Sizes around the shard boundaries (fewer elements than ranks, one more, one less) and
    past the workspace's first size (it grows, collectively); in place and not; a strided
    output; blocking and non-blocking on a serial communicator; in one shot and in two."""
    if shots == "two":
        monkeypatch.setattr(_nodereduce, "ONE_SHOT_BYTES", 0)
    P, one_node = comm.size, _one_node(comm)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [1, max(P - 1, 1), P, P + 1, 7 * P + 3, (2 ** 21) // itemsize + 5]
    for k, n in enumerate(sizes):
        x = _values(comm, n, dtype, salt=k)
        expected = rank_order_sum(comm, x)
        for mode in ("blocking", "Wait", "Test", "wait_all"):
            inplace = x.clone()
            out = torch.zeros(2 * n, dtype=dtype)[::2]
            with _node_path():
                _complete(comm, mode, hl.IN_PLACE, inplace)
                _complete(comm, mode, x, out)
            _assert_sum(inplace, expected, one_node, (n, mode))
            assert torch.equal(out, inplace), (n, mode)
            everyone = comm.handle.allgather(inplace.view(torch.uint8).numpy().tobytes())
            assert all(b == everyone[0] for b in everyone)
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
