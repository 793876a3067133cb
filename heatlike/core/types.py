"""Element types of DNDarrays.

Every DNDarray holds a torch dtype. Wherever a dtype is accepted, these are understood: a
``torch.dtype``, a numpy dtype or scalar type (``np.float64``), a name (``"float32"``, ``"f8"``,
``"bfloat16"``) and the Python types ``bool``, ``int`` (int64), ``float`` (torch's default float
type, float32 unless changed) and ``complex`` (the matching complex type). Arithmetic promotes
with torch's rules (``torch.result_type``), which agree with numpy 2 for arrays of the same kind
and treat Python scalars as "weak" like numpy 2 does.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "bool_", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex64", "complex128",
    "canonical_dtype", "numpy_dtype", "is_bool", "is_integer", "is_floating", "is_complex",
    "promote_types", "can_cast", "result_type",
]

bool_ = torch.bool
uint8 = torch.uint8
int8 = torch.int8
int16 = torch.int16
int32 = torch.int32
int64 = torch.int64
float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64
complex64 = torch.complex64
complex128 = torch.complex128

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
    if dtype is bool:
        return torch.bool
    if dtype is int:
        return torch.int64
    if dtype is float:
        return torch.get_default_dtype()
    if dtype is complex:
        return torch.complex128 if torch.get_default_dtype() is torch.float64 \
            else torch.complex64
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return torch.bfloat16
    try:
        npd = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(f"data type {dtype!r} not understood") from None
    out = _FROM_NUMPY.get(npd if npd.isnative else npd.newbyteorder("="))
    if out is None:
        raise TypeError(f"data type {npd} is not supported by DNDarray")
    return out


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of ``dtype`` (bfloat16 has none and maps to float32)."""
    if dtype is torch.bfloat16:
        return np.dtype(np.float32)
    return _TO_NUMPY[canonical_dtype(dtype)]


def is_bool(dtype: torch.dtype) -> bool:
    return dtype is torch.bool


def is_integer(dtype: torch.dtype) -> bool:
    """Integer types, bool excluded."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def is_complex(dtype: torch.dtype) -> bool:
    return dtype.is_complex


def promote_types(a: object, b: object) -> torch.dtype:
    """The smallest dtype both ``a`` and ``b`` convert to without loss (torch's table)."""
    return torch.promote_types(canonical_dtype(a), canonical_dtype(b))


def can_cast(from_: object, to: object) -> bool:
    """Whether torch's casting rules allow ``from_`` -> ``to`` in an in-place operation."""
    return torch.can_cast(canonical_dtype(from_), canonical_dtype(to))


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
        elif isinstance(op, (bool, int, float, complex)):
            scalars.append(op)
        elif isinstance(op, np.generic):
            tensors.append(canonical_dtype(op.dtype))
        else:
            tensors.append(canonical_dtype(op))
    if not tensors:
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
