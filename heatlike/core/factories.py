"""Creating DNDarrays.

With ``split=k`` every rank creates only its own part (balanced layout: the first ``n % P`` ranks
get one extra index along k); nothing is communicated. :func:`array` with ``split`` expects the
whole object on every rank and keeps the local part; with ``is_split=k`` each rank passes its own
piece, and one small ``allgather`` of the pieces' shapes and dtypes builds the layout (the pieces
may be unbalanced, even empty). Defaults follow torch: Python floats give torch's default float
type (float32), Python ints int64, numpy arrays keep their dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from . import distribution
from .agreement import gather_or_raise
from .communication import MPICommunication, sanitize_comm
from .devices import sanitize_device, torch_device
from .dndarray import DNDarray, _normalize_split
from .types import canonical_dtype, is_integer, numpy_dtype

__all__ = ["array", "asarray", "zeros", "ones", "full", "empty", "zeros_like", "ones_like",
           "full_like", "empty_like", "arange", "linspace", "logspace", "eye", "meshgrid",
           "from_dlpack", "from_partitioned", "from_partition_dict"]

_SAME = object()  # "as the prototype" default of the *_like functions


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray,
                                                                 torch.Tensor, DNDarray)):
        raise TypeError(f"shape must be an integer or a sequence of integers, got "
                        f"{type(shape).__name__}")
    if isinstance(shape, DNDarray):
        shape = shape.tolist()
    elif isinstance(shape, (np.ndarray, torch.Tensor)):
        shape = shape.tolist()
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape entries must be integers, got {type(s).__name__}")
    dims = tuple(int(s) for s in shape)
    if any(d < 0 for d in dims):
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


def _as_local_tensor(obj: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``obj`` as a torch tensor (sharing memory with tensors and numpy arrays where possible);
    Python data are converted straight to ``dtype`` when given (no float32 detour)."""
    if isinstance(obj, DNDarray):
        raise TypeError("internal: DNDarray handled by the caller")
    if isinstance(obj, torch.Tensor):
        return obj.detach() if obj.requires_grad else obj
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"cannot build a DNDarray from numpy dtype {arr.dtype}")
        dt = canonical_dtype(arr.dtype)
        arr = np.require(arr, dtype=arr.dtype.newbyteorder("="), requirements="C")
        if not arr.flags.writeable:
            arr = arr.copy()
        t = torch.from_numpy(arr)
        return t if t.dtype is dt else t.to(dt)
    if isinstance(obj, (str, bytes)):
        raise TypeError(f"cannot build a DNDarray from {type(obj).__name__}")
    if dtype is not None and is_integer(dtype):
        # numpy 2 raises OverflowError for a Python integer out of the type's range; data numpy
        # cannot convert (nested tensors, ...) are left to torch's conversion below
        with contextlib.suppress(TypeError, ValueError, KeyError):
            return torch.from_numpy(np.array(obj, dtype=numpy_dtype(dtype)))
    try:
        return torch.tensor(obj, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        try:
            arr = np.asarray(obj)
        except (TypeError, ValueError):
            raise TypeError(f"cannot build a DNDarray from {type(obj).__name__}") from None
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"cannot build a DNDarray from {type(obj).__name__}") from None
        return _as_local_tensor(arr)


def _check_copy(copy: object) -> None:
    if copy is not None and not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be True, False or None, got {type(copy).__name__}")


def _order(t: torch.Tensor, order: str) -> torch.Tensor:
    """``t`` with C (row-major) or F (column-major) strides."""
    if order == "C" or t.ndim < 2:
        return t if order == "F" or t.is_contiguous() else t.contiguous()
    rev = tuple(reversed(range(t.ndim)))
    return t.permute(rev).contiguous().permute(rev)


def array(obj: object, dtype: object = None, copy: bool | None = True, ndmin: int = 0,
          order: str = "C", split: int | None = None, is_split: int | None = None,
          device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """A DNDarray from a numpy array, torch tensor, (nested) list, scalar or DNDarray.

    ``split=k``: ``obj`` is the whole array (the same on every rank); each rank keeps its part
    (one ``allgather`` of the whole array's shape and dtype: ranks that pass different ones
    raise ValueError on every rank, as does an ``obj`` one rank cannot take).
    ``is_split=k``: ``obj`` is this rank's piece of an array concatenated along k in rank order;
    pieces must agree in every other dimension (their dtypes are promoted to a common one; one
    ``allgather`` of the pieces' shapes and dtypes).

    ``copy``: True (default) always copies; None copies only when needed (a dtype or device
    change, a cut); False never copies and raises ``ValueError`` where a copy is needed (numpy
    2's meaning). ``ndmin``: at least this many dimensions, new axes in front (negative: at the
    end, as in Heat). ``order``: ``"C"`` or ``"F"`` (column-major local tensors).
    """
    _check_copy(copy)
    if isinstance(ndmin, bool) or not isinstance(ndmin, (int, np.integer)):
        raise TypeError(f"ndmin must be an integer, got {type(ndmin).__name__}")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    if split is not None and is_split is not None:
        raise ValueError("split and is_split are mutually exclusive")
    comm_checked = None if comm is None else sanitize_comm(comm)
    dt = None if dtype is None else canonical_dtype(dtype)
    if isinstance(obj, DNDarray):
        return _from_dndarray(obj, dt, copy, ndmin, order, split, is_split, device,
                              comm_checked)
    comm = sanitize_comm(comm_checked)
    dev = torch_device(sanitize_device(device))
    if split is not None:
        _normalize_split(split, 1 << 30)  # type errors first; the range is checked below

    def local() -> tuple[torch.Tensor, bool]:
        t = _as_local_tensor(obj, dt if not isinstance(obj, (torch.Tensor, np.ndarray,
                                                             np.generic)) else None)
        canonical_dtype(t.dtype)
        shares = isinstance(obj, (torch.Tensor, np.ndarray))
        if dt is not None and t.dtype is not dt:
            if copy is False and shares:
                raise ValueError(f"copy=False: converting {t.dtype} to {dt} needs a copy")
            t = t.to(dt)
            shares = False
        while t.ndim < abs(int(ndmin)):
            t = t.unsqueeze(0) if ndmin > 0 else t.unsqueeze(-1)
        if t.device != dev:
            if copy is False and shares:
                raise ValueError("copy=False: moving the data to another device needs a copy")
            t = t.to(dev)
            shares = False
        return t, shares

    def everywhere(what: str) -> tuple[torch.Tensor, bool, list]:
        """local(), and every rank's (shape, dtype); one that fails raises on every rank."""
        error = t = shares = None
        try:
            t, shares = local()
        except (TypeError, ValueError, RuntimeError) as bad:
            error = bad
        meta = gather_or_raise(None if error else (tuple(t.shape), str(t.dtype)), error, comm,
                               what, kinds=(BufferError,))
        return t, shares, meta

    if is_split is None and (split is None or comm.size == 1):
        t, shares = local()
    elif is_split is None:  # the whole array on every rank: the same shape and dtype
        t, shares, meta = everywhere("array(split=...): the whole array's shape")
        if len(set(meta)) != 1:
            shown = ", ".join(f"rank {r}: {sh} {dt.removeprefix('torch.')}"
                              for r, (sh, dt) in enumerate(meta[:8]))
            raise ValueError(f"array(split={split}): every rank must pass the same whole array "
                             f"(is_split= takes one piece per rank); the ranks pass shapes and "
                             f"dtypes {shown}{' ...' if len(meta) > 8 else ''}")
    else:  # each rank's own piece: one that cannot be taken fails on every rank, named
        t, shares, meta = everywhere("array(is_split=...): the pieces' shapes")
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
        if common is not t.dtype:
            if copy is False and shares:
                raise ValueError(f"copy=False: promoting {t.dtype} to {common} needs a copy")
            t = t.to(common)
            shares = False
        if copy and shares:
            t = t.clone()
        counts = tuple(sh[s] for sh, _ in meta)
        gshape = list(meta[0][0])
        gshape[s] = sum(counts)
        return DNDarray._make(_order(t, order), tuple(gshape), s, counts, comm)
    gshape = tuple(t.shape)
    s, counts, _ = _layout(gshape, split, comm)
    if s is not None:
        lo, hi = distribution.ranges(counts)[comm.rank]  # type: ignore[arg-type]
        t = t.narrow(s, lo, hi - lo)
        if copy is False and comm.size > 1 and hi - lo != gshape[s]:
            raise ValueError("copy=False: keeping this rank's part of split data needs a copy")
        if copy or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
    elif copy and shares:
        t = t.clone()
    return DNDarray._make(_order(t, order), gshape, s, counts, comm)


def _from_dndarray(obj: DNDarray, dt: torch.dtype | None, copy: bool | None, ndmin: int,
                   order: str, split: object, is_split: object, device: object,
                   comm: MPICommunication | None) -> DNDarray:
    """:func:`array` of a DNDarray: a copy (``copy=True``) or ``obj`` itself where nothing has to
    change; ``split``/``is_split`` name the layout the result must have."""
    if comm is not None and comm is not obj.comm and comm.handle != obj.comm.handle:
        raise ValueError("array: a DNDarray cannot be moved to another communicator")
    want = is_split if is_split is not None else split
    if want is not None:
        want = _normalize_split(want, obj.ndim)
    if is_split is not None and want != obj.split:
        raise ValueError(f"is_split={is_split}, but the DNDarray is split along {obj.split}")
    changes = (dt is not None and dt is not obj.dtype) or \
        (device is not None and sanitize_device(device) != obj.device) or \
        (want is not None and want != obj.split) or obj.ndim < abs(int(ndmin))
    if copy is False and changes:
        raise ValueError("copy=False: the requested dtype, device, split or ndmin needs a copy")
    out = obj
    if dt is not None and dt is not obj.dtype:
        out = out.astype(dt)
    if device is not None:
        out = out.to(device)
    if want is not None and want != out.split:
        out = out.resplit(want)
    while out.ndim < abs(int(ndmin)):
        out = out.expand_dims(0 if ndmin > 0 else out.ndim)
    if copy and out is obj:
        out = obj.copy()
    if order == "F":
        out = out._rewrap(_order(out.larray, "F"))
    return out


def asarray(obj: object, dtype: object = None, copy: bool | None = None, order: str = "C",
            split: int | None = None, is_split: int | None = None, device: object = None,
            comm: MPICommunication | None = None) -> DNDarray:
    """:func:`array` with ``copy=None``: the input's memory is used where possible (a DNDarray
    that needs no change is returned as is)."""
    return array(obj, dtype=dtype, copy=copy, order=order, split=split, is_split=is_split,
                 device=device, comm=comm)


def _filled(shape, fill, dtype, split, device, comm) -> DNDarray:
    comm = sanitize_comm(comm)
    shape = _shape(shape)
    s, counts, lshape = _layout(shape, split, comm)
    dev = torch_device(sanitize_device(device))
    if fill is None:
        t = torch.empty(lshape, dtype=dtype, device=dev)
    else:
        t = _full(lshape, fill, dtype, dev)
    return DNDarray._make(t, shape, s, counts, comm)


def _full(lshape: tuple[int, ...], fill: object, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """``torch.full``; a Python integer out of an integer dtype's range is numpy 2's
    OverflowError (torch's RuntimeError before)."""
    if isinstance(fill, int) and not isinstance(fill, bool) and is_integer(dtype):
        info = torch.iinfo(dtype)
        if not info.min <= fill <= info.max:
            raise OverflowError(f"Python integer {fill} out of bounds for "
                                f"{str(dtype).removeprefix('torch.')}")
    return torch.full(lshape, fill, dtype=dtype, device=device)


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
        _full(lshape, fill, dt, td)
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
    own part (in float64, then cast), with numpy's step: the difference of the first two values
    (``(start + step) - start``; in the integer type for an integer ``dtype``, so
    ``arange(0.5, 5, 1.5, dtype=int64)`` is ``[0, 2, 4]`` as in numpy)."""
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
    elif not dt.is_floating_point and not dt.is_complex:
        # numpy: the first two values converted to the integer type fix the step
        first, second = int(float(start)), int(float(start) + float(step))
        t = torch.arange(lo, hi, dtype=torch.int64, device=dev) * (second - first) + first
    else:  # numpy's step: the difference of the first two values (float64, then cast)
        first = float(start)
        delta = (first + float(step)) - first
        t = torch.arange(lo, hi, dtype=torch.float64, device=dev) * delta + first
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
    dt = _dtype_or(dtype)
    if not dt.is_floating_point and not dt.is_complex and dt != torch.bool:
        t = t.floor()  # numpy floors toward an integer dtype (a cast would truncate)
    out = DNDarray._make(t.to(dt), (num,), s, counts, comm)
    return (out, step) if retstep else out


def eye(n: int | Sequence[int], m: int | None = None, k: int = 0, dtype: object = None,
        split: int | None = None, device: object = None,
        comm: MPICommunication | None = None) -> DNDarray:
    """The ``n x m`` matrix with ones on the ``k``-th diagonal (each rank fills its part).

    ``n`` may be a shape: ``eye((4, 6))`` is ``eye(4, 6)`` and ``eye((4,))`` is ``eye(4)`` (Heat's
    and numpy's spelling); ``m`` must then be omitted."""
    if isinstance(n, (Sequence, np.ndarray)) and not isinstance(n, (str, bytes)):
        dims = _shape(n)
        if not 1 <= len(dims) <= 2:
            raise ValueError(f"eye: a shape must have one or two entries, got {dims}")
        if m is not None:
            raise TypeError("eye: give either a shape (n, m) or n and m, not both")
        n, m = dims[0], dims[-1]
    for name, v in (("n", n), ("m", m), ("k", k)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise TypeError(f"eye: {name} must be an integer, got {type(v).__name__}")
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
    t = ((cols[None, :] - rows[:, None]) == int(k)).to(_dtype_or(dtype))
    return DNDarray._make(t, shape, s, counts, comm)


def logspace(start: float, stop: float, num: int = 50, endpoint: bool = True,
             base: float = 10.0, dtype: object = None, split: int | None = None,
             device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """``base ** linspace(start, stop, num, endpoint)``: ``num`` values spaced evenly on a log
    scale (computed in float64, then cast to ``dtype``, default the default float type). Each
    rank computes its own part."""
    if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)):
        raise TypeError(f"logspace: base must be a real number, got {type(base).__name__}")
    y = linspace(start, stop, num, endpoint=endpoint, dtype=torch.float64, split=split,
                 device=device, comm=comm)
    return y._rewrap(torch.pow(float(base), y.larray).to(_dtype_or(dtype)))


def meshgrid(*arrays: object, indexing: str = "xy", sparse: bool = False) -> list[DNDarray]:
    """Coordinate matrices from coordinate vectors (numpy's ``meshgrid``).

    At most one input may be split; the outputs are then split along the axis that input spans
    (with ``indexing="xy"`` the first two inputs span axes 1 and 0). Each rank builds its own part
    from its piece of the split input and the whole of the others (no communication). Inputs
    with more than one dimension are flattened; ``sparse=True`` returns broadcastable arrays with
    length-one axes instead of full grids."""
    if indexing not in ("xy", "ij"):
        raise ValueError(f"meshgrid: indexing must be 'xy' or 'ij', got {indexing!r}")
    if not arrays:
        return []
    vecs = []
    for a in arrays:
        if not isinstance(a, DNDarray):
            a = array(a)
        vecs.append(a)
    if len(vecs) == 1:  # a new array, as numpy's (copy=True): writing to it leaves the input
        return [vecs[0].copy() if vecs[0].ndim == 1 else vecs[0].flatten()]
    comm = vecs[0].comm
    for v in vecs[1:]:
        if v.comm is not comm and v.comm.handle != comm.handle:
            raise ValueError("meshgrid: arrays live on different communicators")
    if len({v.device for v in vecs}) > 1:
        raise ValueError("meshgrid: arrays are on different devices")
    split_inputs = [i for i, v in enumerate(vecs) if v.split is not None and v.ndim > 0]
    if len(split_inputs) > 1:
        raise ValueError("meshgrid: at most one input may be split (resplit the others to None)")
    vecs = [v if v.ndim == 1 else v.flatten() for v in vecs]
    nd = len(vecs)
    axes = list(range(nd))
    if indexing == "xy":
        axes[0], axes[1] = 1, 0
    shape = [0] * nd
    for v, ax in zip(vecs, axes):
        shape[ax] = v.gshape[0]
    split = counts = None
    lshape = list(shape)
    if split_inputs:
        lead = vecs[split_inputs[0]]
        split, counts = axes[split_inputs[0]], lead.counts
        lshape[split] = lead.lshape[0]
    out = []
    for v, ax in zip(vecs, axes):
        view = [1] * nd
        view[ax] = v.lshape[0]
        t = v.larray.reshape(view)
        if sparse:
            vshape = [1] * nd
            vshape[ax] = shape[ax]
            s = split if split == ax else None
            out.append(DNDarray._make(t.clone(), tuple(vshape), s,
                                      counts if s is not None else None, comm))
        else:
            out.append(DNDarray._make(t.expand(lshape).clone(), tuple(shape), split, counts,
                                      comm))
    return out


def _tensor_from_dlpack(obj: object) -> torch.Tensor:
    try:
        return torch.from_dlpack(obj)
    except (TypeError, AttributeError, RuntimeError, BufferError) as exc:
        if isinstance(exc, BufferError):
            raise
        raise TypeError(f"from_dlpack: {type(obj).__name__} does not implement the DLPack "
                        f"protocol usable by torch ({exc})") from None


def from_dlpack(x: object, is_split: int | None = None,
                comm: MPICommunication | None = None) -> DNDarray:
    """A DNDarray sharing the memory of ``x``, any object implementing ``__dlpack__`` (torch
    tensors, numpy and cupy arrays, a non-distributed DNDarray, ...): no copy is made.

    By default ``x`` is the whole array on every rank (the result is replicated, no
    communication). ``is_split=k``: ``x`` is this rank's piece of an array concatenated along
    ``k`` (one ``allgather`` of the pieces' shapes and dtypes, as in :func:`array`). A
    distributed DNDarray has no single buffer: ``BufferError``."""
    comm = sanitize_comm(comm)
    if is_split is not None:  # array() checks each rank's piece on every rank
        error = None
        try:
            t = _tensor_from_dlpack(x)
        except (TypeError, BufferError) as bad:
            error = bad
        if error is not None:
            gather_or_raise(None, error, comm, "array(is_split=...): the pieces' shapes",
                            kinds=(BufferError,))
        return array(t, copy=False, is_split=is_split, device=t.device.type, comm=comm)
    t = _tensor_from_dlpack(x)
    canonical_dtype(t.dtype)
    return DNDarray._make(t, tuple(t.shape), None, None, comm)


_PARTITION_KEYS = ("shape", "partition_tiling", "partitions", "locals", "get")


def from_partition_dict(parted: dict, comm: MPICommunication | None = None) -> DNDarray:
    """A DNDarray from a ``__partitioned__`` dictionary (the distributed array protocol), using
    the local partitions' memory without copying where possible.

    The dictionary holds ``shape`` (global), ``partition_tiling`` (partitions per axis),
    ``partitions`` (``{tile index: {"start", "shape", "data", "location"}}``), ``locals`` (the tile
    indices held by this rank) and ``get`` (turns a partition's ``data`` handle into its data).
    At most one axis may be tiled (DNDarrays have one split axis), and the ranks must hold the
    tiles in rank order (rank 0 the first ones along that axis, ...), each rank a contiguous run;
    a tiling of 1 everywhere whose one partition every rank holds gives a replicated array.
    Every rank reads the layout from the same metadata; for a split layout one small allgather
    checks each rank's data against it (shape and dtype). Missing keys, a layout that cannot be
    represented or data that contradicts it on any rank raise ``RuntimeError`` on every rank."""
    comm = sanitize_comm(comm)
    if not isinstance(parted, dict):
        raise TypeError(f"from_partition_dict expects a dict, got {type(parted).__name__}")
    missing = [k for k in _PARTITION_KEYS if k not in parted]
    if missing:
        raise RuntimeError(f"__partitioned__ dictionary lacks the key(s) {missing}")
    shape = tuple(int(s) for s in parted["shape"])
    tiling = tuple(int(t) for t in parted["partition_tiling"])
    parts = parted["partitions"]
    if len(tiling) != len(shape):
        raise RuntimeError(f"partition_tiling {tiling} does not match the shape {shape}")
    tiled = [i for i, t in enumerate(tiling) if t > 1]
    if len(tiled) > 1:
        raise RuntimeError(f"partitions tiled along several axes {tiled} cannot be represented "
                           "by a DNDarray (one split axis)")
    keys = sorted(parts, key=lambda key: tuple(parts[key]["start"]))
    for key in keys:
        p = parts[key]
        if any(f not in p for f in ("start", "shape", "location")):
            raise RuntimeError(f"partition {key} lacks start, shape or location")
    get = parted["get"]
    mine = [tuple(k) if isinstance(k, (tuple, list)) else (k,) for k in parted["locals"]]
    if not tiled and len(keys) == 1 and len(parts[keys[0]]["location"]) >= comm.size:
        data = get(parts[keys[0]]["data"])
        t = data if isinstance(data, torch.Tensor) else _tensor_from_dlpack(data)
        if tuple(t.shape) != shape:
            raise RuntimeError(f"the partition's data has shape {tuple(t.shape)}, not {shape}")
        return DNDarray._make(t, shape, None, None, comm)
    split = tiled[0] if tiled else 0
    counts = [0] * comm.size
    last_owner, last_end = -1, 0
    for key in keys:
        p = parts[key]
        owner = int(p["location"][0])
        start, pshape = tuple(p["start"]), tuple(p["shape"])
        if not 0 <= owner < comm.size:
            raise RuntimeError(f"partition {key} is located on rank {owner}, outside the "
                               f"communicator of {comm.size} ranks")
        if owner < last_owner or start[split] != last_end:
            raise RuntimeError("the partitions are not held in rank order along the split axis; "
                               "redistribute them first")
        counts[owner] += pshape[split]
        last_owner, last_end = owner, start[split] + pshape[split]
    if last_end != shape[split]:
        raise RuntimeError(f"the partitions cover {last_end} of {shape[split]} indices of axis "
                           f"{split}")
    mine_set = set(mine)
    local = [parts[k] for k in keys if tuple(k) in mine_set]

    def local_tensor() -> torch.Tensor:
        tensors = []
        for p in local:
            data = get(p["data"])
            tensors.append(data if isinstance(data, torch.Tensor) else _tensor_from_dlpack(data))
        if not tensors:
            lshape = list(shape)
            lshape[split] = 0
            named = [parts[k]["dtype"] for k in keys if "dtype" in parts[k]]
            dt = canonical_dtype(named[0]) if named else torch.get_default_dtype()
            return torch.empty(lshape, dtype=dt)
        t = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=split)
        canonical_dtype(t.dtype)
        if tuple(t.shape[:split] + t.shape[split + 1:]) != shape[:split] + shape[split + 1:] \
                or t.shape[split] != counts[comm.rank]:
            raise RuntimeError(f"rank {comm.rank} holds data of shape {tuple(t.shape)}, the "
                               f"partitions say {counts[comm.rank]} indices of axis {split} of "
                               f"{shape}")
        return t

    error, t = None, None
    try:
        t = local_tensor()
    except (TypeError, ValueError, RuntimeError, BufferError) as bad:
        error = RuntimeError(str(bad))
    dtypes = gather_or_raise(None if error else str(t.dtype), error, comm,
                             "from_partition_dict: the local data")
    if len(set(dtypes)) > 1:
        raise RuntimeError(f"the ranks' partitions have different dtypes: {dtypes}")
    return DNDarray._make(t, shape, split, counts, comm)


def from_partitioned(x: object, comm: MPICommunication | None = None) -> DNDarray:
    """A DNDarray from any object implementing the ``__partitioned__`` protocol (see
    :func:`from_partition_dict`), sharing its local partitions' memory."""
    try:
        parted = x.__partitioned__  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"{type(x).__name__} does not implement __partitioned__") from None
    return from_partition_dict(parted, comm=comm)
