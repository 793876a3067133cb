"""Bad input: a clear TypeError / ValueError naming the argument, on every rank, nothing sent."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import heatlike as hl

pytestmark = pytest.mark.mpi


def _still_in_step(comm):
    """Nothing was sent by the failed call: the next collective matches on every rank and no
    stray point-to-point message is waiting."""
    v = torch.tensor([float(comm.rank + 1)])
    comm.Allreduce(hl.IN_PLACE, v)
    assert v.item() == sum(range(1, comm.size + 1))
    assert not comm.handle.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    comm.Barrier()


def _cases(comm):
    size = comm.size
    f4 = torch.zeros(8)
    ro = np.zeros(4)
    ro.setflags(write=False)
    return [
        # (call, exception, words the message must contain)
        (lambda: comm.Allreduce([1.0, 2.0], torch.zeros(2)), TypeError, "sendbuf"),
        (lambda: comm.Allreduce(torch.zeros(2), "out"), TypeError, "recvbuf"),
        (lambda: comm.Allreduce(torch.zeros(2), None), TypeError, "recvbuf"),
        (lambda: comm.Bcast(3.0, root=0), TypeError, "buf"),
        (lambda: comm.Allreduce(np.array(["a", "b"]), np.zeros(2)), TypeError, "sendbuf"),
        (lambda: comm.Allreduce(np.zeros(2, dtype=object), np.zeros(2)), TypeError, "sendbuf"),
        (lambda: comm.Allreduce(np.zeros(2, dtype=">f4"), np.zeros(2, dtype=">f4")),
         TypeError, "recvbuf"),
        (lambda: comm.Allreduce(torch.zeros(3), torch.zeros(3, dtype=torch.float64)),
         TypeError, "dtype"),
        (lambda: comm.Allreduce(torch.zeros(3), torch.zeros(4)), ValueError, "recvbuf"),
        (lambda: comm.Iallreduce(torch.zeros(3), torch.zeros(4)), ValueError, "recvbuf"),
        (lambda: comm.Allreduce(torch.zeros(3), torch.zeros(3), "sum"), TypeError, "MPI.Op"),
        (lambda: comm.Allgather(torch.zeros(2), torch.zeros(2 * size + 1)), ValueError,
         "recvbuf"),
        (lambda: comm.Alltoall(torch.zeros(size), torch.zeros(2 * size)), ValueError, "recvbuf"),
        (lambda: comm.Gather(torch.zeros(2), torch.zeros(2 * size + 1), root=0)
         if comm.rank == 0 else comm.Gather(torch.zeros(2), None, root=99), ValueError, "root"
         if comm.rank else "recvbuf"),
        (lambda: comm.Scatter(torch.zeros(3), torch.zeros(1), root=size), ValueError, "root"),
        (lambda: comm.Bcast(torch.zeros(1), root=-1), ValueError, "root"),
        (lambda: comm.Bcast(torch.zeros(1), root=0.0), TypeError, "root"),
        (lambda: comm.Send(torch.zeros(1), dest=size), ValueError, "dest"),
        (lambda: comm.Isend(torch.zeros(1), dest="1"), TypeError, "dest"),
        (lambda: comm.Recv(torch.zeros(1), source=size + 3), ValueError, "source"),
        (lambda: comm.Allgatherv(torch.zeros(1), (torch.zeros(size), [1] * (size + 1))),
         ValueError, "counts"),
        (lambda: comm.Allgatherv(torch.zeros(1), (torch.zeros(size), [1] * size, [5] * size)),
         ValueError, "does not fit"),
        (lambda: comm.Allgatherv(torch.zeros(1), (torch.zeros(size), [-1] * size)), ValueError,
         "block"),
        (lambda: comm.Allgatherv(torch.zeros(2), (torch.zeros(size), [1] * size)), ValueError,
         "sendbuf"),
        (lambda: comm.Allgatherv(torch.zeros(1), (torch.zeros(size),)), TypeError, "counts"),
        *([(lambda: comm.Allgatherv(torch.zeros(1), torch.zeros(size + 1)), ValueError,
            "multiple")] if size > 1 else []),
        (lambda: comm.Allgather(np.zeros(2), torch.zeros(2, size), recv_axis=1), TypeError,
         "axis 0 only"),
        (lambda: comm.Allgather(torch.zeros(2), torch.zeros(2 * size), recv_axis=2),
         ValueError, "axis 2"),
        (lambda: comm.Gather(torch.zeros(2), torch.zeros(2 * size), axis=1.0), TypeError,
         "axis"),
        (lambda: comm.Alltoallv(torch.zeros(size), torch.zeros(size), send_axis=None),
         NotImplementedError, "send_axis"),
        *([(lambda: comm.Alltoall(torch.zeros(1, 1, size), torch.zeros(1, 1, size),
                                  send_axis=2, recv_axis=2), NotImplementedError, "axis")]
          if size > 1 else []),
        (lambda: comm.Alltoallv((torch.zeros(size), [1.5] * size), (torch.zeros(size),
                                                                      [1] * size)),
         TypeError, "integers"),
        (lambda: comm.Reduce(hl.IN_PLACE, torch.zeros(1), root=0) if comm.rank
         else comm.Reduce(hl.IN_PLACE, torch.zeros(1), root=size), ValueError,
         "root" if comm.rank == 0 else "IN_PLACE"),
        (lambda: comm.Reduce_scatter(torch.zeros(size + 1), torch.zeros(1), [1] * size),
         ValueError, "sum"),
        *([(lambda: comm.Alltoall(torch.zeros(size + 1), torch.zeros(size + 1)), ValueError,
            "multiple"),
           (lambda: comm.Reduce_scatter_block(torch.zeros(size + 1), torch.zeros(1)),
            ValueError, "multiple")] if size > 1 else []),
        (lambda: comm.Allreduce(f4[:4], f4[2:6]), ValueError, "overlap"),
        (lambda: comm.Allreduce(np.zeros(4), ro), ValueError, "read-only"),
        (lambda: comm.Allreduce(torch.zeros(4), torch.zeros(1).expand(4)), ValueError,
         "overlapping"),
        (lambda: comm.Bcast(torch.zeros(1).expand(4), root=0 if comm.rank else 1 % size)
         if size > 1 else comm.Recv(torch.zeros(1).expand(2), 0), ValueError, "overlapping"),
        (lambda: comm.Free(), ValueError, "not created by heatlike"),
        (lambda: comm.Create_group([0, 0]), ValueError, "duplicates"),
        (lambda: comm.Create_group([size]), ValueError, "ranks entry"),
    ]


def test_bad_input_table(comm):
    for i, (call, exc, words) in enumerate(_cases(comm)):
        with pytest.raises(exc) as info:
            call()
        assert words.lower() in str(info.value).lower(), (i, str(info.value))
        _still_in_step(comm)


def test_send_error_sends_nothing(comm):
    """A rejected send leaves no message behind: the receiver's probe finds nothing."""
    with pytest.raises(TypeError):
        comm.Send([1, 2, 3], dest=(comm.rank + 1) % comm.size, tag=1)
    with pytest.raises(TypeError):
        comm.Isend(torch.zeros(2), dest=(comm.rank + 1) % comm.size, tag=(1,))
    comm.Barrier()
    assert not comm.handle.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_deferred_step_is_verified_with_reads_started_after_its_record(comm):
    """Across nodes a training step only starts reading the other ranks' records when it is
    posted, and its confirmation (before its first exchange) completes those reads: read at
    once, every step waited for the other node's ranks, busy in their backward pass, to make
    MPI progress. The reads serve the confirmation only while this rank has written no newer
    record (of two ranks, at least one must see the other's record before issuing); otherwise
    it reads anew. Boards read through MPI_Rget here, as across nodes."""
    from heatlike.core import checks
    from heatlike.engine.liveness import StepBoard

    shared = checks.shared_windows
    checks.shared_windows = False
    try:
        sub = comm.Split(0, comm.rank)
        steps = StepBoard(sub)
    finally:
        checks.shared_windows = shared
    board = steps.board
    assert board.shared is None  # records read with MPI_Rget
    steps.post(defer=True)
    assert board._fresh is not None and board._fresh[0] == board.seq
    started = board._fresh[1]
    steps.confirm()
    assert board._fresh is None and all(q.Test() for q, _ in started.values())
    steps.post(defer=True)
    board.arrive("Barrier")  # a newer record: the reads started at the post are not current
    comm.handle.Barrier()  # (every rank has posted both steps)
    rows = board.read(patience=5.0)
    assert board._fresh is None
    assert [int(row[checks.STEPS]) for row in rows] == [2] * comm.size
    sub.Free()
    _still_in_step(comm)


def test_freeing_a_communicator_frees_its_board(comm):
    """The board heatlike sets up for a communicator (here by check mode) is freed with it, and
    its collectives never ran on the communicator itself: the next collective matches."""
    from heatlike.core import checks

    was = checks.checking()
    checks.set_check(True)
    try:
        sub = comm.Split(0, comm.size - 1 - comm.rank)
        v = torch.ones(2)
        sub.Allreduce(hl.IN_PLACE, v)
        assert v.tolist() == [float(comm.size)] * 2
        board = sub._hub.board
        assert (board is not None) == (comm.size > 1)
        sub.Free()
        assert board is None or (board not in checks._BOARDS and board.closed)
    finally:
        checks.set_check(was)
    _still_in_step(comm)


@pytest.mark.mpi(min_size=2)
def test_check_mode_compares_the_counts_every_rank_must_pass_alike(comm):
    """Check mode: ``Allgatherv``'s receive counts and ``Reduce_scatter``'s ``recvcounts`` that
    differ on one rank, and ``Alltoallv`` send counts that differ from what their receivers
    expect, raise ValueError on every rank (they gave wrong or truncated data silently); a
    placeholder send buffer off the root of ``Scatter`` (ignored there) is no mismatch."""
    from heatlike.core import checks

    P, r = comm.size, comm.rank
    was = checks.checking()
    checks.set_check(True)
    try:
        counts = [2] + [1] * (P - 1) if r == 1 else [1] * P
        out = torch.zeros(sum(counts))
        with pytest.raises(ValueError, match="ranks call different collectives.*Allgatherv.*"
                                             "counts with checksum"):
            comm.Allgatherv(torch.full((counts[r],), float(r)), (out, counts))
        counts = [1] + [2] * (P - 2) + [3] if r == 1 else [2] * P
        with pytest.raises(ValueError, match="Reduce_scatter.*counts with checksum"):
            comm.Reduce_scatter(torch.ones(2 * P), torch.zeros(counts[r]), counts, MPI.SUM)
        sent = [2] * P if r == 0 else [1] * P  # rank 0 sends 2 where each expects 1
        with pytest.raises(ValueError, match="rank 0 sends 2 slice.* to rank 0, which expects 1"):
            comm.Alltoallv((torch.zeros(sum(sent)), sent), (torch.zeros(P), [1] * P))
        got = torch.zeros(P)
        comm.Alltoallv((torch.full((P,), float(r)), [1] * P), (got, [1] * P))
        assert got.tolist() == [float(s) for s in range(P)]
        whole = torch.arange(2.0 * P) if r == 0 else torch.empty(0)
        out = torch.zeros(2)
        comm.Scatter(whole, out, root=0)
        assert out.tolist() == [2.0 * r, 2.0 * r + 1]
    finally:
        checks.set_check(was)
    _still_in_step(comm)


def _one_rank_wrong(comm):
    """Rooted collectives where only one rank passes wrong arguments, which only that rank can
    see (the root's counts and buffers, a non-root's IN_PLACE): (who fails, call, its reason).
    Every receive buffer starts at -1."""
    size, rank, last = comm.size, comm.rank, comm.size - 1
    src = torch.arange(3.0 * size)
    recv = torch.full((3,), -1.0)
    gathered = torch.full((3 * size,), -1.0)
    ones = [3] * size
    cases = [
        (0, lambda: comm.Scatterv((src, [3] * (size - 1) + [30]) if rank == 0 else None, recv,
                                  root=0), "does not fit"),
        (0, lambda: comm.Iscatterv((src, ones, [0] * (size - 1) + [9 * size])
                                   if rank == 0 else None, recv, root=0).Wait(), "does not fit"),
        (0, lambda: comm.Gatherv(torch.ones(3), (gathered, ones, [-1] + [3] * (size - 1))
                                 if rank == 0 else None, root=0), "block 0"),
        (0, lambda: comm.Igatherv(torch.ones(3), (gathered, [4] * size) if rank == 0 else None,
                                  root=0).Wait(), "does not fit"),
        (0, lambda: comm.Gather(torch.ones(3), gathered[:-1] if rank == 0 else None, root=0),
         "recvbuf"),
        (0, lambda: comm.Scatter(src[1:] if rank == 0 else None, recv, root=0), "sendbuf"),
        (0, lambda: comm.Reduce(torch.ones(3), torch.zeros(4) if rank == 0 else None, root=0),
         "recvbuf"),
        (0, lambda: comm.Ireduce(torch.ones(3), recv.double() if rank == 0 else None,
                                 root=0).Wait(), "dtype"),
    ]
    if size > 1:
        cases += [
            (last, lambda: comm.Scatterv((src, ones) if rank == 0 else None,
                                         hl.IN_PLACE if rank == last else recv, root=0),
             "IN_PLACE"),
            (last, lambda: comm.Gatherv(hl.IN_PLACE if rank == last else torch.ones(3),
                                        (gathered, ones) if rank == 0 else None, root=0),
             "IN_PLACE"),
            (last, lambda: comm.Gather(torch.ones(3), gathered, root=0 if rank != last else 1.5),
             "root"),
            (last, lambda: comm.Reduce(hl.IN_PLACE if rank == last else torch.ones(3),
                                       recv if rank == 0 else None, root=0), "IN_PLACE"),
        ]
    return cases, recv, gathered


def test_one_ranks_wrong_rooted_arguments_raise_on_every_rank(comm):
    """A rooted collective whose arguments only one rank gets wrong (the root's buffers, counts
    and displacements, a non-root's IN_PLACE or root) raises on every rank, in the blocking and the
    non-blocking forms: that rank its own reason, the others a ValueError or TypeError naming it;
    nothing was received and the next collective matches (before, the other ranks waited in
    the collective forever)."""
    cases, recv, gathered = _one_rank_wrong(comm)
    for i, (who, call, reason) in enumerate(cases):
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        text = str(info.value)
        if comm.rank == who:
            assert reason.lower() in text.lower(), (i, text)
        else:
            assert f"rank(s) [{who}]" in text and "nothing was sent" in text, (i, text)
        assert (recv == -1).all() and (gathered == -1).all(), i
        _still_in_step(comm)
    # and right arguments still work: the root's scatter of 3 values per rank
    src = torch.arange(3.0 * comm.size)
    comm.Scatterv((src, [3] * comm.size) if comm.rank == 0 else None, recv, root=0)
    assert recv.tolist() == [3.0 * comm.rank + j for j in range(3)]


def test_any_error_in_a_rooted_collectives_checks_reaches_every_rank(comm, monkeypatch):
    """An unexpected exception in one rank's checks (here the root check raising RuntimeError
    on the last rank alone) is raised there and reported on every other rank as a RuntimeError
    naming it; nothing is sent."""
    last = comm.size - 1
    if comm.rank == last:
        def broken(root):
            raise RuntimeError("broken root check")
        monkeypatch.setattr(comm, "_check_root", broken)
    recv = torch.full((3,), -1.0)
    with pytest.raises(RuntimeError) as info:
        comm.Scatterv((torch.arange(3.0 * comm.size), [3] * comm.size) if comm.rank == 0
                      else None, recv, root=0)
    monkeypatch.undo()
    text = str(info.value)
    assert ("broken root check" in text) if comm.rank == last else f"rank(s) [{last}]" in text
    assert (recv == -1).all()
    _still_in_step(comm)


def _rooted_call(comm, name: str, mine, whole, root: int) -> None:
    """Rooted collective ``name`` of blocks of two elements: ``mine`` sent (gathers, Reduce) or
    received (scatters), ``whole`` the root's buffer of every rank's block (gathers)."""
    size = comm.size
    calls = {
        "Gather": lambda: comm.Gather(mine, whole, root=root),
        "Gatherv": lambda: comm.Gatherv(mine, (whole, [2] * size), root=root),
        "Igatherv": lambda: comm.Igatherv(mine, (whole, [2] * size), root=root).Wait(),
        "Scatter": lambda: comm.Scatter(torch.arange(2.0 * size), mine, root=root),
        "Scatterv": lambda: comm.Scatterv((torch.arange(2.0 * size), [2] * size), mine,
                                          root=root),
        "Iscatterv": lambda: comm.Iscatterv((torch.arange(2.0 * size), [2] * size), mine,
                                            root=root).Wait(),
        "Reduce": lambda: comm.Reduce(mine, torch.full((2,), -1.0) if comm.rank == root
                                      else None, MPI.SUM, root=root),
    }
    calls[name]()


@pytest.mark.parametrize("name", ["Gather", "Gatherv", "Scatter", "Scatterv", "Reduce",
                                  "Igatherv", "Iscatterv"])
@pytest.mark.parametrize("delta", [1, -1])
def test_a_rank_whose_buffer_differs_from_the_roots_counts_raises_everywhere(comm, name, delta):
    """Root 0 expects 2 elements of (or for) every rank; the last rank's buffer holds 2 + delta.
    Every rank raises a ValueError naming that rank and both counts, nothing is received (before,
    one more element was "Message truncated" on one rank only, one fewer went unnoticed: the
    root kept a stale value)."""
    if comm.size == 1:
        pytest.skip("a rank's count can only differ from the root's with a second rank")
    last, root, size = comm.size - 1, 0, comm.size
    n = 2 + delta if comm.rank == last else 2
    mine = torch.full((n,), -1.0) if "catter" in name else torch.full((n,), float(comm.rank))
    whole = torch.full((2 * size,), -1.0) if comm.rank == root else None
    with pytest.raises(ValueError) as info:
        _rooted_call(comm, name, mine, whole, root)
    text = str(info.value)
    assert f"rank {last}: {2 + delta} (root expects 2)" in text and "nothing was sent" in text, \
        text
    if "catter" in name:
        assert (mine == -1).all()
    if whole is not None:
        assert (whole == -1).all()
    _still_in_step(comm)


def test_a_rank_whose_dtype_differs_from_the_roots_raises_everywhere(comm):
    if comm.size == 1:
        pytest.skip("a rank's dtype can only differ from the root's with a second rank")
    last = comm.size - 1
    send = torch.ones(2, dtype=torch.float64 if comm.rank == last else torch.float32)
    recv = torch.full((2,), -1.0) if comm.rank == 0 else None
    with pytest.raises(ValueError, match=rf"rank\(s\) \[{last}\] pass a buffer of another dtype"):
        comm.Reduce(send, recv, MPI.SUM, root=0)
    if recv is not None:
        assert (recv == -1).all()
    _still_in_step(comm)


@pytest.mark.parametrize("name", ["Gather", "Gatherv", "Igatherv", "Scatter", "Scatterv",
                                  "Iscatterv", "Reduce"])
def test_ranks_naming_different_roots_raise_everywhere(comm, name):
    """The last rank names root 1, the others root 0: every rank raises a ValueError naming
    each rank's root, and nothing is received. At three ranks the counts balanced (rank 1 does
    not act as the root the last rank names): Gather and Scatter returned on two ranks while
    the root waited forever, Reduce gave zeros."""
    if comm.size == 1:
        pytest.skip("ranks can only name different roots with a second rank")
    last, size = comm.size - 1, comm.size
    root = 1 if comm.rank == last else 0
    mine = torch.full((2,), -1.0) if "catter" in name else torch.full((2,), float(comm.rank))
    whole = torch.full((2 * size,), -1.0) if comm.rank == root else None
    with pytest.raises(ValueError, match="name different roots") as info:
        _rooted_call(comm, name, mine, whole, root)
    assert f"rank {last}: 1" in str(info.value) and "rank 0: 0" in str(info.value)
    if "catter" in name:
        assert (mine == -1).all()
    if whole is not None:
        assert (whole == -1).all()
    _still_in_step(comm)
