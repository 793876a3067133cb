"""Element types of DNDarrays.

Every DNDarray holds a torch dtype (``x.dtype`` is a ``torch.dtype``). Wherever a dtype is
accepted, these are understood: a ``torch.dtype``; heatlike's type classes (``heatlike.float32``,
``heatlike.int``, ...: Heat's names, below); a numpy dtype or scalar type (``np.float64``); a name
(``"float32"``, ``"f8"``, ``"bfloat16"``); and the Python types ``bool``, ``int`` (int64), ``float``
(torch's default float type, float32 unless changed) and ``complex`` (the matching complex type).

The type classes are Heat's: a hierarchy ``datatype > number > integer > signedinteger /
unsignedinteger``, ``number > floating``, ``number > complexfloating``, ``datatype > bool`` with
one class per element type and Heat's aliases (``int`` is int32, ``long`` int64, ``float`` and
``float_`` float32, ``double`` float64, ``half`` float16, ``byte`` int8, ``ubyte`` uint8, ``short``
int16, ``cfloat``/``csingle`` complex64, ``cdouble`` complex128, ``bool_`` bool). A class compares
equal to (and hashes like) its torch dtype, so ``x.dtype == heatlike.float32`` holds for a float32
array; ``heatlike.float32(obj)`` converts ``obj`` (a DNDarray keeps its layout) to a float32
DNDarray; ``heatlike.float32.torch_type()`` is ``torch.float32``.

Binary arithmetic promotes with torch's rules (``torch.result_type``), which agree with numpy 2
for arrays of the same kind and treat Python scalars as "weak" like numpy 2 does.

Float results of integer inputs (the one dtype rule): an operation that turns integer or bool
inputs into floating-point values by itself (``sqrt``, ``exp``, ``log``, ``sin``, ``tanh``, ...,
true division, ``arctan2``, ``hypot``, ``mean``, ``var``, ``std``) returns
:func:`float_result_type` of the inputs' (promoted) type: the smallest float type that holds
every value of that type exactly, and never less than torch's default float type. That is
float64 for int32 and int64 (as numpy; torch gives float32, Heat float32 for int32), and float32
for bool, uint8, int8 and int16 (numpy gives float16 for the 8-bit types). When a float operand is
involved (``x * 0.5``, ``x + float_array``), torch's promotion applies instead.
"""

from __future__ import annotations

import builtins

import numpy as np
import torch

__all__ = [
    # Heat's type classes and aliases
    "datatype", "number", "integer", "signedinteger", "unsignedinteger", "floating",
    "complexfloating", "flexible",
    "bool", "bool_", "uint8", "ubyte", "int8", "byte", "int16", "short", "int32", "int", "int64",
    "long", "float16", "half", "bfloat16", "float32", "float", "float_", "float64", "double",
    "complex64", "cfloat", "csingle", "complex128", "cdouble",
    # functions
    "canonical_dtype", "numpy_dtype", "is_bool", "is_integer", "is_floating", "is_complex",
    "promote_types", "can_cast", "result_type", "float_result_type",
    "canonical_heat_type", "heat_type_of", "heat_type_is_exact", "heat_type_is_inexact",
    "heat_type_is_realfloating", "heat_type_is_complexfloating", "issubdtype", "isdtype",
    "iscomplex", "isreal", "finfo", "iinfo", "astype",
]


class _TypeMeta(type):
    """Metaclass of the type classes: a concrete class equals and hashes like its torch dtype."""

    _torch: torch.dtype | None

    def __eq__(cls, other: object) -> builtins.bool:
        if isinstance(other, torch.dtype):
            return cls._torch is not None and cls._torch is other
        return cls is other

    def __ne__(cls, other: object) -> builtins.bool:
        return not _TypeMeta.__eq__(cls, other)

    def __hash__(cls) -> builtins.int:
        return hash(cls._torch) if cls._torch is not None else id(cls)


class datatype(metaclass=_TypeMeta):
    """Base of heatlike's type classes. Calling a concrete class converts its argument to a
    DNDarray of that type: ``heatlike.float32(x)`` (a DNDarray keeps its layout; anything else is
    passed to :func:`heatlike.array` with ``device`` and ``comm``; no argument: a 0-d zero)."""

    _torch: torch.dtype | None = None
    _char: str | None = None

    def __new__(cls, *value: object, device: object = None, comm: object = None):  # type: ignore
        from .dndarray import DNDarray
        from .factories import array

        if cls._torch is None:
            raise TypeError(f"cannot create '{cls.__name__}' instances: it is an abstract type")
        if len(value) > 1:
            raise TypeError(f"{cls.__name__}() takes at most 1 argument ({len(value)} given)")
        obj = value[0] if value else 0
        if isinstance(obj, DNDarray):
            out = obj.astype(cls._torch)
            return out if device is None else out.to(device)
        return array(obj, dtype=cls._torch, device=device, comm=comm)

    @classmethod
    def torch_type(cls) -> torch.dtype:
        """The torch dtype of this type (``NotImplemented`` for abstract types, as in Heat)."""
        return cls._torch if cls._torch is not None else NotImplemented

    @classmethod
    def char(cls) -> str:
        """numpy's one-letter code of this type (``NotImplemented`` for abstract types)."""
        return cls._char if cls._char is not None else NotImplemented


class bool_(datatype):
    _torch, _char = torch.bool, "?"


class number(datatype):
    """Abstract: the numeric types (every type but bool), for ``issubdtype``."""


class integer(number):
    """Abstract: the signed and unsigned integer types."""


class signedinteger(integer):
    """Abstract: int8, int16, int32, int64."""


class unsignedinteger(integer):
    """Abstract: uint8."""


class floating(number):
    """Abstract: float16, bfloat16, float32, float64."""


class complexfloating(number):
    """Abstract: complex64, complex128."""


class flexible(datatype):
    """Abstract: Heat's placeholder for non-numeric types; no DNDarray has one."""


class int8(signedinteger):
    _torch, _char = torch.int8, "b"


class int16(signedinteger):
    _torch, _char = torch.int16, "h"


class int32(signedinteger):
    _torch, _char = torch.int32, "i"


class int64(signedinteger):
    _torch, _char = torch.int64, "l"


class uint8(unsignedinteger):
    _torch, _char = torch.uint8, "B"


class float16(floating):
    _torch, _char = torch.float16, "e"


class bfloat16(floating):
    _torch, _char = torch.bfloat16, None


class float32(floating):
    _torch, _char = torch.float32, "f"


class float64(floating):
    _torch, _char = torch.float64, "d"


class complex64(complexfloating):
    _torch, _char = torch.complex64, "F"


class complex128(complexfloating):
    _torch, _char = torch.complex128, "D"


for _cls in (datatype, bool_, number, integer, signedinteger, unsignedinteger, floating,
             complexfloating, flexible, int8, int16, int32, int64, uint8, float16, bfloat16,
             float32, float64, complex64, complex128):
    _cls.__module__ = "heatlike"

_CONCRETE = (bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64,
             complex64, complex128)
_CLASS_OF = {c._torch: c for c in _CONCRETE}

_FROM_NUMPY = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
_TO_NUMPY = {t: n for n, t in _FROM_NUMPY.items()}
_SUPPORTED = frozenset(_FROM_NUMPY.values()) | {torch.bfloat16}


def canonical_dtype(dtype: object) -> torch.dtype:
    """The torch dtype meant by ``dtype``; ``TypeError`` if it names no supported type."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _SUPPORTED:
            raise TypeError(f"data type {dtype} is not supported by DNDarray")
        return dtype
    if isinstance(dtype, _TypeMeta):
        if dtype._torch is None:
            raise TypeError(f"data type {dtype.__name__} is abstract; name a concrete type "
                            "(e.g. heatlike.float32)")
        return dtype._torch
    if dtype is builtins.bool:
        return torch.bool
    if dtype is builtins.int:
        return torch.int64
    if dtype is builtins.float:
        return torch.get_default_dtype()
    if dtype is builtins.complex:
        return torch.complex128 if torch.get_default_dtype() is torch.float64 \
            else torch.complex64
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return torch.bfloat16
    if dtype is None:
        raise TypeError("data type None not understood")
    try:
        npd = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(f"data type {dtype!r} not understood") from None
    out = _FROM_NUMPY.get(npd if npd.isnative else npd.newbyteorder("="))
    if out is None:
        raise TypeError(f"data type {npd} is not supported by DNDarray")
    return out


def canonical_heat_type(a_type: object) -> type[datatype]:
    """The type class (``heatlike.float32``, ...) of any dtype spelling :func:`canonical_dtype`
    understands."""
    return _CLASS_OF[canonical_dtype(a_type)]


def numpy_dtype(dtype: object) -> np.dtype:
    """The numpy dtype of ``dtype`` (bfloat16 has none and maps to float32)."""
    dtype = canonical_dtype(dtype)
    if dtype is torch.bfloat16:
        return np.dtype(np.float32)
    return _TO_NUMPY[dtype]


def is_bool(dtype: torch.dtype) -> builtins.bool:
    return canonical_dtype(dtype) is torch.bool


def is_integer(dtype: torch.dtype) -> builtins.bool:
    """Integer types, bool excluded."""
    dtype = canonical_dtype(dtype)
    return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool


def is_floating(dtype: torch.dtype) -> builtins.bool:
    return canonical_dtype(dtype).is_floating_point


def is_complex(dtype: torch.dtype) -> builtins.bool:
    return canonical_dtype(dtype).is_complex


def heat_type_is_exact(ht_dtype: object) -> builtins.bool:
    """Whether the type is an integer or bool type."""
    d = canonical_dtype(ht_dtype)
    return not (d.is_floating_point or d.is_complex)


def heat_type_is_inexact(ht_dtype: object) -> builtins.bool:
    """Whether the type is a floating-point or complex type."""
    return not heat_type_is_exact(ht_dtype)


def heat_type_is_realfloating(ht_dtype: object) -> builtins.bool:
    return canonical_dtype(ht_dtype).is_floating_point


def heat_type_is_complexfloating(ht_dtype: object) -> builtins.bool:
    return canonical_dtype(ht_dtype).is_complex


def _dtype_of(obj: object) -> torch.dtype:
    """The dtype of an array, tensor, scalar or dtype spelling."""
    from .dndarray import DNDarray

    if isinstance(obj, (DNDarray, torch.Tensor)):
        return obj.dtype
    if isinstance(obj, (np.ndarray, np.generic)):
        return canonical_dtype(obj.dtype)
    if isinstance(obj, builtins.bool):
        return torch.bool
    if isinstance(obj, builtins.int):
        return torch.int64
    if isinstance(obj, builtins.float):
        return torch.get_default_dtype()
    if isinstance(obj, builtins.complex):
        return canonical_dtype(builtins.complex)
    if isinstance(obj, (list, tuple)):
        return torch.tensor(obj).dtype if obj else torch.get_default_dtype()
    return canonical_dtype(obj)


def heat_type_of(obj: object) -> type[datatype]:
    """The type class of a DNDarray, tensor, numpy array, scalar, (nested) list or dtype."""
    try:
        return _CLASS_OF[_dtype_of(obj)]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"data type of {type(obj).__name__} is not understood") from None


def issubdtype(arg1: object, arg2: object) -> builtins.bool:
    """Whether type ``arg1`` is ``arg2`` or below it in the type hierarchy
    (``issubdtype(heatlike.float32, heatlike.floating)``)."""
    def cls_of(a: object) -> type[datatype]:
        return a if isinstance(a, _TypeMeta) else canonical_heat_type(a)
    return issubclass(cls_of(arg1), cls_of(arg2))


_KINDS = {
    "bool": lambda d: d is torch.bool,
    "signed integer": lambda d: d in (torch.int8, torch.int16, torch.int32, torch.int64),
    "unsigned integer": lambda d: d is torch.uint8,
    "integral": lambda d: is_integer(d),
    "real floating": lambda d: d.is_floating_point,
    "complex floating": lambda d: d.is_complex,
    "numeric": lambda d: d is not torch.bool,
}


def isdtype(dtype: object, kind: object) -> builtins.bool:
    """The array API's ``isdtype``: whether ``dtype`` is of ``kind`` (a kind name such as
    ``"integral"`` or ``"real floating"``, a dtype, or a tuple of them)."""
    d = canonical_dtype(dtype)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if isinstance(k, str) and k in _KINDS:
            if _KINDS[k](d):
                return True
        elif isinstance(k, str) and k not in _KINDS and not _is_dtype_name(k):
            raise ValueError(f"unknown kind {k!r}; expected one of {sorted(_KINDS)} or a dtype")
        elif isinstance(k, _TypeMeta) and k._torch is None:
            if issubclass(_CLASS_OF[d], k):
                return True
        elif canonical_dtype(k) is d:
            return True
    return False


def _is_dtype_name(name: str) -> builtins.bool:
    try:
        canonical_dtype(name)
        return True
    except TypeError:
        return False


def promote_types(a: object, b: object) -> torch.dtype:
    """The smallest dtype both ``a`` and ``b`` convert to without loss (torch's table)."""
    return torch.promote_types(canonical_dtype(a), canonical_dtype(b))


def _np_or_bf16(d: torch.dtype) -> np.dtype | None:
    return None if d is torch.bfloat16 else _TO_NUMPY[d]


def can_cast(from_: object, to: object, casting: str = "torch") -> builtins.bool:
    """Whether ``from_`` (a dtype, array or scalar) may be cast to ``to``.

    ``casting="torch"`` (default): torch's rule for in-place results (``torch.can_cast``: no
    float -> integer, no complex -> real, bool only from bool). numpy's ``"no"``, ``"equiv"``,
    ``"safe"``, ``"same_kind"`` and ``"unsafe"`` are understood too (bfloat16 is safe only from
    bool and 8-bit integers, and to float32/float64/complex)."""
    src = _dtype_of(from_)
    dst = canonical_dtype(to)
    if casting == "torch":
        return torch.can_cast(src, dst)
    if casting in ("no", "equiv"):
        return src is dst
    if casting == "unsafe":
        return True
    if casting not in ("safe", "same_kind"):
        raise ValueError(f"casting must be one of 'torch', 'no', 'equiv', 'safe', 'same_kind', "
                         f"'unsafe', got {casting!r}")
    if torch.bfloat16 in (src, dst):
        if src is dst:
            return True
        if src is torch.bfloat16:
            ok = dst in (torch.float32, torch.float64, torch.complex64, torch.complex128)
            return ok or (casting == "same_kind" and dst.is_floating_point)
        ok = src in (torch.bool, torch.uint8, torch.int8)
        return ok or (casting == "same_kind" and not src.is_complex)
    return builtins.bool(np.can_cast(_np_or_bf16(src), _np_or_bf16(dst), casting=casting))


def result_type(*operands: object) -> torch.dtype:
    """The dtype of an elementwise operation on ``operands`` (DNDarrays, tensors, numpy arrays,
    Python scalars, dtypes), with torch's promotion rules; Python scalars are weak."""
    from .dndarray import DNDarray

    tensors: list[torch.dtype] = []
    scalars: list[object] = []
    for op in operands:
        if isinstance(op, DNDarray):
            tensors.append(op.dtype)
        elif isinstance(op, torch.Tensor):
            tensors.append(op.dtype)
        elif isinstance(op, np.ndarray):
            tensors.append(canonical_dtype(op.dtype))
        elif isinstance(op, (builtins.bool, builtins.int, builtins.float, builtins.complex)):
            scalars.append(op)
        elif isinstance(op, np.generic):
            tensors.append(canonical_dtype(op.dtype))
        else:
            tensors.append(canonical_dtype(op))
    if not tensors:
        if not scalars:
            raise ValueError("at least one array or dtype is required")
        return torch.result_type(torch.tensor(scalars[0]), scalars[1]) if len(scalars) > 1 \
            else torch.tensor(scalars[0]).dtype
    dtype = tensors[0]
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t)
    probe = torch.empty((1,), dtype=dtype)
    for s in scalars:
        dtype = torch.result_type(probe, s)
        probe = torch.empty((1,), dtype=dtype)
    return dtype


_EXACT_FLOAT = {
    torch.bool: torch.float32, torch.uint8: torch.float32, torch.int8: torch.float32,
    torch.int16: torch.float32, torch.int32: torch.float64, torch.int64: torch.float64,
}


def float_result_type(dtype: object) -> torch.dtype:
    """The dtype of a floating-point function of inputs of type ``dtype`` (the module's dtype
    rule): float and complex types are kept; integer and bool types give the smallest float type
    holding all their values exactly, at least torch's default float type."""
    d = canonical_dtype(dtype)
    if d.is_floating_point or d.is_complex:
        return d
    exact = _EXACT_FLOAT.get(d, torch.float64)
    return torch.promote_types(exact, torch.get_default_dtype())


def iscomplex(x: object) -> object:
    """Elementwise: whether the imaginary part is non-zero (all False for real arrays)."""
    from .dndarray import DNDarray

    if not isinstance(x, DNDarray):
        from .factories import array

        x = array(x)
    if x.dtype.is_complex:
        return x._rewrap(x.larray.imag != 0)
    return x._rewrap(torch.zeros(x.lshape, dtype=torch.bool, device=x.larray.device))


def isreal(x: object) -> object:
    """Elementwise: whether the imaginary part is zero (all True for real arrays)."""
    from .dndarray import DNDarray

    if not isinstance(x, DNDarray):
        from .factories import array

        x = array(x)
    if x.dtype.is_complex:
        return x._rewrap(x.larray.imag == 0)
    return x._rewrap(torch.ones(x.lshape, dtype=torch.bool, device=x.larray.device))


def astype(x: object, dtype: object, copy: bool = True) -> object:
    """``x`` (a DNDarray) converted to ``dtype`` (Heat's function; see ``DNDarray.astype``)."""
    from .dndarray import DNDarray

    if not isinstance(x, DNDarray):
        raise TypeError(f"astype: expected a DNDarray, got {type(x).__name__}")
    return x.astype(dtype, copy=copy)


def finfo(dtype: object) -> torch.finfo:
    """Machine limits of a floating-point type (``bits``, ``eps``, ``max``, ``min``, ``tiny``)."""
    d = canonical_dtype(dtype)
    if not (d.is_floating_point or d.is_complex):
        raise TypeError(f"finfo needs a floating-point type, got {d}")
    return torch.finfo(d)


def iinfo(dtype: object) -> torch.iinfo:
    """Machine limits of an integer type (``bits``, ``max``, ``min``)."""
    d = canonical_dtype(dtype)
    if d.is_floating_point or d.is_complex or d is torch.bool:
        raise TypeError(f"iinfo needs an integer type, got {d}")
    return torch.iinfo(d)


# Heat's aliases; assigned last: these names shadow the builtins in this module's namespace,
# and the functions above use ``builtins.*`` explicitly
bool = bool_  # noqa: A001
ubyte = uint8
byte = int8
short = int16
int = int32  # noqa: A001
long = int64
half = float16
float = float32  # noqa: A001
float_ = float32
double = float64
cfloat = csingle = complex64
cdouble = complex128
