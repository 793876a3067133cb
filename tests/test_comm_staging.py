"""Pipelined staging (``heatlike.core._staging``), exercised without a GPU through
``force_staging``: the pipelined all-reduce gives bitwise the result of the direct one at every
chunk boundary, for every dtype and completion path; it is used exactly where it may be (staged,
contiguous, predefined op, not half precision, blocking or on a serial communicator) and
otherwise the whole buffer is staged at once; host buffers are reused; the engine runs staged
gradient buckets through it."""

import contextlib

import numpy as np
import pytest
import torch
from _helpers import train_small_mlp
from mpi4py import MPI

import heatlike as hl
from heatlike.core import _staging
from heatlike.core._buffers import force_staging
from heatlike.core.buffer_pool import pool as buffer_pool

pytestmark = pytest.mark.mpi

CHUNK = 8  # elements per chunk in these tests
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool,
          torch.complex64]
SIZES = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 5 * CHUNK + 3,
         (_staging.DEPTH + 3) * CHUNK + 1]


@pytest.fixture
def pipelines(monkeypatch):
    """Counts the pipelines built."""
    made = []
    real = _staging.Pipeline.__init__

    def spy(self, *args, **kwargs):
        made.append(args[2].numel())
        real(self, *args, **kwargs)
    monkeypatch.setattr(_staging.Pipeline, "__init__", spy)
    return made


@contextlib.contextmanager
def _staged(dtype):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    with force_staging(), _staging.staging_chunk(CHUNK * itemsize):
        yield


def _values(comm, n, dtype, salt=0):
    """Rank-specific values whose sums are exact (small integers), so any summation order gives
    the same bits."""
    g = torch.Generator().manual_seed(1000 * comm.rank + salt)
    ints = torch.randint(-50, 50, (n,), generator=g)
    if dtype is torch.bool:
        return ints > 0
    if dtype is torch.uint8:
        return (ints.abs() % 3).to(dtype)
    if dtype.is_complex:
        return torch.complex(ints.float(), -ints.float()).to(dtype)
    return ints.to(dtype)


def _complete(comm, mode, sendbuf, recvbuf, op):
    if mode == "blocking":
        comm.Allreduce(sendbuf, recvbuf, op)
        return
    serial = comm.Dup(serial=True)
    request = serial.Iallreduce(sendbuf, recvbuf, op)
    if mode == "Wait":
        request.Wait()
    elif mode == "wait":
        request.wait()
    elif mode == "Test":
        while not request.Test():
            pass
    elif mode == "test":
        while not request.test():
            pass
    elif mode == "wait_all":
        hl.wait_all([request])
    elif mode == "test_all":
        while not hl.core.test_all([request]):
            pass
    serial.Free()


MODES = ["blocking", "Wait", "wait", "Test", "test", "wait_all", "test_all"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pipelined_allreduce_is_bitwise_the_direct_one(comm, pipelines, dtype):
    ops = [MPI.SUM, MPI.MAX] if dtype is not torch.complex64 else [MPI.SUM]
    for n in SIZES:
        for op in ops:
            x = _values(comm, n, dtype)
            expected = x.clone()
            comm.Allreduce(MPI.IN_PLACE, expected, op)  # direct: plain host buffers
            for mode in MODES:
                for in_place in (True, False):
                    got = x.clone() if in_place else torch.empty_like(x)
                    before = len(pipelines)
                    with _staged(dtype):
                        _complete(comm, mode, MPI.IN_PLACE if in_place else x, got, op)
                    what = f"n={n} {op} {mode} in_place={in_place}"
                    assert torch.equal(got, expected), what
                    if comm.size > 1:
                        assert len(pipelines) == before + (n > CHUNK), what


def test_float_values_of_any_magnitude(comm):
    """Random floats (sums not exact): at two ranks addition is commutative, so any order of
    the two values gives the same bits; with more ranks the chunks may be summed in another
    order by the library, within a rounding."""
    n = 13 * CHUNK + 5
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -5, 5, (n,), generator=g)
    expected = x.clone()
    comm.Allreduce(MPI.IN_PLACE, expected, MPI.SUM)
    got = x.clone()
    with _staged(torch.float64):
        comm.Allreduce(MPI.IN_PLACE, got, MPI.SUM)
    if comm.size <= 2:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)


def test_where_the_pipeline_is_not_used(comm, pipelines):
    """Whole-buffer staging (one collective) for half types, user-defined ops, buffers of one
    chunk, and non-blocking calls on an ordinary communicator (their later chunks
    could interleave with other operations there); the results are the same."""
    if comm.size == 1:
        pytest.skip("one rank exchanges nothing")
    n = 6 * CHUNK
    x = _values(comm, 2 * n, torch.float32)
    cases = []
    half = x[:n].to(torch.bfloat16)
    cases.append(("bfloat16", lambda: comm.Allreduce(MPI.IN_PLACE, half, MPI.SUM), half,
                  x[:n].to(torch.bfloat16)))
    plus = MPI.Op.Create(lambda a, b, t: None, commute=True)  # user-defined: no pipeline
    world = x[:n].clone()
    cases.append(("world, non-blocking",
                  lambda: comm.Iallreduce(MPI.IN_PLACE, world, MPI.SUM).Wait(), world, x[:n]))
    try:
        for name, call, buf, start in cases:
            expected = start.clone()
            comm.Allreduce(MPI.IN_PLACE, expected, MPI.SUM)
            before = len(pipelines)
            with _staged(buf.dtype):
                call()
            assert len(pipelines) == before, name
            torch.testing.assert_close(buf, expected, rtol=0, atol=0, msg=name)
        with _staged(torch.float32):
            before = len(pipelines)
            comm.Allreduce(MPI.IN_PLACE, x[:n].clone(), plus)
            assert len(pipelines) == before
    finally:
        plus.Free()


def test_host_buffers_are_reused(comm):
    if comm.size == 1:
        pytest.skip("one rank exchanges nothing")
    buffer_pool.clear()
    x = _values(comm, 20 * CHUNK, torch.int64)
    with _staged(torch.int64):
        comm.Allreduce(MPI.IN_PLACE, x.clone(), MPI.SUM)
        kept = {id(b) for b in buffer_pool._free[(CHUNK * 8, torch.device("cpu"), False)]}
        assert 0 < len(kept) <= _staging.DEPTH
        for _ in range(3):
            comm.Allreduce(MPI.IN_PLACE, x.clone(), MPI.SUM)
        assert {id(b) for b in buffer_pool._free[(CHUNK * 8, torch.device("cpu"), False)]} == kept


def test_chunk_size_setting(monkeypatch):
    monkeypatch.setenv("HEATLIKE_STAGING_CHUNK_MB", "0.5")
    assert _staging.chunk_bytes() == 2 ** 19
    monkeypatch.setenv("HEATLIKE_STAGING_CHUNK_MB", "-1")
    with pytest.raises(ValueError, match="HEATLIKE_STAGING_CHUNK_MB"):
        _staging.chunk_bytes()
    monkeypatch.delenv("HEATLIKE_STAGING_CHUNK_MB")
    assert _staging.chunk_bytes() == 4 * 2 ** 20
    with _staging.staging_chunk(64):
        assert _staging.chunk_bytes() == 64
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            with _staging.staging_chunk(bad):
                pass


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_data_parallel_runs_staged_buckets_through_the_pipeline(comm, pipelines, blocking):
    """Gradient buckets staged through host memory: the engine runs them on its private channel,
    pipelined, one after the other (in non-blocking mode, waiting for one bucket advances the
    exchanges of those launched before it, which is not taken for a change of their gradients by
    the user), and trains bitwise the same model as with host buffers."""

    def train(staging):
        return train_small_mlp(comm, blocking, _staged(torch.float32) if staging
                               else contextlib.nullcontext())

    plain = train(False)
    before = len(pipelines)
    staged = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))
    if comm.size > 1:
        assert len(pipelines) == before + 4 * 3


def test_layouts_that_differ_between_ranks_and_arrays_written_back(comm, pipelines):
    """The choice to pipeline does not depend on a rank's own layout (a strided view on some
    ranks, a contiguous tensor on others: the same chunks everywhere, no hang), and arrays torch
    cannot view (numpy with negative strides) receive the result."""
    n = 6 * CHUNK
    x = _values(comm, n, torch.float64)
    expected = x.clone()
    comm.Allreduce(MPI.IN_PLACE, expected, MPI.SUM)
    base = torch.zeros(2 * n, dtype=torch.float64)
    got = base[::2] if comm.rank % 2 else torch.zeros(n, dtype=torch.float64)
    reversed_out = np.zeros(n)[::-1]
    before = len(pipelines)
    with _staged(torch.float64):
        comm.Allreduce(x, got, MPI.SUM)
        comm.Allreduce(x.numpy(), reversed_out, MPI.SUM)
    assert torch.equal(got, expected)
    assert (base[1::2] == 0).all()
    np.testing.assert_array_equal(reversed_out, expected.numpy())
    if comm.size > 1:
        assert len(pipelines) == before + 2


class _OutOfOrder(torch.nn.Module):
    """Four parameters of 150, 150, 100 and 100 floats used in the order 2, 3, 1, 4: backward
    delivers their gradients as 4, 1, 3, 2, not in the reverse registration order the first
    bucket plan assumes."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (150, 150, 100, 100)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(())
        for i in (1, 2, 0, 3):
            out = out + (x[:, :self.p[i].numel()] * self.p[i]).square().sum()
        return out


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_a_bucket_plan_rebuilt_in_gradient_order_is_pipelined_when_it_needs_to_be(
        comm, pipelines, blocking):
    """The first plan (reverse registration order, 1000-byte buckets) holds buckets of 800, 600
    and 600 bytes; the plan rebuilt at the second step in the observed order 4, 1, 3, 2 holds two
    of 1000 bytes, more than a 900-byte staging chunk: from then on both go through the pipeline,
    one after the other on the engine's private channel (whose exchanges are not taken for a
    user's changes to the gradients in non-blocking mode), and the model is bitwise the one
    trained with host buffers."""

    def train(staging):
        net = _OutOfOrder()
        scope = force_staging() if staging else contextlib.nullcontext()
        with scope, _staging.staging_chunk(900):
            opt = hl.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                                 blocking=blocking)
            model = hl.nn.DataParallel(net, comm, opt, bucket_cap_mb=1000 / 2 ** 20,
                                       first_bucket_mb=1000 / 2 ** 20)
            g = torch.Generator().manual_seed(comm.rank)
            for _ in range(4):
                opt.zero_grad()
                model(torch.randn(3, 150, generator=g)).backward()
                opt.step()
            model(torch.randn(3, 150, generator=g))  # applies the last deferred update
            buckets = sorted(b.values.numel() * 4 for b in model.grad_sync.buckets)
        return [p.detach().clone() for p in net.parameters()], buckets

    plain, _ = train(False)
    before = len(pipelines)
    staged, buckets = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))
    if comm.size > 1:  # (one rank exchanges nothing)
        assert buckets == [1000, 1000]
        # steps 2 to 4, two buckets each: 250 values and the use flags of their 2 parameters
        assert pipelines[before:] == [252] * 6


def test_a_one_rank_communicator_stages_nothing(comm, pipelines, monkeypatch):
    """On a one-rank communicator a reduction of buffers that would be staged is its input,
    copied where it is (a device buffer never goes through host memory), and a broadcast leaves
    the buffer alone; the results are those of MPI's one-rank operations, on every completion
    path, for contiguous buffers, strided views and the in-place form."""
    from heatlike.core import _buffers

    alone = comm.Split(color=comm.rank)
    try:
        base = _values(comm, 6 * CHUNK, torch.float32)
        monkeypatch.setattr(_buffers, "_host_like", lambda t: pytest.fail("staged a buffer"))
        with _staged(torch.float32):
            for send in (base.clone(), base[::2].clone(), base[::3]):
                expected = send.clone()
                out = torch.zeros(2 * send.numel())[::2]
                alone.Allreduce(send, out, MPI.SUM)
                assert torch.equal(out, expected)
                out.zero_()
                alone.Iallreduce(send, out, MPI.MAX).Wait()
                assert torch.equal(out, expected)
                out.zero_()
                req = alone.Iallreduce(send, out, MPI.MIN)
                while not req.Test():
                    pass
                assert torch.equal(out, expected)
                inplace = send.clone()
                alone.Allreduce(MPI.IN_PLACE, inplace, MPI.SUM)
                assert torch.equal(inplace, expected)
                out.zero_()
                alone.Reduce(send, out, MPI.SUM, root=0)
                assert torch.equal(out, expected)
                alone.Bcast(inplace, root=0)
                assert torch.equal(inplace, expected)
            half = base.to(torch.bfloat16)
            alone.Allreduce(MPI.IN_PLACE, half, MPI.SUM)
            assert torch.equal(half, base.to(torch.bfloat16))
        assert pipelines == []
    finally:
        alone.Free()
