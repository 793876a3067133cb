"""Mapping between torch dtypes and MPI datatypes, and which reduction ops are valid for which.

Every element type is sent with a *predefined* MPI datatype, so the wrapper never creates (and so
can never leak) derived datatypes:

* types MPI knows (floats, integers, bool, complex) use their MPI counterpart;
* float16 / bfloat16 move as unsigned 16-bit integers: exact for moving data and defined in every
  library. mpi4py names ``MPI.FLOAT16_T`` even where the loaded library has no such type (Open
  MPI 4.1 rejects it with ``MPI_ERR_TYPE``), and reductions of half types never use MPI's
  arithmetic anyway: they accumulate in float32 (see ``_halfreduce``);
* any other fixed-size torch dtype (float8, complex32, ...) travels as an unsigned integer of the
  same size; it can be moved but not reduced.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

__all__ = [
    "HALF_DTYPES",
    "mpi_type",
    "reduction_type",
    "op_name",
    "is_predefined_op",
]


#: half-precision dtypes whose reductions the wrapper computes itself with float32 accumulation
HALF_DTYPES = (torch.float16, torch.bfloat16)

_UNSIGNED_BY_SIZE = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}

# element types MPI can do arithmetic on; half types are listed separately below
_ARITH: dict[torch.dtype, MPI.Datatype] = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _ARITH[getattr(torch, _name)] = _UNSIGNED_BY_SIZE[getattr(torch, _name).itemsize]

_TRANSFER: dict[torch.dtype, MPI.Datatype] = dict(_ARITH)
_TRANSFER[torch.bool] = MPI.C_BOOL
_TRANSFER[torch.float16] = MPI.UINT16_T
_TRANSFER[torch.bfloat16] = MPI.UINT16_T

_INTEGER = {
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
}
_FLOAT = {torch.float32, torch.float64, *HALF_DTYPES}
_COMPLEX = {torch.complex64, torch.complex128}

# predefined op -> element kinds it is defined for (MPI standard, section "Predefined Reductions")
_OPS: dict[int, tuple[str, frozenset]] = {}


def _register(op: MPI.Op, name: str, kinds: set) -> None:
    _OPS[op.py2f()] = (name, frozenset(kinds))


_register(MPI.SUM, "SUM", _INTEGER | _FLOAT | _COMPLEX | {torch.bool})
_register(MPI.PROD, "PROD", _INTEGER | _FLOAT | _COMPLEX | {torch.bool})
_register(MPI.MIN, "MIN", _INTEGER | _FLOAT | {torch.bool})
_register(MPI.MAX, "MAX", _INTEGER | _FLOAT | {torch.bool})
_register(MPI.LAND, "LAND", _INTEGER | {torch.bool})
_register(MPI.LOR, "LOR", _INTEGER | {torch.bool})
_register(MPI.LXOR, "LXOR", _INTEGER | {torch.bool})
_register(MPI.BAND, "BAND", _INTEGER)
_register(MPI.BOR, "BOR", _INTEGER)
_register(MPI.BXOR, "BXOR", _INTEGER)
_UNSUPPORTED_PREDEFINED = {
    MPI.MINLOC.py2f(): "MINLOC",
    MPI.MAXLOC.py2f(): "MAXLOC",
    MPI.REPLACE.py2f(): "REPLACE",
    MPI.NO_OP.py2f(): "NO_OP",
}

# bool SUM / MAX are logical or, PROD / MIN logical and (numpy's and Heat's results on bool
# arrays); MPI defines only its logical ops for bool, so these go to MPI as LOR / LAND
_BOOL_OPS = {MPI.SUM.py2f(): MPI.LOR, MPI.MAX.py2f(): MPI.LOR,
             MPI.PROD.py2f(): MPI.LAND, MPI.MIN.py2f(): MPI.LAND}

# predefined op -> {dtype: MPI datatype} for the pairs MPI reduces exactly as heatlike defines
_DIRECT = {h: {d: _TRANSFER[d] for d in kinds
               if d not in HALF_DTYPES and not (d is torch.bool and h in _BOOL_OPS)}
           for h, (_, kinds) in _OPS.items()}


def mpi_op(dtype: torch.dtype, op: MPI.Op) -> MPI.Op:
    """The op handed to MPI for reducing ``dtype`` with ``op``: ``op`` itself, except that on
    bool SUM / MAX become LOR and PROD / MIN become LAND."""
    if dtype is torch.bool:
        return _BOOL_OPS.get(op.py2f(), op)
    return op

_NUMPY_TO_TORCH = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NUMPY_TO_TORCH[np.dtype(_name)] = getattr(torch, _name)


def torch_dtype_of_numpy(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype that shares ``dtype``'s memory layout, or None."""
    return _NUMPY_TO_TORCH.get(dtype)


def direct_reduction_type(dtype: torch.dtype, op: MPI.Op) -> MPI.Datatype | None:
    """The MPI datatype for reducing ``dtype`` with a predefined ``op`` that MPI computes exactly
    as heatlike defines it, or None (half types, user-defined ops, invalid pairs): the general
    path then validates and handles those."""
    if not isinstance(op, MPI.Op):
        return None
    table = _DIRECT.get(op.py2f())
    return None if table is None else table.get(dtype)


def mpi_type(dtype: torch.dtype) -> MPI.Datatype:
    """The predefined MPI datatype used to move elements of ``dtype``."""
    t = _TRANSFER.get(dtype)
    if t is None:
        size = getattr(dtype, "itemsize", None)
        t = _UNSIGNED_BY_SIZE.get(size)
        if t is None:
            raise TypeError(f"dtype {dtype} has no fixed element size MPI can move")
        _TRANSFER[dtype] = t
    return t


def is_predefined_op(op: MPI.Op) -> bool:
    return op.py2f() in _OPS or op.py2f() in _UNSUPPORTED_PREDEFINED


def op_name(op: MPI.Op) -> str:
    h = op.py2f()
    if h in _OPS:
        return _OPS[h][0]
    return _UNSUPPORTED_PREDEFINED.get(h, "user-defined op")


def reduction_type(dtype: torch.dtype, op: MPI.Op, arg: str = "op") -> MPI.Datatype:
    """The MPI datatype to reduce ``dtype`` with ``op``; raises TypeError if ``op`` is undefined
    for it.

    User-defined ops (``MPI.Op.Create``) are accepted for every dtype; for half types they see
    float32 values (the wrapper reduces half types in float32).
    """
    if not isinstance(op, MPI.Op):
        raise TypeError(f"{arg} must be an mpi4py MPI.Op (e.g. MPI.SUM), got {type(op).__name__}")
    h = op.py2f()
    if h in _UNSUPPORTED_PREDEFINED:
        raise TypeError(f"{arg}: MPI.{_UNSUPPORTED_PREDEFINED[h]} is not supported by heatlike "
                        "reductions (use MIN/MAX with an index tensor instead)")
    entry = _OPS.get(h)
    if entry is not None and dtype not in entry[1]:
        raise TypeError(f"{arg}: MPI.{entry[0]} is not defined for dtype {dtype}")
    if dtype in HALF_DTYPES:
        return MPI.FLOAT
    if dtype is torch.bool:
        return MPI.C_BOOL
    t = _ARITH.get(dtype)
    if t is None:
        raise TypeError(f"{arg}: dtype {dtype} cannot be reduced over MPI")
    return t
