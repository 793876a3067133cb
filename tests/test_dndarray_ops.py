"""Elementwise operations (broadcasting across layouts) and reductions, against numpy, for every
split, balanced and unbalanced, with empty local parts."""

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from _dndarray_helpers import (
    COMM,
    assert_matches,
    global_array,
    layout,
    layouts,
    raises_everywhere,
    unbalanced,
)

import heatlike as hl

pytestmark = pytest.mark.mpi

PAIRS = [((4, 3), (4, 3)), ((5, 3), (3,)), ((4, 1), (1, 3)), ((1, 3), (5, 3)),
         ((2, 3, 4), (3, 1)), ((3,), (3,)), ((0, 3), (1, 3)), ((5,), ()), ((2, 1, 3), (4, 1))]


def _operands(g: np.ndarray, seed: int):
    """Every layout of g as a DNDarray, plus g as numpy array and torch tensor."""
    yield from layouts(g, seed)
    yield "numpy", g
    yield "torch", torch.from_numpy(g.copy())


def test_broadcasting_across_all_layouts():
    for i, (sa, sb) in enumerate(PAIRS):
        ga, gb = global_array(i, sa), global_array(100 + i, sb)
        for (wa, a), (wb, b) in itertools.product(layouts(ga, i), _operands(gb, i + 50)):
            what = f"{sa} {wa} / {sb} {wb}"
            assert_matches(a + b, ga + gb, what)
            assert_matches(b - a, gb - ga, what)
            assert_matches(a * b > 0, ga * gb > 0, what)
        assert_matches(hl.array(ga, split=0) * 2.5, ga * 2.5) if ga.ndim else None
        assert_matches(3 - hl.array(gb), 3 - gb)


def test_binary_functions():
    a_np = global_array(1, (6, 4))
    b_np = global_array(2, (4,))
    b_nz = np.where(b_np == 0, 3, b_np)
    ai, bi = a_np.astype(np.int64), b_nz.astype(np.int64)
    for (wa, a), (wb, b) in [(("0u", unbalanced(a_np, 0, 3)), ("rep", hl.array(b_nz))),
                             (("1", hl.array(a_np, split=1)), ("0", hl.array(b_nz, split=0))),
                             (("None", hl.array(a_np)), ("0u", unbalanced(b_nz, 0, 5)))]:
        ia, ib = a.astype(hl.int64), b.astype(hl.int64)
        what = f"{wa} {wb}"
        cases = [
            (hl.add, a, b, a_np + b_nz), (hl.subtract, a, b, a_np - b_nz),
            (hl.multiply, a, b, a_np * b_nz), (hl.divide, a, b, a_np / b_nz),
            (hl.true_divide, ia, ib, ai / bi),
            (hl.floor_divide, a, b, a_np // b_nz), (hl.floor_divide, ia, ib, ai // bi),
            (hl.remainder, a, b, a_np % b_nz), (hl.mod, ia, ib, ai % bi),
            (hl.fmod, a, b, np.fmod(a_np, b_nz)),
            (hl.power, a, b.abs() % 3, a_np ** (np.abs(b_nz) % 3)),
            (hl.maximum, a, b, np.maximum(a_np, b_nz)), (hl.minimum, a, b, np.minimum(a_np, b_nz)),
            (hl.arctan2, a, b, np.arctan2(a_np, b_nz)), (hl.hypot, a, b, np.hypot(a_np, b_nz)),
            (hl.copysign, a, b, np.copysign(a_np, b_nz)),
            (hl.bitwise_and, ia, ib, ai & bi), (hl.bitwise_or, ia, ib, ai | bi),
            (hl.bitwise_xor, ia, ib, ai ^ bi),
            (hl.left_shift, ia.abs(), ib.abs() % 4, np.abs(ai) << (np.abs(bi) % 4)),
            (hl.right_shift, ia.abs(), ib.abs() % 4, np.abs(ai) >> (np.abs(bi) % 4)),
            (hl.logical_and, a, b, np.logical_and(a_np, b_nz)),
            (hl.logical_or, a, b, np.logical_or(a_np, b_nz)),
            (hl.logical_xor, a, b, np.logical_xor(a_np, b_nz)),
            (hl.eq, a, b, a_np == b_nz), (hl.not_equal, a, b, a_np != b_nz),
            (hl.less, a, b, a_np < b_nz), (hl.less_equal, a, b, a_np <= b_nz),
            (hl.greater, a, b, a_np > b_nz), (hl.greater_equal, a, b, a_np >= b_nz),
        ]
        for fn, x, y, expect in cases:
            assert_matches(fn(x, y), expect, f"{fn.__name__} {what}")
        assert_matches(a // b, a_np // b_nz, what)
        assert_matches(a % 4, a_np % 4, what)
        assert_matches(2 ** (a % 3), 2 ** (a_np % 3), what)
        assert_matches((a > 0) & (b < 0), (a_np > 0) & (b_nz < 0), what)
        assert_matches((a > 0) | (b < 0), (a_np > 0) | (b_nz < 0), what)
        assert_matches((a > 0) ^ (b < 0), (a_np > 0) ^ (b_nz < 0), what)
        assert_matches(~(a > 0), ~(a_np > 0), what)
        assert_matches(a == b, a_np == b_nz, what)
        assert_matches(a != 3, a_np != 3, what)
        assert_matches(ia // 0, np.zeros_like(ai), what)  # numpy: integer division by 0 is 0
        assert_matches(ia % ib * 0 + ia % hl.zeros_like(ia), np.zeros_like(ai), what)


def test_unary_functions():
    g = global_array(7, (5, 3)) / 3.0
    pos = np.abs(g) + 0.5
    unit = np.clip(g / 10, -0.99, 0.99)
    cases = [(hl.negative, g, -g), (hl.positive, g, g), (hl.absolute, g, np.abs(g)),
             (hl.abs, g, np.abs(g)), (hl.sign, g, np.sign(g)), (hl.sqrt, pos, np.sqrt(pos)),
             (hl.square, g, g ** 2), (hl.exp, g, np.exp(g)), (hl.expm1, g, np.expm1(g)),
             (hl.exp2, g, np.exp2(g)), (hl.log, pos, np.log(pos)), (hl.log2, pos, np.log2(pos)),
             (hl.log10, pos, np.log10(pos)), (hl.log1p, pos, np.log1p(pos)),
             (hl.sin, g, np.sin(g)), (hl.cos, g, np.cos(g)), (hl.tan, unit, np.tan(unit)),
             (hl.arcsin, unit, np.arcsin(unit)), (hl.arccos, unit, np.arccos(unit)),
             (hl.arctan, g, np.arctan(g)), (hl.sinh, g, np.sinh(g)), (hl.cosh, g, np.cosh(g)),
             (hl.tanh, g, np.tanh(g)), (hl.floor, g, np.floor(g)), (hl.ceil, g, np.ceil(g)),
             (hl.trunc, g, np.trunc(g)), (hl.round, g, np.round(g)),
             (hl.isnan, g, np.isnan(g)), (hl.isinf, g, np.isinf(g)),
             (hl.isfinite, g, np.isfinite(g)), (hl.logical_not, g, np.logical_not(g))]
    for wx, _ in layouts(g):
        for fn, src, expect in cases:
            x = layout(src, wx)
            assert_matches(fn(x), expect, f"{fn.__name__} {wx}", rtol=1e-12)
        x = layout(g, wx)
        assert_matches(-x, -g)
        assert_matches(abs(x), np.abs(g))
        assert_matches(+x, g)
        assert_matches(hl.round(x, 1), np.round(g, 1))
        assert_matches(hl.invert(x.astype(hl.int32)), ~g.astype(np.int32))
        assert_matches(x.clip(-1, 1), np.clip(g, -1, 1))
        assert_matches(hl.clip(x, None, 0.5), np.clip(g, None, 0.5))
        assert_matches(hl.clip(x, hl.array(g[0] / 2), 1), np.clip(g, g[0] / 2, 1))
        assert_matches(hl.isnan(x.sqrt()), g < 0)
    assert_matches(hl.sqrt(np.array([4.0, 9.0])), np.array([2.0, 3.0]))


def test_round_and_sign_of_integers_nans_and_complex_numbers_as_numpy():
    """``round`` with negative decimals rounds integers (it returned them unchanged) and rounds
    complex numbers part by part (they came back unrounded); ``sign`` keeps NaN (torch gives 0)
    and is z / |z| for complex z (torch raised)."""
    ints = np.array([14, 15, 25, -15, 7, -25, 5, 0, -5, 45, 55, 1234567])
    cases = [(ints, -1), (ints, -2), (ints, 1), (ints.astype(np.int8) % 100, -1),
             (np.array([250, 149, 150, 151, 50], dtype=np.uint8), -2), (ints, -20),
             (np.array([1.25 + 2.35j, -0.5 + 2.5j, 3.75 - 1.05j]), 1)]
    for g, decimals in cases:
        for wx, _ in layouts(g):
            expect = np.round(g, decimals)
            assert_matches(hl.round(layout(g, wx), decimals), expect,
                           f"round {g.dtype} {decimals} {wx}", dtype=expect.dtype)
    floats = np.array([np.nan, -2.0, 0.0, 3.0, -np.inf, np.inf])
    complexes = np.array([1 + 1j, -2j, 0j, 3 + 0j, -4 - 3j])
    for g in (floats, complexes, ints):
        for wx, _ in layouts(g):
            assert_matches(hl.sign(layout(g, wx)), np.sign(g), f"sign {g.dtype} {wx}",
                           rtol=1e-12, dtype=g.dtype)


def test_where_and_closeness():
    g = global_array(3, (4, 5))
    h = global_array(4, (5,))
    for (wx, x), (wy, y) in itertools.product(layouts(g), layouts(h)):
        what = f"{wx} {wy}"
        assert_matches(hl.where(x > 0, x, y), np.where(g > 0, g, h), what)
        assert_matches(hl.where(x > 0, 1.0, y), np.where(g > 0, 1.0, h), what)
        assert_matches(hl.where(g > 0, x, 0), np.where(g > 0, g, 0), what)
        assert_matches(hl.isclose(x, y), np.isclose(g, h), what)
        assert hl.allclose(x, x + 1e-9) and not hl.allclose(x, y)
        assert hl.array_equal(x, g) and not hl.array_equal(x, g[:2])


def test_inplace_operators_keep_layout():
    g = global_array(5, (6, 4))
    h = global_array(6, (4,))
    for (wx, _), (wy, y) in itertools.product(layouts(g), layouts(h)):
        x = layout(g, wx)
        counts, split = x.counts, x.split
        expect = g.copy()
        x += y
        expect += h
        x *= 2
        expect *= 2
        x -= hl.array(g, split=1)
        expect -= g
        x /= 4
        expect /= 4
        assert x.counts == counts and x.split == split
        assert_matches(x, expect, f"{wx} {wy}")
        xi = layout(g.astype(np.int64), wx)
        xi //= 2
        xi %= 3
        xi **= 2
        xi |= 1
        xi &= 3
        xi ^= 1
        ei = ((g.astype(np.int64) // 2) % 3) ** 2
        ei = ((ei | 1) & 3) ^ 1
        assert_matches(xi, ei, wx)
        raises_everywhere(TypeError, lambda xi=xi: xi.__iadd__(0.5), "Cannot cast")
        raises_everywhere(TypeError, lambda xi=xi: xi.__itruediv__(2), "Cannot cast")
        raises_everywhere(ValueError, lambda xi=xi: xi.__ipow__(-1), "negative")
        raises_everywhere(ValueError, lambda y=y: y.__iadd__(hl.zeros((6, 4))), "broadcast")


def test_dtype_promotion_follows_torch():
    x = hl.arange(6, split=0)
    assert (x + 1).dtype is torch.int64
    assert (x + 1.5).dtype is torch.float32
    assert (x / 2).dtype is torch.float64  # the dtype rule: int64 inputs, float64 result
    assert (x.astype(hl.float64) + 1).dtype is torch.float64
    assert (x.astype(hl.int32) + x.astype(hl.int8)).dtype is torch.int32
    assert (x > 2).dtype is torch.bool
    assert (x.astype(hl.float16) * 2).dtype is torch.float16


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32, np.float32, np.bool_], ids=str)
def test_numpy_scalars_and_0d_arrays_promote_as_arrays(dtype):
    """numpy 2's rule: numpy scalars and 0-d arrays take part in promotion like arrays of any
    dimension (torch ranks a 0-d tensor below dimensioned ones of its kind, so uint8 + int64(300)
    wrapped around in uint8); Python scalars stay weak."""
    g = (np.arange(7) % 4).astype(dtype)
    scalars = [np.int64(300), np.int8(-3), np.uint8(3), np.int16(7), np.float64(0.5),
               np.float32(2.5), np.bool_(True)]
    for what, x in layouts(g):
        for s in scalars:
            kinds = {"f" if k == "f" else "i" for k in (np.dtype(dtype).kind,
                                                         np.asarray(s).dtype.kind) if k != "b"}
            if kinds == {"i", "f"}:
                continue  # integers with floats promote by torch's rule (documented)
            for op in (np.add, np.multiply, np.maximum, np.less, np.equal):
                for operand in (s, hl.array(np.asarray(s))):
                    tag = f"{what} {op.__name__} {s!r} ({type(operand).__name__})"
                    want, back = op(g, s), op(s, g)
                    assert_matches(op(x, operand), want, tag, dtype=want.dtype)
                    assert_matches(op(operand, x), back, tag + " reversed", dtype=back.dtype)
    assert (hl.ones(3) + 2.5).dtype is torch.float32  # a Python float stays weak


def test_python_integers_out_of_an_integer_type_s_range_as_numpy():
    """Arithmetic raises OverflowError (was torch's RuntimeError); comparisons are exact."""
    for dtype in (np.uint8, np.int32, np.int64):
        g = (np.arange(7) % 4).astype(dtype)
        for what, x in layouts(g):
            for v in (300, -1, 2**40, 2**63, -2**70):
                info = np.iinfo(dtype)
                for op in (np.less, np.equal, np.greater_equal, np.not_equal):
                    assert_matches(op(x, v), op(g, v), f"{what} {op.__name__} {v}")
                if not info.min <= v <= info.max:
                    raises_everywhere(OverflowError, lambda x=x, v=v: x + v, "out of bounds")


def test_python_integers_out_of_range_in_factories_as_numpy():
    """``array(data, dtype=)``, ``full`` and ``full_like`` raise numpy 2's OverflowError for a
    Python integer the integer type cannot hold (array wrapped it silently: 300 -> 44 as
    uint8; full raised torch's RuntimeError); values in range and floats convert as numpy's."""
    for obj, dtype in (([300, 1], np.uint8), ([-1, 1], np.uint8), ([[200], [1]], np.int8),
                       ([2**40], np.int32), (300, np.uint8)):
        with pytest.raises(OverflowError):
            np.array(obj, dtype=dtype)
        for split in (None, 0) if np.ndim(obj) else (None,):
            raises_everywhere(OverflowError, lambda o=obj, d=dtype, s=split: hl.array(
                o, dtype=d, split=s), "out of bounds")
    raises_everywhere(OverflowError, lambda: hl.full((5,), 300, dtype=np.uint8, split=0),
                      "out of bounds")
    raises_everywhere(OverflowError, lambda: hl.full_like(hl.zeros(5, dtype=np.int8), 200),
                      "out of bounds")
    for obj, dtype in (([255, 0, 7], np.uint8), ([1.7, -2.5, 3.0], np.int64),
                       ([True, False, True], np.int16), ([-128, 127, 0], np.int8)):
        for what, x in layouts(np.array(obj, dtype=dtype)):
            assert_matches(hl.array(obj, dtype=dtype, split=x.split), np.array(obj, dtype=dtype),
                           what, dtype=np.dtype(dtype))
    assert_matches(hl.full((3,), -128, dtype=np.int8), np.full(3, -128, dtype=np.int8), "full")


def test_booleans_in_abs_and_integer_division_as_numpy():
    g = np.array([True, False, True, True, False, False, True])
    for what, x in layouts(g):
        assert_matches(hl.abs(x), np.abs(g), what, dtype=np.bool_)
        assert_matches(x // True, g // True, what, dtype=np.int8)
        assert_matches(x % True, g % True, what, dtype=np.int8)
        with np.errstate(divide="ignore"):
            assert_matches(hl.floor_divide(x, x), np.floor_divide(g, g), what)  # by zero: 0


def test_elementwise_errors():
    a = hl.zeros((4, 3), split=0)
    raises_everywhere(ValueError, lambda: a + hl.zeros((4, 2), split=1), "broadcast")
    raises_everywhere(ValueError, lambda: a * np.ones(5), "broadcast")
    raises_everywhere(TypeError, lambda: a & a, "bitwise_and")
    raises_everywhere(TypeError, lambda: hl.left_shift(a, 1), "left_shift")
    raises_everywhere(ValueError, lambda: hl.arange(3, split=0) ** -1, "negative")
    raises_everywhere(TypeError, lambda: a + "text")
    raises_everywhere(ValueError, lambda: hl.clip(a), "min and max")
    assert (a == None) is False  # noqa: E711  (Python falls back to identity)


REDUCTIONS = ["sum", "prod", "mean", "var", "std", "min", "max", "all", "any"]
SOME = ["sum", "var", "max", "any"]  # on unbalanced layouts (same code paths, fewer checks)


def _numpy_reduce(name, g, axis, keepdims):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return getattr(np, name)(g, axis=axis, keepdims=keepdims)


def test_reductions_every_axis_and_layout():
    shapes = [(0,), (7,), (5, 3), (2, 0), (1, 4), (3, 4, 2)]
    for i, shape in enumerate(shapes):
        g = global_array(i, shape) / 2.0
        nd = len(shape)
        axes = [None, 0, -1, ()] + ([(0, nd - 1)] if nd > 1 else []) + \
            ([(1, 2), 1] if nd > 2 else [])
        for what, x in layouts(g, seed=i):
            for axis, keepdims in [(a, k) for a in axes
                                   for k in ((False, True) if a in (None, 0, ()) else (False,))]:
                for name in (REDUCTIONS if "unbalanced" not in what else SOME):
                    tag = f"{name} {shape} {what} axis={axis} keepdims={keepdims}"
                    try:
                        expect = _numpy_reduce(name, g, axis, keepdims)
                    except ValueError:
                        raises_everywhere(ValueError, lambda name=name, x=x, axis=axis,
                                          keepdims=keepdims: getattr(hl, name)(
                                              x, axis=axis, keepdims=keepdims))
                        continue
                    got = getattr(x, name)(axis=axis, keepdims=keepdims)
                    assert_matches(got, expect, tag, rtol=1e-9, atol=1e-12)
            if g.size > 1 and g.shape[0] > 1:
                assert_matches(x.var(ddof=1), np.var(g, ddof=1), what)
                assert_matches(hl.std(x, axis=0, ddof=1), np.std(g, axis=0, ddof=1), what)


def test_reduction_dtypes_and_values():
    gi = global_array(2, (6, 5)).astype(np.int32)
    gb = global_array(3, (6, 5), dtype=bool)
    for what, x in layouts(gi):
        s = x.sum(axis=0)
        assert s.dtype is torch.int64
        assert_matches(s, gi.sum(axis=0), what)
        assert_matches(x.min(axis=1), gi.min(axis=1), what)
        assert_matches(x.max(), gi.max(), what)
        assert_matches(x.mean(axis=0), gi.mean(axis=0), what)
        assert x.mean().dtype is torch.float64  # int32 mean: float64 (the dtype rule)
        assert_matches(x.sum(dtype=hl.float64), gi.sum(), what)
        # an integer dtype is the accumulator and result type, as numpy's (was int64)
        for dt, nd in ((hl.int32, np.int32), (hl.int16, np.int16)):
            assert_matches(x.sum(axis=0, dtype=dt), gi.sum(axis=0, dtype=nd),
                           f"{what} sum dtype {nd}", dtype=nd)
            assert_matches(x.prod(axis=1, dtype=dt), gi.prod(axis=1, dtype=nd),
                           f"{what} prod dtype {nd}", dtype=nd)
    for what, x in layouts(gb):
        assert_matches(x.all(axis=0), gb.all(axis=0), what)
        assert_matches(x.any(axis=1), gb.any(axis=1), what)
        assert_matches(x.sum(), gb.sum(), what)
        assert_matches(x.min(axis=0), gb.min(axis=0), what)
        assert_matches(x.max(axis=1), gb.max(axis=1), what)
    gh = global_array(4, (9, 3)).astype(np.float32)
    for what, x in layouts(gh):
        h = x.astype(hl.bfloat16)
        assert_matches(h.sum(axis=0).astype(hl.float32), gh.sum(axis=0), what)
        assert h.mean().dtype is torch.bfloat16


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_of_wide_rows_along_inner_axes(dtype, monkeypatch):
    """Sums and means over a non-last axis of arrays wide and long enough for the blocked row
    accumulation (:func:`heatlike.core.reductions._rows_sum`), with NaN and infinity, in every
    layout: within a few units in the last place of the float64 sum, like torch's own."""
    from heatlike.core import reductions

    eps = np.finfo(dtype).eps
    calls = []
    blocked = reductions._rows_sum
    monkeypatch.setattr(reductions, "_rows_sum", lambda v: calls.append(v.shape) or blocked(v))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the blocked path is taken on one thread only
    try:
        _check_wide_sums(dtype, eps)
    finally:
        torch.set_num_threads(threads)
    assert calls, "the blocked row sum was never used"
    # the blocked sum itself (one block, a remainder, several levels, outer > 1) on positive
    # values, whose one-after-the-other sum drifts (52 eps for 70000 float32 rows)
    for n in (1, 63, 64, 65, 64 * 64, 64 * 64 + 3, 70000):
        v = (0.1 + 0.01 * np.random.default_rng(n).random((2, n, 5))).astype(dtype)
        exact = np.array([[math.fsum(v[o, :, j].tolist()) for j in range(5)] for o in range(2)])
        err = np.abs(blocked(v) - exact) / exact
        assert err.max() <= 4 * eps, f"n={n}: error {err.max() / eps:.1f} eps"


def _check_wide_sums(dtype, eps):
    for i, (shape, axis) in enumerate([((2200, 1100), 0), ((3, 300, 1030), 1),
                                       ((520, 2, 600), 0)]):
        g = global_array(40 + i, shape).astype(dtype) / 7
        g.reshape(-1)[5::100003] = np.inf
        g.reshape(-1)[11::90001] = np.nan
        exact = g.astype(np.float64).sum(axis=axis)
        scale = np.abs(g.astype(np.float64)).sum(axis=axis)
        for what, x in layouts(g, seed=i):
            got = x.sum(axis=axis).numpy()
            assert got.dtype == dtype, what
            finite = np.isfinite(exact)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(exact), err_msg=what)
            np.testing.assert_array_equal(got[~finite & ~np.isnan(exact)],
                                          exact[~finite & ~np.isnan(exact)], err_msg=what)
            err = np.abs(got[finite] - exact[finite]) / scale[finite]
            assert err.max() <= 16 * eps, f"{what}: error {err.max() / eps:.1f} eps"
            assert_matches(x.mean(axis=axis), g.mean(axis=axis), what, rtol=32 * eps,
                           atol=32 * eps)


def test_min_and_max_of_signed_zeros_and_nans_are_the_same_bits_on_every_rank():
    """MPI's MIN of -0.0 and +0.0 depends on the order it combines the ranks in, which differs
    between ranks: the replicated result had different sign bits on different ranks (seen at
    four ranks). Now -0.0 wins a minimum (+0.0 a maximum) wherever a rank's own is that zero."""
    g = np.array([[-0.0, 0.0, 1.0], [0.0, -0.0, 2.0], [0.0, 0.0, -1.0], [np.nan, 0.0, 3.0],
                  [-0.0, -0.0, 0.0]], dtype=np.float32)
    for wx, _ in layouts(g):
        x = layout(g, wx)
        for fn, ref in ((hl.min, np.min), (hl.max, np.max)):
            for axis in (0, 1):
                got = fn(x, axis=axis).numpy()
                np.testing.assert_array_equal(got, ref(g, axis=axis), f"{fn.__name__} {wx}")
                bits = COMM.allgather(np.signbit(got).tolist())
                assert all(b == bits[0] for b in bits), (fn.__name__, wx, axis, bits)


def test_argmin_argmax():
    shapes = [(1,), (7,), (5, 3), (3, 4, 2), (4, 1)]
    for i, shape in enumerate(shapes):
        g = global_array(i, shape) // 3  # many ties: the first occurrence must win
        nd = len(shape)
        for what, x in layouts(g, seed=i):
            for axis in [None, *range(nd), -1]:
                for keepdims in (False, True):
                    tag = f"{shape} {what} axis={axis} keepdims={keepdims}"
                    assert_matches(x.argmin(axis=axis, keepdims=keepdims),
                                   np.argmin(g, axis=axis, keepdims=keepdims), tag)
                    assert_matches(hl.argmax(x, axis=axis, keepdims=keepdims),
                                   np.argmax(g, axis=axis, keepdims=keepdims), tag)
    g = global_array(9, (6, 4))
    g[2, 1] = g[4, 3] = g[5, 0] = np.nan
    for what, x in layouts(g):
        for axis in (None, 0, 1):
            assert_matches(x.argmin(axis=axis), np.argmin(g, axis=axis), what)
            assert_matches(x.argmax(axis=axis), np.argmax(g, axis=axis), what)
            assert_matches(x.min(axis=axis), np.min(g, axis=axis), what)
    gi = global_array(8, (5, 4)).astype(np.int16)
    for what, x in layouts(gi):
        assert_matches(x.argmax(axis=0), np.argmax(gi, axis=0), what)
        assert_matches(x.argmin(), np.argmin(gi), what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int16, np.uint8])
def test_argmin_argmax_of_large_arrays_along_strided_axes(dtype):
    """Arrays large enough for the vectorized arg-reduction across strided axes: ties (the first
    occurrence wins), NaN (the extremum) and -0.0 == 0.0, against numpy, in every layout."""
    for i, (shape, axes) in enumerate([((2400, 120), (0, 1)), ((160, 300, 8), (0, 1))]):
        g = (global_array(20 + i, shape) // 5).astype(dtype)
        if np.issubdtype(dtype, np.floating):
            g.reshape(-1)[::997] = np.nan
            g.reshape(-1)[3::1009] = -0.0
        for what, x in layouts(g, seed=i):
            for axis in axes:
                assert_matches(x.argmax(axis=axis), np.argmax(g, axis=axis), f"{what} {axis}")
                assert_matches(x.argmin(axis=axis), np.argmin(g, axis=axis), f"{what} {axis}")


def test_reduction_errors():
    x = hl.zeros((4, 3), split=0)
    raises_everywhere(ValueError, lambda: x.sum(axis=2), "out of bounds")
    raises_everywhere(ValueError, lambda: x.mean(axis=(0, -2)), "duplicate")
    raises_everywhere(TypeError, lambda: x.sum(axis=1.0), "integer")
    raises_everywhere(ValueError, lambda: hl.zeros((0, 3), split=0).max(axis=0), "zero-size")
    raises_everywhere(ValueError, lambda: hl.zeros((3, 0), split=0).argmin(axis=1), "empty")
    raises_everywhere(TypeError, lambda: hl.zeros(3, dtype=hl.complex64, split=0).min(),
                      "complex")
