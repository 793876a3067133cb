"""float16 / bfloat16 reductions: numeric results, float32 accumulation, both routes."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core import _dtypes
from heatlike.core._halfreduce import ALLTOALL_MIN_ELEMENTS

pytestmark = pytest.mark.mpi
HALF = [torch.bfloat16, torch.float16]
SIZES = {"small": 1001, "large": ALLTOALL_MIN_ELEMENTS + 7}  # the two routes, uneven chunks


def _values(rank, n, seed=0):
    """float32 values exactly representable in bfloat16 and float16."""
    rng = np.random.default_rng([seed, rank, n])
    return torch.from_numpy(rng.integers(-64, 64, n) / 8.0).float()


def _exact_sum(n, size, dtype, seed=0):
    total = sum(_values(r, n, seed).double() for r in range(size))
    return total.to(dtype)  # one rounding of the exact sum


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_heat_bug_half_values_are_summed_as_numbers(comm, dtype):
    """Heat reduced half types as INT16 bit patterns: 1.5 + 1.5 gave inf."""
    x = torch.full((8,), 1.5, dtype=dtype)
    y = torch.empty_like(x)
    comm.Allreduce(x, y, MPI.SUM)
    assert torch.equal(y, torch.full((8,), 1.5 * comm.size, dtype=dtype)), y


@pytest.mark.parametrize("route", SIZES, ids=str)
def test_bfloat16_sum_accumulates_in_float32(comm, route):
    """256 + 1 + 1 + 1 in bfloat16: pairwise rounding gives 256, one rounding of the float32 sum
    gives 260 (at 4 ranks; the reference is computed for every size)."""
    n = SIZES[route]
    x = torch.full((n,), 1.0 if comm.rank else 256.0, dtype=torch.bfloat16)
    comm.Allreduce(hl.IN_PLACE, x, MPI.SUM)
    expected = torch.tensor(256.0 + comm.size - 1).to(torch.bfloat16)
    assert (x == expected).all(), (x[:4], expected)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("route", SIZES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "2-d"])
def test_half_allreduce_reduce_reduce_scatter(comm, dtype, route, layout):
    """Every half reduction equals one rounding of the exact sum, blocking and non-blocking, in
    buffers of any shape (the blocks of the large route are counted in elements: 2-d buffers
    whose size the ranks do not divide failed there)."""
    n = SIZES[route]
    expected = _exact_sum(n, comm.size, dtype)
    mine = _values(comm.rank, n).to(dtype)

    def buffer(values):
        if layout == "contiguous":
            return values.clone()
        if layout == "2-d":  # 1001 = 7 x 143, 32775 = 5 x 6555
            return values.clone().view(7 if values.numel() == 1001 else
                                       5 if values.numel() == n else 1, -1)
        base = torch.zeros(2 * values.numel(), dtype=dtype)
        base[::2] = values
        return base[::2]

    out = buffer(torch.zeros(n, dtype=dtype))
    comm.Allreduce(buffer(mine), out)
    assert torch.equal(out.reshape(-1), expected)
    out = buffer(torch.zeros(n, dtype=dtype))
    comm.Iallreduce(buffer(mine), out).wait()
    assert torch.equal(out.reshape(-1), expected)
    inplace = buffer(mine)
    req = comm.Iallreduce(hl.IN_PLACE, inplace)
    while not req.Test():
        pass
    assert torch.equal(inplace.reshape(-1), expected)
    for root in range(comm.size):
        out = buffer(torch.zeros(n, dtype=dtype)) if comm.rank == root else None
        comm.Reduce(buffer(mine), out, MPI.SUM, root=root)
        if comm.rank == root:
            assert torch.equal(out.reshape(-1), expected)
    counts = hl.MPI_WORLD.counts_displs(n)[0]
    start = sum(counts[: comm.rank])
    part = buffer(torch.zeros(counts[comm.rank], dtype=dtype))
    comm.Reduce_scatter(buffer(mine), part, counts, MPI.SUM)
    assert torch.equal(part.reshape(-1), expected[start:start + counts[comm.rank]])


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("route", SIZES, ids=str)
def test_half_min_max_prod(comm, dtype, route):
    n = SIZES[route]
    rows = [_values(r, n, seed=1).to(dtype) for r in range(comm.size)]
    stacked = torch.stack([r.double() for r in rows])
    for op, ref in ((MPI.MIN, stacked.amin(0)), (MPI.MAX, stacked.amax(0)),
                    (MPI.PROD, stacked.prod(0))):
        out = torch.empty(n, dtype=dtype)
        comm.Allreduce(rows[comm.rank], out, op)
        assert torch.equal(out, ref.to(dtype)), op


def test_half_types_move_as_16_bit_integers():
    """Transfers of float16 / bfloat16 use MPI.UINT16_T (exact for moving data, defined in every
    library). Before, float16 used MPI.FLOAT16_T, which mpi4py names under Open MPI 4.1 although
    the library rejects it: every float16 Bcast / Allgather raised MPI_ERR_TYPE there."""
    for dtype in (torch.float16, torch.bfloat16):
        assert _dtypes.mpi_type(dtype) == MPI.UINT16_T


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_scan_exscan(comm, dtype):
    mine = torch.full((5,), 0.5 * (comm.rank + 1), dtype=dtype)
    out = torch.zeros(5, dtype=dtype)
    comm.Scan(mine, out, MPI.SUM)
    assert torch.equal(out, torch.full((5,), 0.5 * sum(range(1, comm.rank + 2)), dtype=dtype))
    comm.Exscan(hl.IN_PLACE, mine, MPI.SUM)
    if comm.rank:
        assert torch.equal(mine, torch.full((5,), 0.5 * sum(range(1, comm.rank + 1)),
                                            dtype=dtype))


def test_concurrent_nonblocking_half_reductions_stay_matched(comm, monkeypatch):
    """Several non-blocking bf16 all-reduces in flight on one communicator, with a blocking
    collective issued between them, give the right results: on an ordinary communicator they
    are single float32 collectives; only on a serial one (one operation at a time) does the
    multi-phase half-on-the-wire route run."""
    from heatlike.core import _halfreduce

    used = []
    real = _halfreduce._block_reduce_scatter

    def counting(*args, **kwargs):
        used.append(True)
        return (yield from real(*args, **kwargs))

    monkeypatch.setattr(_halfreduce, "_block_reduce_scatter", counting)
    n = ALLTOALL_MIN_ELEMENTS + 5
    bufs = [torch.full((n,), float(comm.rank + i), dtype=torch.bfloat16) for i in range(4)]
    reqs = [comm.Iallreduce(hl.IN_PLACE, b) for b in bufs[:2]]
    x = torch.tensor([1.0])
    comm.Allreduce(hl.IN_PLACE, x)  # a blocking collective while two are in flight
    reqs += [comm.Iallreduce(hl.IN_PLACE, b) for b in bufs[2:]]
    for r in reversed(reqs):  # complete them in another order than they started
        while not r.Test():
            pass
    for i, b in enumerate(bufs):
        assert (b.float() == sum(r + i for r in range(comm.size))).all(), i
    assert x.item() == comm.size
    assert not used or comm.size == 1
    with comm.Dup(serial=True) as serial:
        b = torch.full((n,), 1.0, dtype=torch.bfloat16)
        serial.Iallreduce(hl.IN_PLACE, b).Wait()
        assert (b.float() == comm.size).all()
    assert used or comm.size == 1
