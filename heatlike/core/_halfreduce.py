"""Reductions of float16 / bfloat16 buffers with float32 accumulation.

MPI libraries either lack half types (``MPI.BFLOAT16_T`` is DATATYPE_NULL in MPICH 5) or reduce
them pairwise in half precision, rounding after every partial sum; Heat reduced them as INT16
bit patterns. heatlike computes every half-type reduction with one rounding at the end:

* **small buffers** (fewer than ``ALLTOALL_MIN_ELEMENTS`` elements), user-defined ops and prefix
  scans are cast to float32, reduced with one MPI call, and cast back;
* **large buffers** keep half precision on the wire (blocking calls, and non-blocking calls on
  communicators marked ``serial``; other non-blocking calls take the float32 route, a single
  collective, because a multi-phase operation's later collectives could otherwise interleave
  differently with other operations on different ranks). With P ranks and n elements, the first
  ``h = P * (n // P)`` elements are reduce-scattered with a block ``Alltoall`` (rank r receives
  block r of every rank, 2 bytes per element) and a local float32 accumulation of those P rows
  (in-place ``add_``/``mul_``/``minimum``/``maximum``, no Python callback per element); the
  reduced half blocks are then put together with a block ``Allgather`` (``Allreduce``), a block
  ``Gather`` (``Reduce``), or kept (``Reduce_scatter_block``). Each rank sends and receives
  ``2 (P-1)/P`` of the buffer twice: the traffic of a ring all-reduce of half data, half that of
  float32. The remaining ``n - h < P`` elements take the float32 route. (Block collectives, not
  their v-forms: MPICH's ``Alltoallv``/``Allgatherv`` are about twice as slow on shared memory.)
  ``Reduce_scatter`` with arbitrary counts uses ``Alltoallv``.

SUM and PROD accumulate in float32; MIN and MAX are exact in any precision. User-defined ops run
on the float32 values.

All functions here take contiguous tensors of any shape in MPI-accessible memory (the caller packs
and stages; blocks are counted in elements of the flattened buffers) and are operation generators
(see ``_requests``). Every tensor whose address is handed to MPI is held by a local variable until
the phase that uses it has completed.
"""

from __future__ import annotations

import itertools

import torch
from mpi4py import MPI

from ._buffers import bspec, spec, vspec
from ._requests import Operation, call

__all__ = ["allreduce", "reduce", "reduce_scatter", "scan", "ALLTOALL_MIN_ELEMENTS"]

#: buffers with at least this many elements take the half-precision-on-the-wire route
ALLTOALL_MIN_ELEMENTS = 1 << 15

_SUM, _PROD, _MIN, _MAX = (op.py2f() for op in (MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX))


def _reduce_rows(rows: torch.Tensor, op: MPI.Op) -> torch.Tensor:
    """Reduce the rows of a (P, c) half tensor, accumulating in float32; returns c values in the
    rows' dtype (rank order, as MPI's predefined ops)."""
    h = op.py2f()
    if h in (_SUM, _PROD):
        acc = rows[0].float()
        step = acc.add_ if h == _SUM else acc.mul_
        for i in range(1, rows.shape[0]):
            step(rows[i])
        return acc.to(rows.dtype)
    acc = rows[0].clone()
    pick = torch.minimum if h == _MIN else torch.maximum
    for i in range(1, rows.shape[0]):
        pick(acc, rows[i], out=acc)
    return acc


def _wire_route(op: MPI.Op, n: int, size: int) -> bool:
    return size > 1 and n >= ALLTOALL_MIN_ELEMENTS and op.py2f() in (_SUM, _PROD, _MIN, _MAX)


def _block_reduce_scatter(comm: MPI.Intracomm, head: torch.Tensor, op: MPI.Op,
                          blocking: bool) -> Operation:
    """Reduce-scatter of ``head`` (P equal blocks): the generator returns this rank's reduced
    block (half dtype)."""
    size = comm.Get_size()
    rows = torch.empty_like(head)
    yield from call(comm, blocking, "Alltoall", bspec(head, size), bspec(rows, size))
    return _reduce_rows(rows.view(size, -1), op)


def _float32_allreduce(comm: MPI.Intracomm, x: torch.Tensor, dst: torch.Tensor, op: MPI.Op,
                       blocking: bool) -> Operation:
    acc = x.float()
    yield from call(comm, blocking, "Allreduce", MPI.IN_PLACE, spec(acc), op)
    dst.copy_(acc)


def allreduce(comm: MPI.Intracomm, src: torch.Tensor | None, dst: torch.Tensor, op: MPI.Op,
              blocking: bool, phases: bool = True) -> Operation:
    """``dst = op(src over ranks)``; ``src=None`` means in place (the input is ``dst``).
    ``phases=False`` forbids the multi-phase route (see ``MPICommunication.Dup(serial=...)``)."""
    dst = dst.view(-1)  # blocks are counted in elements, whatever the buffers' shapes
    x = dst if src is None else src.view(-1)
    n, size = x.numel(), comm.Get_size()
    if not phases or not _wire_route(op, n, size):
        yield from _float32_allreduce(comm, x, dst, op, blocking)
        return
    h = size * (n // size)
    mine = yield from _block_reduce_scatter(comm, x[:h], op, blocking)
    if h < n:  # read the tail before the gather below may overwrite it (in place)
        yield from _float32_allreduce(comm, x[h:], dst[h:], op, blocking)
    out = dst[:h]
    yield from call(comm, blocking, "Allgather", spec(mine), bspec(out, size))


def reduce(comm: MPI.Intracomm, src: torch.Tensor | None, dst: torch.Tensor | None, op: MPI.Op,
           root: int, blocking: bool, phases: bool = True) -> Operation:
    """``dst = op(src over ranks)`` at ``root``; ``dst`` is None on other ranks, ``src`` None at
    the root means in place. ``phases=False`` forbids the multi-phase route."""
    if dst is not None:
        dst = dst.view(-1)  # blocks are counted in elements, whatever the buffers' shapes
    x = dst if src is None else src.view(-1)
    n, size = x.numel(), comm.Get_size()
    is_root = comm.Get_rank() == root
    h = size * (n // size) if phases and _wire_route(op, n, size) else 0
    if h < n:
        tail = x[h:].float()
        tail_out = torch.empty_like(tail) if is_root else None
        yield from call(comm, blocking, "Reduce", spec(tail),
                        spec(tail_out) if is_root else None, op, root)
        if is_root:
            dst[h:].copy_(tail_out)
    if h:
        mine = yield from _block_reduce_scatter(comm, x[:h], op, blocking)
        out = dst[:h] if is_root else None
        yield from call(comm, blocking, "Gather", spec(mine),
                        bspec(out, size) if is_root else None, root)


def reduce_scatter(comm: MPI.Intracomm, src: torch.Tensor, dst: torch.Tensor,
                   counts: list[int], op: MPI.Op, blocking: bool) -> Operation:
    """``dst`` = this rank's block (``counts[rank]`` elements) of ``op(src over ranks)``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    src, dst = src.view(-1), dst.view(-1)
    if not _wire_route(op, src.numel(), size):
        acc = src.float()
        out = torch.empty(counts[rank], dtype=torch.float32, device=src.device)
        yield from call(comm, blocking, "Reduce_scatter", spec(acc), spec(out), counts, op)
        dst.copy_(out)
        return
    if len(set(counts)) == 1:
        mine = yield from _block_reduce_scatter(comm, src, op, blocking)
    else:
        displs = [0, *itertools.accumulate(counts[:-1])]
        c = counts[rank]
        rows = torch.empty(size * c, dtype=src.dtype, device=src.device)
        yield from call(comm, blocking, "Alltoallv", vspec(src, counts, displs),
                        vspec(rows, [c] * size, [i * c for i in range(size)]))
        mine = _reduce_rows(rows.view(size, c), op)
    dst.copy_(mine)


def scan(comm: MPI.Intracomm, src: torch.Tensor | None, dst: torch.Tensor, op: MPI.Op,
         exclusive: bool, blocking: bool) -> Operation:
    """Inclusive (``Scan``) or exclusive (``Exscan``) prefix reduction, in float32."""
    acc = (dst if src is None else src).float()
    yield from call(comm, blocking, "Exscan" if exclusive else "Scan", MPI.IN_PLACE, spec(acc), op)
    if not (exclusive and comm.Get_rank() == 0):  # Exscan leaves rank 0's buffer undefined
        dst.copy_(acc)
