"""numpy and torch calling heatlike: ``__array_ufunc__``, ``__array_function__`` and
``__torch_function__`` of DNDarray.

* ``np.add(x, 1)``, ``np.sin(x)``, ``ndarray + x`` with a DNDarray operand run heatlike's
  function of the ufunc's name (:data:`UFUNCS`) and return a DNDarray. Only plain calls are
  handled: ``np.add.reduce(x)``, ``np.add.at``, ufuncs heatlike lacks (``np.heaviside``) and
  keyword arguments other than ``out`` (one DNDarray) and ``where`` make numpy raise
  ``TypeError``.
* ``np.concatenate([x, y])``, ``np.sum(x, axis=0)``, ... run the heatlike function of the same
  name with the same arguments; a function heatlike lacks (``np.array_equiv``) is a
  ``TypeError``. Where heatlike's function (Heat's signature) differs from numpy's, numpy's
  meaning is kept (:data:`_NUMPY_CALLS`): ``np.sort`` returns the values only, ``np.cumsum``
  without an axis runs over the flattened array, ``np.percentile(..., method=)``,
  ``np.unique`` sorted; options heatlike does not have (``return_counts``) are a
  ``TypeError``.
* ``torch.sum(x)``, ``torch.concatenate([x, y])`` (and tensor operators with a DNDarray operand)
  likewise run heatlike's function of the same name; others are a ``TypeError``.

These are the same collective operations as the heatlike functions: every rank calls them.
"""

from __future__ import annotations

import inspect

import numpy as np

__all__ = ["UFUNCS", "array_ufunc", "array_function", "torch_function"]

#: numpy ufunc name -> heatlike function name (where they differ from the ufunc's)
UFUNCS: dict[str, str] = {
    "add": "add", "subtract": "subtract", "multiply": "multiply", "divide": "divide",
    "true_divide": "divide", "floor_divide": "floor_divide", "remainder": "remainder",
    "mod": "remainder", "fmod": "fmod", "power": "power", "maximum": "maximum",
    "minimum": "minimum", "fmax": "fmax", "fmin": "fmin", "arctan2": "arctan2",
    "hypot": "hypot", "copysign": "copysign", "gcd": "gcd", "lcm": "lcm",
    "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor",
    "left_shift": "left_shift", "right_shift": "right_shift", "logical_and": "logical_and",
    "logical_or": "logical_or", "logical_xor": "logical_xor", "logical_not": "logical_not",
    "equal": "eq", "not_equal": "not_equal", "less": "less", "less_equal": "less_equal",
    "greater": "greater", "greater_equal": "greater_equal", "negative": "negative",
    "positive": "positive", "absolute": "absolute", "fabs": "fabs", "sign": "sign",
    "sqrt": "sqrt", "square": "square", "exp": "exp", "expm1": "expm1", "exp2": "exp2",
    "log": "log", "log2": "log2", "log10": "log10", "log1p": "log1p", "sin": "sin",
    "cos": "cos", "tan": "tan", "arcsin": "arcsin", "arccos": "arccos", "arctan": "arctan",
    "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "arcsinh": "arcsinh",
    "arccosh": "arccosh", "arctanh": "arctanh", "deg2rad": "deg2rad", "rad2deg": "rad2deg",
    "radians": "deg2rad", "degrees": "rad2deg", "floor": "floor", "ceil": "ceil",
    "trunc": "trunc", "rint": "round", "isnan": "isnan", "isinf": "isinf",
    "isfinite": "isfinite", "signbit": "signbit", "invert": "invert", "divmod": "divmod",
    "matmul": "matmul",
}

_BINARY_WHERE = {"add", "subtract", "multiply", "divide", "floor_divide", "remainder", "fmod",
                 "power", "maximum", "minimum", "fmax", "fmin", "arctan2", "hypot", "copysign",
                 "gcd", "lcm", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift",
                 "right_shift", "logical_and", "logical_or", "logical_xor", "eq", "not_equal",
                 "less", "less_equal", "greater", "greater_equal"}


def _heatlike() -> object:
    import heatlike

    return heatlike


def array_ufunc(ufunc: np.ufunc, method: str, inputs: tuple, kwargs: dict) -> object:
    """``DNDarray.__array_ufunc__`` (module docstring)."""
    if method != "__call__":
        return NotImplemented
    name = UFUNCS.get(ufunc.__name__)
    if name is None:
        return NotImplemented
    fn = getattr(_heatlike(), name)
    kw = dict(kwargs)
    out = kw.pop("out", None)
    where = kw.pop("where", True)
    if kw:
        return NotImplemented
    call: dict = {}
    if out is not None:
        if name == "divmod":
            call["out"] = tuple(out)
        else:
            if len(out) != 1:
                return NotImplemented
            call["out"] = out[0]
    if where is not True:
        if name not in _BINARY_WHERE:
            return NotImplemented
        call["where"] = where
    return fn(*inputs, **call)


def _np_sort(a, axis=-1, kind=None, order=None, *, stable=None):
    if order is not None:
        return NotImplemented
    return _heatlike().sort(a, axis=axis, return_sort_indices=False)


def _np_cumulative(name: str):
    def call(a, axis=None, dtype=None, out=None):
        if axis is None:
            a, axis = _heatlike().flatten(a), 0
        return getattr(_heatlike(), name)(a, axis, dtype=dtype, out=out)
    return call


def _np_percentile(a, q, axis=None, out=None, overwrite_input=False, method="linear",
                   keepdims=False, *, weights=None, interpolation=None):
    if weights is not None:
        return NotImplemented
    return _heatlike().percentile(a, q, axis=axis, out=out, keepdims=keepdims,
                                  interpolation=interpolation or method)


def _np_median(a, axis=None, out=None, overwrite_input=False, keepdims=False):
    if out is not None:
        return NotImplemented
    return _heatlike().median(a, axis=axis, keepdims=keepdims)


def _np_unique(ar, return_index=False, return_inverse=False, return_counts=False, axis=None,
               *, equal_nan=True, sorted=True):  # noqa: A002 (numpy's keyword)
    if return_index or return_counts:
        return NotImplemented
    return _heatlike().unique(ar, sorted=True, return_inverse=return_inverse, axis=axis)


_NO_VALUE = getattr(np, "_NoValue", None)  # numpy's marker of an argument not passed


def _given(value: object) -> bool:
    return value is not None and value is not _NO_VALUE


def _np_reduction(name: str, dtype: bool = True, ddof: bool = False):
    """numpy's ``name(a, axis, [dtype,] out, [ddof,] keepdims, ...)``, positional order
    included, on heatlike's ``name(x, axis, keepdims=, ...)`` (numpy's positional dtype landed
    in heatlike's keepdims); ``initial``, ``where`` and arguments heatlike's lacks: not
    implemented here (numpy then raises TypeError)."""
    def call(a, axis=None, *args, **kwargs):
        names = (["dtype"] if dtype else []) + ["out"] + (["ddof"] if ddof else []) + \
            ["keepdims"]
        if len(args) > len(names) or set(names[:len(args)]) & set(kwargs):
            return NotImplemented
        kwargs.update(zip(names, args))
        if any(_given(kwargs.pop(k, None)) for k in ("initial", "where", "mean",
                                                      "correction")):
            return NotImplemented
        fn = getattr(_heatlike(), name)
        accepted = inspect.signature(fn).parameters
        given = {k: v for k, v in kwargs.items() if _given(v) and not
                 (k == "keepdims" and v is False) and not (k == "ddof" and v == 0)}
        if any(k not in accepted for k in given):
            return NotImplemented
        return fn(a, axis, **given)
    return call


def _np_take(a, indices, axis=None, out=None, mode="raise"):
    if out is not None or mode != "raise":
        return NotImplemented
    if axis is None:  # numpy takes from the flattened array
        a, axis = _heatlike().flatten(a), 0
    return _heatlike().take(a, indices, axis=axis)


def _np_not_here(*_args, **_kwargs):
    return NotImplemented


#: numpy functions whose heatlike namesake takes Heat's arguments: numpy's meaning, kept
_NUMPY_CALLS = {"sort": _np_sort, "cumsum": _np_cumulative("cumsum"),
                "cumprod": _np_cumulative("cumprod"), "percentile": _np_percentile,
                "median": _np_median, "unique": _np_unique,
                "sum": _np_reduction("sum"), "prod": _np_reduction("prod"),
                "mean": _np_reduction("mean"),
                "var": _np_reduction("var", ddof=True), "std": _np_reduction("std", ddof=True),
                "min": _np_reduction("min", dtype=False), "max": _np_reduction("max", dtype=False),
                "any": _np_reduction("any", dtype=False), "all": _np_reduction("all", dtype=False),
                "take": _np_take,
                # Heat's histogram returns the counts only, numpy's (counts, edges)
                "histogram": _np_not_here}


def array_function(func: object, types: tuple, args: tuple, kwargs: dict) -> object:
    """``DNDarray.__array_function__`` (module docstring). Only numpy's own top-level functions
    are taken (``np.linalg.diagonal`` is not ``heatlike.diagonal``)."""
    if getattr(func, "__module__", None) != "numpy":
        return NotImplemented
    call = _NUMPY_CALLS.get(getattr(func, "__name__", ""))
    if call is not None:
        try:
            return call(*args, **kwargs)
        except TypeError:  # numpy's own arguments did not fit numpy's signature
            return NotImplemented
    fn = getattr(_heatlike(), getattr(func, "__name__", ""), None)
    if fn is None or not callable(fn) or isinstance(fn, type):
        return NotImplemented
    return fn(*args, **kwargs)


_TORCH_NAMES = {"cat": "concatenate", "concat": "concatenate", "eq": "eq", "ne": "not_equal",
                "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
                "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative",
                "__add__": "add", "__radd__": "add", "__sub__": "subtract",
                "__mul__": "multiply", "__rmul__": "multiply", "__truediv__": "divide",
                "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
                "__eq__": "eq", "__ne__": "not_equal", "__lt__": "less", "__le__": "less_equal",
                "__gt__": "greater", "__ge__": "greater_equal", "__matmul__": "matmul"}
_REFLECTED = {"__rsub__": "subtract", "__rtruediv__": "divide", "__rpow__": "power",
              "__rmatmul__": "matmul", "__rfloordiv__": "floor_divide", "__rmod__": "remainder"}


def torch_function(func: object, types: tuple, args: tuple, kwargs: dict) -> object:
    """``DNDarray.__torch_function__`` (module docstring)."""
    name = getattr(func, "__name__", "")
    if name in _REFLECTED and len(args) == 2:
        fn = getattr(_heatlike(), _REFLECTED[name])
        return fn(args[1], args[0], **kwargs)
    name = _TORCH_NAMES.get(name, name)
    fn = getattr(_heatlike(), name, None)
    if fn is None or not callable(fn) or isinstance(fn, type) or name.startswith("_"):
        return NotImplemented
    return fn(*args, **kwargs)
