"""Every non-blocking operation finalizes through every completion path.

Buffers are staged (``force_staging``: what CUDA tensors get without a CUDA-aware MPI) or strided,
so each operation has a copy-back to run; Heat's lower-case ``wait()`` skipped it.
"""

import contextlib
import gc
import time

import pytest
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core import checks
from heatlike.core._buffers import force_staging
from heatlike.core._halfreduce import ALLTOALL_MIN_ELEMENTS

pytestmark = pytest.mark.mpi

PATHS = ["Wait", "wait", "Test", "test", "wait_all", "test_all"]


def _complete(req, path):
    if path in ("Wait", "wait"):
        getattr(req, path)()
    elif path in ("Test", "test"):
        while not getattr(req, path)():
            pass
    elif path == "wait_all":
        hl.core.wait_all([req, None])
    else:
        while not hl.core.test_all([req]):
            pass
    assert req.done


def _operations(comm, dtype, n):
    """(name, start, check) triples: start() returns a Request, check() asserts the result."""
    size, rank = comm.size, comm.rank
    ops = []

    def add(name, start, check):
        ops.append((name, start, check))

    x = torch.full((n,), float(rank + 1), dtype=dtype)
    total = float(sum(range(1, size + 1)))

    out = torch.zeros(n, dtype=dtype)
    add("Iallreduce", lambda: comm.Iallreduce(x, out), lambda: (out == total).all())
    inpl = x.clone()
    add("Iallreduce in place", lambda: comm.Iallreduce(hl.IN_PLACE, inpl),
        lambda: (inpl == total).all())
    red = torch.zeros(n, dtype=dtype)
    add("Ireduce", lambda: comm.Ireduce(x, red if rank == 0 else None, MPI.SUM, 0),
        lambda: rank != 0 or (red == total).all())
    bc = torch.full((n,), 7.0 if rank == 0 else 0.0, dtype=dtype)
    add("Ibcast", lambda: comm.Ibcast(bc, 0), lambda: (bc == 7.0).all())
    ag = torch.zeros(size * n, dtype=dtype)
    add("Iallgather", lambda: comm.Iallgather(x, ag),
        lambda: torch.equal(ag, torch.arange(1, size + 1, dtype=dtype).repeat_interleave(n)))
    counts = [n] * size
    agv = torch.zeros(size * n, dtype=dtype)
    add("Iallgatherv", lambda: comm.Iallgatherv(x, (agv, counts)),
        lambda: torch.equal(agv, torch.arange(1, size + 1, dtype=dtype).repeat_interleave(n)))
    a2a_send = torch.arange(size, dtype=dtype).repeat_interleave(2) + 10 * rank
    a2a = torch.zeros(2 * size, dtype=dtype)
    add("Ialltoall", lambda: comm.Ialltoall(a2a_send, a2a),
        lambda: torch.equal(a2a, (torch.arange(size, dtype=dtype) * 10 + rank)
                            .repeat_interleave(2)))
    a2av = torch.zeros(2 * size, dtype=dtype)
    add("Ialltoallv", lambda: comm.Ialltoallv((a2a_send, [2] * size), (a2av, [2] * size)),
        lambda: torch.equal(a2av, (torch.arange(size, dtype=dtype) * 10 + rank)
                            .repeat_interleave(2)))
    ga = torch.zeros(size * n, dtype=dtype)
    add("Igather", lambda: comm.Igather(x, ga if rank == 0 else None, 0),
        lambda: rank != 0 or torch.equal(
            ga, torch.arange(1, size + 1, dtype=dtype).repeat_interleave(n)))
    gv = torch.zeros(size * n, dtype=dtype)
    add("Igatherv", lambda: comm.Igatherv(x, (gv, counts) if rank == 0 else None, 0),
        lambda: rank != 0 or torch.equal(
            gv, torch.arange(1, size + 1, dtype=dtype).repeat_interleave(n)))
    full = torch.arange(size * 2, dtype=dtype)
    sc = torch.zeros(2, dtype=dtype)
    add("Iscatter", lambda: comm.Iscatter(full if rank == 0 else None, sc, 0),
        lambda: torch.equal(sc, full[2 * rank:2 * rank + 2]))
    scv = torch.zeros(2, dtype=dtype)
    add("Iscatterv", lambda: comm.Iscatterv((full, [2] * size) if rank == 0 else None, scv, 0),
        lambda: torch.equal(scv, full[2 * rank:2 * rank + 2]))
    rs = torch.zeros(2, dtype=dtype)
    add("Ireduce_scatter_block",
        lambda: comm.Ireduce_scatter_block(torch.ones(2 * size, dtype=dtype), rs),
        lambda: (rs == size).all())
    rsv = torch.zeros(2, dtype=dtype)
    add("Ireduce_scatter",
        lambda: comm.Ireduce_scatter(torch.ones(2 * size, dtype=dtype), rsv, [2] * size),
        lambda: (rsv == size).all())
    scan = torch.zeros(n, dtype=dtype)
    add("Iscan", lambda: comm.Iscan(x, scan),
        lambda: (scan == float(sum(range(1, rank + 2)))).all())
    exs = torch.zeros(n, dtype=dtype)
    add("Iexscan", lambda: comm.Iexscan(x, exs),
        lambda: rank == 0 or (exs == float(sum(range(1, rank + 1)))).all())
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        p2p = torch.zeros(n, dtype=dtype)

        def start_p2p():
            recv = comm.Irecv(p2p, left, 9)
            comm.Isend(x, right, 9).Wait()
            return recv

        add("Isend/Irecv", start_p2p, lambda: (p2p == float(left + 1)).all())
    return ops


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["staged", "staged-half-large", "strided"])
def test_every_completion_path_finalizes(comm, path, mode):
    dtype = torch.bfloat16 if mode == "staged-half-large" else torch.float32
    n = ALLTOALL_MIN_ELEMENTS + 3 if mode == "staged-half-large" else 5
    staging = force_staging() if mode.startswith("staged") else contextlib.nullcontext()
    with staging:
        ops = _operations(comm, dtype, n)
        if mode == "strided":  # swap every buffer for a strided view of the same values
            ops = _operations_strided(comm)
        for name, start, check in ops:
            req = start()
            _complete(req, path)
            assert bool(check()), f"{name} via {path} ({mode})"


def _operations_strided(comm):
    """A few operations whose receive buffers are strided views (unpacked on completion)."""
    size = comm.size
    base = torch.zeros(10)
    view = base[::2]
    out = torch.zeros(2 * size * 3)[::3]
    base2 = torch.zeros(size * 2, 2)
    col = base2[:, 1]
    return [
        ("Iallreduce strided", lambda: comm.Iallreduce(torch.ones(5), view),
         lambda: (view == size).all() and (base[1::2] == 0).all()),
        ("Iallgather strided", lambda: comm.Iallgather(torch.full((2,), float(comm.rank)), out),
         lambda: torch.equal(out, torch.arange(size).float().repeat_interleave(2))),
        ("Ialltoall column",
         lambda: comm.Ialltoall(torch.arange(2 * size).float() + 100 * comm.rank, col),
         lambda: (base2[:, 0] == 0).all() and torch.equal(
             col, torch.cat([torch.tensor([2.0 * comm.rank, 2.0 * comm.rank + 1]) + 100 * r
                             for r in range(size)]))),
    ]


def test_wait_all_overlaps_several_operations(comm):
    """Many requests in flight at once (as DataParallel's buckets) complete together."""
    bufs = [torch.full((1000 + i,), float(comm.rank), dtype=torch.bfloat16 if i % 2 else
                       torch.float32) for i in range(6)]
    with force_staging():
        reqs = [comm.Iallreduce(hl.IN_PLACE, b) for b in bufs]
        hl.core.wait_all(reqs)
    for b in bufs:
        assert (b.float() == sum(range(comm.size))).all()
    assert all(r.done for r in reqs)


def test_dropped_request_warns_and_is_kept_until_it_completes(comm):
    """A request dropped before completion warns and is kept with its temporaries (the
    contiguous buffer a strided receive goes through here), which MPI still writes: later waits
    complete it, into the caller's buffer, and no memory is freed under MPI."""
    base = torch.zeros(8)
    req = comm.Irecv(base[::2], source=comm.rank, tag=77)
    with pytest.warns(ResourceWarning, match="it is kept"):
        del req
    gc.collect()
    victim = torch.full((4,), 5.0)  # may reuse freed memory: must not be written
    comm.Send(torch.arange(1.0, 5.0), dest=comm.rank, tag=77)
    deadline = time.monotonic() + 30
    while checks.ORPHANS and time.monotonic() < deadline:
        checks.drive_orphans()
    assert not checks.ORPHANS
    assert base.tolist() == [1, 0, 2, 0, 3, 0, 4, 0]
    assert victim.tolist() == [5.0] * 4
