"""Reductions: dtype x op x buffer layout x in-place, against a numpy reference, on every rank."""

import numpy as np
import pytest
import torch
from _helpers import (
    MPI_OPS,
    VALID_OPS,
    gaps_intact,
    layouts,
    make_buffer,
    rank_data,
    read_back,
    reduce_reference,
    tensor_identity,
    to_numpy,
)
from mpi4py import MPI

import heatlike as hl

pytestmark = pytest.mark.mpi

CASES = [(op, dtype) for op, dtypes in VALID_OPS.items() for dtype in dtypes]
SHAPE = (5, 3)  # 15 elements: uneven over 2, 3 and 4 ranks


def _all_ranks(comm, shape, dtype, op, seed=0):
    return [to_numpy(rank_data(r, shape, dtype, op, seed)) for r in range(comm.size)]


def _empty_like_layout(shape, dtype, layout):
    return make_buffer(torch.zeros(shape, dtype=dtype), layout)


@pytest.mark.parametrize("op,dtype", CASES, ids=[f"{o}-{str(d)[6:]}" for o, d in CASES])
def test_allreduce_reduce_scan_matrix(comm, op, dtype):
    """Allreduce, Iallreduce, Reduce (every root), Scan and Exscan for one (op, dtype) in every
    layout, with and without MPI.IN_PLACE."""
    mpi_op = MPI_OPS[op]
    data = _all_ranks(comm, SHAPE, dtype, op)
    total = reduce_reference(data, op, dtype)
    prefix = [reduce_reference(data[: r + 1], op, dtype) for r in range(comm.size)]
    mine = rank_data(comm.rank, SHAPE, dtype, op)
    for layout in layouts(dtype):
        for inplace in (False, True):
            for name in ("Allreduce", "Iallreduce", "Reduce", "Scan", "Exscan"):
                roots = range(comm.size) if name == "Reduce" else [None]
                for root in roots:
                    what = f"{name} {op} {dtype} {layout} inplace={inplace} root={root}"
                    send, sbase = make_buffer(mine, layout)
                    sid = tensor_identity(send)
                    at_root = root is None or root == comm.rank
                    if inplace and at_root:
                        recv, rbase, sendbuf = send, sbase, hl.IN_PLACE
                    else:
                        recv, rbase = _empty_like_layout(SHAPE, dtype, layout)
                        sendbuf = send
                    rid = tensor_identity(recv)
                    if name == "Allreduce":
                        comm.Allreduce(sendbuf, recv, mpi_op)
                    elif name == "Iallreduce":
                        comm.Iallreduce(sendbuf, recv, mpi_op).Wait()
                    elif name == "Reduce":
                        comm.Reduce(sendbuf, recv if at_root else None, mpi_op, root=root)
                    else:
                        getattr(comm, name)(sendbuf, recv, mpi_op)
                    expected = {"Scan": prefix[comm.rank],
                                "Exscan": prefix[comm.rank - 1] if comm.rank else None}.get(
                                    name, total)
                    if at_root and expected is not None:
                        np.testing.assert_array_equal(read_back(recv), expected, err_msg=what)
                    if sendbuf is not hl.IN_PLACE:
                        np.testing.assert_array_equal(read_back(send), to_numpy(mine),
                                                      err_msg=what + ": sendbuf changed")
                    assert tensor_identity(send) == sid, what + ": sendbuf object modified"
                    assert tensor_identity(recv) == rid, what + ": recvbuf object modified"
                    assert gaps_intact(send, sbase), what + ": memory outside sendbuf changed"
                    assert gaps_intact(recv, rbase), what + ": memory outside recvbuf changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "numpy"])
@pytest.mark.parametrize("inplace", [False, True])
def test_reduce_scatter(comm, dtype, layout, inplace):
    """Reduce_scatter with uneven default counts and with explicit counts, and
    Reduce_scatter_block, against numpy."""
    if layout == "numpy" and dtype is torch.bfloat16:
        pytest.skip("numpy has no bfloat16")
    size = comm.size
    for counts in (None, [(r % 3) + 1 for r in range(size)], "block"):
        n = 2 * size if counts == "block" else (13 if counts is None else sum(counts))
        data = _all_ranks(comm, (n,), dtype, "SUM", seed=n)
        total = reduce_reference(data, "SUM", dtype)
        if counts == "block":
            c = [2] * size
        else:
            c = hl.MPI_WORLD.counts_displs(n)[0] if counts is None else counts
        start = sum(c[: comm.rank])
        expected = total[start:start + c[comm.rank]]
        send, _ = make_buffer(rank_data(comm.rank, (n,), dtype, "SUM", seed=n), layout)
        if inplace:
            recv, sendbuf = send, hl.IN_PLACE
        else:
            recv, _ = _empty_like_layout((c[comm.rank],), dtype, layout)
            sendbuf = send
        if counts == "block":
            comm.Reduce_scatter_block(sendbuf, recv, MPI.SUM)
        else:
            comm.Reduce_scatter(sendbuf, recv, counts, MPI.SUM)
        got = read_back(recv)[: c[comm.rank]]
        np.testing.assert_array_equal(got, expected, err_msg=f"counts={counts}")


@pytest.mark.parametrize("op,dtype", [("BAND", torch.float32), ("BOR", torch.bool),
                                      ("MIN", torch.complex64), ("LOR", torch.float64),
                                      ("BXOR", torch.bfloat16), ("MAXLOC", torch.float32)])
def test_invalid_op_dtype_pairs_raise_everywhere(comm, op, dtype):
    """An op undefined for a dtype is a TypeError naming both, on every rank, before sending."""
    x = torch.ones(4, dtype=dtype)
    y = torch.empty(4, dtype=dtype)
    mpi_op = getattr(MPI, op)
    for call in (lambda: comm.Allreduce(x, y, mpi_op), lambda: comm.Iallreduce(x, y, mpi_op),
                 lambda: comm.Reduce(x, y, mpi_op, root=0), lambda: comm.Scan(x, y, mpi_op)):
        with pytest.raises(TypeError, match=op):
            call()
    # nothing was sent: the next collective still matches on every rank
    z = torch.tensor([float(comm.rank)])
    comm.Allreduce(hl.IN_PLACE, z)
    assert z.item() == sum(range(comm.size))


def test_user_defined_op(comm):
    """A user-defined MPI.Op reduces float32, and half types through float32."""
    def absmax(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, dtype=np.float32)
        b = np.frombuffer(inoutbuf, dtype=np.float32)
        np.copyto(b, np.maximum(np.abs(a), np.abs(b)))

    op = MPI.Op.Create(absmax, commute=True)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.tensor([-(comm.rank + 1.0), comm.rank * 0.5], dtype=dtype)
            y = torch.empty_like(x)
            comm.Allreduce(x, y, op)
            values = [[-(r + 1.0), r * 0.5] for r in range(comm.size)]
            folded = values[0]  # MPI applies the op between ranks' values only
            for v in values[1:]:
                folded = [max(abs(a), abs(b)) for a, b in zip(folded, v)]
            expected = torch.tensor(folded, dtype=dtype)
            assert torch.equal(y, expected), (dtype, y)
    finally:
        op.Free()
