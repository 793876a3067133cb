"""Statistics over DNDarrays (Heat's ``heat.core.statistics``): ``average``, ``bincount``,
``bucketize``, ``digitize``, ``cov``, ``histc`` / ``histogram``, ``kurtosis``, ``skew``,
``percentile`` / ``median`` and ``ptp``.

Communication:

* ``average``, ``kurtosis``, ``skew``, ``ptp``: built from the reductions (``sum``, ``mean``,
  ``max``, ``min``): local when the split axis is not reduced, one ``Allreduce`` per pass over it
  otherwise. The result's split axis follows the reductions' rule.
* ``bincount``, ``histc``: each rank counts its own elements; one ``Allreduce`` of the bins (and
  one of the value range where it must be found). The result is replicated.
* ``bucketize``, ``digitize``: local (the boundaries must be replicated).
* ``percentile`` / ``median``: local when the split axis is not reduced. Otherwise the data are
  resplit along a kept axis (one ``Alltoallv``) and the result gathered (``Allgatherv``), or, when
  every axis is reduced, replicated first (``Allgatherv``).
* ``cov``: centring plus one matrix product (see :func:`heatlike.matmul`).

Argument checks use only metadata every rank shares, so bad input raises on every rank.
"""

from __future__ import annotations

import builtins
import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

from . import reductions
from .arithmetics import _check_out, _store
from .communication import IN_PLACE
from .dndarray import DNDarray
from .manipulations import expand_dims
from .reductions import _axis_index, normalize_axes
from .types import float_result_type

__all__ = ["average", "bincount", "bucketize", "digitize", "cov", "histc", "histogram",
           "kurtosis", "skew", "percentile", "median", "ptp"]


def _check(x: object, name: str) -> DNDarray:
    if not isinstance(x, DNDarray):
        raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
    return x


def _floated(x: DNDarray) -> DNDarray:
    dt = float_result_type(x.dtype)
    return x if dt is x.dtype else x.astype(dt)


def average(x: DNDarray, axis: int | Sequence[int] | None = None, weights: DNDarray | None = None,
            returned: bool = False) -> DNDarray | tuple[DNDarray, DNDarray]:
    """The weighted mean ``sum(x * w) / sum(w)`` over ``axis`` (numpy's ``average``).

    ``weights`` (a DNDarray) has ``x``'s shape, or is 1-D with the length of ``axis`` (one int).
    ``returned=True`` also returns the sum of the weights, broadcast to the result's shape.
    ``ZeroDivisionError`` when the weights sum to zero."""
    x = _check(x, "average")
    axes = normalize_axes(axis, x.ndim)
    if weights is None:
        res = reductions.mean(x, axis)
        if returned:
            n = float(np.prod([x.gshape[a] for a in axes])) if axes else 1.0
            return res, res._rewrap(torch.full_like(res.larray, n))
        return res
    if not isinstance(weights, DNDarray):
        raise TypeError(f"average: weights must be a DNDarray, got {type(weights).__name__}")
    if weights.gshape != x.gshape:
        if axis is None:
            raise TypeError("average: axis must be given when the weights' shape differs from "
                            "the array's")
        if isinstance(axis, (tuple, list)):
            raise NotImplementedError("average: 1-D weights along several axes are not "
                                      "supported; give weights of the array's shape")
        if weights.ndim != 1:
            raise TypeError("average: weights must be 1-D or have the array's shape")
        a = _axis_index(axis, x.ndim)
        if weights.gshape[0] != x.gshape[a]:
            raise ValueError(f"average: the weights' length {weights.gshape[0]} differs from "
                             f"the length {x.gshape[a]} of axis {a}")
        w = weights
        for d in range(x.ndim):
            if d != a:
                w = expand_dims(w, d)
    else:
        w = weights
    dt = torch.promote_types(float_result_type(x.dtype), float_result_type(w.dtype))
    xf, wf = x.astype(dt, copy=False), w.astype(dt, copy=False)
    wsum = reductions.sum(wf, axis)
    if builtins.bool(reductions.any(wsum == 0).item()):
        raise ZeroDivisionError("average: the weights sum to zero")
    res = reductions.sum(xf * wf, axis) / wsum
    if returned:
        if wsum.gshape != res.gshape:
            from .manipulations_more import broadcast_to

            wsum = broadcast_to(wsum, res.gshape)
        return res, wsum
    return res


def bincount(x: DNDarray, weights: DNDarray | None = None, minlength: int = 0) -> DNDarray:
    """The number of occurrences of each value in the non-negative integer array ``x`` (weighted
    sums with ``weights``, which must be laid out like ``x``). Replicated result of length
    ``max(max(x) + 1, minlength)``: one ``Allreduce`` of the maximum and one of the counts."""
    x = _check(x, "bincount")
    if x.ndim != 1:
        raise ValueError(f"bincount: x must be 1-D, got {x.ndim} dimensions")
    if x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(f"bincount: x must hold integers, got {x.dtype}")
    if weights is not None:
        weights = _check(weights, "bincount")
        if weights.gshape != x.gshape or weights.split != x.split or \
                weights.counts != x.counts:
            raise ValueError("bincount: weights must have the shape and layout of x")
    if isinstance(minlength, bool) or not isinstance(minlength, (int, np.integer)) \
            or minlength < 0:
        raise ValueError(f"bincount: minlength must be a non-negative integer, got {minlength!r}")
    t = x.larray.to(torch.int64)
    if builtins.bool(reductions.any(x < 0).item()) if x.size else False:
        raise ValueError("bincount: x must not hold negative values")
    top = int(t.max()) + 1 if t.numel() else 0
    if x.split is not None and x.comm.size > 1:
        top = x.comm.allreduce(top, op=MPI.MAX)
    n = builtins.max(top, int(minlength))
    w = None if weights is None else weights.larray
    local = torch.bincount(t, weights=w, minlength=n)
    # the result's dtype from the inputs' dtypes alone: torch counts an empty part as int64
    # whatever the weights, and every rank must sum the same type
    if w is None:
        local = local.to(torch.int64)
    elif w.dtype.is_floating_point or w.dtype.is_complex:
        local = local.to(w.dtype)
    else:
        local = local.to(torch.float64)
    if x.split is not None and x.comm.size > 1:
        local = local.contiguous()
        x.comm.Allreduce(IN_PLACE, local, MPI.SUM)
    return DNDarray._make(local, (n,), None, None, x.comm)


def _boundaries(b: object, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(b, DNDarray):
        if b.is_distributed():
            raise RuntimeError(f"{name}: the boundaries must not be distributed (resplit them "
                               "to None)")
        t = b.larray
    elif isinstance(b, torch.Tensor):
        t = b
    elif isinstance(b, (np.ndarray, list, tuple)):
        t = torch.as_tensor(np.asarray(b))
    else:
        raise TypeError(f"{name}: boundaries must be a 1-D array, got {type(b).__name__}")
    if t.ndim != 1:
        raise ValueError(f"{name}: boundaries must be 1-D, got {t.ndim} dimensions")
    return t.to(device)


def bucketize(input: DNDarray, boundaries: object, out_int32: bool = False,  # noqa: A002
              right: bool = False, out: DNDarray | None = None) -> DNDarray:
    """torch's ``bucketize``: the index of the bucket of every element in the increasing
    ``boundaries`` (replicated), locally."""
    x = _check(input, "bucketize")
    b = _boundaries(boundaries, "bucketize", x.larray.device)
    if b.dtype is not x.dtype and not (b.dtype.is_complex or x.dtype.is_complex):
        common = torch.promote_types(b.dtype, x.dtype)
        t, b = x.larray.to(common), b.to(common)
    else:
        t = x.larray
    res = x._rewrap(torch.bucketize(t, b, out_int32=bool(out_int32), right=bool(right)))
    _check_out(out)
    return _store(res, out, True, "bucketize")


def digitize(x: DNDarray, bins: object, right: bool = False) -> DNDarray:
    """numpy's ``digitize``: the index of the bin of every element, for increasing or decreasing
    ``bins`` (replicated), locally."""
    x = _check(x, "digitize")
    b = _boundaries(bins, "digitize", x.larray.device)
    rising, falling = builtins.bool((b[1:] >= b[:-1]).all()), builtins.bool((b[1:] <= b[:-1]).all())
    if not (rising or falling):  # the same bins on every rank: every rank raises
        raise ValueError("digitize: bins must be monotonically increasing or decreasing")
    if b.numel() > 1 and falling and builtins.bool((b[1:] < b[:-1]).any()):
        rev = bucketize(x, b.flip(0), right=not right)
        return rev._rewrap(b.numel() - rev.larray)
    return bucketize(x, b, right=not right)


def cov(m: DNDarray, y: DNDarray | None = None, rowvar: bool = True, bias: bool = False,
        ddof: int | None = None) -> DNDarray:
    """numpy's ``cov``: the covariance matrix of the variables in the rows of ``m`` (columns if
    not ``rowvar``), with ``y``'s variables appended. Normalized by ``N - 1`` (``N`` with
    ``bias``, ``N - ddof`` with ``ddof``). A single variable's is 0-d, as numpy's (Heat's
    takes a 1-D ``m`` for one observation of many variables)."""
    m = _check(m, "cov")
    if y is not None:
        y = _check(y, "cov")
    if ddof is not None and (isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer))):
        raise TypeError(f"cov: ddof must be an integer, got {type(ddof).__name__}")
    from .manipulations import concatenate

    def as_rows(a: DNDarray) -> DNDarray:
        if a.ndim > 2:
            raise ValueError(f"cov: arrays must have at most 2 dimensions, got {a.ndim}")
        a = _floated(a)
        if a.ndim == 1:
            a = expand_dims(a, 0)
        elif not rowvar:
            a = a.T
        return a

    x = as_rows(m)
    if y is not None:
        yr = as_rows(y)
        if yr.gshape[1] != x.gshape[1]:
            raise ValueError("cov: m and y must have the same number of observations")
        dt = torch.promote_types(x.dtype, yr.dtype)
        x = concatenate([x.astype(dt, copy=False), yr.astype(dt, copy=False)], axis=0)
    n = x.gshape[1]
    if ddof is None:
        ddof = 0 if bias else 1
    fact = n - int(ddof)
    if fact <= 0:
        raise ValueError(f"cov: ddof={ddof} leaves no degrees of freedom for {n} observations")
    from .linalg import matmul

    xc = x - reductions.mean(x, 1, keepdims=True)
    c = matmul(xc, xc.T) / fact
    c = c.resplit(None) if c.split is not None else c
    return c.reshape(()) if c.gshape == (1, 1) else c  # numpy squeezes a single variable's


def histc(input: DNDarray, bins: int = 100, min: float = 0, max: float = 0,  # noqa: A002
          out: DNDarray | None = None) -> DNDarray:
    """torch's ``histc``: ``bins`` equal-width bins between ``min`` and ``max`` (both 0: the
    data's range, one ``Allreduce`` each); each rank counts its elements, one ``Allreduce`` of the
    counts; replicated result of the input's float type."""
    x = _check(input, "histc")
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins <= 0:
        raise ValueError(f"histc: bins must be a positive integer, got {bins!r}")
    t = x.larray
    if not t.dtype.is_floating_point:
        t = t.to(float_result_type(t.dtype))
    lo, hi = float(min), float(max)
    if lo == hi == 0:
        if x.size == 0:
            lo, hi = 0.0, 0.0
        else:
            lo = float(reductions.min(x).item())
            hi = float(reductions.max(x).item())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    # the range is known alike on every rank: checked here, not by torch on the ranks with data
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"histc: range of [{lo}, {hi}] is not finite")
    if lo > hi:
        raise RuntimeError(f"histc: max must be larger than min, got min={lo}, max={hi}")
    local = torch.histc(t, bins=int(bins), min=lo, max=hi) if t.numel() else \
        torch.zeros(int(bins), dtype=t.dtype, device=t.device)
    if x.split is not None and x.comm.size > 1:
        local = local.contiguous()
        x.comm.Allreduce(IN_PLACE, local, MPI.SUM)
    res = DNDarray._make(local, (int(bins),), None, None, x.comm)
    _check_out(out)
    return _store(res, out, True, "histc")


def histogram(a: DNDarray, bins: int = 10, range: tuple[float, float] | None = None,  # noqa: A002
              normed: bool | None = None, weights: object = None,
              density: bool | None = None) -> DNDarray:
    """Heat's ``histogram``: :func:`histc` with an integer number of bins over ``range`` (the
    data's range by default). Bin edges as arrays, weights and densities are not supported
    (``NotImplementedError``)."""
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)):
        raise NotImplementedError("histogram: only an integer number of bins is supported")
    if weights is not None or normed is not None or density is not None:
        raise NotImplementedError("histogram: weights, normed and density are not supported")
    lo, hi = (0, 0) if range is None else range
    return histc(a, bins=int(bins), min=lo, max=hi)


def _moments(x: DNDarray, axis: object, name: str) -> tuple[DNDarray, DNDarray, DNDarray, int]:
    """(m2, m3, m4, n): the biased central moments over one axis or all."""
    x = _check(x, name)
    if axis is not None and not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{name}: axis must be None or an integer, got {type(axis).__name__}")
    if axis is not None:
        _axis_index(axis, x.ndim)
    xf = _floated(x)
    n = xf.size if axis is None else xf.gshape[int(axis)]
    d = xf - reductions.mean(xf, axis, keepdims=True)
    d2 = d * d
    m2 = reductions.mean(d2, axis)
    m3 = reductions.mean(d2 * d, axis)
    m4 = reductions.mean(d2 * d2, axis)
    return m2, m3, m4, n


def skew(x: DNDarray, axis: int | None = None, unbiased: bool = True) -> DNDarray:
    """The sample skewness over ``axis`` (all by default), scipy's ``skew`` with
    ``bias=not unbiased``."""
    m2, m3, _, n = _moments(x, axis, "skew")
    g = m3 / m2 ** 1.5
    if unbiased:
        if n < 3:
            raise ValueError("skew: the unbiased estimate needs at least 3 values")
        g = g * (float(np.sqrt(n * (n - 1))) / (n - 2))
    return g


def kurtosis(x: DNDarray, axis: int | None = None, unbiased: bool = True,
             Fischer: bool = True) -> DNDarray:  # noqa: N803
    """The sample kurtosis over ``axis`` (all by default), scipy's ``kurtosis`` with
    ``bias=not unbiased`` and ``fisher=Fischer`` (excess kurtosis)."""
    m2, _, m4, n = _moments(x, axis, "kurtosis")
    g = m4 / (m2 * m2)
    if unbiased:
        if n < 4:
            raise ValueError("kurtosis: the unbiased estimate needs at least 4 values")
        g = ((g * (n * n - 1.0)) - 3.0 * (n - 1) ** 2) * (1.0 / ((n - 2) * (n - 3))) + 3.0
    return g - 3.0 if Fischer else g


def ptp(x: DNDarray, axis: object = None, out: DNDarray | None = None,
        keepdims: bool = False) -> DNDarray:
    """The range ``max - min`` over ``axis`` (numpy's ``ptp``), in ``x``'s dtype."""
    x = _check(x, "ptp")
    res = reductions.max(x, axis, keepdims=keepdims) - reductions.min(x, axis, keepdims=keepdims)
    res = res.astype(x.dtype, copy=False)
    _check_out(out)
    return _store(res, out, True, "ptp")


_METHODS = ("linear", "lower", "higher", "midpoint", "nearest")


def _quantiles(t: torch.Tensor, q: torch.Tensor, method: str) -> torch.Tensor:
    """Quantiles ``q`` (in [0, 1]) of the last axis of ``t``: shape ``(len(q), *t.shape[:-1])``.
    NaN anywhere along the axis gives NaN (numpy's rule)."""
    n = t.shape[-1]
    srt, _ = torch.sort(t, dim=-1)
    pos = q.to(torch.float64) * (n - 1)
    lo = torch.floor(pos).to(torch.int64).clamp(0, n - 1)
    hi = torch.ceil(pos).to(torch.int64).clamp(0, n - 1)
    frac = pos - lo.to(torch.float64)
    a = srt.index_select(-1, lo).movedim(-1, 0)
    b = srt.index_select(-1, hi).movedim(-1, 0)
    if method == "lower":
        out = a
    elif method == "higher":
        out = b
    elif method == "midpoint":
        out = b - (b - a) * 0.5  # numpy's lerp at 0.5
    elif method == "nearest":
        idx = torch.round(pos).to(torch.int64).clamp(0, n - 1)
        out = srt.index_select(-1, idx).movedim(-1, 0)
    else:
        shape = (-1,) + (1,) * (a.ndim - 1)
        # numpy's lerp, the same bits: the weight and its complement rounded from float64 to
        # the data's dtype, the form by the side of the nearer end (-inf, not nan, beside -inf)
        f64 = frac.reshape(shape)
        f, g = f64.to(t.dtype), (1 - f64).to(t.dtype)
        d = b - a
        out = torch.where(f64 >= 0.5, b - d * g, a + d * f)
        out = torch.where(f64 == 0, a, out)
    nan = torch.isnan(t).any(-1)
    if builtins.bool(nan.any()):
        out = out.masked_fill(nan.unsqueeze(0).expand_as(out), float("nan"))
    return out


def percentile(x: DNDarray, q: object, axis: object = None, out: DNDarray | None = None,
               interpolation: str = "linear", keepdims: bool = False,
               sketched: bool = False, sketch_size: float | None = None, *,
               _empty: str = "raise") -> DNDarray:
    """The ``q``-th percentiles (a number or a sequence / 1-D array of numbers in [0, 100]) over
    ``axis`` (all by default; an int or a tuple) with numpy's methods ``linear``, ``lower``,
    ``higher``, ``midpoint`` and ``nearest``. A sequence ``q`` adds a leading axis to the
    result. The result is split along ``x``'s split axis when that axis is kept (renumbered),
    else replicated; ``out`` must match it in shape and dtype (its layout is kept). ``sketched``
    is accepted (``sketch_size`` in (0, 1]) and ignored: the exact percentiles are computed."""
    x = _check(x, "percentile")
    if sketched and sketch_size is not None and not 0 < float(sketch_size) <= 1:
        raise ValueError(f"percentile: sketch_size must lie in (0, 1], got {sketch_size}")
    if x.dtype.is_complex:
        raise TypeError("percentile is not defined for complex arrays")
    if interpolation not in _METHODS:
        raise ValueError(f"percentile: interpolation must be one of {_METHODS}, got "
                         f"{interpolation!r}")
    scalar_q = isinstance(q, (int, float, np.number)) and not isinstance(q, bool)
    if isinstance(q, DNDarray):
        if q.ndim > 1:
            raise TypeError("percentile: q must be a number or a 1-D sequence of numbers")
        qt = (q.resplit(None) if q.split is not None else q).larray.to(torch.float64).cpu()
        scalar_q = q.ndim == 0
    elif scalar_q:
        qt = torch.tensor([float(q)], dtype=torch.float64)
    else:
        try:
            arr = np.asarray(q, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"percentile: q must hold numbers, got {q!r}") from None
        if arr.dtype.kind not in "iuf" or arr.ndim > 1:
            raise TypeError("percentile: q must be a number or a 1-D sequence of numbers")
        qt = torch.from_numpy(arr.reshape(-1).copy())
        scalar_q = arr.ndim == 0
    qt = qt.reshape(-1)
    if not builtins.bool(((qt >= 0) & (qt <= 100)).all()):  # NaN is out of range too
        raise ValueError("percentile: q must lie in [0, 100]")
    axes = normalize_axes(axis, x.ndim)
    keep = [d for d in range(x.ndim) if d not in axes]
    dt = float_result_type(x.dtype)
    split = x.split
    if split is not None and split in axes:
        work = x.resplit(keep[0]) if keep else x.resplit(None)
    else:
        work = x
    t = work.larray.to(dt)
    perm = [d for d in range(x.ndim) if d not in axes] + list(axes)
    t = t.permute(perm)
    lead = t.shape[:len(keep)]
    reduced = int(np.prod([x.gshape[d] for d in axes], dtype=np.int64))
    if reduced == 0:
        if _empty == "raise":
            raise ValueError("percentile of an empty array")
        # median's: NaN, as numpy's mean of an empty slice, with its warning
        warnings.warn(f"{_empty} of an empty slice", RuntimeWarning, stacklevel=3)
        t, reduced = torch.full((*lead, 1), float("nan"), dtype=dt, device=t.device), 1
    t = t.reshape(*lead, reduced)
    res = _quantiles(t, (qt / 100).to(t.device), interpolation)
    if keepdims:
        shape_kept = [1 if d in axes else x.gshape[d] for d in range(x.ndim)]
        local_kept = [1 if d in axes else work.lshape[d] for d in range(x.ndim)]
        res = res.reshape(res.shape[0], *local_kept)
        gshape = tuple(shape_kept)
    else:
        gshape = tuple(x.gshape[d] for d in keep)
    if scalar_q:
        res = res[0]
    else:
        gshape = (qt.numel(), *gshape)
    offset = 0 if scalar_q else 1
    if work.split is not None:
        ws = work.split if keepdims else keep.index(work.split)
        rsplit = ws + offset
        result = DNDarray._make(res.contiguous(), gshape, rsplit, work.counts, x.comm)
        if split is not None and split in axes:
            result = result.resplit(None)
    else:
        result = DNDarray._make(res.contiguous(), gshape, None, None, x.comm)
    if out is not None:
        if not isinstance(out, DNDarray):
            raise TypeError(f"percentile: out must be a DNDarray, got {type(out).__name__}")
        if tuple(out.shape) != tuple(result.shape):
            raise ValueError(f"percentile: out has shape {tuple(out.shape)}, the result "
                             f"{tuple(result.shape)}")
        if out.dtype is not result.dtype:
            raise TypeError(f"percentile: out has dtype {out.dtype}, the result {result.dtype}")
        return _store(result, out, True, "percentile")
    return result


def median(x: DNDarray, axis: object = None, keepdims: bool = False,
           sketched: bool = False, sketch_size: float | None = None) -> DNDarray:
    """The median over ``axis``: :func:`percentile` at 50; NaN (with a ``RuntimeWarning``) over
    an empty axis, as numpy (where :func:`percentile` raises ValueError)."""
    return percentile(x, 50.0, axis=axis, keepdims=keepdims, _empty="median")
