"""Data movement: Bcast, Allgather(v), Alltoall(v), Gather(v), Scatter(v), point-to-point; every
layout, MPI.IN_PLACE where MPI allows it, every root, compared with the expected placement."""

import contextlib

import numpy as np
import pytest
import torch
from _helpers import gaps_intact, make_buffer, rank_data, read_back, tensor_identity, to_numpy
from mpi4py import MPI

import heatlike as hl
from heatlike.core._buffers import force_staging

pytestmark = pytest.mark.mpi

DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.float16, torch.bool, torch.uint8]
LAYOUTS = ["contiguous", "offset", "strided", "numpy", "numpy-reversed"]


def _layouts(dtype):
    return [lay for lay in LAYOUTS if not (lay.startswith("numpy") and dtype is torch.bfloat16)]


def _data(rank, n, dtype, seed=0):
    return rank_data(rank, (n,), dtype, seed=seed)


def _zeros(n, dtype, layout):
    return make_buffer(torch.zeros(n, dtype=dtype), layout)


def _blocking_or_not(comm, name, nonblocking, *args, **kwargs):
    if nonblocking:
        getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs).Wait()
    else:
        getattr(comm, name)(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_bcast(comm, dtype, nonblocking):
    for layout in _layouts(dtype):
        for root in range(comm.size):
            expected = to_numpy(_data(root, 7, dtype, seed=root))
            if comm.rank == root:
                buf, base = make_buffer(_data(root, 7, dtype, seed=root), layout)
            else:
                buf, base = _zeros(7, dtype, layout)
            ident = tensor_identity(buf)
            _blocking_or_not(comm, "Bcast", nonblocking, buf, root=root)
            np.testing.assert_array_equal(read_back(buf), expected, err_msg=f"{layout} {root}")
            assert gaps_intact(buf, base) and tensor_identity(buf) == ident


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_allgather_and_gather(comm, dtype, nonblocking):
    k, size = 3, comm.size
    everyone = np.concatenate([to_numpy(_data(r, k, dtype)) for r in range(size)])
    for layout in _layouts(dtype):
        for inplace in (False, True):
            what = f"{layout} inplace={inplace}"
            send, sbase = make_buffer(_data(comm.rank, k, dtype), layout)
            recv, rbase = _zeros(size * k, dtype, layout)
            if inplace:
                full = torch.zeros(size * k, dtype=dtype)
                full[comm.rank * k:(comm.rank + 1) * k] = _data(comm.rank, k, dtype)
                recv, rbase = make_buffer(full, layout)
                _blocking_or_not(comm, "Allgather", nonblocking, hl.IN_PLACE, recv)
            else:
                _blocking_or_not(comm, "Allgather", nonblocking, send, recv)
            np.testing.assert_array_equal(read_back(recv), everyone, err_msg="Allgather " + what)
            assert gaps_intact(send, sbase) and gaps_intact(recv, rbase), what
            for root in range(size):
                at_root = comm.rank == root
                send, _ = make_buffer(_data(comm.rank, k, dtype), layout)
                if inplace and at_root:
                    full = torch.zeros(size * k, dtype=dtype)
                    full[root * k:(root + 1) * k] = _data(root, k, dtype)
                    recv, rbase = make_buffer(full, layout)
                    _blocking_or_not(comm, "Gather", nonblocking, hl.IN_PLACE, recv, root=root)
                else:
                    recv, rbase = _zeros(size * k, dtype, layout) if at_root else (None, None)
                    _blocking_or_not(comm, "Gather", nonblocking, send, recv, root=root)
                if at_root:
                    np.testing.assert_array_equal(read_back(recv), everyone,
                                                  err_msg=f"Gather {what} root={root}")
                    assert gaps_intact(recv, rbase)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_allgatherv_and_gatherv(comm, dtype, nonblocking):
    size = comm.size
    counts = [(r * 2) % 5 for r in range(size)]  # includes empty contributions
    displs = [sum(counts[:r]) + r for r in range(size)]  # with holes between blocks
    total = displs[-1] + counts[-1] + 1
    expected = torch.zeros(total, dtype=dtype)
    for r in range(size):
        expected[displs[r]:displs[r] + counts[r]] = _data(r, counts[r], dtype, seed=r)
    for layout in _layouts(dtype):
        for inplace in (False, True):
            what = f"{layout} inplace={inplace}"
            mine = _data(comm.rank, counts[comm.rank], dtype, seed=comm.rank)
            send, _ = make_buffer(mine, layout)
            if inplace:
                start = torch.zeros(total, dtype=dtype)
                start[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]] = mine
                recv, rbase = make_buffer(start, layout)
                _blocking_or_not(comm, "Allgatherv", nonblocking, hl.IN_PLACE,
                                 (recv, counts, displs))
            else:
                recv, rbase = _zeros(total, dtype, layout)
                _blocking_or_not(comm, "Allgatherv", nonblocking, send, (recv, counts, displs))
            np.testing.assert_array_equal(read_back(recv), to_numpy(expected), err_msg=what)
            assert gaps_intact(recv, rbase)
            for root in range(size):
                recv, _ = _zeros(total, dtype, layout)
                spec = (recv, counts, displs) if comm.rank == root else None
                _blocking_or_not(comm, "Gatherv", nonblocking, send, spec, root=root)
                if comm.rank == root:
                    np.testing.assert_array_equal(read_back(recv), to_numpy(expected),
                                                  err_msg=f"Gatherv {what} root={root}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int8], ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_scatter_and_scatterv(comm, dtype, nonblocking):
    size, k = comm.size, 2
    for layout in _layouts(dtype):
        for root in range(size):
            full = _data(root, size * k, dtype, seed=10 + root)
            send, sbase = make_buffer(full, layout) if comm.rank == root else (None, None)
            recv, rbase = _zeros(k, dtype, layout)
            _blocking_or_not(comm, "Scatter", nonblocking, send, recv, root=root)
            np.testing.assert_array_equal(read_back(recv),
                                          to_numpy(full[comm.rank * k:(comm.rank + 1) * k]))
            assert gaps_intact(recv, rbase)
            if comm.rank == root:  # in place at the root: its block stays in sendbuf
                send, _ = make_buffer(full, layout)
                _blocking_or_not(comm, "Scatter", nonblocking, send, hl.IN_PLACE, root=root)
                np.testing.assert_array_equal(read_back(send), to_numpy(full))
            else:
                recv, _ = _zeros(k, dtype, layout)
                _blocking_or_not(comm, "Scatter", nonblocking, None, recv, root=root)
                np.testing.assert_array_equal(read_back(recv),
                                              to_numpy(full[comm.rank * k:(comm.rank + 1) * k]))
            counts = [r % 3 + 1 for r in range(size)]
            displs = [sum(counts[:r]) for r in range(size)]
            fullv = _data(root, sum(counts), dtype, seed=20 + root)
            spec = (make_buffer(fullv, layout)[0], counts, displs) if comm.rank == root else None
            recv, _ = _zeros(counts[comm.rank], dtype, layout)
            _blocking_or_not(comm, "Scatterv", nonblocking, spec, recv, root=root)
            mine = fullv[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]]
            np.testing.assert_array_equal(read_back(recv), to_numpy(mine), err_msg=layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_alltoall_and_alltoallv(comm, dtype, nonblocking):
    size, k = comm.size, 2

    def block(src, dst):
        return _data(src, k, dtype, seed=100 * dst + src)

    expected = torch.cat([block(src, comm.rank) for src in range(size)])
    for layout in _layouts(dtype):
        for inplace in (False, True):
            send, sbase = make_buffer(torch.cat([block(comm.rank, d) for d in range(size)]),
                                      layout)
            if inplace:
                _blocking_or_not(comm, "Alltoall", nonblocking, hl.IN_PLACE, send)
                got = read_back(send)
            else:
                recv, rbase = _zeros(size * k, dtype, layout)
                _blocking_or_not(comm, "Alltoall", nonblocking, send, recv)
                got = read_back(recv)
                assert gaps_intact(recv, rbase)
            np.testing.assert_array_equal(got, to_numpy(expected), err_msg=f"{layout} {inplace}")
            assert gaps_intact(send, sbase)
        # v-form: rank i sends (i + j) % 3 elements to rank j
        scounts = [(comm.rank + j) % 3 for j in range(size)]
        rcounts = [(i + comm.rank) % 3 for i in range(size)]
        sdispls = [sum(scounts[:j]) for j in range(size)]
        rdispls = [sum(rcounts[:i]) + i for i in range(size)]  # holes between blocks
        sendv = torch.cat([block(comm.rank, j)[: scounts[j]] for j in range(size)])
        expected_v = torch.zeros(rdispls[-1] + rcounts[-1], dtype=dtype)
        for i in range(size):
            expected_v[rdispls[i]:rdispls[i] + rcounts[i]] = block(i, comm.rank)[: rcounts[i]]
        send, _ = make_buffer(sendv, layout)
        recv, _ = _zeros(expected_v.numel(), dtype, layout)
        _blocking_or_not(comm, "Alltoallv", nonblocking, (send, scounts, sdispls),
                         (recv, rcounts, rdispls))
        np.testing.assert_array_equal(read_back(recv), to_numpy(expected_v), err_msg=layout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128], ids=str)
def test_point_to_point_ring(comm, dtype):
    """Send/Recv, Isend/Irecv, Ssend and Sendrecv around a ring, every layout."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    layouts = ["contiguous", "strided", "offset"]
    if dtype is not torch.bfloat16:
        layouts += ["numpy", "numpy-reversed"]
    for layout in layouts:
        mine = _data(comm.rank, 5, dtype, seed=7)
        expect = to_numpy(_data(left, 5, dtype, seed=7))
        send, _ = make_buffer(mine, layout)
        recv, rbase = _zeros(5, dtype, layout)
        req = comm.Irecv(recv, source=left, tag=3)
        comm.Send(send, dest=right, tag=3)
        status = MPI.Status()
        req.Wait(status)
        assert status.Get_source() == left
        np.testing.assert_array_equal(read_back(recv), expect, err_msg=layout)
        assert gaps_intact(recv, rbase)
        recv, _ = _zeros(5, dtype, layout)
        sreq = comm.Isend(send, dest=right, tag=4)
        comm.Recv(recv, source=left, tag=4)
        sreq.wait()
        np.testing.assert_array_equal(read_back(recv), expect)
        recv, _ = _zeros(5, dtype, layout)
        comm.Sendrecv(send, right, 5, recv, left, 5)
        np.testing.assert_array_equal(read_back(recv), expect)
        recv, _ = _zeros(5, dtype, layout)
        rreq = comm.Irecv(recv, source=left, tag=6)
        comm.Ssend(send, dest=right, tag=6)
        rreq.Wait()
        np.testing.assert_array_equal(read_back(recv), expect)


def test_empty_buffers_and_fewer_elements_than_ranks(comm):
    """Zero-size buffers and buffers smaller than the communicator work in every collective."""
    e = torch.empty(0)
    comm.Allreduce(hl.IN_PLACE, e)
    comm.Bcast(e, root=0)
    out = torch.empty(0)
    comm.Allgather(e, out)
    one = torch.tensor([float(comm.rank)], dtype=torch.bfloat16)
    comm.Allreduce(hl.IN_PLACE, one)
    assert one.item() == sum(range(comm.size))
    small = torch.full((1,), 2.0, dtype=torch.float16)
    part = torch.empty(1 if comm.rank == 0 else 0, dtype=torch.float16)
    comm.Reduce_scatter(small, part, None, MPI.SUM)
    if comm.rank == 0:
        assert part.item() == 2.0 * comm.size


def test_empty_numpy_buffers_receive_nothing_without_error(comm):
    """numpy's empty multi-dimensional arrays have zero strides, which torch keeps: they were
    refused as "overlapping elements", on the rank that got no rows only."""
    rows = [1] * (comm.size - 1) + [0]  # the last rank gets no rows
    x = np.arange(3 * sum(rows), dtype=np.float64).reshape(-1, 3)
    mine = np.empty((rows[comm.rank], 3))
    displs = [sum(rows[:r]) for r in range(comm.size)]  # in rows: slices along axis 0
    comm.Scatterv((x, rows, displs), mine, root=0)
    start = sum(rows[:comm.rank])
    np.testing.assert_array_equal(mine, x[start:start + rows[comm.rank]])
    empty = np.zeros((0, 4), np.float16)
    comm.Allreduce(hl.IN_PLACE, empty)
    everyone = np.empty((sum(rows), 3))
    comm.Allgatherv(mine, (everyone, rows, displs))
    np.testing.assert_array_equal(everyone, x)


def test_a_reversed_length_one_axis_is_a_buffer(comm):
    """A numpy array reversed along a length-1 axis (stride -24: numpy calls it contiguous, torch
    refuses to view it) is copied and sent as it reads."""
    mine = np.full((1, 3), float(comm.rank))[::-1]
    assert mine.strides[0] < 0
    out = np.empty((comm.size, 3))
    comm.Allgather(mine, out)
    np.testing.assert_array_equal(out, np.repeat(np.arange(comm.size, dtype=float), 3)
                                  .reshape(comm.size, 3))
    half = np.full((1, 3), 1.0, np.float16)[::-1]
    total = np.empty((1, 3), np.float16)
    comm.Allreduce(half, total)
    np.testing.assert_array_equal(total, np.full((1, 3), float(comm.size), np.float16))


def test_barrier_and_ibarrier(comm):
    comm.Barrier()
    req = comm.Ibarrier()
    req.Wait()
    assert req.done


def test_contiguous_buffers_are_handed_over_not_copied():
    """Contiguous CPU tensors (with a storage offset too) and numpy arrays reach MPI at their own
    address; only non-contiguous ones get a temporary."""
    from heatlike.core import _buffers

    base = torch.zeros(10)
    for t in (torch.ones(5), base[3:8]):
        assert _buffers.readable(t) is t
        assert _buffers.writable(t)[0] is t
        mem, n, _ = _buffers.direct(t, True)
        assert mem.address == t.data_ptr() and n == t.numel()
    a = np.ones(4)
    mem, _, _ = _buffers.direct(a, True)
    assert mem.address == a.ctypes.data
    view, _ = _buffers.as_tensor(a, "buf")
    assert view.data_ptr() == a.ctypes.data
    strided = base[::2]
    assert _buffers.readable(strided) is not strided and _buffers.direct(strided, False) is None


@pytest.mark.mpi(min_size=2)
def test_wait_fills_the_status_on_a_watched_communicator(comm):
    """Once a training model watches the communicator (its waits are polled against the board),
    Request.Wait(status) still fills the status."""
    from heatlike.nn import DataParallel

    DataParallel(torch.nn.Linear(2, 2), comm)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    recv = torch.zeros(3)
    req = comm.Irecv(recv, source=left, tag=9)
    comm.Send(torch.full((3,), float(comm.rank)), dest=right, tag=9)
    status = MPI.Status()
    req.Wait(status)
    assert status.Get_source() == left and status.Get_tag() == 9
    assert torch.equal(recv, torch.full((3,), float(left)))


def test_point_to_point_is_not_counted_as_a_collective(comm):
    """On a communicator a gradient synchronization watches, messages between some ranks only
    (blocking or not) leave every rank's collective position alone: the next training step is
    not taken for a rank that ran another number of steps."""
    from heatlike.nn import DataParallel
    from heatlike.optim import DataParallelOptimizer

    if comm.size == 1:
        pytest.skip("one rank: the training step does not communicate")
    with comm.Dup() as c:
        net = torch.nn.Linear(3, 2)
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        model = DataParallel(net, c, optimizer=opt)

        def step():
            opt.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            opt.step()

        step()
        before = c._hub.board.seq
        if c.rank < 2:  # ranks 0 and 1 only, each way, both kinds
            peer, buf = 1 - c.rank, torch.zeros(4)
            reqs = [c.Isend(torch.full((4,), float(c.rank)), dest=peer, tag=7),
                    c.Irecv(buf, source=peer, tag=7)]
            for r in reqs:
                r.Wait()
            assert buf.tolist() == [float(peer)] * 4
            if c.rank == 0:
                c.Send(torch.ones(2), dest=1, tag=8)
            else:
                c.Recv(buf[:2], source=0, tag=8)
        assert c._hub.board.seq == before
        step()
        after = c.handle.allgather(c._hub.board.seq)
        assert after[0] > before and after == [after[0]] * c.size


def test_conjugate_and_negative_views_are_sent_and_received_as_they_read(comm):
    """``x.conj()`` and ``torch._neg_view(x)`` are lazy views: their memory holds x, not what they
    read. Sent, they carry the values they read; received into, they read the message (before,
    the memory was sent as it is: conjugates arrived unconjugated)."""
    rank, size = comm.rank, comm.size
    x = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
    total = sum(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (r + 1)
                for r in range(size))
    out = torch.zeros(2, dtype=torch.complex64)
    comm.Allreduce(x.conj(), out)
    assert torch.equal(out, total.conj())
    out = torch.zeros(2, dtype=torch.complex64)
    comm.Iallreduce(x.conj(), out).Wait()
    assert torch.equal(out, total.conj())
    real = torch.tensor([1.0, 2.0]) * (rank + 1)
    summed = torch.zeros(2)
    comm.Allreduce(torch._neg_view(real), summed)
    assert summed.tolist() == [-s for s in (torch.tensor([1.0, 2.0]) * sum(range(1, size + 1)))
                               .tolist()]
    gathered = torch.zeros(2 * size, dtype=torch.complex64)
    comm.Allgather(x.conj(), gathered)
    assert torch.equal(gathered, torch.cat([torch.tensor([1 + 2j, 3 - 1j],
                                                         dtype=torch.complex64) * (r + 1)
                                            for r in range(size)]).conj())
    into = torch.zeros(2, dtype=torch.complex64)
    view = into.conj()
    comm.Allreduce(x, view)  # the view reads the sum, its memory holds the conjugate
    assert torch.equal(view, total) and torch.equal(into, total.conj())


@pytest.mark.parametrize("layout", ["strided", "staged"])
def test_a_shorter_message_leaves_the_rest_of_the_buffer_alone(comm, layout):
    """A receive of fewer elements than the buffer holds writes only those, into a strided
    buffer or a staged one (device memory goes through a host copy: ``force_staging`` here),
    blocking or not, and the status says how many arrived, with checks on too (before, the
    rest of a strided or staged buffer was overwritten with uninitialized memory, and with
    ``HEATLIKE_CHECK`` a blocking Recv's status stayed empty)."""
    from heatlike.core import checks

    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for checked in (False, True):
        for blocking in (True, False):
            base = torch.full((16,), -7.0)
            view = base[::2] if layout == "strided" else base[:8]
            send = torch.arange(3.0) + 10 * left
            status = MPI.Status()
            old = checks.checking()
            checks.set_check(checked)
            try:
                with force_staging() if layout == "staged" else contextlib.nullcontext():
                    sent = comm.Isend(torch.arange(3.0) + 10 * comm.rank, dest=right, tag=9)
                    if blocking:
                        comm.Recv(view, source=left, tag=9, status=status)
                    else:
                        comm.Irecv(view, source=left, tag=9).Wait(status)
                    sent.Wait()
            finally:
                checks.set_check(old)
            assert view.tolist() == [*send.tolist(), *[-7.0] * 5], (checked, blocking)
            assert (base[8:] == -7).all() if layout == "staged" else (base[1::2] == -7).all()
            assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.FLOAT)) == \
                (left, 9, 3), (checked, blocking)
    with pytest.raises(TypeError, match="pass it to the request's Wait"):
        comm.Irecv(torch.zeros(2), source=left, tag=9, status=MPI.Status())


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64], ids=lambda d: d.__name__)
def test_numpy_unsigned_arrays_are_buffers(comm, dtype):
    """numpy's wider unsigned integers (torch has them too) are reduced and gathered, contiguous
    and strided (they were a TypeError)."""
    size, rank = comm.size, comm.rank
    def buffer(values, strided):
        if not strided:
            return values
        base = np.zeros(2 * values.size, dtype=dtype)
        base[::2] = values
        return base[::2]

    for strided in (False, True):
        mine = buffer(np.arange(10, dtype=dtype) * (rank + 1), strided)
        out = buffer(np.zeros(10, dtype=dtype), strided)
        comm.Allreduce(mine, out, MPI.SUM)
        assert (out == np.arange(10, dtype=dtype) * sum(range(1, size + 1))).all()
        comm.Allreduce(mine, out, MPI.MAX)
        assert (out == np.arange(10, dtype=dtype) * size).all()
        gathered = np.zeros(10 * size, dtype=dtype)
        comm.Allgather(mine, gathered)
        assert (gathered.reshape(size, 10) == np.arange(10, dtype=dtype) *
                np.arange(1, size + 1, dtype=dtype)[:, None]).all()
