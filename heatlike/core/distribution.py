"""How a DNDarray is laid out over the ranks, and the one primitive that moves data between two
layouts.

A layout is an axis (or None: every rank holds the whole array) and, per rank, the half-open
range of global indices it holds along that axis. DNDarrays always use *ordered* layouts: the
ranges of ranks 0, 1, ... follow each other and cover the axis, so the layout is described by the
per-rank ``counts`` alone (the balanced one gives the first ``n % P`` ranks one extra index,
:func:`heatlike.core.chunking.counts_displs`). :func:`move` also accepts arbitrary disjoint
ranges, which slicing with negative steps and concatenation use.

:func:`move` is one collective call:

* split -> same split with other ranges, or split -> another axis: every rank cuts, for every
  destination, the intersection of what it holds with what the destination needs, and one
  ``Alltoallv`` moves every element once (a rank's own share is copied locally by torch).
  Pieces that are contiguous runs of the source tensor are sent from it directly (no packing);
  likewise pieces landing on contiguous runs of the result are received in place. Other pieces
  are packed / unpacked with torch copies.
* split -> None (replicate): one ``Allgatherv``.
* None -> split: no communication; each rank copies its part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .chunking import counts_displs
from .communication import MPICommunication

__all__ = ["balanced_counts", "offsets", "ranges", "local_shape", "cut", "move"]

Range = tuple[int, int]


def balanced_counts(n: int, parts: int) -> tuple[int, ...]:
    """Per-rank counts of ``n`` indices over ``parts`` ranks, the first ``n % parts`` one more."""
    return tuple(counts_displs(n, parts)[0])


def offsets(counts: Sequence[int]) -> tuple[int, ...]:
    """Exclusive prefix sums of ``counts``: where each rank's range starts."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return tuple(out)


def ranges(counts: Sequence[int]) -> list[Range]:
    """The ordered ranges ``[(lo, hi), ...]`` of ``counts``."""
    out, acc = [], 0
    for c in counts:
        out.append((acc, acc + c))
        acc += c
    return out


def local_shape(gshape: Sequence[int], split: int | None, count: int) -> tuple[int, ...]:
    """The shape of a rank's part holding ``count`` indices along ``split``."""
    shape = tuple(gshape)
    if split is None:
        return shape
    return shape[:split] + (count,) + shape[split + 1:]


def _runs(base: torch.Tensor, views: list[torch.Tensor]) -> tuple[list[int], list[int]] | None:
    """``(counts, displs)`` in elements of ``base`` when ``base`` is contiguous and every view is
    a contiguous run of it, else None."""
    if not base.is_contiguous():
        return None
    origin = base.storage_offset()
    counts, displs = [], []
    for v in views:
        n = v.numel()
        if n == 0:
            counts.append(0)
            displs.append(0)
            continue
        if not v.is_contiguous():
            return None
        counts.append(n)
        displs.append(v.storage_offset() - origin)
    return counts, displs


def _packed(views: list[torch.Tensor], like: torch.Tensor
            ) -> tuple[torch.Tensor, list[int], list[int]]:
    counts = [v.numel() for v in views]
    displs = list(offsets(counts))
    buf = torch.empty(sum(counts), dtype=like.dtype, device=like.device)
    for v, c, d in zip(views, counts, displs):
        if c:
            buf[d:d + c].view(v.shape).copy_(v)
    return buf, counts, displs


def _send_side(local: torch.Tensor, views: list[torch.Tensor]):
    runs = _runs(local, views)
    if runs is not None:
        return local.view(-1), runs[0], runs[1]
    return _packed(views, local)


def _recv_side(out: torch.Tensor, views: list[torch.Tensor]):
    """``(buffer, counts, displs, unpack)``; ``unpack`` is None when MPI writes ``out``."""
    runs = _runs(out, views)
    if runs is not None:
        return out.view(-1), runs[0], runs[1], None
    counts = [v.numel() for v in views]
    displs = list(offsets(counts))
    buf = torch.empty(sum(counts), dtype=out.dtype, device=out.device)

    def unpack() -> None:
        for v, c, d in zip(views, counts, displs):
            if c:
                v.copy_(buf[d:d + c].view(v.shape))

    return buf, counts, displs, unpack


def cut(t: torch.Tensor, axis: int, rng: Range, origin: int = 0) -> torch.Tensor:
    """The global indices ``rng`` along ``axis`` of ``t``, whose first index is ``origin``."""
    lo, hi = rng
    if hi <= lo:
        return t.narrow(axis, 0, 0)
    return t.narrow(axis, lo - origin, hi - lo)


def _intersect(a: Range, b: Range) -> Range:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


def move(local: torch.Tensor, gshape: Sequence[int], src_axis: int | None,
         src_ranges: Sequence[Range] | None, dst_axis: int | None,
         dst_ranges: Sequence[Range] | None, comm: MPICommunication,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Redistribute an array of global shape ``gshape``.

    Rank r holds, in ``local``, the indices ``src_ranges[r]`` along ``src_axis`` (all of every
    other axis; ``src_axis=None``: the whole array) and receives the indices ``dst_ranges[r]``
    along ``dst_axis``, written into ``out`` (allocated when None) and returned. Collective
    unless ``src_axis`` is None; every rank must pass the same layouts. The result never shares
    memory with ``local``.
    """
    gshape = tuple(gshape)
    rank, size = comm.rank, comm.size
    if dst_axis is None:
        dst_shape = gshape
    else:
        lo, hi = dst_ranges[rank]
        dst_shape = local_shape(gshape, dst_axis, hi - lo)
    if out is None:
        out = torch.empty(dst_shape, dtype=local.dtype, device=local.device)
    if src_axis is None:
        if dst_axis is None:
            out.copy_(local)
        else:
            out.copy_(cut(local, dst_axis, dst_ranges[rank]))
        return out
    if dst_axis is None:
        send = local.contiguous()
        views = [cut(out, src_axis, r) for r in src_ranges]
        buf, counts, displs, unpack = _recv_side(out, views)
        comm.Allgatherv(send, (buf, counts, displs))
        if unpack is not None:
            unpack()
        return out
    if src_axis == dst_axis and list(src_ranges) == list(dst_ranges):
        out.copy_(local)
        return out
    my_src, my_dst = src_ranges[rank], dst_ranges[rank]
    send_views, recv_views = [], []
    for peer in range(size):
        if src_axis == dst_axis:
            send_views.append(cut(local, src_axis, _intersect(my_src, dst_ranges[peer]),
                                   my_src[0]))
            recv_views.append(cut(out, dst_axis, _intersect(src_ranges[peer], my_dst),
                                   my_dst[0]))
        else:
            send_views.append(cut(local, dst_axis, dst_ranges[peer]))
            recv_views.append(cut(out, src_axis, src_ranges[peer]))
    # this rank's own share is copied by torch, not sent to itself through MPI
    recv_views[rank].copy_(send_views[rank])
    send_views[rank] = local.narrow(src_axis, 0, 0)
    recv_views[rank] = out.narrow(dst_axis, 0, 0)
    if size > 1:
        sbuf, scounts, sdispls = _send_side(local, send_views)
        rbuf, rcounts, rdispls, unpack = _recv_side(out, recv_views)
        comm.Alltoallv((sbuf, scounts, sdispls), (rbuf, rcounts, rdispls))
        if unpack is not None:
            unpack()
    return out
