"""Reductions over any axis, tuple of axes or all axes, with numpy's ``keepdims``.

Protocol: each rank reduces its local tensor over the requested axes with torch (a sum over one
inner axis on one thread with numpy's row accumulation, blocked: :func:`_local_sum`). When the split
axis is not among them that is all (the result keeps the layout, its split axis renumbered when
axes disappear). When it is, the partial results are combined with one ``Allreduce`` (SUM, PROD,
MIN, MAX, LAND, LOR) and the result is replicated. Ranks whose part is empty contribute the
operation's identity. ``mean`` divides a sum by the global count; ``var``/``std`` take the mean
first, then the mean of squared deviations (two passes, numerically safe). ``argmin``/``argmax``
over the split axis allgather every rank's local extremum and its global index and pick the first
extremum (NaN counts as the extremum, as in numpy).

Result dtypes: integer and bool sums/products are int64 (numpy's and torch's rule);
``mean``/``var``/``std`` of integers and bools follow the dtype rule of
:func:`heatlike.core.types.float_result_type` (float64 for int32/int64, float32 for smaller
types); half-precision means accumulate in float32. Every reduction takes ``out=`` (a DNDarray of
the result's shape: the result is brought to its layout and dtype).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .communication import IN_PLACE
from .dndarray import DNDarray
from .types import canonical_dtype, float_result_type

__all__ = ["sum", "prod", "mean", "var", "std", "min", "max", "argmin", "argmax", "all", "any",
           "normalize_axes", "AxisTypeError"]

Axis = int | Sequence[int] | None


class AxisTypeError(TypeError, ValueError):
    """An axis that is not an integer: a ``TypeError`` (numpy's) that is also a ``ValueError``
    (what Heat raises for some spellings), so either ``except`` clause catches it."""


def _axis_index(a: object, ndim: int) -> int:
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
        raise AxisTypeError(f"axis must be an integer or a tuple of integers, got "
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
    if isinstance(axis, (torch.Tensor, np.ndarray)):
        raise AxisTypeError(f"axis must be an integer or a tuple of integers, got "
                            f"{type(axis).__name__}")
    items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = [_axis_index(a, ndim) for a in items]
    if len(set(out)) != len(out):
        raise ValueError("duplicate value in 'axis'")
    return tuple(sorted(out))


def _out(res: DNDarray, out: DNDarray | None, name: str) -> DNDarray:
    """``res`` written into ``out`` (its layout and dtype) when given."""
    if out is None:
        return res
    from .arithmetics import _check_out, _store

    _check_out(out)
    if tuple(out.shape) != tuple(res.shape):
        raise ValueError(f"{name}: out has shape {tuple(out.shape)}, the result "
                         f"{tuple(res.shape)}")
    return _store(res, out, True, name)


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
    rank had one. A zero result is -0.0 for MIN where any rank's own minimum was -0.0 (+0.0 for
    MAX where any rank's own maximum was +0.0), the other zero otherwise: MPI's MIN of -0.0 and
    +0.0 depends on the order it combines the ranks in, which differs between ranks, so the
    replicated result had different bits on different ranks. The flags travel in one second
    ``Allreduce`` with LOR."""
    minimum = op == MPI.MIN
    nan = local.isnan()
    clean = local.masked_fill(nan, float("inf") if minimum else float("-inf"))
    comm.Allreduce(IN_PLACE, clean, op)
    negative = local.signbit()
    flags = torch.stack([nan, (local == 0) & (negative if minimum else ~negative)])
    comm.Allreduce(IN_PLACE, flags, MPI.LOR)
    first, other = (-0.0, 0.0) if minimum else (0.0, -0.0)
    zero = torch.where(flags[1], first, other).to(clean.dtype)
    clean = torch.where(clean == 0, zero, clean)
    return clean.masked_fill(flags[0], float("nan"))


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


def _as_dtype(result: DNDarray, dtype: object) -> DNDarray:
    """A sum or product in the ``dtype`` asked for (numpy's result type): an integer one
    accumulated in int64 is the same modulo its width (numpy's wrap-around), a boolean one is
    whether it is non-zero (numpy's logical or / and)."""
    return result if dtype is None else result.astype(canonical_dtype(dtype), copy=False)


_ROW_BLOCK = 64  # rows summed one after the other before their partial sums are summed
# below any of these torch's own sum is as fast or faster
_ROWS_MIN, _ROW_BYTES_MIN, _BYTES_MIN = 256, 4096, 2 << 20


def _rows_sum(v: np.ndarray) -> np.ndarray:
    """Sums over axis 1 of ``v`` (``outer x n x inner``, C-contiguous): blocks of
    ``_ROW_BLOCK`` consecutive rows are summed one row after the other (numpy's vectorized row
    accumulation), then the block sums the same way, recursively; the rows a block cannot fill
    are added last. The rounding error grows with ``_ROW_BLOCK`` times the number of levels,
    not with n."""
    outer, n, inner = v.shape
    if n <= _ROW_BLOCK:
        return np.add.reduce(v, axis=1)
    q = n // _ROW_BLOCK
    blocks = np.add.reduce(v[:, :q * _ROW_BLOCK].reshape(outer, q, _ROW_BLOCK, inner), axis=2)
    total = _rows_sum(blocks)
    if n > q * _ROW_BLOCK:
        total += np.add.reduce(v[:, q * _ROW_BLOCK:], axis=1)
    return total


def _local_sum(t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """``torch.sum(t, axes, keepdim=True)``. One axis that is not the last of a contiguous
    float32/float64 CPU tensor, summed on one thread over at least 256 rows of at least 4 KiB
    (2 MiB in all), goes through :func:`_rows_sum` instead: torch sums such an axis 1.5-2.5x
    slower on one thread (2048 rows of 4096 float32: 0.8 against 2.0 ms; of 1024: 0.14
    against 0.26 ms) for an error of the same size (a few units in the last place). Narrower
    rows, smaller arrays and several threads are faster in torch."""
    if len(axes) == 1 and axes[0] < t.dim() - 1 and t.device.type == "cpu" \
            and t.dtype in (torch.float32, torch.float64) and t.is_contiguous() \
            and not t.requires_grad and torch.get_num_threads() == 1:
        a = axes[0]
        n, inner = t.shape[a], int(np.prod(t.shape[a + 1:], dtype=np.int64))
        row = inner * t.element_size()
        if n >= _ROWS_MIN and row >= _ROW_BYTES_MIN \
                and t.numel() * t.element_size() >= _BYTES_MIN:
            v = t.detach().numpy().reshape(-1, n, inner)
            kept = [1 if i == a else s for i, s in enumerate(t.shape)]
            return torch.from_numpy(_rows_sum(v)).reshape(kept)
    return torch.sum(t, dim=axes, keepdim=True)


def sum(x: DNDarray, axis: Axis = None, keepdims: bool = False, dtype: object = None,
        out: DNDarray | None = None) -> DNDarray:
    """Sum over ``axis`` (all by default); ``dtype`` converts the input first."""
    x = _accumulating(_check(x, "sum"), dtype)
    return _out(_as_dtype(_reduce(x, axis, keepdims, _local_sum, MPI.SUM, "add"), dtype), out,
                "sum")


def prod(x: DNDarray, axis: Axis = None, keepdims: bool = False, dtype: object = None,
         out: DNDarray | None = None) -> DNDarray:
    """Product over ``axis`` (all by default)."""
    x = _accumulating(_check(x, "prod"), dtype)
    return _out(_as_dtype(_reduce(x, axis, keepdims, _loop(torch.prod), MPI.PROD, "multiply"),
                          dtype), out, "prod")


def _count(x: DNDarray, axis: Axis) -> int:
    return int(np.prod([x.gshape[a] for a in normalize_axes(axis, x.ndim)], dtype=np.int64))


def _float_type(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(result dtype, accumulation dtype) of a mean of ``dtype``."""
    out = float_result_type(dtype)
    acc = torch.float32 if out in (torch.float16, torch.bfloat16) else out
    return out, acc


def mean(x: DNDarray, axis: Axis = None, keepdims: bool = False) -> DNDarray:
    """Arithmetic mean over ``axis``: a sum divided by the number of reduced elements."""
    x = _check(x, "mean")
    out, acc = _float_type(x.dtype)
    n = _count(x, axis)
    s = sum(x.astype(acc, copy=False), axis, keepdims=keepdims)
    return s._rewrap((s.larray / n).to(out))


def _ddof(ddof: object, bessel: object) -> int:
    if bessel is not None:
        if not isinstance(bessel, (bool, np.bool_)):
            raise TypeError(f"bessel must be a bool, got {type(bessel).__name__}")
        return 1 if bessel else 0
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)):
        raise TypeError(f"ddof must be an integer, got {type(ddof).__name__}")
    if ddof < 0:
        raise ValueError(f"ddof must be non-negative, got {ddof}")
    return int(ddof)


def var(x: DNDarray, axis: Axis = None, ddof: int = 0, keepdims: bool = False,
        bessel: bool | None = None) -> DNDarray:
    """Variance ``sum(|x - mean|**2) / max(N - ddof, 0)`` over ``axis`` (two passes; numpy's
    divisor: ``ddof >= N`` gives inf, or NaN where the sum is 0). ``bessel`` (Heat's spelling):
    True is ``ddof=1``, False ``ddof=0``."""
    x = _check(x, "var")
    ddof = _ddof(ddof, bessel)
    out, acc = _float_type(x.dtype)
    n = _count(x, axis)
    xa = x.astype(acc, copy=False)
    m = mean(xa, axis, keepdims=True)
    d = xa - m
    sq = d._rewrap(d.larray.abs().square() if d.dtype.is_complex else d.larray.square())
    s = sum(sq, axis, keepdims=keepdims)
    return s._rewrap((s.larray / builtins.max(n - ddof, 0))
                     .to(out if not out.is_complex else s.dtype))


def std(x: DNDarray, axis: Axis = None, ddof: int = 0, keepdims: bool = False,
        bessel: bool | None = None) -> DNDarray:
    """Standard deviation: the square root of :func:`var`."""
    v = var(x, axis, ddof=ddof, keepdims=keepdims, bessel=bessel)
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


def min(x: DNDarray, axis: Axis = None, keepdims: bool = False,
        out: DNDarray | None = None) -> DNDarray:
    """Minimum over ``axis`` (NaN propagates). ``ValueError`` over an empty axis."""
    return _out(_minmax(x, axis, keepdims, largest=False), out, "min")


def max(x: DNDarray, axis: Axis = None, keepdims: bool = False,
        out: DNDarray | None = None) -> DNDarray:
    """Maximum over ``axis`` (NaN propagates). ``ValueError`` over an empty axis."""
    return _out(_minmax(x, axis, keepdims, largest=True), out, "max")


def all(x: DNDarray, axis: Axis = None, keepdims: bool = False,
        out: DNDarray | None = None) -> DNDarray:
    """Whether every element over ``axis`` is true (non-zero)."""
    x = _check(x, "all")
    xb = x if x.dtype is torch.bool else x._rewrap(x.larray != 0)
    return _out(_reduce(xb, axis, keepdims, _loop(torch.all), MPI.LAND, "all"), out, "all")


def any(x: DNDarray, axis: Axis = None, keepdims: bool = False,
        out: DNDarray | None = None) -> DNDarray:
    """Whether some element over ``axis`` is true (non-zero)."""
    x = _check(x, "any")
    xb = x if x.dtype is torch.bool else x._rewrap(x.larray != 0)
    return _out(_reduce(xb, axis, keepdims, _loop(torch.any), MPI.LOR, "any"), out, "any")


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


def _local_arg(t: torch.Tensor, dim: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(extremum, index of its first occurrence)`` along ``dim``, keepdim, as ``torch.max`` /
    ``torch.min`` (NaN counts as the extremum). Across a strided dimension of a large tensor it
    takes the extremum with ``amax``/``amin``, marks where it occurs and finds the first mark by
    the largest reversed row number: four vectorized passes, 1.5-3x faster on the CPU than
    torch's strided arg-reduction."""
    n = t.shape[dim]
    if dim == t.ndim - 1 or t.numel() < 1 << 16 or t.dtype is torch.bool or \
            t.dtype.is_complex or n >= 1 << 31:
        found = torch.max(t, dim, keepdim=True) if largest else torch.min(t, dim, keepdim=True)
        return found.values, found.indices
    best = t.amax(dim, keepdim=True) if largest else t.amin(dim, keepdim=True)
    hit = t == best
    if t.dtype.is_floating_point and bool(best.isnan().any()):
        hit |= t.isnan() & best.isnan()
    dtype = torch.int16 if n < 1 << 15 else torch.int32
    shape = [1] * t.ndim
    shape[dim] = n
    reversed_rows = torch.arange(n - 1, -1, -1, dtype=dtype, device=t.device).view(shape)
    first = (n - 1) - (hit * reversed_rows).amax(dim, keepdim=True).long()
    return best, first


def _arg(x: DNDarray, axis: int | None, keepdims: bool, largest: bool) -> DNDarray:
    name = "argmax" if largest else "argmin"
    x = _check(x, name)
    if x.dtype.is_complex:
        raise TypeError(f"{name} is not defined for complex dtype {x.dtype}")
    fn = torch.argmax if largest else torch.argmin
    comm, t = x.comm, x.larray
    if axis is None and t.dtype == torch.bool:  # torch's arg-reductions refuse bool
        t = t.to(torch.uint8)
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
        local = _local_arg(t, a, largest)[1] if t.shape[a] else fn(t, dim=a, keepdim=True)
        return _finish(x, local, (a,), keepdims, None)
    kept = [1 if i == a else s for i, s in enumerate(t.shape)]
    if t.shape[a]:
        vals, idx = _local_arg(t, a, largest)
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


def argmin(x: DNDarray, axis: int | None = None, keepdims: bool = False,
           out: DNDarray | None = None) -> DNDarray:
    """Index of the first minimum along ``axis`` (None: into the flattened array)."""
    return _out(_arg(x, axis, keepdims, largest=False), _int_out(out, "argmin"), "argmin")


def argmax(x: DNDarray, axis: int | None = None, keepdims: bool = False,
           out: DNDarray | None = None) -> DNDarray:
    """Index of the first maximum along ``axis`` (None: into the flattened array)."""
    return _out(_arg(x, axis, keepdims, largest=True), _int_out(out, "argmax"), "argmax")


def _int_out(out: object, name: str) -> object:
    """``out`` of an index result must hold integers (numpy's safe rule for indices)."""
    if isinstance(out, DNDarray) and (out.dtype.is_floating_point or out.dtype.is_complex
                                      or out.dtype is torch.bool):
        raise TypeError(f"{name}: out must have an integer dtype, got {out.dtype}")
    return out
