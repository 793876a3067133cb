"""Elementwise operations with numpy broadcasting over DNDarrays of any layouts.

Operands are DNDarrays, torch tensors / numpy arrays / nested lists (replicated values every rank
holds entirely) and Python scalars. The result shape is numpy's broadcast shape. Its layout is
that of the first DNDarray operand whose split axis is not broadcast (the *leader*); without one
the result is replicated. Every other operand is brought to the leader's layout before the local
torch operation:

* replicated operands are cut locally to the leader's range (no communication);
* an operand split along the same axis with the same counts is used as is;
* one split along the same axis with other counts is rebalanced to the leader's (``Alltoallv``);
* one split along another axis is resplit to the leader's axis and counts (``Alltoallv``);
* one whose split axis is broadcast or absent in the leader's axis is replicated
  (``Allgatherv``).

Shape and device checks use only metadata every rank shares, so errors are raised on every rank
before anything is sent. Dtypes follow torch's promotion (``heatlike.core.types``).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import distribution
from .communication import MPICommunication, get_comm
from .devices import torch_device
from .dndarray import DNDarray
from .types import canonical_dtype

__all__ = [
    "add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "remainder", "mod",
    "fmod", "power", "pow", "maximum", "minimum", "arctan2", "hypot", "copysign",
    "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift",
    "logical_and", "logical_or", "logical_xor", "logical_not",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
    "negative", "positive", "absolute", "abs", "sign", "sqrt", "square", "exp", "expm1", "exp2",
    "log", "log2", "log10", "log1p", "sin", "cos", "tan", "arcsin", "arccos", "arctan", "sinh",
    "cosh", "tanh", "floor", "ceil", "trunc", "round", "isnan", "isinf", "isfinite", "invert",
    "bitwise_not", "clip", "where", "isclose", "allclose", "array_equal",
]

_SCALARS = (bool, int, float, complex)


def _is_arraylike(x: object) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, np.generic, list, tuple))


def _to_tensor(x: object, device: torch.device) -> torch.Tensor:
    """A replicated operand as a torch tensor on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    arr = np.asarray(x)
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"unsupported operand of dtype {arr.dtype}")
    dtype = canonical_dtype(arr.dtype)
    arr = np.require(arr, dtype=arr.dtype.newbyteorder("="), requirements="C")
    return torch.from_numpy(arr.copy()).to(device=device, dtype=dtype)


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError("operands could not be broadcast together with shapes "
                         + " ".join(str(s) for s in shapes)) from None


def _common_comm(arrays: list[DNDarray]) -> MPICommunication:
    comm = arrays[0].comm
    for a in arrays[1:]:
        if a.comm is not comm and a.comm.handle != comm.handle:
            raise ValueError("operands live on different communicators")
    devices = {a.device for a in arrays}
    if len(devices) > 1:
        raise ValueError(f"operands are on different devices: {sorted(devices)}")
    return comm


def _replicate(x: DNDarray) -> torch.Tensor:
    if x.split is None:
        return x.larray
    return distribution.move(x.larray, x.gshape, x.split, x._ranges(), None, None, x.comm)


class Aligned:
    """Operands brought to one layout: ``tensors[i]`` is operand i's local tensor (or a Python
    scalar), broadcast-compatible with the local part of a result of shape ``shape``."""

    def __init__(self, shape: tuple[int, ...], split: int | None,
                 counts: tuple[int, ...] | None, comm: MPICommunication,
                 device: torch.device, tensors: list) -> None:
        self.shape, self.split, self.counts = shape, split, counts
        self.comm, self.device, self.tensors = comm, device, tensors

    def wrap(self, local: torch.Tensor) -> DNDarray:
        return DNDarray._make(local, self.shape, self.split, self.counts, self.comm)

    def scalars_as_tensors(self) -> list:
        """The operands with Python scalars turned into 0-d tensors of the dtype torch would
        promote them to against the tensor operands (torch functions that need tensors)."""
        tensors = [t for t in self.tensors if isinstance(t, torch.Tensor)]
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        probe = torch.empty((1,), dtype=dtype)
        for s in self.tensors:
            if not isinstance(s, torch.Tensor):
                probe = torch.empty((1,), dtype=torch.result_type(probe, s))
        return [t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=probe.dtype,
                                                                   device=self.device)
                for t in self.tensors]


def align(operands: Sequence[object], leader: DNDarray | None = None) -> Aligned | None:
    """Bring ``operands`` to a common layout (module docstring); None if an operand has a type
    this module does not handle (operators then return ``NotImplemented``)."""
    arrays = [op for op in operands if isinstance(op, DNDarray)]
    for op in operands:
        if not isinstance(op, DNDarray) and not isinstance(op, _SCALARS) \
                and not _is_arraylike(op):
            return None
    if arrays:
        comm = _common_comm(arrays)
        device = arrays[0].larray.device
    else:
        comm, device = get_comm(), torch_device("cpu")
    items: list = []
    for op in operands:
        if isinstance(op, DNDarray) or isinstance(op, _SCALARS):
            items.append(op)
        elif isinstance(op, np.generic):
            items.append(_to_tensor(np.asarray(op), device))
        else:
            items.append(_to_tensor(op, device))
    shapes = [tuple(it.shape) if isinstance(it, (DNDarray, torch.Tensor)) else ()
              for it in items]
    shape = _broadcast_shape(shapes)
    ndim = len(shape)

    def out_axis(x: DNDarray) -> int:
        return x.split + ndim - x.ndim  # type: ignore[operator]

    if leader is None:
        for x in arrays:
            if x.split is not None and x.gshape[x.split] == shape[out_axis(x)]:
                leader = x
                break
    if leader is None or leader.split is None:
        split, counts = None, None
    else:
        split, counts = out_axis(leader), leader.counts
    my_range = None if split is None else leader._ranges()[comm.rank]  # type: ignore[union-attr]

    def cut(t: torch.Tensor) -> torch.Tensor:
        """The leader's range of a replicated tensor (kept whole where it broadcasts)."""
        if split is None:
            return t
        k = split - (ndim - t.ndim)
        if k < 0 or (t.shape[k] == 1 and shape[split] != 1):
            return t
        lo, hi = my_range  # type: ignore[misc]
        return t.narrow(k, lo, hi - lo)

    tensors: list = []
    for it in items:
        if isinstance(it, _SCALARS):
            tensors.append(it)
        elif isinstance(it, torch.Tensor):
            tensors.append(cut(it))
        elif it is leader or it.split is None:
            tensors.append(it.larray if it is leader else cut(it.larray))
        elif split is None or it.gshape[it.split] != shape[out_axis(it)]:
            tensors.append(cut(_replicate(it)))
        elif out_axis(it) == split:
            if it.counts == counts:
                tensors.append(it.larray)
            else:
                tensors.append(distribution.move(it.larray, it.gshape, it.split, it._ranges(),
                                                 it.split, leader._ranges(), comm))
        else:
            k = split - (ndim - it.ndim)
            if k >= 0 and it.gshape[k] == shape[split]:
                tensors.append(distribution.move(it.larray, it.gshape, it.split, it._ranges(),
                                                 k, leader._ranges(), comm))
            else:
                tensors.append(cut(_replicate(it)))
    return Aligned(shape, split, counts, comm, device, tensors)


_probed: dict = {}


def _probe(fn: Callable, name: str | None, args: Sequence) -> None:
    """Raise ``TypeError`` if ``fn`` is not defined for the operands' dtypes. Decided on one-element
    tensors of those dtypes, so every rank decides alike (an empty local part would not raise).
    Verdicts of named operations are cached."""
    key = (name, tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args))
    verdict = _probed.get(key) if name is not None else None
    if verdict is None:
        probe = [torch.ones((1,), dtype=a.dtype) if isinstance(a, torch.Tensor) else a
                 for a in args]
        try:
            fn(*probe)
            verdict = ""
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            verdict = str(exc).splitlines()[0]
        if name is not None:
            _probed[key] = verdict
    if verdict:
        kinds = ", ".join(str(k).removeprefix("torch.") for k in key[1])
        raise TypeError(f"{name or getattr(fn, '__name__', 'operation')} is not supported for "
                        f"operands of type ({kinds}): {verdict}")


def elementwise(fn: Callable[..., torch.Tensor], *operands: object,
                scalars_ok: bool = False, name: str | None = None) -> DNDarray:
    """``fn`` applied to the aligned local tensors of ``operands``; the result's layout is the
    leader's. ``scalars_ok``: ``fn`` accepts Python scalars where tensors are expected."""
    al = align(operands)
    if al is None:
        return NotImplemented
    args = al.tensors if scalars_ok else al.scalars_as_tensors()
    _probe(fn, name, args)
    return al.wrap(fn(*args))


def _zero_safe(fn: Callable) -> Callable:
    """Integer ``fn(a, b)`` giving 0 where ``b == 0`` (numpy's result) instead of torch's
    ZeroDivisionError, which would stop only the ranks holding a zero."""
    def op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rt = torch.result_type(a, b)
        if rt.is_floating_point or rt.is_complex or rt is torch.bool:
            return fn(a, b)
        zero = b == 0
        if not bool(zero.any()):
            return fn(a, b)
        return fn(a, torch.where(zero, torch.ones_like(b), b)).masked_fill(zero, 0)
    op.__name__ = fn.__name__
    return op


def _power(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.pow(a, b)


def power(x1: object, x2: object) -> DNDarray:
    """x1 ** x2, elementwise with broadcasting. Integers to a negative integer scalar power raise
    ``ValueError`` (numpy's rule)."""
    def is_int(v: object) -> bool:
        if isinstance(v, DNDarray):
            v = torch.empty(0, dtype=v.dtype)
        if isinstance(v, torch.Tensor):
            return not (v.dtype.is_floating_point or v.dtype.is_complex)
        return isinstance(v, (int, np.integer))

    if is_int(x1) and isinstance(x2, (int, np.integer)) and not isinstance(x2, bool) and x2 < 0:
        raise ValueError("Integers to negative integer powers are not allowed.")
    return elementwise(_power, x1, x2, name="power")


def _binary(fn: Callable, name: str, doc: str, scalars_ok: bool = False) -> Callable:
    def op(x1: object, x2: object) -> DNDarray:
        return elementwise(fn, x1, x2, scalars_ok=scalars_ok, name=name)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"{doc}, elementwise with broadcasting (module docstring: layouts)."
    return op


def _unary(fn: Callable, name: str, doc: str) -> Callable:
    def op(x: object) -> DNDarray:
        return elementwise(fn, x if isinstance(x, DNDarray) else _as_replicated(x), name=name)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"{doc}, elementwise (local; no communication)."
    return op


def _as_replicated(x: object) -> DNDarray:
    if not isinstance(x, _SCALARS) and not _is_arraylike(x):
        raise TypeError(f"expected a DNDarray or array-like, got {type(x).__name__}")
    t = _to_tensor(x, torch_device("cpu"))
    return DNDarray._make(t, tuple(t.shape), None, None, get_comm())


add = _binary(torch.add, "add", "x1 + x2")
subtract = _binary(torch.sub, "subtract", "x1 - x2")
multiply = _binary(torch.mul, "multiply", "x1 * x2")
divide = _binary(torch.true_divide, "divide", "x1 / x2 (true division: integers give floats)")
true_divide = divide
floor_divide = _binary(_zero_safe(torch.floor_divide), "floor_divide",
                       "x1 // x2 (rounded toward -inf; integer division by 0 gives 0)")
remainder = _binary(_zero_safe(torch.remainder), "remainder",
                    "x1 % x2 (sign of x2, like numpy; integer remainder by 0 gives 0)")
mod = remainder
fmod = _binary(_zero_safe(torch.fmod), "fmod", "C remainder of x1 / x2 (sign of x1)")
maximum = _binary(torch.maximum, "maximum", "the larger of x1, x2 (NaN propagates)")
minimum = _binary(torch.minimum, "minimum", "the smaller of x1, x2 (NaN propagates)")
arctan2 = _binary(torch.atan2, "arctan2", "arctan(x1 / x2) in the right quadrant")
hypot = _binary(torch.hypot, "hypot", "sqrt(x1**2 + x2**2)")
copysign = _binary(torch.copysign, "copysign", "|x1| with the sign of x2")
bitwise_and = _binary(torch.bitwise_and, "bitwise_and", "x1 & x2")
bitwise_or = _binary(torch.bitwise_or, "bitwise_or", "x1 | x2")
bitwise_xor = _binary(torch.bitwise_xor, "bitwise_xor", "x1 ^ x2")
left_shift = _binary(torch.bitwise_left_shift, "left_shift", "x1 << x2")
right_shift = _binary(torch.bitwise_right_shift, "right_shift", "x1 >> x2")
logical_and = _binary(torch.logical_and, "logical_and", "x1 and x2 (bool result)")
logical_or = _binary(torch.logical_or, "logical_or", "x1 or x2 (bool result)")
logical_xor = _binary(torch.logical_xor, "logical_xor", "x1 xor x2 (bool result)")
equal = _binary(torch.eq, "equal", "x1 == x2")
not_equal = _binary(torch.ne, "not_equal", "x1 != x2")
less = _binary(torch.lt, "less", "x1 < x2")
less_equal = _binary(torch.le, "less_equal", "x1 <= x2")
greater = _binary(torch.gt, "greater", "x1 > x2")
greater_equal = _binary(torch.ge, "greater_equal", "x1 >= x2")

negative = _unary(torch.neg, "negative", "-x")
positive = _unary(lambda t: t.clone(), "positive", "+x (a copy)")
absolute = _unary(torch.abs, "absolute", "|x|")
abs = absolute  # noqa: A001
sign = _unary(torch.sign, "sign", "-1, 0 or 1")
sqrt = _unary(torch.sqrt, "sqrt", "square root")
square = _unary(torch.square, "square", "x * x")
exp = _unary(torch.exp, "exp", "e ** x")
expm1 = _unary(torch.expm1, "expm1", "e ** x - 1")
exp2 = _unary(torch.exp2, "exp2", "2 ** x")
log = _unary(torch.log, "log", "natural logarithm")
log2 = _unary(torch.log2, "log2", "base-2 logarithm")
log10 = _unary(torch.log10, "log10", "base-10 logarithm")
log1p = _unary(torch.log1p, "log1p", "log(1 + x)")
sin = _unary(torch.sin, "sin", "sine")
cos = _unary(torch.cos, "cos", "cosine")
tan = _unary(torch.tan, "tan", "tangent")
arcsin = _unary(torch.asin, "arcsin", "inverse sine")
arccos = _unary(torch.acos, "arccos", "inverse cosine")
arctan = _unary(torch.atan, "arctan", "inverse tangent")
sinh = _unary(torch.sinh, "sinh", "hyperbolic sine")
cosh = _unary(torch.cosh, "cosh", "hyperbolic cosine")
tanh = _unary(torch.tanh, "tanh", "hyperbolic tangent")
floor = _unary(torch.floor, "floor", "largest integer <= x")
ceil = _unary(torch.ceil, "ceil", "smallest integer >= x")
trunc = _unary(torch.trunc, "trunc", "x rounded toward zero")
isnan = _unary(torch.isnan, "isnan", "whether x is NaN")
isinf = _unary(torch.isinf, "isinf", "whether x is +-inf")
isfinite = _unary(torch.isfinite, "isfinite", "whether x is finite")
logical_not = _unary(torch.logical_not, "logical_not", "not x (bool result)")
invert = _unary(torch.bitwise_not, "invert", "~x (bitwise not; logical not for bool)")
bitwise_not = invert


pow = power  # noqa: A001


def round(x: DNDarray, decimals: int = 0) -> DNDarray:  # noqa: A001
    """x rounded to ``decimals`` decimals, halves to even (like numpy), elementwise."""
    if not isinstance(x, DNDarray):
        x = _as_replicated(x)
    if x.dtype.is_floating_point:
        return x._rewrap(torch.round(x.larray, decimals=decimals))
    return x._rewrap(x.larray.clone())


def clip(x: DNDarray, min: object = None, max: object = None) -> DNDarray:  # noqa: A002
    """x limited to ``[min, max]`` (either may be None; arrays broadcast), elementwise."""
    if min is None and max is None:
        raise ValueError("clip: at least one of min and max must be given")
    if not isinstance(x, DNDarray):
        x = _as_replicated(x)
    bounds = [b for b in (min, max) if b is not None]
    al = align([x, *bounds], leader=x if x.split is not None else None)
    if al is None:
        raise TypeError("clip: bounds must be scalars or arrays")
    args = al.scalars_as_tensors()
    lo = args[1] if min is not None else None
    hi = args[-1] if max is not None else None
    return al.wrap(torch.clamp(args[0], min=lo, max=hi))


def where(condition: object, x: object, y: object) -> DNDarray:
    """``x`` where ``condition`` holds, else ``y``, elementwise with broadcasting."""
    def fn(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(c.to(torch.bool), a, b)

    al = align([condition, x, y])
    if al is None:
        raise TypeError("where: operands must be DNDarrays, arrays or scalars")
    c, a, b = al.tensors
    rest = Aligned(al.shape, al.split, al.counts, al.comm, al.device, [a, b])
    a, b = rest.scalars_as_tensors()
    if not isinstance(c, torch.Tensor):
        c = torch.tensor(c, device=al.device)
    return al.wrap(fn(c, a, b))


def isclose(a: object, b: object, rtol: float = 1e-05, atol: float = 1e-08,
            equal_nan: bool = False) -> DNDarray:
    """``|a - b| <= atol + rtol * |b|``, elementwise."""
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, y.dtype)
        return torch.isclose(x.to(dtype), y.to(dtype), rtol=rtol, atol=atol, equal_nan=equal_nan)

    return elementwise(fn, a, b, name="isclose")


def allclose(a: object, b: object, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> bool:
    """Whether :func:`isclose` holds everywhere (one ``Allreduce`` when distributed)."""
    from .reductions import all as _all

    return builtins.bool(_all(isclose(a, b, rtol, atol, equal_nan)).item())


def array_equal(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` have the same shape and elements."""
    from .reductions import all as _all

    sa = a.shape if isinstance(a, DNDarray) else np.shape(a)
    sb = b.shape if isinstance(b, DNDarray) else np.shape(b)
    if tuple(sa) != tuple(sb):
        return False
    return builtins.bool(_all(equal(a, b)).item())


_INPLACE: dict[str, Callable] = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul,
    "divide": torch.true_divide, "floor_divide": _zero_safe(torch.floor_divide),
    "remainder": _zero_safe(torch.remainder), "power": _power,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor,
}


def inplace(name: str, x: DNDarray, other: object) -> DNDarray:
    """``x op= other`` for the operation ``name`` (a key of ``_INPLACE``): ``other`` is brought
    to ``x``'s layout and the result written into ``x``'s local tensor. ``TypeError`` when the
    result type cannot be cast to ``x.dtype`` (numpy's same-kind rule)."""
    fn = _INPLACE[name]
    if name == "power" and isinstance(other, (int, np.integer)) and other < 0 and \
            not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise ValueError("Integers to negative integer powers are not allowed.")
    al = align([x, other], leader=x)
    if al is None:
        return NotImplemented
    if al.shape != x.shape:
        raise ValueError(f"non-broadcastable output operand with shape {x.shape} doesn't match "
                         f"the broadcast shape {al.shape}")
    mine, theirs = al.scalars_as_tensors()
    _probe(fn, name, [mine, theirs])
    result = torch.result_type(mine, theirs)
    if name == "divide" and not (result.is_floating_point or result.is_complex):
        result = torch.get_default_dtype()
    if not torch.can_cast(result, x.dtype):
        raise TypeError(f"Cannot cast ufunc '{name}' output from {result} to {x.dtype} with "
                        "casting rule 'same_kind'")
    x.larray.copy_(fn(mine, theirs))
    return x
