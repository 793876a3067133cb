"""Reductions over any axis, tuple of axes or all axes, with numpy's ``keepdims``.

Protocol: each rank reduces its local tensor over the requested axes with torch. When the split
axis is not among them that is all (the result keeps the layout, its split axis renumbered when
axes disappear). When it is, the partial results are combined with one ``Allreduce`` (SUM, PROD,
MIN, MAX, LAND, LOR) and the result is replicated. Ranks whose part is empty contribute the
operation's identity. ``mean`` divides a sum by the global count; ``var``/``std`` take the mean
first, then the mean of squared deviations (two passes, numerically safe). ``argmin``/``argmax``
over the split axis allgather every rank's local extremum and its global index and pick the first
extremum (NaN counts as the extremum, as in numpy).

Result dtypes follow torch: integer and bool sums/products are int64, ``mean``/``var``/``std`` of
integers use the default float type, half-precision means accumulate in float32.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .communication import IN_PLACE
from .dndarray import DNDarray
from .types import canonical_dtype

__all__ = ["sum", "prod", "mean", "var", "std", "min", "max", "argmin", "argmax", "all", "any",
           "normalize_axes"]

Axis = int | Sequence[int] | None


def _axis_index(a: object, ndim: int) -> int:
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
        raise TypeError(f"axis must be an integer or a tuple of integers, got "
                        f"{type(a).__name__}")
    a = int(a)
    if not -ndim <= a < ndim:
        raise np.exceptions.AxisError(a, ndim)
    return a % ndim


def normalize_axes(axis: Axis, ndim: int) -> tuple[int, ...]:
    """Sorted non-negative axes; None means all. ``AxisError`` (a ``ValueError``) when out of
    range, ``ValueError`` for duplicates, ``TypeError`` for non-integers."""
    if axis is None:
        return tuple(range(ndim))
    items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = [_axis_index(a, ndim) for a in items]
    if len(set(out)) != len(out):
        raise ValueError("duplicate value in 'axis'")
    return tuple(sorted(out))


def _check(x: object, name: str) -> DNDarray:
    if not isinstance(x, DNDarray):
        raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
    return x


def _finish(x: DNDarray, local: torch.Tensor, axes: tuple[int, ...], keepdims: bool,
            op: MPI.Op | None) -> DNDarray:
    """Wrap a local result reduced with ``keepdim=True`` over ``axes``; ``op`` combines the
    ranks' partial results when the split axis was reduced."""
    kept = tuple(1 if i in axes else s for i, s in enumerate(x.gshape))
    split = x.split
    if split is not None and split in axes:
        local = local.contiguous()
        if x.comm.size > 1:
            if local.dtype.is_floating_point and (op == MPI.MIN or op == MPI.MAX):
                local = _nan_aware(x.comm, local, op)
            else:
                x.comm.Allreduce(IN_PLACE, local, op)
        split, counts = None, None
        shape = kept
    else:
        counts = x.counts
        shape = kept
    if not keepdims:
        local = local.reshape([s for i, s in enumerate(local.shape) if i not in axes])
        shape = tuple(s for i, s in enumerate(shape) if i not in axes)
        if split is not None:
            split -= builtins.sum(1 for a in axes if a < split)
    return DNDarray._make(local, shape, split, counts, x.comm)


def _nan_aware(comm, local: torch.Tensor, op: MPI.Op) -> torch.Tensor:
    """MIN / MAX over ranks where NaN wins, as in numpy (MPI leaves NaN handling undefined, and
    ranks could disagree): NaNs are replaced by the identity, reduced, and put back where any
    rank had one (a second ``Allreduce`` with LOR)."""
    nan = local.isnan()
    clean = local.masked_fill(nan, float("inf") if op == MPI.MIN else float("-inf"))
    comm.Allreduce(IN_PLACE, clean, op)
    comm.Allreduce(IN_PLACE, nan, MPI.LOR)
    return clean.masked_fill(nan, float("nan"))


def _identity(dtype: torch.dtype, largest: bool) -> object:
    """The identity of min (``largest=True``: the largest value) or max."""
    if dtype is torch.bool:
        return largest
    if dtype.is_floating_point:
        return float("inf") if largest else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


def _reduce(x: DNDarray, axis: Axis, keepdims: bool, local_fn: Callable, op: MPI.Op,
            name: str, empty_fill: object = None) -> DNDarray:
    axes = normalize_axes(axis, x.ndim)
    if empty_fill is not None and builtins.any(x.gshape[a] == 0 for a in axes):
        raise ValueError(f"zero-size array to reduction operation {name} which has no identity")
    t = x.larray
    if empty_fill is not None and t.numel() == 0 and x.split in axes:
        kept = [1 if i in axes else s for i, s in enumerate(t.shape)]
        local = torch.full(kept, empty_fill, dtype=t.dtype, device=t.device)
    elif not axes:
        local = t.clone()
    else:
        local = local_fn(t, axes)
    return _finish(x, local, axes, keepdims, op)


def _loop(fn: Callable) -> Callable:
    def apply(t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        for a in axes:
            t = fn(t, dim=a, keepdim=True)
        return t
    return apply


def _accumulating(x: DNDarray, dtype: object) -> DNDarray:
    """``x`` in ``dtype`` if given; booleans and integers accumulate in int64 (numpy's rule)."""
    if dtype is not None:
        x = x.astype(canonical_dtype(dtype), copy=False)
    if x.dtype is torch.bool or not (x.dtype.is_floating_point or x.dtype.is_complex):
        x = x.astype(torch.int64, copy=False)
    return x


def sum(x: DNDarray, axis: Axis = None, keepdims: bool = False, dtype: object = None
        ) -> DNDarray:
    """Sum over ``axis`` (all by default); ``dtype`` converts the input first."""
    x = _accumulating(_check(x, "sum"), dtype)
    return _reduce(x, axis, keepdims, lambda t, a: torch.sum(t, dim=a, keepdim=True),
                   MPI.SUM, "add")


def prod(x: DNDarray, axis: Axis = None, keepdims: bool = False, dtype: object = None
         ) -> DNDarray:
    """Product over ``axis`` (all by default)."""
    x = _accumulating(_check(x, "prod"), dtype)
    return _reduce(x, axis, keepdims, _loop(torch.prod), MPI.PROD, "multiply")


def _count(x: DNDarray, axis: Axis) -> int:
    return int(np.prod([x.gshape[a] for a in normalize_axes(axis, x.ndim)], dtype=np.int64))


def _float_type(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(result dtype, accumulation dtype) of a mean of ``dtype``."""
    if dtype.is_floating_point or dtype.is_complex:
        out = dtype
    else:
        out = torch.get_default_dtype()
    acc = torch.float32 if out in (torch.float16, torch.bfloat16) else out
    return out, acc


def mean(x: DNDarray, axis: Axis = None, keepdims: bool = False) -> DNDarray:
    """Arithmetic mean over ``axis``: a sum divided by the number of reduced elements."""
    x = _check(x, "mean")
    out, acc = _float_type(x.dtype)
    n = _count(x, axis)
    s = sum(x.astype(acc, copy=False), axis, keepdims=keepdims)
    return s._rewrap((s.larray / n).to(out))


def var(x: DNDarray, axis: Axis = None, ddof: int = 0, keepdims: bool = False) -> DNDarray:
    """Variance ``sum(|x - mean|**2) / (N - ddof)`` over ``axis`` (two passes)."""
    x = _check(x, "var")
    out, acc = _float_type(x.dtype)
    n = _count(x, axis)
    xa = x.astype(acc, copy=False)
    m = mean(xa, axis, keepdims=True)
    d = xa - m
    sq = d._rewrap(d.larray.abs().square() if d.dtype.is_complex else d.larray.square())
    s = sum(sq, axis, keepdims=keepdims)
    return s._rewrap((s.larray / (n - ddof)).to(out if not out.is_complex else s.dtype))


def std(x: DNDarray, axis: Axis = None, ddof: int = 0, keepdims: bool = False) -> DNDarray:
    """Standard deviation: the square root of :func:`var`."""
    v = var(x, axis, ddof=ddof, keepdims=keepdims)
    return v._rewrap(torch.sqrt(v.larray))


def _minmax(x: DNDarray, axis: Axis, keepdims: bool, largest: bool) -> DNDarray:
    name = "maximum" if largest else "minimum"
    x = _check(x, "max" if largest else "min")
    if x.dtype.is_complex:
        raise TypeError(f"{name} is not defined for complex dtype {x.dtype}")
    fn = torch.amax if largest else torch.amin
    if x.dtype is torch.bool:
        op = MPI.LOR if largest else MPI.LAND
    else:
        op = MPI.MAX if largest else MPI.MIN
    return _reduce(x, axis, keepdims, lambda t, a: fn(t, dim=a, keepdim=True), op, name,
                   empty_fill=_identity(x.dtype, not largest))


def min(x: DNDarray, axis: Axis = None, keepdims: bool = False) -> DNDarray:
    """Minimum over ``axis`` (NaN propagates). ``ValueError`` over an empty axis."""
    return _minmax(x, axis, keepdims, largest=False)


def max(x: DNDarray, axis: Axis = None, keepdims: bool = False) -> DNDarray:
    """Maximum over ``axis`` (NaN propagates). ``ValueError`` over an empty axis."""
    return _minmax(x, axis, keepdims, largest=True)


def all(x: DNDarray, axis: Axis = None, keepdims: bool = False) -> DNDarray:
    """Whether every element over ``axis`` is true (non-zero)."""
    x = _check(x, "all")
    xb = x if x.dtype is torch.bool else x._rewrap(x.larray != 0)
    return _reduce(xb, axis, keepdims, _loop(torch.all), MPI.LAND, "all")


def any(x: DNDarray, axis: Axis = None, keepdims: bool = False) -> DNDarray:
    """Whether some element over ``axis`` is true (non-zero)."""
    x = _check(x, "any")
    xb = x if x.dtype is torch.bool else x._rewrap(x.larray != 0)
    return _reduce(xb, axis, keepdims, _loop(torch.any), MPI.LOR, "any")


def _pick(values: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, largest: bool
          ) -> torch.Tensor:
    """Along dim 0 (one row per rank): the smallest global index among the valid rows holding the
    extremum, NaN being the extremum if present."""
    shape = (-1,) + (1,) * (values.ndim - 1)
    valid = valid.reshape(shape).expand_as(values)
    if values.dtype is torch.bool:
        values = values.to(torch.uint8)
    if values.dtype.is_floating_point:
        nan = values.isnan() & valid
        fill = _identity(values.dtype, not largest)
        clean = values.masked_fill(nan | ~valid, fill)
        best = clean.amax(0) if largest else clean.amin(0)
        cand = valid & ~nan & (values == best)
        cand = torch.where(nan.any(0, keepdim=True), nan, cand)
    else:
        clean = values.masked_fill(~valid, _identity(values.dtype, not largest))
        best = clean.amax(0) if largest else clean.amin(0)
        cand = valid & (values == best)
    big = torch.iinfo(torch.int64).max
    return index.masked_fill(~cand, big).amin(0)


def _arg(x: DNDarray, axis: int | None, keepdims: bool, largest: bool) -> DNDarray:
    name = "argmax" if largest else "argmin"
    x = _check(x, name)
    if x.dtype.is_complex:
        raise TypeError(f"{name} is not defined for complex dtype {x.dtype}")
    fn = torch.argmax if largest else torch.argmin
    comm, t = x.comm, x.larray
    if axis is None:
        if x.size == 0:
            raise ValueError(f"attempt to get {name} of an empty sequence")
        shape: tuple[int, ...] = (1,) * x.ndim if keepdims else ()
        if x.split is None:
            local = fn(t.reshape(-1)).reshape(shape)
            return DNDarray._make(local, shape, None, None, comm)
        flat = t.reshape(-1)
        if flat.numel():
            li = int(fn(flat))
            coords = list(np.unravel_index(li, t.shape))
            coords[x.split] += x.displs[comm.rank]  # type: ignore[index]
            gi = int(np.ravel_multi_index(coords, x.gshape))
            mine_v, mine_i = flat[li:li + 1], torch.tensor([gi], device=t.device)
        else:
            mine_v = torch.zeros(1, dtype=t.dtype, device=t.device)
            mine_i = torch.zeros(1, dtype=torch.int64, device=t.device)
        values = torch.empty((comm.size, 1), dtype=t.dtype, device=t.device)
        index = torch.empty((comm.size, 1), dtype=torch.int64, device=t.device)
        comm.Allgather(mine_v.contiguous(), values)
        comm.Allgather(mine_i, index)
        valid = torch.tensor([c > 0 for c in x.counts], device=t.device)  # type: ignore[union-attr]
        local = _pick(values, index, valid, largest).reshape(shape)
        return DNDarray._make(local, shape, None, None, comm)
    a = _axis_index(axis, x.ndim)
    if x.gshape[a] == 0:
        raise ValueError(f"attempt to get {name} of an empty sequence")
    if x.split != a:
        local = fn(t, dim=a, keepdim=True)
        return _finish(x, local, (a,), keepdims, None)
    kept = [1 if i == a else s for i, s in enumerate(t.shape)]
    if t.shape[a]:
        idx = fn(t, dim=a, keepdim=True)
        vals = torch.gather(t, a, idx)
        idx = idx + x.displs[comm.rank]  # type: ignore[index]
    else:
        vals = torch.zeros(kept, dtype=t.dtype, device=t.device)
        idx = torch.zeros(kept, dtype=torch.int64, device=t.device)
    values = torch.empty((comm.size, *kept), dtype=t.dtype, device=t.device)
    index = torch.empty((comm.size, *kept), dtype=torch.int64, device=t.device)
    comm.Allgather(vals.contiguous(), values)
    comm.Allgather(idx.contiguous(), index)
    valid = torch.tensor([c > 0 for c in x.counts], device=t.device)  # type: ignore[union-attr]
    local = _pick(values, index, valid, largest)
    shape = tuple(kept)
    if not keepdims:
        local = local.squeeze(a)
        shape = shape[:a] + shape[a + 1:]
    return DNDarray._make(local, shape, None, None, comm)


def argmin(x: DNDarray, axis: int | None = None, keepdims: bool = False) -> DNDarray:
    """Index of the first minimum along ``axis`` (None: into the flattened array)."""
    return _arg(x, axis, keepdims, largest=False)


def argmax(x: DNDarray, axis: int | None = None, keepdims: bool = False) -> DNDarray:
    """Index of the first maximum along ``axis`` (None: into the flattened array)."""
    return _arg(x, axis, keepdims, largest=True)
