"""The dtype rule for float results of integer inputs (docs/tensor.md, "Dtypes"), over every
elementwise operation and the float-valued reductions, against numpy's values, on every rank."""

import warnings

import numpy as np
import pytest
import torch
from _dndarray_helpers import assert_matches, global_array, layouts

import heatlike as ht
from heatlike.core import arithmetics

pytestmark = pytest.mark.mpi

# the rule: float64 for int32 / int64, float32 (the default float) for bool, uint8, int8, int16
RULE = {np.bool_: torch.float32, np.uint8: torch.float32, np.int8: torch.float32,
        np.int16: torch.float32, np.int32: torch.float64, np.int64: torch.float64}

# float-valued unary functions: heatlike name -> numpy function
FLOAT_UNARY = {
    "sqrt": np.sqrt, "exp": np.exp, "expm1": np.expm1, "exp2": np.exp2, "log": np.log,
    "log2": np.log2, "log10": np.log10, "log1p": np.log1p, "sin": np.sin, "cos": np.cos,
    "tan": np.tan, "arcsin": np.arcsin, "arccos": np.arccos, "arctan": np.arctan,
    "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh, "arcsinh": np.arcsinh,
    "arccosh": np.arccosh, "arctanh": np.arctanh, "deg2rad": np.deg2rad, "rad2deg": np.rad2deg,
    "fabs": np.fabs,
}
FLOAT_BINARY = {"divide": np.divide, "arctan2": np.arctan2, "hypot": np.hypot,
                "copysign": np.copysign}
# elementwise operations whose integer results stay integer (numpy's and torch's rule)
EXACT_UNARY = {"negative": np.negative, "positive": np.positive, "absolute": np.absolute,
               "sign": np.sign, "square": np.square, "floor": np.floor, "ceil": np.ceil,
               "trunc": np.trunc}
EXACT_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
                "floor_divide": np.floor_divide, "remainder": np.remainder, "fmod": np.fmod,
                "maximum": np.maximum, "minimum": np.minimum, "power": np.power}
BOOL_RESULT = {"isnan": np.isnan, "isinf": np.isinf, "isfinite": np.isfinite,
               "signbit": np.signbit, "logical_not": np.logical_not}


def _numpy(fn, *args):
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*(a.astype(np.float64) for a in args))


def test_every_elementwise_function_is_classified():
    """A new elementwise function must be added to one of the tables above."""
    known = set(FLOAT_UNARY) | set(FLOAT_BINARY) | set(EXACT_UNARY) | set(EXACT_BINARY) \
        | set(BOOL_RESULT) | {"gcd", "lcm", "bitwise_and", "bitwise_or", "bitwise_xor",
                              "left_shift", "right_shift", "invert", "logical_and",
                              "logical_or", "logical_xor", "eq", "not_equal", "less",
                              "less_equal", "greater", "greater_equal", "fmax", "fmin",
                              "isposinf", "isneginf"}
    seen = {fn.__name__ for fn in vars(arithmetics).values()
            if callable(fn) and getattr(fn, "elementwise", None)}
    assert len(seen) > 60
    assert seen <= known, f"not in the dtype-rule tables: {sorted(seen - known)}"


@pytest.mark.parametrize("npdt", list(RULE))
def test_float_functions_of_integers_follow_the_rule(npdt):
    g = np.abs(global_array(7, (5, 4))).astype(npdt)
    unit = (g % 2).astype(npdt)  # in [0, 1]: inside every function's domain
    for what, x in layouts(g):
        for name, npf in FLOAT_UNARY.items():
            src = unit if name in ("arcsin", "arccos", "arctanh") else g
            if name == "arccosh":
                src = (g + 1).astype(npdt) if npdt is not np.bool_ else np.ones_like(g)
            if name == "arctanh":
                src = np.zeros_like(g)
            xs = ht.array(src, split=x.split)
            r = getattr(ht, name)(xs)
            assert r.dtype is RULE[npdt], f"{name} {npdt.__name__}: {r.dtype}"
            assert_matches(r, _numpy(npf, src), f"{name} {what}", rtol=1e-5, atol=1e-5)
        nz = np.where(g == 0, 1, g).astype(npdt)
        for name, npf in FLOAT_BINARY.items():
            r = getattr(ht, name)(x, ht.array(nz))
            assert r.dtype is RULE[npdt], f"{name} {npdt.__name__}: {r.dtype}"
            assert_matches(r, _numpy(npf, g, nz), f"{name} {what}", rtol=1e-5)
        if npdt is not np.bool_:
            assert (x / 2).dtype is RULE[npdt]
            assert (x / 2.0).dtype is torch.float32  # a float operand: torch's promotion
            for red in ("mean", "var", "std"):
                r = getattr(x, red)(axis=0)
                assert r.dtype is RULE[npdt], f"{red} {npdt.__name__}"
                assert_matches(r, getattr(g.astype(np.float64), red)(axis=0), red, rtol=1e-5)


@pytest.mark.parametrize("npdt", [np.int8, np.int16, np.int32, np.int64])
def test_exact_functions_keep_integer_types(npdt):
    g = global_array(8, (6, 3)).astype(npdt)
    h = np.where(global_array(9, (6, 3)) == 0, 2, np.abs(global_array(9, (6, 3)))).astype(npdt)
    for what, x in layouts(g):
        for name, npf in EXACT_UNARY.items():
            r = getattr(ht, name)(x)
            assert r.dtype == ht.canonical_heat_type(npdt), f"{name}: {r.dtype}"
            assert_matches(r, npf(g), f"{name} {what}")
        for name, npf in EXACT_BINARY.items():
            other = (h % 3).astype(npdt) if name == "power" else h
            r = getattr(ht, name)(x, ht.array(other))
            assert r.dtype == ht.canonical_heat_type(npdt), f"{name}: {r.dtype}"
            assert_matches(r, npf(g, other), f"{name} {what}")
        for name, npf in BOOL_RESULT.items():
            r = getattr(ht, name)(x)
            assert r.dtype is torch.bool
            assert_matches(r, npf(g), name)


def test_rule_follows_the_default_float_type():
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert ht.sqrt(ht.arange(4, dtype=ht.int8)).dtype is torch.float64
        assert ht.types.float_result_type(ht.int16) is torch.float64
    finally:
        torch.set_default_dtype(old)
    assert ht.types.float_result_type(ht.int16) is torch.float32
    assert ht.types.float_result_type(ht.float16) is torch.float16
    assert ht.types.float_result_type(ht.complex64) is torch.complex64
