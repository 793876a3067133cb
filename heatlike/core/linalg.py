"""Matrix products of DNDarrays: ``matmul`` / ``@``.

For 2-D operands ``a`` (n x k) and ``b`` (k x m), by split combination:

=========  ======================================================  ==============  =========
a, b       algorithm                                               communication   result
=========  ======================================================  ==============  =========
None,None  local product                                           none            None
0, None    local rows of a times b                                 none            split 0
None, 1    a times local columns of b                              none            split 1
1, 0       local a[:, K_r] @ b[K_r, :], summed over ranks          Allreduce n*m   None
None, 0    a[:, K_r] cut locally, then as (1, 0)                   Allreduce n*m   None
1, None    b[K_r, :] cut locally, then as (1, 0)                   Allreduce n*m   None
0, 0       ring: the row blocks of b travel around the ranks;      P-1 shifts of   split 0
           each rank adds a[:, K_i] @ b_i for every block i         b's blocks
0, 1       ring over the column blocks of b: out[:, M_j] = a @ b_j P-1 shifts      split 0
1, 1       a is resplit to 0 (Alltoallv), then as (0, 1)
=========  ======================================================  ==============  =========

``K_r`` is the range of k that rank r holds. In (1, 0) the operands' ranges must agree; b is
rebalanced to a's counts if not. In the ring, each shift is posted (``Isend``/``Irecv``) before
the local product on the current block, so communication overlaps computation. 1-D operands are
promoted to matrices as in numpy and the added axis is removed from the result. Stacks of matrices
(ndim > 2) are multiplied locally when one operand is split along a batch axis and the other is
replicated; any other layout is replicated first.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from . import distribution
from .arithmetics import _as_replicated, _broadcast_shape, _common_comm
from .communication import IN_PLACE, MPICommunication, wait_all
from .dndarray import DNDarray
from .manipulations import expand_dims, resplit, squeeze

__all__ = ["matmul", "dot"]

_RING_TAG = 23173


def _operand(x: object, other: object) -> DNDarray:
    if isinstance(x, DNDarray):
        return x
    r = _as_replicated(x)
    if isinstance(other, DNDarray):
        r = DNDarray._make(r.larray.to(other.larray.device), r.gshape, None, None, other.comm)
    return r


def _ring(comm: MPICommunication, block: torch.Tensor, shapes: list[tuple[int, ...]],
          consume: Callable[[int, torch.Tensor], None]) -> None:
    """Pass every rank's ``block`` (rank i's has shape ``shapes[i]``) around the ring; call
    ``consume(owner, block)`` for each, the next block already in flight."""
    size, rank = comm.size, comm.rank
    cur, owner = block.contiguous(), rank
    biggest = max(int(np.prod(s, dtype=np.int64)) for s in shapes)
    bufs = [torch.empty(biggest, dtype=block.dtype, device=block.device) for _ in range(2)]
    for step in range(size):
        last = step == size - 1
        if not last:
            nxt = (owner - 1) % size
            n = int(np.prod(shapes[nxt], dtype=np.int64))
            recv = bufs[step % 2][:n].view(shapes[nxt])
            reqs = [comm.Irecv(recv, source=(rank - 1) % size, tag=_RING_TAG),
                    comm.Isend(cur, dest=(rank + 1) % size, tag=_RING_TAG)]
        consume(owner, cur)
        if not last:
            wait_all(reqs)
            cur, owner = recv, nxt


def _mm2(a: DNDarray, b: DNDarray) -> DNDarray:
    comm = a.comm
    rank = comm.rank
    n, k = a.gshape
    m = b.gshape[1]
    sa, sb = a.split, b.split
    A, B = a.larray, b.larray
    if sa is None and sb is None:
        return DNDarray._make(A @ B, (n, m), None, None, comm)
    if sa == 0 and sb is None:
        return DNDarray._make(A @ B, (n, m), 0, a.counts, comm)
    if sa is None and sb == 1:
        return DNDarray._make(A @ B, (n, m), 1, b.counts, comm)
    if sa == 1 and sb == 1:
        return _mm2(resplit(a, 0), b)
    if sb == 0 and sa in (None, 1):
        if sa == 1 and a.counts != b.counts:
            B = distribution.move(B, b.gshape, 0, b._ranges(), 0, a._ranges(), comm)
        lo, hi = b._ranges()[rank] if sa is None else a._ranges()[rank]
        if sa is None:
            A = A.narrow(1, lo, hi - lo)
        out = (A @ B).contiguous()
        comm.Allreduce(IN_PLACE, out)
        return DNDarray._make(out, (n, m), None, None, comm)
    if sa == 1 and sb is None:
        lo, hi = a._ranges()[rank]
        out = (A @ B.narrow(0, lo, hi - lo)).contiguous()
        comm.Allreduce(IN_PLACE, out)
        return DNDarray._make(out, (n, m), None, None, comm)
    # sa == 0 and sb in (0, 1): ring over the blocks of b
    out = torch.zeros((A.shape[0], m), dtype=A.dtype, device=A.device)
    ranges = b._ranges()
    if sb == 0:
        shapes = [(hi - lo, m) for lo, hi in ranges]

        def consume(owner: int, blk: torch.Tensor) -> None:
            lo, hi = ranges[owner]
            if hi > lo:
                out.add_(A[:, lo:hi] @ blk)
    else:
        shapes = [(k, hi - lo) for lo, hi in ranges]

        def consume(owner: int, blk: torch.Tensor) -> None:
            lo, hi = ranges[owner]
            if hi > lo:
                out[:, lo:hi] = A @ blk

    _ring(comm, B, shapes, consume)
    return DNDarray._make(out, (n, m), 0, a.counts, comm)


def _batched(a: DNDarray, b: DNDarray) -> DNDarray:
    batch = _broadcast_shape([a.gshape[:-2], b.gshape[:-2]])
    shape = (*batch, a.gshape[-2], b.gshape[-1])
    nd = len(shape)
    comm = a.comm
    for x, y in ((a, b), (b, a)):
        if x.split is None or x.split >= x.ndim - 2 or y.split is not None:
            continue
        out_split = x.split + nd - x.ndim
        if x.gshape[x.split] != shape[out_split]:
            continue
        Y = y.larray
        ky = out_split - (nd - y.ndim)
        if ky >= 0 and ky < y.ndim - 2 and Y.shape[ky] != 1:
            lo, hi = x._ranges()[comm.rank]
            Y = Y.narrow(ky, lo, hi - lo)
        local = x.larray @ Y if x is a else Y @ x.larray
        return DNDarray._make(local, shape, out_split, x.counts, comm)
    A = resplit(a, None).larray if a.split is not None else a.larray
    B = resplit(b, None).larray if b.split is not None else b.larray
    return DNDarray._make(A @ B, shape, None, None, comm)


def matmul(a: object, b: object) -> DNDarray:
    """The matrix product ``a @ b`` with numpy's rules for 1-D and stacked operands (see the
    module docstring for the algorithm per layout)."""
    if not isinstance(a, DNDarray) and not isinstance(b, DNDarray):
        a = _as_replicated(a)
    a, b = _operand(a, b), _operand(b, a)
    _common_comm([a, b])
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: Input operand does not have enough dimensions")
    ka = a.gshape[-1]
    kb = b.gshape[0] if b.ndim == 1 else b.gshape[-2]
    if ka != kb:
        raise ValueError(f"matmul: Input operand 1 has a mismatch in its core dimension 0, with "
                         f"gufunc signature (n?,k),(k,m?)->(n?,m?) (size {kb} is different "
                         f"from {ka})")
    dtype = torch.promote_types(a.dtype, b.dtype)
    work = torch.int64 if dtype is torch.bool else dtype
    a2 = a.astype(work, copy=False)
    b2 = b.astype(work, copy=False)
    if a.ndim == 1:
        a2 = expand_dims(a2, 0)
    if b.ndim == 1:
        b2 = expand_dims(b2, 1)
    if a2.ndim == 2 and b2.ndim == 2:
        out = _mm2(a2, b2)
    else:
        out = _batched(a2, b2)
    if b.ndim == 1:
        out = squeeze(out, -1)
    if a.ndim == 1:
        out = squeeze(out, -2 if b.ndim > 1 else -1)
    if dtype is torch.bool:
        out = out._rewrap(out.larray != 0)
    return out


def dot(a: object, b: object) -> DNDarray:
    """numpy's ``dot`` for 0-D, 1-D and 2-D operands: the product with a scalar, the inner
    product of two vectors, the matrix product. Operands of more dimensions raise
    NotImplementedError (numpy's rule there is not ``matmul``'s: use :func:`matmul` for
    stacks of matrices)."""
    from .arithmetics import multiply

    dims = [x.ndim if isinstance(x, DNDarray) else np.ndim(x) for x in (a, b)]
    if 0 in dims:
        return multiply(a, b)
    if max(dims) > 2:
        raise NotImplementedError(
            f"dot of operands with {dims[0]} and {dims[1]} dimensions: numpy's dot sums over "
            "the last axis of a and the second-to-last of b, which heatlike does not implement; "
            "use matmul for stacks of matrices")
    return matmul(a, b)
