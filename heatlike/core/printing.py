"""``repr(x)`` of a DNDarray: global shape, dtype, split, device and a numpy-style preview.

The preview is gathered on rank 0 only: arrays of up to 1000 elements are gathered whole; larger
ones contribute the first and last three indices of every axis longer than six (numpy's
summarization), so at most ``7 ** ndim`` elements travel (one ``Gatherv`` to rank 0). Other ranks
return the header without the preview. For a split array this is a collective call: every rank
must take the repr (e.g. ``print(x)`` on all ranks), as with every DNDarray operation.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .dndarray import DNDarray

__all__ = ["dndarray_repr"]

_THRESHOLD = 1000
_EDGE = 3


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _preview_indices(shape: tuple[int, ...], summarize: bool) -> list[list[int]]:
    out = []
    for n in shape:
        if summarize and n > 2 * _EDGE:
            out.append([*range(_EDGE + 1), *range(n - _EDGE, n)])
        else:
            out.append(list(range(n)))
    return out


def _preview(x: DNDarray, summarize: bool) -> np.ndarray | None:
    """The preview sub-array on rank 0 (None elsewhere)."""
    comm, t = x.comm, x.larray
    picks = _preview_indices(x.gshape, summarize)
    if x.split is None:
        if comm.rank != 0:
            return None
        sub = t
        for d, idx in enumerate(picks):
            sub = sub.index_select(d, torch.tensor(idx, dtype=torch.int64, device=t.device))
    else:
        s = x.split
        ranges = x._ranges()
        lo, hi = ranges[comm.rank]
        sub = t
        for d, idx in enumerate(picks):
            if d == s:
                idx = [i - lo for i in idx if lo <= i < hi]
            sub = sub.index_select(d, torch.tensor(idx, dtype=torch.int64, device=t.device))
        send = sub.movedim(s, 0).contiguous()
        counts = [sum(1 for i in picks[s] if a <= i < b) for a, b in ranges]
        recv = None
        if comm.rank == 0:
            recv = torch.empty((len(picks[s]), *send.shape[1:]), dtype=t.dtype, device=t.device)
        comm.Gatherv(send, (recv, counts) if recv is not None else None, root=0)
        if comm.rank != 0:
            return None
        sub = recv.movedim(0, s)  # type: ignore[union-attr]
    sub = sub.cpu()
    if sub.dtype is torch.bfloat16:
        sub = sub.float()
    return sub.numpy()


def dndarray_repr(x: DNDarray) -> str:
    meta = (f"shape={x.gshape}, dtype={_dtype_name(x.dtype)}, split={x.split}, "
            f"device={x.device}")
    summarize = x.size > _THRESHOLD
    arr = _preview(x, summarize)
    if arr is None:
        return f"DNDarray({meta})"
    body = np.array2string(arr, separator=", ", prefix="DNDarray(", edgeitems=_EDGE,
                           threshold=0 if summarize else sys.maxsize)
    return f"DNDarray({body}, {meta})"
