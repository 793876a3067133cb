"""Creating DNDarrays.

With ``split=k`` every rank creates only its own part (balanced layout: the first ``n % P`` ranks
get one extra index along k); nothing is communicated. :func:`array` with ``split`` expects the
whole object on every rank and keeps the local part; with ``is_split=k`` each rank passes its own
piece, and one small ``allgather`` of the pieces' shapes and dtypes builds the layout (the pieces
may be unbalanced, even empty). Defaults follow torch: Python floats give torch's default float
type (float32), Python ints int64, numpy arrays keep their dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import distribution
from .communication import MPICommunication, sanitize_comm
from .devices import sanitize_device, torch_device
from .dndarray import DNDarray, _normalize_split
from .types import canonical_dtype

__all__ = ["array", "asarray", "zeros", "ones", "full", "empty", "zeros_like", "ones_like",
           "full_like", "empty_like", "arange", "linspace", "eye"]

_SAME = object()  # "as the prototype" default of the *_like functions


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    try:
        dims = tuple(int(s) for s in shape)  # type: ignore[union-attr]
    except TypeError:
        raise TypeError(f"shape must be an integer or a sequence of integers, got "
                        f"{type(shape).__name__}") from None
    for s, d in zip(shape, dims):  # type: ignore[arg-type]
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape entries must be integers, got {type(s).__name__}")
        if d < 0:
            raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def _layout(shape: tuple[int, ...], split: object, comm: MPICommunication
            ) -> tuple[int | None, tuple[int, ...] | None, tuple[int, ...]]:
    """``(split, counts, local shape)`` of the balanced layout."""
    s = _normalize_split(split, len(shape))
    if s is None:
        return None, None, shape
    counts = distribution.balanced_counts(shape[s], comm.size)
    return s, counts, distribution.local_shape(shape, s, counts[comm.rank])


def _local_range(shape: tuple[int, ...], split: int | None, counts, comm) -> tuple[int, int]:
    if split is None:
        return 0, shape[0] if shape else 1
    return distribution.ranges(counts)[comm.rank]


def _as_local_tensor(obj: object) -> torch.Tensor:
    if isinstance(obj, DNDarray):
        raise TypeError("internal: DNDarray handled by the caller")
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"cannot build a DNDarray from numpy dtype {arr.dtype}")
        dtype = canonical_dtype(arr.dtype)
        arr = np.require(arr, dtype=arr.dtype.newbyteorder("="), requirements="C")
        if not arr.flags.writeable:
            arr = arr.copy()
        t = torch.from_numpy(arr)
        return t if t.dtype is dtype else t.to(dtype)
    try:
        return torch.tensor(obj)
    except (TypeError, ValueError, RuntimeError):
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"cannot build a DNDarray from {type(obj).__name__}") from None
        return _as_local_tensor(arr)


def array(obj: object, dtype: object = None, copy: bool = True, ndmin: int = 0,
          split: int | None = None, is_split: int | None = None, device: object = None,
          comm: MPICommunication | None = None) -> DNDarray:
    """A DNDarray from a numpy array, torch tensor, (nested) list, scalar or DNDarray.

    ``split=k``: ``obj`` is the whole array (the same on every rank); each rank keeps its part.
    ``is_split=k``: ``obj`` is this rank's piece of an array concatenated along k in rank order;
    pieces must agree in every other dimension (their dtypes are promoted to a common one).
    """
    if split is not None and is_split is not None:
        raise ValueError("split and is_split are mutually exclusive")
    if isinstance(obj, DNDarray):
        out = obj.astype(dtype, copy=copy) if dtype is not None else \
            (obj.copy() if copy else obj)
        if device is not None:
            out = out.to(device)
        if split is not None and split != out.split:
            out = out.resplit(split)
        return out
    comm = sanitize_comm(comm)
    dev = torch_device(sanitize_device(device))
    t = _as_local_tensor(obj)
    if dtype is not None:
        t = t.to(canonical_dtype(dtype))
    else:
        canonical_dtype(t.dtype)
    while t.ndim < ndmin:
        t = t.unsqueeze(0)
    shares = isinstance(obj, (torch.Tensor, np.ndarray)) and t.device == dev
    t = t.to(dev)
    if is_split is not None:
        meta = comm.allgather((tuple(t.shape), str(t.dtype)))
        ndims = {len(s) for s, _ in meta}
        if len(ndims) != 1:
            raise ValueError(f"is_split: the local pieces have different numbers of dimensions: "
                             f"{[s for s, _ in meta]}")
        s = _normalize_split(is_split, ndims.pop())
        if s is None:
            raise ValueError("is_split must name an axis")
        rest = {sh[:s] + sh[s + 1:] for sh, _ in meta}
        if len(rest) != 1:
            raise ValueError(f"is_split={s}: the local pieces' shapes {[sh for sh, _ in meta]} "
                             f"differ outside axis {s}")
        common = t.dtype
        for _, name in meta:
            common = torch.promote_types(common, getattr(torch, name.removeprefix("torch.")))
        t = t.to(common)
        if copy and shares:
            t = t.clone()
        counts = tuple(sh[s] for sh, _ in meta)
        gshape = list(meta[0][0])
        gshape[s] = sum(counts)
        return DNDarray._make(t.contiguous(), tuple(gshape), s, counts, comm)
    gshape = tuple(t.shape)
    s, counts, _ = _layout(gshape, split, comm)
    if s is not None:
        lo, hi = distribution.ranges(counts)[comm.rank]  # type: ignore[arg-type]
        t = t.narrow(s, lo, hi - lo)
        if copy or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
    elif copy and shares:
        t = t.clone()
    return DNDarray._make(t, gshape, s, counts, comm)


def asarray(obj: object, dtype: object = None, split: int | None = None,
            is_split: int | None = None, device: object = None,
            comm: MPICommunication | None = None) -> DNDarray:
    """:func:`array` without copying where the input's memory can be used."""
    return array(obj, dtype=dtype, copy=False, split=split, is_split=is_split, device=device,
                 comm=comm)


def _filled(shape, fill, dtype, split, device, comm) -> DNDarray:
    comm = sanitize_comm(comm)
    shape = _shape(shape)
    s, counts, lshape = _layout(shape, split, comm)
    dev = torch_device(sanitize_device(device))
    if fill is None:
        t = torch.empty(lshape, dtype=dtype, device=dev)
    else:
        t = torch.full(lshape, fill, dtype=dtype, device=dev)
    return DNDarray._make(t, shape, s, counts, comm)


def _dtype_or(dtype: object, default: torch.dtype | None = None) -> torch.dtype:
    if dtype is None:
        return default or torch.get_default_dtype()
    return canonical_dtype(dtype)


def zeros(shape: int | Sequence[int], dtype: object = None, split: int | None = None,
          device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """An array of zeros (default dtype: float32)."""
    return _filled(shape, 0, _dtype_or(dtype), split, device, comm)


def ones(shape: int | Sequence[int], dtype: object = None, split: int | None = None,
         device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """An array of ones (default dtype: float32)."""
    return _filled(shape, 1, _dtype_or(dtype), split, device, comm)


def empty(shape: int | Sequence[int], dtype: object = None, split: int | None = None,
          device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """An uninitialized array (default dtype: float32)."""
    return _filled(shape, None, _dtype_or(dtype), split, device, comm)


def _fill_dtype(value: object) -> torch.dtype:
    if isinstance(value, (bool, np.bool_)):
        return torch.bool
    if isinstance(value, (int, np.integer)):
        return torch.int64
    if isinstance(value, complex):
        return canonical_dtype(complex)
    if isinstance(value, np.generic):
        return canonical_dtype(value.dtype)
    return torch.get_default_dtype()


def full(shape: int | Sequence[int], fill_value: object, dtype: object = None,
         split: int | None = None, device: object = None,
         comm: MPICommunication | None = None) -> DNDarray:
    """An array filled with ``fill_value`` (dtype inferred from it by default)."""
    if isinstance(fill_value, (np.generic, np.ndarray, torch.Tensor)):
        fill_value = fill_value.item()
    dt = canonical_dtype(dtype) if dtype is not None else _fill_dtype(fill_value)
    return _filled(shape, fill_value, dt, split, device, comm)


def _like(a: DNDarray, fill: object, dtype: object, split: object, device: object,
          comm: object) -> DNDarray:
    if not isinstance(a, DNDarray):
        a = array(a)
    dt = a.dtype if dtype is None else canonical_dtype(dtype)
    dev = a.device if device is None else sanitize_device(device)
    comm = a.comm if comm is None else sanitize_comm(comm)
    if split is _SAME and comm is a.comm:
        split, counts, lshape = a.split, a.counts, a.lshape
    else:
        split, counts, lshape = _layout(a.gshape, a.split if split is _SAME else split, comm)
    td = torch_device(dev)
    t = torch.empty(lshape, dtype=dt, device=td) if fill is None else \
        torch.full(lshape, fill, dtype=dt, device=td)
    return DNDarray._make(t, a.gshape, split, counts, comm)


def zeros_like(a: DNDarray, dtype: object = None, split: object = _SAME, device: object = None,
               comm: MPICommunication | None = None) -> DNDarray:
    """Zeros of ``a``'s shape; dtype, device and layout default to ``a``'s (an explicit
    ``split`` gives the balanced layout along it)."""
    return _like(a, 0, dtype, split, device, comm)


def ones_like(a: DNDarray, dtype: object = None, split: object = _SAME, device: object = None,
              comm: MPICommunication | None = None) -> DNDarray:
    """Ones of ``a``'s shape and layout (see :func:`zeros_like`)."""
    return _like(a, 1, dtype, split, device, comm)


def empty_like(a: DNDarray, dtype: object = None, split: object = _SAME, device: object = None,
               comm: MPICommunication | None = None) -> DNDarray:
    """An uninitialized array of ``a``'s shape and layout (see :func:`zeros_like`)."""
    return _like(a, None, dtype, split, device, comm)


def full_like(a: DNDarray, fill_value: object, dtype: object = None, split: object = _SAME,
              device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """``fill_value`` in ``a``'s shape and layout (dtype: ``a``'s unless given)."""
    if isinstance(fill_value, (np.generic, np.ndarray, torch.Tensor)):
        fill_value = fill_value.item()
    return _like(a, fill_value, dtype, split, device, comm)


def arange(*args: float, dtype: object = None, split: int | None = None, device: object = None,
           comm: MPICommunication | None = None) -> DNDarray:
    """``arange([start,] stop[, step])``: ``start + i * step`` for ``i < ceil((stop - start) /
    step)``. Integer arguments give int64, others the default float type; each rank computes its
    own part (in float64, then cast)."""
    if not 1 <= len(args) <= 3:
        raise TypeError(f"arange expects 1 to 3 positional arguments, got {len(args)}")
    start, stop, step = (0, args[0], 1) if len(args) == 1 else \
        (args[0], args[1], args[2] if len(args) == 3 else 1)
    for v in (start, stop, step):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"arange arguments must be real numbers, got {type(v).__name__}")
    if step == 0:
        raise ValueError("arange: step must not be zero")
    integral = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
    n = max(0, int(np.ceil((stop - start) / step)))
    if integral:
        n = max(0, len(range(int(start), int(stop), int(step))))
    dt = _dtype_or(dtype, torch.int64 if integral else None)
    comm = sanitize_comm(comm)
    s, counts, _ = _layout((n,), split, comm)
    lo, hi = _local_range((n,), s, counts, comm)
    dev = torch_device(sanitize_device(device))
    if integral:
        t = torch.arange(lo, hi, dtype=torch.int64, device=dev) * int(step) + int(start)
    else:
        t = torch.arange(lo, hi, dtype=torch.float64, device=dev) * float(step) + float(start)
    return DNDarray._make(t.to(dt), (n,), s, counts, comm)


def linspace(start: float, stop: float, num: int = 50, endpoint: bool = True,
             retstep: bool = False, dtype: object = None, split: int | None = None,
             device: object = None, comm: MPICommunication | None = None
             ) -> DNDarray | tuple[DNDarray, float]:
    """``num`` evenly spaced values from ``start`` to ``stop`` (included if ``endpoint``), as
    numpy computes them: ``start + i * step`` in float64, the last one exactly ``stop``."""
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 0:
        raise ValueError(f"number of samples, {num}, must be a non-negative integer")
    num = int(num)
    div = num - 1 if endpoint else num
    step = (stop - start) / div if div > 0 else float("nan")
    comm = sanitize_comm(comm)
    s, counts, _ = _layout((num,), split, comm)
    lo, hi = _local_range((num,), s, counts, comm)
    dev = torch_device(sanitize_device(device))
    i = torch.arange(lo, hi, dtype=torch.float64, device=dev)
    t = i * step + start if div > 0 else i * (stop - start) + start
    if endpoint and num > 1 and hi == num and hi > lo:
        t[-1] = stop
    out = DNDarray._make(t.to(_dtype_or(dtype)), (num,), s, counts, comm)
    return (out, step) if retstep else out


def eye(n: int, m: int | None = None, k: int = 0, dtype: object = None,
        split: int | None = None, device: object = None,
        comm: MPICommunication | None = None) -> DNDarray:
    """The ``n x m`` matrix with ones on the ``k``-th diagonal (each rank fills its part)."""
    m = n if m is None else m
    shape = _shape((n, m))
    comm = sanitize_comm(comm)
    s, counts, lshape = _layout(shape, split, comm)
    dev = torch_device(sanitize_device(device))
    r0 = c0 = 0
    if s is not None:
        lo = distribution.ranges(counts)[comm.rank][0]  # type: ignore[arg-type]
        r0, c0 = (lo, 0) if s == 0 else (0, lo)
    rows = torch.arange(r0, r0 + lshape[0], device=dev)
    cols = torch.arange(c0, c0 + lshape[1], device=dev)
    t = ((cols[None, :] - rows[:, None]) == k).to(_dtype_or(dtype))
    return DNDarray._make(t, shape, s, counts, comm)
