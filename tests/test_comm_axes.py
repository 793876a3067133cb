"""Heat's buffer conventions: DNDarray buffers, the axis keywords of the concatenating
collectives, v-collective counts in slices along the axis, plain buffers in the v-forms, the
sub-array Alltoallv of axes >= 2, bool reductions, and Heat's helpers on the communicator. Every
result is compared with numpy on every rank."""

import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core import communication as comm_module

pytestmark = pytest.mark.mpi


def _run(comm, name, nonblocking, *args, **kwargs):
    if nonblocking:
        getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs).Wait()
    else:
        getattr(comm, name)(*args, **kwargs)


def _block(rank, shape, dtype=torch.float64):
    """Rank-specific data: every element differs between ranks and positions."""
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float64) + 1000 * rank).reshape(shape).to(dtype)


def _dnd(t):
    return hl.array(t, is_split=None)


both = pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])


@both
def test_dndarray_buffers_stand_for_their_local_tensor(comm, nonblocking):
    x = _dnd(_block(comm.rank, (3, 4)))
    out = _dnd(torch.zeros(3, 4, dtype=torch.float64))
    _run(comm, "Allreduce", nonblocking, x, out, MPI.SUM)
    expected = sum(_block(r, (3, 4)) for r in range(comm.size))
    torch.testing.assert_close(out.larray, expected)
    buf = _dnd(_block(comm.rank, (2, 5)))
    _run(comm, "Bcast", nonblocking, buf, root=comm.size - 1)
    torch.testing.assert_close(buf.larray, _block(comm.size - 1, (2, 5)))
    got = _dnd(torch.zeros(comm.size * 2, 5, dtype=torch.float64))
    _run(comm, "Allgather", nonblocking, _dnd(_block(comm.rank, (2, 5))), got)
    torch.testing.assert_close(got.larray, torch.cat([_block(r, (2, 5))
                                                       for r in range(comm.size)]))


def test_reductions_leave_differently_laid_out_dndarrays_contiguous(comm):
    """Heat's side effect, for DNDarrays only: the values are the reduction's either way; a
    torch tensor passed the same way keeps its layout (it is packed and unpacked)."""
    expected = sum(_block(r, (4, 3)) for r in range(comm.size)).T
    x = _dnd(_block(comm.rank, (4, 3))).T  # not contiguous
    out = _dnd(torch.zeros(3, 4, dtype=torch.float64))
    assert not x.larray.is_contiguous()
    comm.Allreduce(x, out, MPI.SUM)
    assert x.larray.is_contiguous() and out.larray.is_contiguous()
    torch.testing.assert_close(out.larray, expected)
    torch.testing.assert_close(x.larray, _block(comm.rank, (4, 3)).T)
    out_t = torch.zeros(4, 3, dtype=torch.float64).T
    comm.Allreduce(_dnd(_block(comm.rank, (4, 3)).T.contiguous()), out_t, MPI.SUM)
    assert not out_t.is_contiguous()
    torch.testing.assert_close(out_t, expected)
    same = _dnd(_block(comm.rank, (4, 3))).T  # equal layouts: nothing changes
    out_same = _dnd(torch.zeros(4, 3, dtype=torch.float64)).T
    comm.Allreduce(same, out_same, MPI.SUM)
    assert not same.larray.is_contiguous() and not out_same.larray.is_contiguous()
    torch.testing.assert_close(out_same.larray, expected)


@both
@pytest.mark.parametrize("shape,axis", [((2, 3), 0), ((2, 3), 1), ((2, 3), -1), ((2, 3, 2), 1),
                                        ((2, 2, 3), 2)])
def test_allgather_and_gather_join_along_the_axis(comm, nonblocking, shape, axis):
    mine = _block(comm.rank, shape)
    expected = np.concatenate([_block(r, shape).numpy() for r in range(comm.size)], axis=axis)
    out = torch.zeros(expected.shape, dtype=torch.float64)
    _run(comm, "Allgather", nonblocking, mine, out, recv_axis=axis)
    np.testing.assert_array_equal(out.numpy(), expected)
    # a non-contiguous receive buffer of the same shape
    strided = torch.zeros(tuple(reversed(expected.shape)), dtype=torch.float64).permute(
        *reversed(range(len(shape))))
    _run(comm, "Allgather", nonblocking, _dnd(mine), strided, recv_axis=axis)
    np.testing.assert_array_equal(strided.numpy(), expected)
    root = comm.size - 1
    got = torch.zeros(expected.shape, dtype=torch.float64) if comm.rank == root else None
    _run(comm, "Gather", nonblocking, mine, got, root=root, axis=axis)
    if comm.rank == root:
        np.testing.assert_array_equal(got.numpy(), expected)


@both
@pytest.mark.parametrize("axis", [0, 1])
def test_v_forms_count_slices_along_the_axis(comm, nonblocking, axis):
    """Rank r holds r + 1 slices of width 3 along ``axis``; counts and displacements are in
    slices, the receive buffer has room for one unused slice before every block."""
    size = comm.size
    counts = [r + 1 for r in range(size)]
    displs = [sum(counts[:r]) + r + 1 for r in range(size)]
    total = displs[-1] + counts[-1]

    def piece(r):
        return _block(r, (r + 1, 3) if axis == 0 else (3, r + 1))

    out_shape = (total, 3) if axis == 0 else (3, total)
    out = torch.full(out_shape, -1.0, dtype=torch.float64)
    _run(comm, "Allgatherv", nonblocking, piece(comm.rank), (out, counts, displs),
         recv_axis=axis)
    expected = np.full(out_shape, -1.0)
    for r in range(size):
        sl = [slice(None), slice(None)]
        sl[axis] = slice(displs[r], displs[r] + counts[r])
        expected[tuple(sl)] = piece(r).numpy()
    np.testing.assert_array_equal(out.numpy(), expected)
    root = 0
    got = torch.full(out_shape, -1.0, dtype=torch.float64) if comm.rank == root else None
    _run(comm, "Gatherv", nonblocking, piece(comm.rank),
         (got, counts, displs) if got is not None else None, root=root, axis=axis)
    if comm.rank == root:
        np.testing.assert_array_equal(got.numpy(), expected)
    # Scatterv back: rank r receives its slices
    back = torch.zeros(piece(comm.rank).shape, dtype=torch.float64)
    _run(comm, "Scatterv", nonblocking,
         (torch.from_numpy(expected), counts, displs) if comm.rank == root else None, back,
         root=root, axis=axis)
    torch.testing.assert_close(back, piece(comm.rank))


def test_v_forms_take_plain_buffers_and_a_sending_part(comm):
    size = comm.size
    out = torch.zeros(size, 3, dtype=torch.int64)
    comm.Allgatherv(np.full(3, comm.rank, dtype=np.int64), out)  # equal blocks
    np.testing.assert_array_equal(out.numpy(), np.repeat(np.arange(size), 3).reshape(size, 3))
    # (array, counts, displs) as sendbuf: this rank's part of a replicated layout
    counts, displs = [2] * size, [2 * r for r in range(size)]
    full = torch.arange(2 * size * 4, dtype=torch.int64).reshape(2 * size, 4) * (comm.rank + 1)
    got = torch.zeros(2 * size, 4, dtype=torch.int64)
    comm.Allgatherv((full, counts, displs), (got, counts, displs))
    expected = np.concatenate([(np.arange(2 * size * 4).reshape(2 * size, 4) * (r + 1))[2 * r:
                                                                                      2 * r + 2]
                               for r in range(size)])
    np.testing.assert_array_equal(got.numpy(), expected)
    send = torch.arange(size * 2, dtype=torch.float32).reshape(size, 2) + 10 * comm.rank
    recv = torch.zeros(size, 2)
    comm.Alltoallv(send, recv)  # plain buffers: equal blocks
    expected = np.stack([np.arange(size * 2).reshape(size, 2)[comm.rank] + 10 * r
                         for r in range(size)])
    np.testing.assert_array_equal(recv.numpy(), expected)


def _flat_alltoall_reference(blocks, size, recv_shape, send_axis, recv_axis, rank):
    """Heat's rule for axes < 2: each buffer viewed with its axis in front (transpose), blocks
    are runs of that view's C order."""
    pieces = []
    for r in range(size):
        view = np.swapaxes(blocks[r], 0, send_axis).reshape(-1)
        n = view.size // size
        pieces.append(view[rank * n:(rank + 1) * n])
    view_shape = list(recv_shape)
    view_shape[0], view_shape[recv_axis] = recv_shape[recv_axis], recv_shape[0]
    return np.swapaxes(np.concatenate(pieces).reshape(view_shape), 0, recv_axis)


@both
@pytest.mark.parametrize("send_axis,recv_axis", [(0, None), (1, None), (0, 1), (1, 0)])
def test_alltoall_cuts_and_joins_along_the_axes(comm, nonblocking, send_axis, recv_axis):
    size = comm.size
    shape = (2 * size, 3 * size)
    blocks = [_block(r, shape).numpy() for r in range(size)]
    recv_shape = shape if recv_axis in (None, send_axis) else shape[::-1]
    out = torch.zeros(recv_shape, dtype=torch.float64)
    _run(comm, "Alltoall", nonblocking, torch.from_numpy(blocks[comm.rank]), out,
         send_axis=send_axis, recv_axis=recv_axis)
    r_axis = send_axis if recv_axis is None else recv_axis
    expected = _flat_alltoall_reference(blocks, size, recv_shape, send_axis, r_axis, comm.rank)
    np.testing.assert_array_equal(out.numpy(), expected)


@both
@pytest.mark.parametrize("old,new", [(2, 1), (0, 2), (2, 0), (1, 2)])
def test_alltoallv_of_sub_arrays_redistributes(comm, nonblocking, old, new):
    """Axes >= 2: the sub-array form is the redistribution from split ``old`` to split
    ``new`` (uneven splits included)."""
    size = comm.size
    shape = (size + 1, 2 * size + 1, size + 2)
    whole = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)

    def part(axis):
        return np.array_split(whole, size, axis=axis)[comm.rank]

    out = torch.zeros(part(new).shape, dtype=torch.float64)
    _run(comm, "Alltoallv", nonblocking, _dnd(torch.from_numpy(part(old).copy())), out,
         send_axis=new, recv_axis=old)
    np.testing.assert_array_equal(out.numpy(), part(new))


def test_same_axes_from_two_on_are_refused_as_in_heat(comm):
    x = torch.zeros(2, 2, 2 * comm.size)
    if comm.size > 1:
        with pytest.raises(NotImplementedError, match="send_axis == recv_axis"):
            comm.Alltoall(x, torch.zeros_like(x), send_axis=2, recv_axis=2)
    else:
        with pytest.warns(UserWarning, match="one process"):
            comm.Alltoall(x, torch.zeros_like(x), send_axis=2, recv_axis=2)


def test_sub_array_alltoall_takes_only_torch_tensors_and_dndarrays(comm):
    """Axes >= 2 on a numpy buffer are a TypeError naming the buffer (as an axis other than 0
    is in every other collective), plain or with counts, before anything is sent."""
    x = np.zeros((2, 3, 2 * comm.size), dtype=np.float32)
    t = torch.zeros(2, 3, 2 * comm.size)
    counts = [2] * comm.size
    with pytest.raises(TypeError, match="sendbuf of type ndarray supports axis 0 only"):
        comm.Alltoallv(x, t, send_axis=2, recv_axis=1)
    with pytest.raises(TypeError, match="recvbuf of type ndarray supports axis 0 only"):
        comm.Alltoallv((t, counts), (x, [1] * comm.size), send_axis=2, recv_axis=1)


@both
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_bool_reductions_are_logical(comm, nonblocking, layout):
    """SUM / MAX of bools is "any", PROD / MIN is "all" (numpy's result cast to bool)."""
    size = comm.size
    pattern = np.array([[r == 0, r == size - 1, True, False, r % 2 == 0] for r in range(size)])
    mine = torch.from_numpy(pattern[comm.rank].copy())
    def reference(op, part):
        return {"SUM": part.sum(0) > 0, "MAX": part.max(0), "PROD": part.prod(0) > 0,
                "MIN": part.min(0)}[op]

    for name in ("SUM", "MAX", "PROD", "MIN"):
        op, ref = getattr(MPI, name), reference(name, pattern)
        out = torch.zeros(10, dtype=torch.bool)[::2] if layout == "strided" else \
            torch.zeros(5, dtype=torch.bool)
        _run(comm, "Allreduce", nonblocking, mine, out, op)
        np.testing.assert_array_equal(out.numpy(), ref)
        scan = torch.zeros(5, dtype=torch.bool)
        _run(comm, "Scan", nonblocking, mine, scan, op)
        np.testing.assert_array_equal(scan.numpy(), reference(name, pattern[:comm.rank + 1]))
    with pytest.raises(TypeError, match="BAND"):
        comm.Allreduce(mine, torch.zeros(5, dtype=torch.bool), MPI.BAND)


def test_chunk_checks_its_arguments(comm):
    shape = (5, 3)
    for split in (2, -3):
        with pytest.raises(ValueError, match="not an axis"):
            comm.chunk(shape, split=split)
    with pytest.raises(TypeError, match="rank"):
        comm.chunk(shape, split=0, rank="one")
    assert comm.chunk(shape, split=-1) == comm.chunk(shape, split=1)
    offset, lshape, slices = comm.chunk(shape, split=0)
    total = comm.allreduce(lshape[0])
    assert total == 5 and slices[0] == slice(offset, offset + lshape[0])


def test_heat_module_flag_and_helpers(comm):
    assert isinstance(comm_module.GPU_AWARE_MPI, bool)
    assert hl.communication.GPU_AWARE_MPI is comm_module.GPU_AWARE_MPI
    with pytest.raises(AttributeError):
        comm_module.NO_SUCH_NAME  # noqa: B018
    limit = comm.COUNT_LIMIT
    assert limit == 2 ** 31 - 1
    dtype, count = comm._handle_large_count(MPI.INT, 2 * limit)
    assert count == 1 and dtype.Get_envelope()[4] == MPI.COMBINER_VECTOR
    assert dtype.Get_size() == 2 * limit * MPI.INT.Get_size()
    dtype.Free()
    dtype, count = comm._handle_large_count(MPI.INT, 2 * limit + 101)
    assert count == 1 and dtype.Get_envelope()[4] == MPI.COMBINER_STRUCT
    assert dtype.Get_size() == (2 * limit + 101) * MPI.INT.Get_size()
    dtype.Free()
    with pytest.raises(ValueError, match="exceed"):
        comm._handle_large_count(MPI.INT, 2 ** 64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float16, torch.bfloat16])
def test_minmax_op_combines_mins_and_maxs(comm, dtype):
    """Half-precision buffers reach the op as float32 (it read them as halves: wrong, and
    different on each rank)."""
    rng = np.random.default_rng(7)
    values = rng.integers(-100, 100, size=(comm.size, 2, 3))
    mine = torch.tensor(values[comm.rank], dtype=dtype)
    op = comm._minmax_op(dtype, total_count=3, shape=(2, 3), stride=(3, 1))
    try:
        out = _dnd(torch.zeros_like(mine))
        comm.Allreduce(_dnd(mine), out, op=op)
    finally:
        op.Free()
    expected = np.stack([values[:, 0].min(0), values[:, 1].max(0)])
    np.testing.assert_array_equal(out.larray.double().numpy(), expected)
    with pytest.raises(ValueError, match="2 x total_count"):
        comm._minmax_op(dtype, total_count=3, shape=(2, 2), stride=(2, 1))


def test_no_warning_for_ordinary_alltoall(comm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.zeros(comm.size, 2)
        comm.Alltoall(x, torch.zeros_like(x))
