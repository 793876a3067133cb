"""Elementwise operations with numpy broadcasting over DNDarrays of any layouts.

Operands are DNDarrays, torch tensors and numpy arrays (replicated values every rank holds
entirely) and numbers. Python lists and tuples are not operands of the arithmetic functions and
operators (as in Heat: wrap them with :func:`heatlike.array`); ``where``, ``clip`` and ``isclose``
accept them. The result shape is numpy's broadcast shape. Its layout is that of the first
DNDarray operand whose split axis is not broadcast (the *leader*); without one the result is
replicated. Every other operand is brought to the leader's layout before the local torch
operation:

* replicated operands are cut locally to the leader's range (no communication);
* an operand split along the same axis with the same counts is used as is;
* one split along the same axis with other counts is rebalanced to the leader's (``Alltoallv``);
* one split along another axis is resplit to the leader's axis and counts (``Alltoallv``);
* one whose split axis is broadcast or absent in the leader's axis is replicated
  (``Allgatherv``).

Every function takes ``out=`` (a DNDarray of the broadcast shape: the result is brought to its
layout, cast to its dtype under numpy's same-kind rule, and written into its local tensor) and
the binary ones ``where=`` (a boolean array broadcast to the result: elsewhere ``out`` keeps its
values, or the result holds zeros without ``out``). The in-place methods (``x.add_(y)``,
``x += y``, ...) write into ``x``'s local tensor and keep its layout.

Shape and device checks use only metadata every rank shares, so errors are raised on every rank
before anything is sent. Dtypes follow torch's promotion (``heatlike.core.types``), except for
the one dtype rule there: floating-point functions of integer inputs (``sqrt``, ``exp``, ...,
true division, ``arctan2``, ``hypot``) return :func:`heatlike.core.types.float_result_type`
(float64 for int32/int64, float32 for the smaller integer types and bool).

``equal(x, y)`` is Heat's: one bool, whether the arrays are equal everywhere (broadcasting);
the elementwise comparison is ``eq`` / ``==``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from . import distribution
from .communication import MPICommunication, get_comm
from .devices import torch_device
from .dndarray import DNDarray
from .types import canonical_dtype, float_result_type

__all__ = [
    "add", "subtract", "sub", "multiply", "mul", "divide", "div", "true_divide", "floor_divide",
    "floordiv", "remainder", "mod", "fmod", "power", "pow", "divmod", "maximum", "minimum",
    "fmax", "fmin", "arctan2", "atan2", "hypot", "copysign", "gcd", "lcm",
    "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift",
    "logical_and", "logical_or", "logical_xor", "logical_not",
    "equal", "eq", "not_equal", "ne", "less", "lt", "less_equal", "le", "greater", "gt",
    "greater_equal", "ge",
    "negative", "neg", "positive", "pos", "absolute", "abs", "fabs", "sign", "sqrt", "square",
    "exp", "expm1", "exp2", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "arcsin",
    "arccos", "arctan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "arcsinh", "arccosh",
    "arctanh", "asinh", "acosh", "atanh", "deg2rad", "rad2deg", "radians", "degrees",
    "floor", "ceil", "trunc", "round", "isnan", "isinf", "isfinite", "isposinf", "isneginf",
    "signbit", "invert", "bitwise_not", "clip", "where", "isclose", "allclose", "array_equal",
    "nan_to_num", "cumsum", "cumprod", "cumproduct", "diff", "nansum", "nanprod",
    "nan", "inf", "pi", "e",
]

nan = float("nan")
inf = float("inf")
pi = float(np.pi)
e = float(np.e)

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

    def scalars_as_tensors(self, compare: bool = False) -> list:
        """The operands with Python scalars turned into 0-d tensors of the dtype torch would
        promote them to against the tensor operands (torch functions that need tensors). A
        Python integer out of that integer type's range raises OverflowError (numpy 2's rule),
        or, in a comparison (``compare``), is compared exactly."""
        tensors = [t for t in self.tensors if isinstance(t, torch.Tensor)]
        scalars = [t for t in self.tensors if not isinstance(t, torch.Tensor)]
        if tensors:
            dtype = tensors[0].dtype
            for t in tensors[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
        else:
            dtype = torch.tensor(scalars[0]).dtype
        probe = torch.empty((1,), dtype=dtype)
        for s in scalars:
            try:
                probe = torch.empty((1,), dtype=torch.result_type(probe, s))
            except (OverflowError, RuntimeError):
                if type(s) is not int:
                    raise
                # an integer beyond int64: the range check below decides
        dtype = probe.dtype
        if not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool:
            info = torch.iinfo(dtype)
            wide = [s for s in scalars if type(s) is int and not info.min <= s <= info.max]
            if wide and not compare:
                raise OverflowError(f"Python integer {wide[0]} out of bounds for "
                                    f"{str(dtype).removeprefix('torch.')}")
            if wide:  # compared exactly, as numpy does: in int64, or float64 beyond it
                big = any(not -2**63 <= s < 2**63 for s in wide)
                dtype = torch.float64 if big else torch.int64
                return [t.to(dtype) if isinstance(t, torch.Tensor) else
                        torch.tensor(t, dtype=dtype, device=self.device) for t in self.tensors]
        return [t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=dtype,
                                                                   device=self.device)
                for t in self.tensors]


def align(operands: Sequence[object], leader: DNDarray | None = None,
          sequences: bool = True) -> Aligned | None:
    """Bring ``operands`` to a common layout (module docstring); None if an operand has a type
    this module does not handle (operators then return ``NotImplemented``). ``leader``: use its
    layout (a replicated leader replicates everything). ``sequences=False``: Python lists and
    tuples are not operands (Heat's rule for arithmetic)."""
    arrays = [op for op in operands if isinstance(op, DNDarray)]
    for op in operands:
        if isinstance(op, (str, bytes)) or (not isinstance(op, DNDarray)
                                            and not isinstance(op, _SCALARS)
                                            and not _is_arraylike(op)):
            return None
        if not sequences and isinstance(op, (list, tuple)):
            return None
    if arrays:
        comm = _common_comm(arrays)
        device = arrays[0].larray.device
    else:
        comm, device = get_comm(), torch_device("cpu")
    items: list = []
    for op in operands:
        if isinstance(op, np.generic):  # typed (np.float64 is a float too): an array operand
            items.append(_to_tensor(np.asarray(op), device))
        elif isinstance(op, DNDarray) or isinstance(op, _SCALARS):
            items.append(op)
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
                scalars_ok: bool = False, name: str | None = None, out: object = None,
                where: object = True, float_result: bool = False,
                promote: bool = False) -> DNDarray:
    """``fn`` applied to the aligned local tensors of ``operands``; the result's layout is the
    leader's. ``scalars_ok``: ``fn`` accepts Python scalars where tensors are expected.
    ``float_result``: integer and bool inputs are converted to the float type of the dtype rule
    first. ``promote``: the array operands are converted to their common type first
    (:func:`_promoted`). ``out``/``where``: module docstring. ``NotImplemented`` for unsupported
    operand types (the public functions turn it into ``TypeError``)."""
    _check_out(out)
    al = align(operands, sequences=False)
    if al is None:
        return NotImplemented
    if promote:
        al.tensors = _promoted(al.tensors)
    args = al.tensors if scalars_ok else al.scalars_as_tensors(name in _COMPARISONS)
    if float_result:
        args = _floated(args)
    _probe(fn, name, args)
    return _store(al.wrap(fn(*args)), out, where, name)


_COMPARISONS = {"eq", "not_equal", "less", "less_equal", "greater", "greater_equal"}


def _promoted(args: list) -> list:
    """The tensor operands converted to their common type (``torch.promote_types``) when one of
    them is 0-d and the others are not: numpy 2 promotes numpy scalars and 0-d arrays as arrays
    of any dimension, while torch ranks a 0-d tensor below dimensioned ones of its kind, as if
    it were a Python scalar (``uint8_array + np.int64(300)`` would wrap around in uint8). Python
    scalars are not tensors here and stay weak, as in numpy 2."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dims = {t.ndim == 0 for t in tensors}
    if len(dims) < 2:
        return args
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return [a.to(dtype) if isinstance(a, torch.Tensor) else a for a in args]


def _floated(args: list) -> list:
    """The tensors converted to :func:`float_result_type` of their promoted type when that type
    is integer or bool (Python scalars are left to torch's promotion)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return args
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return args
    target = float_result_type(dtype)
    return [a.to(target) if isinstance(a, torch.Tensor) else a for a in args]


def _check_out(out: object) -> None:
    if out is not None and not isinstance(out, DNDarray):
        raise TypeError(f"out must be a DNDarray or None, got {type(out).__name__}")


def _store(res: DNDarray, out: DNDarray | None, where: object, name: str | None) -> DNDarray:
    """Apply ``where`` and write into ``out`` (module docstring); returns ``out`` or the result."""
    if out is None and where is True:
        return res
    target = res if out is None else out
    if out is not None:
        _common_comm([out, res])
        shape = _broadcast_shape([tuple(res.shape), tuple(out.shape)])
        if shape != tuple(out.shape):
            raise ValueError(f"non-broadcastable output operand with shape {tuple(out.shape)} "
                             f"doesn't match the broadcast shape {shape}")
        if not torch.can_cast(res.dtype, out.dtype):
            raise TypeError(f"Cannot cast ufunc '{name}' output from {res.dtype} to "
                            f"{out.dtype} with casting rule 'same_kind'")
    ops: list = [target, res]
    if where is not True:
        if isinstance(where, (bool, np.bool_)):
            where = builtins.bool(where)
        elif not isinstance(where, (DNDarray, np.ndarray, torch.Tensor, list, tuple)):
            raise TypeError(f"where must be a boolean array or bool, got {type(where).__name__}")
        ws = tuple(where.shape) if isinstance(where, (DNDarray, torch.Tensor)) \
            else np.shape(where)
        if _broadcast_shape([tuple(target.shape), ws]) != tuple(target.shape):
            raise ValueError(f"where of shape {ws} does not broadcast to the result's shape "
                             f"{tuple(target.shape)}")
        ops.append(where)
    al = align(ops, leader=target)
    if al is None:
        raise TypeError("where must be a boolean array or bool")
    base, value = al.tensors[0], al.tensors[1]
    dtype = target.dtype
    if where is not True:
        mask = al.tensors[2]
        mask = mask.to(torch.bool) if isinstance(mask, torch.Tensor) else \
            torch.tensor(builtins.bool(mask), device=al.device)
        old = base if out is not None else torch.zeros((), dtype=dtype, device=al.device)
        value = torch.where(mask, value.to(dtype), old.to(dtype))
    if out is None:
        return res._rewrap(value.expand(res.lshape).clone() if value.shape != res.larray.shape
                           else value)
    out.larray.copy_(value)
    return out


def _raise_unsupported(name: str, operands: Sequence[object]) -> None:
    kinds = ", ".join(type(op).__name__ for op in operands)
    raise TypeError(f"{name}: unsupported operand type(s) ({kinds}); operands must be "
                    "DNDarrays, numpy arrays, torch tensors or numbers (wrap lists with "
                    "heatlike.array)")


def _zero_safe(fn: Callable) -> Callable:
    """Integer ``fn(a, b)`` giving 0 where ``b == 0`` (numpy's result) instead of torch's
    ZeroDivisionError, which would stop only the ranks holding a zero."""
    def op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rt = torch.result_type(a, b)
        if rt is torch.bool:  # numpy's quotients and remainders of booleans are int8
            a, b, rt = a.to(torch.int8), b.to(torch.int8), torch.int8
        if rt.is_floating_point or rt.is_complex:
            return fn(a, b)
        zero = b == 0
        if not bool(zero.any()):
            return fn(a, b)
        return fn(a, torch.where(zero, torch.ones_like(b), b)).masked_fill(zero, 0)
    op.__name__ = fn.__name__
    return op


def _power(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.pow(a, b)


def _is_int_operand(v: object) -> bool:
    if isinstance(v, DNDarray):
        v = torch.empty(0, dtype=v.dtype)
    if isinstance(v, torch.Tensor):
        return not (v.dtype.is_floating_point or v.dtype.is_complex)
    if isinstance(v, np.ndarray):
        return v.dtype.kind in "biu"
    return isinstance(v, (int, np.integer))


def _check_power(x1: object, x2: object) -> None:
    if _is_int_operand(x1) and isinstance(x2, (int, np.integer)) and \
            not isinstance(x2, bool) and x2 < 0:
        raise ValueError("Integers to negative integer powers are not allowed.")


#: name -> (torch function, scalars_ok, float_result) of every binary operation
_BINARY: dict[str, tuple[Callable, bool, bool]] = {}


def _binary(fn: Callable, name: str, doc: str, scalars_ok: bool = False,
            float_result: bool = False) -> Callable:
    _BINARY[name] = (fn, scalars_ok, float_result)

    def op(x1: object, x2: object, /, out: DNDarray | None = None, *,
           where: object = True) -> DNDarray:
        if name == "power":
            _check_power(x1, x2)
        r = elementwise(fn, x1, x2, scalars_ok=scalars_ok, name=name, out=out, where=where,
                        float_result=float_result, promote=True)
        if r is NotImplemented:
            _raise_unsupported(name, (x1, x2))
        return r
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"{doc}, elementwise with broadcasting; ``out``, ``where``: module "
                  "docstring.")
    op.elementwise = "binary"  # type: ignore[attr-defined]
    return op


def binary_operator(name: str, x1: object, x2: object) -> DNDarray:
    """The operator form of binary operation ``name`` (``NotImplemented`` for operand types it
    does not handle, so Python can try the other operand)."""
    fn, scalars_ok, float_result = _BINARY[name]
    if name == "power":
        _check_power(x1, x2)
    return elementwise(fn, x1, x2, scalars_ok=scalars_ok, name=name, float_result=float_result,
                       promote=True)


def _unary(fn: Callable, name: str, doc: str, float_result: bool = False) -> Callable:
    def op(x: object, out: DNDarray | None = None) -> DNDarray:
        if not isinstance(x, DNDarray):
            if not isinstance(x, (np.ndarray, torch.Tensor)):
                raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
            x = _as_replicated(x)
        return elementwise(fn, x, name=name, out=out, float_result=float_result)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"{doc}, elementwise (local; no communication); ``out``: module docstring."
    op.elementwise = "unary"  # type: ignore[attr-defined]
    return op


def _as_replicated(x: object) -> DNDarray:
    if isinstance(x, (str, bytes)) or (not isinstance(x, _SCALARS) and not _is_arraylike(x)):
        raise TypeError(f"expected a DNDarray or array-like, got {type(x).__name__}")
    t = _to_tensor(x, torch_device("cpu"))
    return DNDarray._make(t, tuple(t.shape), None, None, get_comm())


def _gcd_lcm(fn: Callable) -> Callable:
    def op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for t in (a, b):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype is torch.bool:
                raise TypeError(f"{fn.__name__} is only defined for integer types")
        dtype = torch.promote_types(a.dtype, b.dtype)
        return fn(a.to(dtype), b.to(dtype))
    op.__name__ = fn.__name__
    return op


add = _binary(torch.add, "add", "x1 + x2")
subtract = _binary(torch.sub, "subtract", "x1 - x2")
multiply = _binary(torch.mul, "multiply", "x1 * x2")
divide = _binary(torch.true_divide, "divide", "x1 / x2 (true division: integers give floats)",
                 float_result=True)
floor_divide = _binary(_zero_safe(torch.floor_divide), "floor_divide",
                       "x1 // x2 (rounded toward -inf; integer division by 0 gives 0)")
remainder = _binary(_zero_safe(torch.remainder), "remainder",
                    "x1 % x2 (sign of x2, like numpy; integer remainder by 0 gives 0)")
fmod = _binary(_zero_safe(torch.fmod), "fmod", "C remainder of x1 / x2 (sign of x1)")
power = _binary(_power, "power", "x1 ** x2 (integers to a negative integer scalar power raise "
                "ValueError, numpy's rule)")
maximum = _binary(torch.maximum, "maximum", "the larger of x1, x2 (NaN propagates)")
minimum = _binary(torch.minimum, "minimum", "the smaller of x1, x2 (NaN propagates)")
fmax = _binary(torch.fmax, "fmax", "the larger of x1, x2 (NaN ignored)")
fmin = _binary(torch.fmin, "fmin", "the smaller of x1, x2 (NaN ignored)")
arctan2 = _binary(torch.atan2, "arctan2", "arctan(x1 / x2) in the right quadrant",
                  float_result=True)
hypot = _binary(torch.hypot, "hypot", "sqrt(x1**2 + x2**2)", float_result=True)
copysign = _binary(torch.copysign, "copysign", "|x1| with the sign of x2", float_result=True)
gcd = _binary(_gcd_lcm(torch.gcd), "gcd", "greatest common divisor of integers")
lcm = _binary(_gcd_lcm(torch.lcm), "lcm", "least common multiple of integers")
bitwise_and = _binary(torch.bitwise_and, "bitwise_and", "x1 & x2")
bitwise_or = _binary(torch.bitwise_or, "bitwise_or", "x1 | x2")
bitwise_xor = _binary(torch.bitwise_xor, "bitwise_xor", "x1 ^ x2")
left_shift = _binary(torch.bitwise_left_shift, "left_shift", "x1 << x2")
right_shift = _binary(torch.bitwise_right_shift, "right_shift", "x1 >> x2")
logical_and = _binary(torch.logical_and, "logical_and", "x1 and x2 (bool result)")
logical_or = _binary(torch.logical_or, "logical_or", "x1 or x2 (bool result)")
logical_xor = _binary(torch.logical_xor, "logical_xor", "x1 xor x2 (bool result)")
eq = _binary(torch.eq, "eq", "x1 == x2 (elementwise; ``equal`` gives one bool)")
not_equal = _binary(torch.ne, "not_equal", "x1 != x2")
less = _binary(torch.lt, "less", "x1 < x2")
less_equal = _binary(torch.le, "less_equal", "x1 <= x2")
greater = _binary(torch.gt, "greater", "x1 > x2")
greater_equal = _binary(torch.ge, "greater_equal", "x1 >= x2")

# Heat's and numpy's other names
sub, mul, div, true_divide, floordiv, mod = subtract, multiply, divide, divide, floor_divide, \
    remainder
pow = power  # noqa: A001
atan2 = arctan2
ne, lt, le, gt, ge = not_equal, less, less_equal, greater, greater_equal

negative = _unary(torch.neg, "negative", "-x")
positive = _unary(lambda t: t.clone(), "positive", "+x (a copy)")
absolute = _unary(lambda t: t.clone() if t.dtype is torch.bool else torch.abs(t), "absolute",
                  "|x| (booleans stay booleans, as in numpy)")
abs = absolute  # noqa: A001
fabs = _unary(lambda t: torch.abs(t.to(float_result_type(t.dtype))), "fabs",
              "|x| as a float")
def _sign(t: torch.Tensor) -> torch.Tensor:
    """numpy 2's sign: NaN stays NaN (torch gives 0 on CPU), z / |z| for complex z (0 at 0)."""
    if t.is_complex():
        return torch.sgn(t)
    result = torch.sign(t)
    return torch.where(torch.isnan(t), t, result) if t.is_floating_point() else result


sign = _unary(_sign, "sign", "-1, 0 or 1 (NaN for NaN; z / |z| for complex z)")
sqrt = _unary(torch.sqrt, "sqrt", "square root", float_result=True)
square = _unary(torch.square, "square", "x * x")
exp = _unary(torch.exp, "exp", "e ** x", float_result=True)
expm1 = _unary(torch.expm1, "expm1", "e ** x - 1", float_result=True)
exp2 = _unary(torch.exp2, "exp2", "2 ** x", float_result=True)
log = _unary(torch.log, "log", "natural logarithm", float_result=True)
log2 = _unary(torch.log2, "log2", "base-2 logarithm", float_result=True)
log10 = _unary(torch.log10, "log10", "base-10 logarithm", float_result=True)
log1p = _unary(torch.log1p, "log1p", "log(1 + x)", float_result=True)
sin = _unary(torch.sin, "sin", "sine", float_result=True)
cos = _unary(torch.cos, "cos", "cosine", float_result=True)
tan = _unary(torch.tan, "tan", "tangent", float_result=True)
arcsin = asin = _unary(torch.asin, "arcsin", "inverse sine", float_result=True)
arccos = acos = _unary(torch.acos, "arccos", "inverse cosine", float_result=True)
arctan = atan = _unary(torch.atan, "arctan", "inverse tangent", float_result=True)
sinh = _unary(torch.sinh, "sinh", "hyperbolic sine", float_result=True)
cosh = _unary(torch.cosh, "cosh", "hyperbolic cosine", float_result=True)
tanh = _unary(torch.tanh, "tanh", "hyperbolic tangent", float_result=True)
arcsinh = asinh = _unary(torch.asinh, "arcsinh", "inverse hyperbolic sine", float_result=True)
arccosh = acosh = _unary(torch.acosh, "arccosh", "inverse hyperbolic cosine",
                         float_result=True)
arctanh = atanh = _unary(torch.atanh, "arctanh", "inverse hyperbolic tangent",
                         float_result=True)
deg2rad = radians = _unary(torch.deg2rad, "deg2rad", "degrees to radians", float_result=True)
rad2deg = degrees = _unary(torch.rad2deg, "rad2deg", "radians to degrees", float_result=True)
floor = _unary(torch.floor, "floor", "largest integer <= x")
ceil = _unary(torch.ceil, "ceil", "smallest integer >= x")
trunc = _unary(torch.trunc, "trunc", "x rounded toward zero")
isnan = _unary(torch.isnan, "isnan", "whether x is NaN")
isinf = _unary(torch.isinf, "isinf", "whether x is +-inf")
isfinite = _unary(torch.isfinite, "isfinite", "whether x is finite")
isposinf = _unary(torch.isposinf, "isposinf", "whether x is +inf")
isneginf = _unary(torch.isneginf, "isneginf", "whether x is -inf")
signbit = _unary(torch.signbit, "signbit", "whether the sign bit is set")
logical_not = _unary(torch.logical_not, "logical_not", "not x (bool result)")
invert = _unary(torch.bitwise_not, "invert", "~x (bitwise not; logical not for bool)")
bitwise_not = invert
neg, pos = negative, positive


def round(x: DNDarray, decimals: int = 0, out: DNDarray | None = None,  # noqa: A001
          dtype: object = None) -> DNDarray:
    """x rounded to ``decimals`` decimals, halves to even (like numpy), elementwise: complex
    numbers part by part; integers unchanged for ``decimals >= 0`` and rounded to a multiple
    of ``10 ** -decimals`` below (exactly, in their own type). ``dtype``: the result's type."""
    if not isinstance(x, DNDarray):
        x = _as_replicated(x)
    if isinstance(decimals, bool) or not isinstance(decimals, (int, np.integer)):
        raise TypeError(f"decimals must be an integer, got {type(decimals).__name__}")
    t, d = x.larray, int(decimals)
    if t.is_complex():
        res = x._rewrap(torch.complex(torch.round(t.real, decimals=d),
                                      torch.round(t.imag, decimals=d)))
    elif t.is_floating_point():
        res = x._rewrap(torch.round(t, decimals=d))
    elif d < 0 and t.dtype is not torch.bool:
        res = x._rewrap(_round_integers(t, 10 ** -d))
    else:
        res = x._rewrap(t.clone())
    if dtype is not None:
        res = res.astype(canonical_dtype(dtype), copy=False)
    return _store(res, out, True, "round")


def _round_integers(t: torch.Tensor, step: int) -> torch.Tensor:
    """Integers rounded to the nearest multiple of ``step`` (a power of ten), halves to even."""
    if step > torch.iinfo(t.dtype).max:
        return torch.zeros_like(t)
    q = torch.div(t, step, rounding_mode="floor")
    rest = t - q * step
    half = step // 2
    up = (rest > half) | ((rest == half) & (q % 2 != 0))
    return (q + up.to(t.dtype)) * step


def equal(x: object, y: object) -> bool:
    """Heat's ``equal``: whether ``x`` and ``y`` (broadcast against each other) are equal
    everywhere, as one bool on every rank; ``False`` when their shapes do not broadcast. One
    ``Allreduce`` when distributed. (The elementwise comparison is :func:`eq` / ``==``.)"""
    from .reductions import all as _all

    try:
        cmp = eq(x, y)
    except ValueError:
        sx = x.shape if isinstance(x, (DNDarray, torch.Tensor)) else np.shape(x)
        sy = y.shape if isinstance(y, (DNDarray, torch.Tensor)) else np.shape(y)
        try:
            np.broadcast_shapes(tuple(sx), tuple(sy))
        except ValueError:
            return False
        raise
    return builtins.bool(_all(cmp).item())


def divmod(x1: object, x2: object, out1: DNDarray | None = None,  # noqa: A001
           out2: DNDarray | None = None, /, out: tuple = (None, None), *,
           where: object = True) -> tuple[DNDarray, DNDarray]:
    """``(x1 // x2, x1 % x2)``, elementwise with broadcasting. The outputs may be given as
    ``out1, out2`` or as ``out=(out1, out2)``, not both."""
    if not isinstance(out, tuple):
        raise TypeError(f"out must be a tuple of two DNDarrays or None, got "
                        f"{type(out).__name__}")
    if len(out) != 2:
        raise ValueError(f"out must hold two entries, got {len(out)}")
    if (out1 is not None or out2 is not None) and out != (None, None):
        raise TypeError("divmod: give the outputs either positionally or as out=, not both")
    o1, o2 = (out1, out2) if out == (None, None) else out
    return (floor_divide(x1, x2, out=o1, where=where), remainder(x1, x2, out=o2, where=where))


def clip(x: DNDarray, min: object = None, max: object = None,  # noqa: A002
         out: DNDarray | None = None) -> DNDarray:
    """x limited to ``[min, max]`` (either may be None; arrays broadcast), elementwise."""
    if min is None and max is None:
        raise ValueError("clip: at least one of min and max must be given")
    if not isinstance(x, DNDarray):
        x = _as_replicated(x)
    bounds = [b for b in (min, max) if b is not None]
    # align chooses the layout (x's where its split axis is not broadcast by a bound)
    al = align([x, *bounds])
    if al is None:
        raise TypeError("clip: bounds must be scalars or arrays")
    args = al.scalars_as_tensors()
    lo = args[1] if min is not None else None
    hi = args[-1] if max is not None else None
    return _store(al.wrap(torch.clamp(args[0], min=lo, max=hi)), out, True, "clip")


def where(condition: object, x: object = None, y: object = None) -> DNDarray:
    """``x`` where ``condition`` holds, else ``y``, elementwise with broadcasting. With only
    ``condition``: :func:`heatlike.nonzero` of it."""
    if x is None and y is None:
        from .indexing import nonzero

        return nonzero(condition)
    if x is None or y is None:
        raise TypeError("where: either both or neither of x and y should be given")
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

    a = _as_replicated(a) if isinstance(a, (list, tuple)) else a
    b = _as_replicated(b) if isinstance(b, (list, tuple)) else b
    r = elementwise(fn, a, b, name="isclose")
    if r is NotImplemented:
        _raise_unsupported("isclose", (a, b))
    return r


def allclose(a: object, b: object, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> bool:
    """Whether :func:`isclose` holds everywhere (one ``Allreduce`` when distributed)."""
    from .reductions import all as _all

    return builtins.bool(_all(isclose(a, b, rtol, atol, equal_nan)).item())


def array_equal(a: object, b: object, equal_nan: bool = False) -> bool:
    """Whether ``a`` and ``b`` have the same shape and elements."""
    from .reductions import all as _all

    sa = a.shape if isinstance(a, DNDarray) else np.shape(a)
    sb = b.shape if isinstance(b, DNDarray) else np.shape(b)
    if tuple(sa) != tuple(sb):
        return False
    a = a if isinstance(a, DNDarray) else _as_replicated(a)
    b = b if isinstance(b, DNDarray) else _as_replicated(b)
    if equal_nan:
        return allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return builtins.bool(_all(eq(a, b)).item())


def nan_to_num(x: DNDarray, nan: float = 0.0, posinf: float | None = None,
               neginf: float | None = None, out: DNDarray | None = None) -> DNDarray:
    """NaN replaced by ``nan``, +-inf by ``posinf`` / ``neginf`` (default: the largest / smallest
    finite value of the dtype), elementwise."""
    if not isinstance(x, DNDarray):
        raise TypeError(f"nan_to_num: expected a DNDarray, got {type(x).__name__}")
    return elementwise(lambda t: torch.nan_to_num(t, nan=nan, posinf=posinf, neginf=neginf), x,
                       name=None, out=out)


def _cum(x: DNDarray, axis: object, dtype: object, out: DNDarray | None, name: str,
         fn: Callable, op: MPI.Op) -> DNDarray:
    if not isinstance(x, DNDarray):
        raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
    if axis is None:
        raise NotImplementedError(f"{name} over the flattened array (axis=None) is not "
                                  "supported; flatten first")
    from .reductions import _axis_index

    if x.ndim == 0:  # numpy: a 0-d array accumulates as one of one element
        x = DNDarray._make(x.larray.reshape(1), (1,), None, None, x.comm)
    a = _axis_index(axis, x.ndim)
    _check_out(out)
    if out is not None and tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    t = x.larray if dtype is None else x.larray.to(canonical_dtype(dtype))
    local = fn(t, dim=a)
    if dtype is not None:
        local = local.to(canonical_dtype(dtype))
    if x.split == a and x.comm.size > 1:
        comm = x.comm
        last = local.narrow(a, local.shape[a] - 1, 1) if local.shape[a] else \
            torch.full(local.narrow(a, 0, 0).shape[:a] + (1,) + local.shape[a + 1:],
                       0 if op == MPI.SUM else 1, dtype=local.dtype, device=local.device)
        ends = torch.empty((comm.size, *last.shape), dtype=local.dtype, device=local.device)
        comm.Allgather(last.contiguous(), ends)
        before = ends[:comm.rank]
        if comm.rank and local.numel():
            offset = before.sum(0) if op == MPI.SUM else before.prod(0)
            # torch promotes bool and small integer totals to int64: back to the result's dtype
            local = (local + offset if op == MPI.SUM else local * offset).to(local.dtype)
    res = x._rewrap(local)
    return _store(res, out, True, name)


def cumsum(a: DNDarray, axis: int, dtype: object = None, out: DNDarray | None = None
           ) -> DNDarray:
    """Cumulative sum along ``axis`` (required). Along the split axis each rank adds the totals
    of the ranks before it (one ``Allgather`` of the last slab of every rank)."""
    return _cum(a, axis, dtype, out, "cumsum", torch.cumsum, MPI.SUM)


def cumprod(a: DNDarray, axis: int, dtype: object = None, out: DNDarray | None = None
            ) -> DNDarray:
    """Cumulative product along ``axis`` (required); see :func:`cumsum`."""
    return _cum(a, axis, dtype, out, "cumprod", torch.cumprod, MPI.PROD)


cumproduct = cumprod


def _first_of_next(x: torch.Tensor, axis: int, counts: Sequence[int],
                   comm: MPICommunication) -> torch.Tensor | None:
    """The first slab along ``axis`` of the next rank holding data, or None for the last one
    (one ``Allgather`` of every rank's first slab)."""
    rank = comm.rank
    slab_shape = x.shape[:axis] + (1,) + x.shape[axis + 1:]
    first = x.narrow(axis, 0, 1) if x.shape[axis] else \
        torch.zeros(slab_shape, dtype=x.dtype, device=x.device)
    slabs = torch.empty((comm.size, *slab_shape), dtype=x.dtype, device=x.device)
    comm.Allgather(first.contiguous(), slabs)
    for r in range(rank + 1, comm.size):
        if counts[r]:
            return slabs[r]
    return None


def diff(a: DNDarray, n: int = 1, axis: int = -1, prepend: object = None,
         append: object = None) -> DNDarray:
    """The ``n``-th discrete difference along ``axis`` (numpy's ``diff``). ``prepend`` /
    ``append``: numbers or DNDarrays joined to ``a`` along ``axis`` first. Along the split axis
    each step needs the first slab of the next rank (one ``Allgather`` of first slabs); the result
    keeps ``a``'s split axis."""
    from .manipulations import concatenate
    from .reductions import _axis_index

    if not isinstance(a, DNDarray):
        raise TypeError(f"diff: expected a DNDarray, got {type(a).__name__}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"diff: n must be an integer, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"diff: order must be non-negative but got {n}")
    ax = _axis_index(axis, a.ndim)
    if prepend is not None or append is not None:
        parts = []
        for name, v in (("prepend", prepend), ("append", append)):
            if v is None:
                parts.append(None)
                continue
            if isinstance(v, (int, float, bool, np.number)):
                shape = list(a.gshape)
                shape[ax] = 1
                from .factories import full

                v = full(tuple(shape), v, dtype=a.dtype, split=a.split if a.split != ax else None,
                         device=a.device, comm=a.comm)
            elif not isinstance(v, DNDarray):
                raise TypeError(f"diff: {name} must be a number or a DNDarray, got "
                                f"{type(v).__name__}")
            for d in range(a.ndim):
                if d != ax and (v.ndim != a.ndim or v.gshape[d] != a.gshape[d]):
                    raise ValueError(f"diff: {name} of shape {v.gshape} does not match "
                                     f"{a.gshape} outside axis {ax}")
            parts.append(v)
        ops = [p for p in (parts[0], a, parts[1]) if p is not None]
        joined = concatenate(ops, axis=ax)
        if a.split is not None and joined.split != a.split:
            joined = joined.resplit(a.split)
        a = joined
    x = a
    for _ in range(int(n)):
        if x.gshape[ax] == 0:
            break
        t = x.larray
        if x.split != ax or x.comm.size == 1:
            local = torch.diff(t, dim=ax)
            shape = list(x.gshape)
            shape[ax] -= 1
            counts = (shape[ax],) if x.split == ax else x.counts
            x = DNDarray._make(local, tuple(shape), x.split, counts, x.comm)
            continue
        nxt = _first_of_next(t, ax, x.counts, x.comm)
        ext = t if nxt is None or t.shape[ax] == 0 else torch.cat([t, nxt], dim=ax)
        hi = ext.narrow(ax, 1, ext.shape[ax] - 1) if ext.shape[ax] else ext
        lo = ext.narrow(ax, 0, ext.shape[ax] - 1) if ext.shape[ax] else ext
        local = (hi != lo) if t.dtype is torch.bool else hi - lo
        last = max(r for r, c in enumerate(x.counts) if c)
        counts = tuple(c - 1 if r == last else c for r, c in enumerate(x.counts))
        shape = list(x.gshape)
        shape[ax] -= 1
        x = DNDarray._make(local.contiguous(), tuple(shape), x.split, counts, x.comm)
    if x is a:
        return a.copy()
    return x


def _nan_reduce(x: DNDarray, axis: object, out: DNDarray | None, keepdims: bool, fill: float,
                name: str) -> DNDarray:
    from . import reductions

    if not isinstance(x, DNDarray):
        raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
    clean = x if not (x.dtype.is_floating_point or x.dtype.is_complex) else \
        x._rewrap(torch.nan_to_num(x.larray, nan=fill, posinf=float("inf"),
                                   neginf=float("-inf")) if not x.dtype.is_complex
                  else torch.where(torch.isnan(x.larray), torch.full_like(x.larray, fill),
                                   x.larray))
    fn = reductions.sum if fill == 0 else reductions.prod
    return fn(clean, axis, keepdims=keepdims, out=out)


def nansum(a: DNDarray, axis: object = None, out: DNDarray | None = None,
           keepdims: bool = False) -> DNDarray:
    """Sum over ``axis`` treating NaN as zero."""
    return _nan_reduce(a, axis, out, keepdims, 0.0, "nansum")


def nanprod(a: DNDarray, axis: object = None, out: DNDarray | None = None,
            keepdims: bool = False) -> DNDarray:
    """Product over ``axis`` treating NaN as one."""
    return _nan_reduce(a, axis, out, keepdims, 1.0, "nanprod")


_INPLACE_EXTRA = {"divide", "true_divide"}


def inplace(name: str, x: DNDarray, other: object) -> DNDarray:
    """``x op= other`` for the binary operation ``name``: ``other`` is brought to ``x``'s layout
    and the result written into ``x``'s local tensor. ``TypeError`` when the result type cannot
    be cast to ``x.dtype`` (numpy's same-kind rule), ``ValueError`` when the result does not
    have ``x``'s shape; ``NotImplemented`` for unsupported operand types."""
    fn, _, float_result = _BINARY[name]
    if name == "power":
        _check_power(x, other)
    al = align([x, other], leader=x, sequences=False)
    if al is None:
        return NotImplemented
    if al.shape != x.shape:
        raise ValueError(f"non-broadcastable output operand with shape {x.shape} doesn't match "
                         f"the broadcast shape {al.shape}")
    args = al.scalars_as_tensors()
    if float_result:
        args = _floated(args)
    _probe(fn, name, args)
    mine, theirs = args
    result = torch.result_type(mine, theirs)
    if not torch.can_cast(result, x.dtype):
        raise TypeError(f"Cannot cast ufunc '{name}' output from {result} to {x.dtype} with "
                        "casting rule 'same_kind'")
    x.larray.copy_(fn(mine, theirs))
    return x


def inplace_method(name: str, x: DNDarray, other: object) -> DNDarray:
    """``x.<name>_(other)``: :func:`inplace`, raising ``TypeError`` for unsupported operands."""
    r = inplace(name, x, other)
    if r is NotImplemented:
        _raise_unsupported(name + "_", (x, other))
    return r


def inplace_unary(x: DNDarray, fn: Callable[[torch.Tensor], torch.Tensor], name: str
                  ) -> DNDarray:
    """``x`` overwritten with ``fn`` of its local tensor (cast back to ``x.dtype``)."""
    out = fn(x.larray)
    if not torch.can_cast(out.dtype, x.dtype):
        raise TypeError(f"Cannot cast ufunc '{name}' output from {out.dtype} to {x.dtype} "
                        "with casting rule 'same_kind'")
    x.larray.copy_(out)
    return x
