"""``x[key]`` and ``x[key] = value`` in global coordinates.

Supported keys: integers, slices (any step, negative indices), ``...``, ``None``, one integer or
boolean 1-D array per key (along one axis), and a boolean mask covering the leading axes of ``x``
(``x[mask]``). As in numpy, an integer and the index array with a slice or ``None`` between them
(``x[0, :, [1, 2]]``) put the array's axis first in the result (and in the value assigned).
Results and communication, with ``k`` the split axis of ``x``:

* integers, slices and ``...`` on other axes: local views, no communication;
* a slice of axis ``k`` with a positive step: each rank keeps its share, no communication; the
  result may be unbalanced. A negative step: one ``Alltoallv`` puts the reversed pieces in rank
  order (balanced);
* an integer on axis ``k``: its owner broadcasts the slab (``Bcast``); the result is replicated;
* an integer array on axis ``k``: ranks send the wanted indices to their owners and receive the
  rows back (two ``Alltoallv`` plus an ``Alltoall`` of counts); the result is distributed like the
  index array (balanced when the index is replicated). Assigning through one: every rank holds
  the whole value along that axis (replicated first if split) and writes the entries it owns;
* a mask: rows of the mask are aligned with ``x``'s layout (moved like an elementwise operand);
  each rank selects locally; the result is split along its first axis when the mask covers axis
  ``k`` (an ``Allgather`` of the local counts; ``x`` is first resplit to axis 0 when ``k > 0``)
  and keeps ``x``'s split otherwise.

Assignment writes through the same local views; ``value`` (scalar, array or DNDarray, broadcast
to the selection's shape) is brought to the selection's layout the way elementwise operands are.
Index errors (out of bounds, wrong mask shape, too many indices) are ``IndexError`` on every rank.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from . import distribution
from .arithmetics import _SCALARS, _common_comm, _replicate, _to_tensor
from .dndarray import DNDarray

__all__ = ["getitem", "setitem", "take", "nonzero"]

_VALID = ("only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) and integer "
          "or boolean arrays are valid indices")


def _is_int(k: object) -> bool:
    if isinstance(k, bool):
        return False
    if isinstance(k, (int, np.integer)):
        return True
    if isinstance(k, DNDarray) and k.ndim == 0:
        k = k.larray  # 0-d arrays are replicated
    if isinstance(k, (np.ndarray, torch.Tensor)) and k.ndim == 0:
        dt = k.dtype
        return (dt.kind in "iu") if isinstance(k, np.ndarray) else \
            (not dt.is_floating_point and not dt.is_complex and dt is not torch.bool)
    return False


def _is_array(k: object) -> bool:
    return isinstance(k, (DNDarray, np.ndarray, torch.Tensor, list)) and not _is_int(k)


def _array_kind(k: object) -> str:
    """``"bool"`` or ``"int"`` for an index array; IndexError otherwise."""
    if isinstance(k, DNDarray):
        dt = k.dtype
    elif isinstance(k, torch.Tensor):
        dt = k.dtype
    else:
        arr = np.asarray(k)
        if arr.dtype == np.bool_:
            return "bool"
        if arr.dtype.kind in "iu" or arr.size == 0:
            return "int"
        raise IndexError("arrays used as indices must be of integer (or boolean) type")
    if dt is torch.bool:
        return "bool"
    if dt.is_floating_point or dt.is_complex:
        raise IndexError("arrays used as indices must be of integer (or boolean) type")
    return "int"


def _shape_of(k: object) -> tuple[int, ...]:
    if isinstance(k, DNDarray):
        return k.gshape
    if isinstance(k, torch.Tensor):
        return tuple(k.shape)
    return np.shape(k)


def _expand(key: object, ndim: int) -> list:
    items = list(key) if isinstance(key, tuple) else [key]
    if sum(1 for k in items if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for k in items if k is not None and k is not Ellipsis)
    if used > ndim:
        raise IndexError(f"too many indices for array: array is {ndim}-dimensional, but {used} "
                         "were indexed")
    out: list = []
    for k in items:
        if k is Ellipsis:
            out.extend([slice(None)] * (ndim - used))
        else:
            out.append(k)
    if not any(k is Ellipsis for k in items):
        out.extend([slice(None)] * (ndim - used))
    return out


def _slice_index(v: object) -> int | None:
    if v is None:
        return None
    if _is_int(v):
        return int(v)
    raise IndexError("slice indices must be integers or None")


def _local_run(first: int, pstep: int, length: int, lo: int, hi: int) -> tuple[int, int]:
    """The positions j of ``first + j * pstep`` (j < length) that fall in ``[lo, hi)``."""
    if length == 0 or hi <= lo:
        return 0, 0
    j_lo = max(0, -((first - lo) // pstep))
    j_hi = min(length, -((first - hi) // pstep))
    return j_lo, max(j_lo, j_hi)


def _advanced_apart(items: list) -> bool:
    """Whether numpy puts the index array's axis first in the result: with an index array in
    the key, integers are advanced indices too, and when a slice or ``None`` stands between two
    advanced indices (``x[0, :, [1, 2]]``) their broadcast axis goes to the front; side by side
    (``x[:, 0, [1, 2]]``) it stays where they are."""
    if not any(_is_array(k) for k in items):
        return False
    where = [i for i, k in enumerate(items) if _is_int(k) or _is_array(k)]
    return where[-1] - where[0] + 1 != len(where)


class _Plan:
    """What a basic key selects from ``x``: the local view, global result shape and layout."""

    def __init__(self, x: DNDarray, items: list) -> None:
        rank, split = x.comm.rank, x.split
        self.view_index: list = []        # torch index into x.larray (positive steps)
        self.flips: list[int] = []        # dims of the view to reverse
        self.none_pos: list[int] = []     # result positions of None
        self.shape: list[int] = []        # result shape, None axes included
        self.inter_shape: list[int] = []  # result shape without None axes
        self.owner: int | None = None     # rank holding an integer-indexed split axis
        self.split_out: int | None = None  # result position of the split axis
        self.split_inter: int | None = None
        self.ranges: list[tuple[int, int]] | None = None  # per rank, result coordinates
        self.reversed = False             # the split axis is selected with a negative step
        self.adv: tuple[int, int, object] | None = None  # (x axis, inter dim, index)
        self.adv_first = _advanced_apart(items)  # numpy puts the index array's axis first
        axis = 0
        for item in items:
            if item is None:
                self.none_pos.append(len(self.shape))
                self.shape.append(1)
                continue
            n = x.gshape[axis]
            if _is_int(item):
                i = int(item.larray if isinstance(item, DNDarray) else item)
                if not -n <= i < n:
                    raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n}")
                i %= n
                if axis == split:
                    self.owner = next(r for r, (lo, hi) in enumerate(x._ranges()) if lo <= i < hi)
                    lo = x._ranges()[rank][0]
                    self.view_index.append(i - lo if rank == self.owner else 0)
                else:
                    self.view_index.append(i)
            elif isinstance(item, slice):
                s = slice(_slice_index(item.start), _slice_index(item.stop),
                          _slice_index(item.step))
                if s.step == 0:
                    raise ValueError("slice step cannot be zero")
                start, stop, step = s.indices(n)
                length = len(range(start, stop, step))
                first = start if step > 0 else start + (length - 1) * step
                pstep = abs(step)
                if axis == split:
                    runs = [_local_run(first, pstep, length, lo, hi) for lo, hi in x._ranges()]
                    j_lo, j_hi = runs[rank]
                    lo = x._ranges()[rank][0]
                    if j_hi > j_lo:
                        a = first + j_lo * pstep - lo
                        self.view_index.append(slice(a, a + (j_hi - j_lo - 1) * pstep + 1, pstep))
                    else:
                        self.view_index.append(slice(0, 0))
                    self.reversed = step < 0
                    self.ranges = [((length - b, length - a) if step < 0 else (a, b))
                                   if b > a else (0, 0) for a, b in runs]
                    self.split_out, self.split_inter = len(self.shape), len(self.inter_shape)
                elif length:
                    self.view_index.append(slice(first, first + (length - 1) * pstep + 1, pstep))
                else:
                    self.view_index.append(slice(0, 0))
                if step < 0 and length > 1:
                    self.flips.append(len(self.inter_shape))
                self.shape.append(length)
                self.inter_shape.append(length)
            elif _is_array(item):
                if self.adv is not None:
                    raise IndexError("only one integer or boolean array per index is supported")
                shape = _shape_of(item)
                if len(shape) != 1:
                    raise IndexError("an index array inside a tuple must be one-dimensional")
                if _array_kind(item) == "bool" and shape[0] != n:
                    raise IndexError(f"boolean index did not match indexed array along axis "
                                     f"{axis}; size of axis is {n} but size of corresponding "
                                     f"boolean axis is {shape[0]}")
                self.adv = (axis, len(self.inter_shape), item)
                self.view_index.append(slice(None))
                if axis == split:
                    self.split_out, self.split_inter = len(self.shape), len(self.inter_shape)
                    self.ranges = x._ranges()
                self.shape.append(-1)  # filled in once the index length is known
                self.inter_shape.append(-1)
            else:
                raise IndexError(_VALID)
            axis += 1


def _index_tensor(idx: object, n: int, axis: int, y: DNDarray
                  ) -> tuple[torch.Tensor, DNDarray | None]:
    """``(local indices in [0, n), the split DNDarray they came from or None)``; a replicated
    index (list, numpy, tensor, replicated DNDarray) is returned whole. ``IndexError`` on every
    rank when an index is out of bounds."""
    device = y.larray.device
    dist = None
    if isinstance(idx, DNDarray):
        _common_comm([y, idx])
        if idx.dtype is torch.bool:
            full = _replicate(idx) if idx.split is not None else idx.larray
            return torch.nonzero(full).reshape(-1).to(device), None
        t = idx.larray.to(device=device, dtype=torch.int64)
        dist = idx if idx.split is not None else None
    elif isinstance(idx, torch.Tensor):
        if idx.dtype is torch.bool:
            return torch.nonzero(idx).reshape(-1).to(device), None
        t = idx.to(device=device, dtype=torch.int64)
    else:
        arr = np.asarray(idx)
        if arr.dtype == np.bool_:
            return torch.from_numpy(np.nonzero(arr)[0]).to(device), None
        t = torch.from_numpy(arr.astype(np.int64)).to(device)
    bad = bool(((t < -n) | (t >= n)).any()) if t.numel() else False
    if dist is not None:
        bad = y.comm.allreduce(bad, op=MPI.LOR)
    if bad:
        raise IndexError(f"an index is out of bounds for axis {axis} with size {n}")
    return torch.where(t < 0, t + n, t), dist


def nonzero(x: DNDarray, as_tuple: bool = True) -> tuple[DNDarray, ...] | DNDarray:
    """numpy's ``nonzero``: one 1-D int64 array per axis with the global indices of the
    non-zero elements, in C order (``as_tuple=False``: one ``(n, ndim)`` array, as Heat offers).
    Each rank finds its own (an array split along an axis other than 0 is resplit to 0 first,
    one ``Alltoallv``); the results are split along 0 by where they were found (one
    ``allgather`` of the counts), replicated for a replicated ``x``."""
    if not as_tuple:
        parts = nonzero(x)
        return manipulations.stack(list(parts), axis=1)
    if not isinstance(x, DNDarray):
        raise TypeError(f"nonzero: expected a DNDarray, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("nonzero of a 0-d array; use atleast_1d or x.reshape(1)")
    if x.split not in (None, 0):
        x = manipulations.resplit(x, 0)
    idx = torch.nonzero(x.larray)
    comm = x.comm
    if x.split is None:
        return tuple(DNDarray._make(idx[:, d].contiguous(), (idx.shape[0],), None, None, comm)
                     for d in range(x.ndim))
    idx[:, 0] += x.displs[comm.rank]  # type: ignore[index]
    counts = tuple(comm.allgather(int(idx.shape[0])))
    n = sum(counts)
    return tuple(DNDarray._make(idx[:, d].contiguous(), (n,), 0, counts, comm)
                 for d in range(x.ndim))


def take(x: DNDarray, indices: object, axis: int = 0) -> DNDarray:
    """``x`` indexed along ``axis`` with a 1-D integer array (numpy's ``take`` for one axis)."""
    key = [slice(None)] * x.ndim
    key[axis] = indices
    return getitem(x, tuple(key))


def _take_split(x: DNDarray, dim: int, want: torch.Tensor) -> torch.Tensor:
    """The slices ``want`` (global indices, this rank's list) of ``x``'s split axis ``dim``:
    requests go to the owners (``Alltoall`` of counts, ``Alltoallv`` of indices) and the slices
    come back (``Alltoallv``)."""
    comm, size = x.comm, x.comm.size
    t = x.larray
    bounds = torch.tensor(x.displs[1:], dtype=torch.int64, device=want.device)  # type: ignore
    owners = torch.bucketize(want, bounds, right=True)
    order = torch.argsort(owners, stable=True)
    asked = want[order].contiguous()
    send_counts = torch.bincount(owners, minlength=size).to(torch.int64).cpu()
    recv_counts = torch.empty_like(send_counts)
    comm.Alltoall(send_counts, recv_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    requests = torch.empty(sum(rc), dtype=torch.int64, device=want.device)
    comm.Alltoallv((asked, sc), (requests, rc))
    rows = t.movedim(dim, 0)
    reply = rows.index_select(0, requests - x.displs[comm.rank]).contiguous()  # type: ignore
    got = torch.empty((want.numel(), *rows.shape[1:]), dtype=t.dtype, device=t.device)
    comm.Alltoallv((reply, rc), (got, sc))
    out = torch.empty_like(got)
    out[order] = got
    return out.movedim(0, dim)


def _take_dim(y: DNDarray, dim: int, idx: object, axis: int) -> DNDarray:
    """``y`` indexed along ``dim`` by the 1-D array ``idx`` (``axis``: the axis in the user's
    array, for messages)."""
    comm = y.comm
    n = y.gshape[dim]
    t, dist = _index_tensor(idx, n, axis, y)
    length = dist.gshape[0] if dist is not None else t.numel()
    shape = y.gshape[:dim] + (length,) + y.gshape[dim + 1:]
    if y.split == dim:
        if dist is not None:
            want, counts = t, dist.counts
        else:
            counts = distribution.balanced_counts(length, comm.size)
            lo, hi = distribution.ranges(counts)[comm.rank]
            want = t[lo:hi]
        return DNDarray._make(_take_split(y, dim, want), shape, dim, counts, comm)
    if dist is not None:
        if y.split is None:
            return DNDarray._make(y.larray.index_select(dim, t), shape, dim, dist.counts, comm)
        t = _replicate(dist).to(device=y.larray.device, dtype=torch.int64)
        t = torch.where(t < 0, t + n, t)
    return DNDarray._make(y.larray.index_select(dim, t), shape, y.split, y.counts, comm)


def _is_mask(key: object) -> bool:
    return _is_array(key) and _array_kind(key) == "bool" and len(_shape_of(key)) >= 1


def _basic(x: DNDarray, plan: _Plan) -> DNDarray:
    """The basic (integer / slice) part of ``plan`` as a DNDarray without the None axes."""
    comm = x.comm
    shape = [s if s >= 0 else x.gshape[plan.adv[0]]  # type: ignore[index]
             for s in plan.inter_shape]
    if plan.owner is not None:
        if comm.rank == plan.owner:
            local = x.larray[tuple(plan.view_index)]
            local = local.flip(plan.flips) if plan.flips else local.clone()
        else:
            local = torch.empty(shape, dtype=x.dtype, device=x.larray.device)
        if comm.size > 1:
            comm.Bcast(local, root=plan.owner)
        return DNDarray._make(local, shape, None, None, comm)
    local = x.larray[tuple(plan.view_index)]
    if plan.flips:
        local = local.flip(plan.flips)
    split = plan.split_inter
    if split is None:
        return DNDarray._make(local, shape, None, None, comm)
    if plan.adv is not None and plan.adv[1] == split:
        return DNDarray._make(local, shape, split, x.counts, comm)
    ranges = plan.ranges
    if plan.reversed:
        counts = distribution.balanced_counts(shape[split], comm.size)
        local = distribution.move(local, shape, split, ranges, split,
                                  distribution.ranges(counts), comm)
    else:
        counts = tuple(hi - lo for lo, hi in ranges)  # type: ignore[union-attr]
    return DNDarray._make(local, shape, split, counts, comm)


def _scalar_mask(key: object) -> bool | None:
    """The value of a 0-d boolean index (``True``, ``np.True_``, ``x > 0`` of a 0-d array, a
    0-d bool tensor), None for any other index. A 0-d DNDarray is the same on every rank."""
    if isinstance(key, (bool, np.bool_)):
        return bool(key)
    if isinstance(key, (DNDarray, np.ndarray, torch.Tensor)) and len(_shape_of(key)) == 0 and \
            _array_kind(key) == "bool":
        return bool(key.larray.item() if isinstance(key, DNDarray) else key.item())
    return None


def _unwrapped(key: object) -> object:
    """``x[(k,)]`` is ``x[k]`` in numpy unless ``k`` is itself a tuple (a mask in a tuple, as
    ``np.nonzero`` style code writes it)."""
    if isinstance(key, tuple) and len(key) == 1 and not isinstance(key[0], tuple):
        return key[0]
    return key


def getitem(x: DNDarray, key: object) -> DNDarray:
    """``x[key]`` (module docstring). Results share memory with ``x`` where no data moves, like
    numpy's views."""
    key = _unwrapped(key)
    if _is_mask(key):
        return _getitem_mask(x, key)
    truth = _scalar_mask(key)
    if truth is not None:  # numpy: a new first axis holding x once (True) or not at all
        y = manipulations.expand_dims(x, 0)
        return y if truth else y[0:0]
    plan = _Plan(x, _expand(key, x.ndim))
    y = _basic(x, plan)
    if plan.adv is not None:
        y = _take_dim(y, plan.adv[1], plan.adv[2], plan.adv[0])
    for p in plan.none_pos:
        y = manipulations.expand_dims(y, p)
    if plan.adv_first:
        y = manipulations_more.moveaxis(y, plan.shape.index(-1), 0)
    return y


def _check_mask(x: DNDarray, mshape: tuple[int, ...]) -> None:
    if len(mshape) > x.ndim:
        raise IndexError(f"too many indices for array: array is {x.ndim}-dimensional, but "
                         f"{len(mshape)} were indexed")
    for d, (a, b) in enumerate(zip(x.gshape, mshape)):
        if a != b:
            raise IndexError(f"boolean index did not match indexed array along axis {d}; size "
                             f"of axis is {a} but size of corresponding boolean axis is {b}")


def _mask_on(mask: object, split: int | None, ranges: list | None, x: DNDarray
             ) -> torch.Tensor:
    """The local part of ``mask`` on the layout (``split``, ``ranges``) of ``x``'s leading axes;
    the whole mask when ``split`` is None or beyond the mask's axes."""
    device = x.larray.device
    if isinstance(mask, DNDarray):
        if split is None or split >= mask.ndim:
            return _replicate(mask).to(device)
        if mask.split == split and mask._ranges() == ranges:
            return mask.larray
        return distribution.move(mask.larray, mask.gshape, mask.split,
                                 None if mask.split is None else mask._ranges(), split, ranges,
                                 x.comm)
    t = _to_tensor(mask, device)
    if split is None or split >= t.ndim:
        return t
    lo, hi = ranges[x.comm.rank]  # type: ignore[index]
    return t.narrow(split, lo, hi - lo)


def _getitem_mask(x: DNDarray, mask: object) -> DNDarray:
    mshape = tuple(_shape_of(mask))
    _check_mask(x, mshape)
    comm, k, rest = x.comm, len(mshape), x.gshape[len(mshape):]
    if x.split is None and isinstance(mask, DNDarray) and mask.split is not None:
        counts = distribution.balanced_counts(x.gshape[0], comm.size)
        lo, hi = distribution.ranges(counts)[comm.rank]
        x = DNDarray._make(x.larray.narrow(0, lo, hi - lo), x.gshape, 0, counts, comm)
    s = x.split
    if s is not None and 0 < s < k:
        x, s = manipulations.resplit(x, 0), 0
    m = _mask_on(mask, s, None if s is None else x._ranges(), x)
    local = x.larray[m]
    if s is None:
        return DNDarray._make(local, tuple(local.shape), None, None, comm)
    if s >= k:
        shape = (local.shape[0], *rest)
        return DNDarray._make(local, shape, s - k + 1, x.counts, comm)
    counts = tuple(comm.allgather(int(local.shape[0])))
    return DNDarray._make(local, (sum(counts), *rest), 0, counts, comm)


def _check_broadcast(vshape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    v = tuple(vshape)
    while len(v) > len(shape) and v[0] == 1:
        v = v[1:]
    ok = len(v) <= len(shape)
    if ok:
        try:
            ok = tuple(np.broadcast_shapes(v, tuple(shape))) == tuple(shape)
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"could not broadcast input array from shape {tuple(vshape)} into "
                         f"shape {tuple(shape)}")


def _value_piece(value: object, shape: tuple[int, ...], rs: int | None,
                 ranges: list | None, x: DNDarray) -> torch.Tensor:
    """This rank's part of ``value`` broadcast to a selection of global ``shape`` split along
    ``rs`` with per-rank ``ranges``; broadcastable to the local selection."""
    comm, device = x.comm, x.larray.device
    nd = len(shape)
    if isinstance(value, DNDarray):
        _check_broadcast(value.gshape, shape)
        if value.split is not None:
            kv = None if rs is None else rs - (nd - value.ndim)
            if kv is not None and kv >= 0 and value.gshape[kv] == shape[rs]:  # type: ignore
                return distribution.move(value.larray, value.gshape, value.split,
                                         value._ranges(), kv, ranges, comm)
            t = _replicate(value)
        else:
            t = value.larray
        t = t.to(device)
    else:
        t = _to_tensor(value, device)
        _check_broadcast(tuple(t.shape), shape)
    if rs is not None:
        kv = rs - (nd - t.ndim)
        if kv >= 0 and t.shape[kv] == shape[rs]:
            t = distribution.cut(t, kv, ranges[comm.rank])  # type: ignore[index]
    return t


def _fit(piece: torch.Tensor, local_shape: list[int], x: DNDarray) -> torch.Tensor:
    """``piece`` cast to ``x.dtype`` and broadcast to ``local_shape`` (no copy unless it shares
    memory with ``x``)."""
    while piece.ndim > len(local_shape):
        piece = piece.squeeze(0)
    piece = piece.to(x.dtype).broadcast_to(local_shape)
    xs = x.larray.untyped_storage().data_ptr()
    if piece.numel() and piece.untyped_storage().data_ptr() == xs:
        piece = piece.clone()
    return piece


def setitem(x: DNDarray, key: object, value: object) -> None:
    """``x[key] = value`` (module docstring)."""
    if not isinstance(x, DNDarray):
        raise TypeError("setitem: expected a DNDarray")
    if not isinstance(value, (*_SCALARS, DNDarray, np.ndarray, np.generic, torch.Tensor, list,
                              tuple)):
        raise TypeError(f"cannot assign a {type(value).__name__} to a DNDarray")
    key = _unwrapped(key)
    if _is_mask(key):
        _setitem_mask(x, key, value)
        return
    comm = x.comm
    plan = _Plan(x, _expand(key, x.ndim))
    index = pick = None  # the index array's local positions, and which entries they take
    shape = list(plan.shape)
    at = shape.index(-1) if plan.adv is not None else 0  # the index array's axis
    if plan.adv is not None:
        axis, dim, idx = plan.adv
        index, dist = _index_tensor(idx, x.gshape[axis], axis, x)
        if dist is not None:
            index = _replicate(dist).to(device=x.larray.device, dtype=torch.int64)
            index = torch.where(index < 0, index + x.gshape[axis], index)
        shape[shape.index(-1)] = index.numel()
        if axis == x.split:
            # every rank sees the whole value along this axis and writes the entries it owns
            lo, hi = x._ranges()[comm.rank]
            pick = torch.nonzero((index >= lo) & (index < hi)).reshape(-1)
            index = index[pick] - lo
    rs = plan.split_out if plan.owner is None and pick is None else None
    ranges = plan.ranges if rs is not None else None
    writes = plan.owner is None or comm.rank == plan.owner
    view = x.larray[tuple(plan.view_index)] if writes else None
    if isinstance(value, _SCALARS):
        if view is not None:
            if index is not None:
                view.index_fill_(plan.adv[1], index, value)  # type: ignore[index]
            else:
                view.fill_(value)
        return
    # the value is shaped as numpy's selection: the index array's axis first where numpy puts it
    first = plan.adv_first and at > 0
    order = [at, *(d for d in range(len(shape)) if d != at)] if first else list(range(len(shape)))
    vrs = None if rs is None else order.index(rs)
    piece = _value_piece(value, tuple(shape[d] for d in order), vrs, ranges, x)
    if view is None:
        return
    local_shape = list(shape)
    if rs is not None:
        lo, hi = ranges[comm.rank]  # type: ignore[index]
        local_shape[rs] = hi - lo
    piece = _fit(piece, [local_shape[d] for d in order], x)
    if first:
        piece = piece.movedim(0, at)
    piece = piece[tuple(0 if i in plan.none_pos else slice(None) for i in range(len(shape)))]
    if plan.flips:
        piece = piece.flip(plan.flips)
    if index is not None:
        dim = plan.adv[1]  # type: ignore[index]
        if pick is not None:
            piece = piece.index_select(dim, pick)
        view.index_copy_(dim, index, piece.contiguous())
    else:
        view.copy_(piece)


def _setitem_mask(x: DNDarray, mask: object, value: object) -> None:
    mshape = tuple(_shape_of(mask))
    _check_mask(x, mshape)
    comm, k, rest = x.comm, len(mshape), x.gshape[len(mshape):]
    s = x.split
    if s is not None and 0 < s < k:
        tmp = manipulations.resplit(x, 0)
        _setitem_mask(tmp, mask, value)
        x.larray.copy_(distribution.move(tmp.larray, tmp.gshape, 0, tmp._ranges(), s,
                                         x._ranges(), comm))
        return
    m = _mask_on(mask, s, None if s is None else x._ranges(), x)
    if isinstance(value, _SCALARS):
        x.larray[m] = value
        return
    if s is not None and s < k:
        counts = tuple(comm.allgather(int(m.sum())))
        rs, ranges, n = 0, distribution.ranges(counts), sum(counts)
    else:
        n = int(m.sum())
        rs = None if s is None else s - k + 1
        ranges = None if s is None else x._ranges()
    shape = (n, *rest)
    piece = _value_piece(value, shape, rs, ranges, x)
    local_shape = list(shape)
    if rs is not None:
        lo, hi = ranges[comm.rank]  # type: ignore[index]
        local_shape[rs] = hi - lo
    x.larray[m] = _fit(piece, local_shape, x)


from . import manipulations, manipulations_more  # noqa: E402
