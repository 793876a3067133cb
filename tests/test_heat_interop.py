"""numpy / torch calling heatlike (``__array_ufunc__``, ``__array_function__``,
``__torch_function__``), Heat's ``equal``, ``out=`` / ``where=``, in-place methods, scalar and
broadcast operands, cumulative operations, ``diff`` and the NaN reductions; against numpy on
every rank, for every layout."""

import numpy as np
import pytest
import torch
from _dndarray_helpers import (
    COMM,
    assert_matches,
    global_array,
    layouts,
    raises_everywhere,
    still_in_step,
)

import heatlike as ht
from heatlike.core.interop import UFUNCS

pytestmark = pytest.mark.mpi


def test_numpy_ufuncs_give_dndarrays():
    g = np.abs(global_array(1, (5, 4))) + 1.0
    h = np.abs(global_array(2, (4,))) + 1.0
    gi, hi = g.astype(np.int64), h.astype(np.int64)
    for what, x in layouts(g):
        xi = x.astype(ht.int64)
        for name in UFUNCS:
            uf = getattr(np, name, None)
            if not isinstance(uf, np.ufunc) or name in ("divmod", "matmul"):
                continue
            ints = name in ("gcd", "lcm", "bitwise_and", "bitwise_or", "bitwise_xor",
                            "left_shift", "right_shift", "invert")
            a, b, na, nb = (xi, hi, gi, hi) if ints else (x, h, g, h)
            if name in ("arccosh",):
                a, na = a + 1, na + 1
            if name in ("arcsin", "arccos", "arctanh"):
                a, na = a / 10, na / 10
            args = (a, b) if uf.nin == 2 else (a,)
            nargs = (na, nb) if uf.nin == 2 else (na,)
            with np.errstate(all="ignore"):
                expect = uf(*nargs)
            got = uf(*args)
            assert isinstance(got, ht.DNDarray), f"np.{name} {what}: {type(got).__name__}"
            assert_matches(got, expect, f"np.{name} {what}", rtol=1e-5, atol=1e-6)
        # operators with a numpy array on the left go through the ufuncs too
        assert_matches(h + x, h + g, what)
        assert_matches(np.asarray(h) * x, h * g, what)
        assert_matches(h @ x.T, h @ g.T, what)
        q, r = np.divmod(x, 3.0)
        assert_matches(q, np.floor_divide(g, 3.0)) and assert_matches(r, np.mod(g, 3.0))
        out = ht.empty_like(x)
        assert np.add(x, 1.0, out=out) is out
        assert_matches(out, g + 1.0, what)


def test_numpy_and_torch_functions_dispatch_to_heatlike():
    g = global_array(3, (6, 3))
    for what, x in layouts(g):
        for got, exp in [(np.concatenate([x, x]), np.concatenate([g, g])),
                         (np.sum(x, axis=0), np.sum(g, axis=0)), (np.mean(x), np.mean(g)),
                         (np.transpose(x), g.T), (np.reshape(x, (3, 6)), g.reshape(3, 6)),
                         (torch.sum(x, axis=0), g.sum(axis=0)),
                         (torch.concatenate([x, x]), np.concatenate([g, g])),
                         (torch.exp(x), np.exp(g))]:
            assert isinstance(got, ht.DNDarray), what
            assert_matches(got, exp, what)
        assert np.allclose(x, g) is True or np.allclose(x, g) == True  # noqa: E712
    x = ht.array(g, split=0)
    # numpy and torch word these errors themselves (with the array's repr, which every rank
    # takes, so the ranks stay in step): only the exception type is checked
    for call in (lambda: np.add.reduce(x), lambda: np.heaviside(x, 5),
                 lambda: np.array_equiv(x, x), lambda: torch.sigmoid(x),
                 lambda: np.add(x, 1, casting="unsafe")):
        with pytest.raises(TypeError):
            call()
    still_in_step()


def test_numpy_functions_keep_numpys_arguments_or_are_not_taken():
    """numpy's positional order and defaults where heatlike's namesake orders them otherwise
    (``np.sum(x, 0, np.float64)``: the dtype went to keepdims; ``np.take`` without an axis takes
    from the flattened array); functions whose heatlike namesake means something else
    (``np.histogram``: Heat's gives the counts only) and those outside numpy's top level
    (``np.linalg.diagonal``: other axes) raise numpy's TypeError instead of a wrong result."""
    g = global_array(3, (4, 3))
    for what, x in layouts(g):
        assert_matches(np.sum(x, 0, np.float64), np.sum(g, 0, np.float64), f"{what} sum",
                       gather=True)
        assert_matches(np.max(x, 1, None, True), np.max(g, 1, None, True), f"{what} max",
                       gather=True)
        assert_matches(np.var(x, 0, None, None, 1), np.var(g, 0, None, None, 1), f"{what} var",
                       gather=True)
        assert_matches(np.take(x, [1, 5]), np.take(g, [1, 5]), f"{what} take", gather=True)
        assert_matches(np.take(x, [2, 0], axis=1), np.take(g, [2, 0], axis=1), f"{what} take",
                       gather=True)
        raises_everywhere(TypeError, lambda x=x: np.histogram(x, bins=3),
                          "no implementation found")
        raises_everywhere(TypeError, lambda x=x: np.linalg.diagonal(x),
                          "no implementation found")
        raises_everywhere(TypeError, lambda x=x: np.sum(x, where=np.ones(3, bool)),
                          "no implementation found")


def test_equal_is_one_bool_and_eq_is_elementwise():
    g = global_array(4, (5, 3))
    for what, x in layouts(g):
        assert ht.equal(x, g) is True and ht.equal(x, ht.array(g, split=1)) is True
        assert ht.equal(x, x + 1) is False
        assert ht.equal(x, np.zeros((2, 2))) is False  # shapes that do not broadcast
        assert ht.equal(ht.ones((5, 3), split=x.split), 1.0) is True
        assert_matches(ht.eq(x, 0), g == 0, what)
        assert_matches(x == 0, g == 0, what)
    assert ht.equal(2.0, 2) is True and ht.equal(ht.array([np.nan]), np.nan) is False


def test_nonzero_and_one_argument_where():
    g = global_array(12, (5, 4, 3)) > 2
    for what, x in layouts(g):
        for got, exp in zip(ht.nonzero(x), np.nonzero(g)):
            assert_matches(got, exp, what, dtype=np.int64)
        for got, exp in zip(ht.where(x), np.where(g)):
            assert_matches(got, exp, what)
        for got, exp in zip(np.nonzero(x), np.nonzero(g)):  # __array_function__
            assert_matches(got, exp, what)
        assert_matches(ht.nonzero(x, as_tuple=False), np.argwhere(g), what)
    raises_everywhere(ValueError, lambda: ht.nonzero(ht.array(1)), "0-d")
    raises_everywhere(TypeError, lambda: ht.where(ht.ones(2), 1), "both or neither")


def test_scalar_and_broadcast_operands():
    """Two scalars, 0-d arrays and broadcast operands (these failed with IndexError)."""
    for name, npf in [("add", np.add), ("pow", np.power), ("fmod", np.fmod), ("sub", np.subtract),
                      ("mul", np.multiply), ("div", np.divide), ("floordiv", np.floor_divide),
                      ("remainder", np.remainder), ("maximum", np.maximum),
                      ("copysign", np.copysign), ("hypot", np.hypot)]:
        fn = getattr(ht, name)
        r = fn(3.0, 2.0)
        assert r.shape == () and r.item() == pytest.approx(float(npf(3.0, 2.0)))
        g = global_array(5, (4, 3)) + 0.5
        for what, x in layouts(g):
            assert_matches(fn(x, ht.array(2.0)), npf(g, 2.0), f"{name} {what}", rtol=1e-5)
            assert_matches(fn(2.0, x), npf(2.0, g), f"{name} {what}", rtol=1e-5)
            assert_matches(fn(x, ht.array([[2.0]])), npf(g, 2.0), f"{name} {what}", rtol=1e-5)
    raises_everywhere(TypeError, lambda: ht.add(ht.ones(2), (2, 2)), "heatlike.array")
    raises_everywhere(TypeError, lambda: ht.add("T", "s"), "unsupported")
    raises_everywhere(TypeError, lambda: ht.neg(1), "DNDarray")


def test_out_and_where():
    g = global_array(6, (6, 4))
    h = global_array(7, (4,))
    mask = global_array(8, (6, 4), dtype=bool)
    for what, x in layouts(g):
        for split in (None, 0, 1):
            out = ht.zeros((6, 4), split=split)
            keep = out.larray
            r = ht.add(x, h, out=out)
            assert r is out and out.split == split and out.larray is keep
            assert_matches(out, g + h, f"{what} out split {split}")
            old = ht.full((6, 4), -1.0, split=split)
            ht.multiply(x, 2.0, out=old, where=ht.array(mask, split=1))
            assert_matches(old, np.where(mask, g * 2.0, -1.0), f"{what} where")
        r = ht.subtract(x, 1.0, where=mask)
        assert_matches(r, np.where(mask, g - 1.0, 0.0), f"{what} where without out")
        assert_matches(ht.sqrt(ht.abs(x), out=ht.empty((6, 4))), np.sqrt(np.abs(g)), what)
    x = ht.array(g, split=0)
    raises_everywhere(ValueError, lambda: ht.add(x, 1, out=ht.empty((6, 3))), "broadcast")
    raises_everywhere(TypeError, lambda: ht.add(x, 1, out=ht.empty((6, 4), dtype=ht.int32)),
                      "same_kind")
    raises_everywhere(TypeError, lambda: ht.add(x, 1, out=np.empty((6, 4))), "out")
    raises_everywhere(ValueError, lambda: ht.add(x, 1, where=ht.ones(3, dtype=ht.bool)),
                      "broadcast")


def test_inplace_methods_and_operators():
    g = np.abs(global_array(9, (5, 4))).astype(np.int64) + 1
    h = np.abs(global_array(10, (4,))).astype(np.int64) + 1
    cases = [("add_", np.add), ("sub_", np.subtract), ("mul_", np.multiply),
             ("floordiv_", np.floor_divide), ("remainder_", np.remainder), ("fmod_", np.fmod),
             ("pow_", np.power), ("bitwise_and_", np.bitwise_and), ("bitwise_or_", np.bitwise_or),
             ("bitwise_xor_", np.bitwise_xor), ("left_shift_", np.left_shift),
             ("right_shift_", np.right_shift), ("gcd_", np.gcd), ("lcm_", np.lcm)]
    for what, x0 in layouts(g):
        for name, npf in cases:
            x = x0.copy()
            keep = x.larray
            other = ht.array(h % 3) if name in ("pow_", "left_shift_") else ht.array(h)
            assert getattr(x, name)(other) is x and x.larray is keep
            assert_matches(x, npf(g, h % 3 if name in ("pow_", "left_shift_") else h),
                           f"{name} {what}")
        x = x0.astype(ht.float64)
        x.div_(2)
        assert_matches(x, g / 2, what)
        x = x0.copy()
        x.neg_()
        assert_matches(x, -g, what)
        x = x0.copy()
        x.cumsum_(0)
        assert_matches(x, np.cumsum(g, 0), what)
        y = x0.astype(ht.float32)
        y.cumprod_(1)
        assert_matches(y, np.cumprod(g.astype(np.float32), 1), what, rtol=1e-5)
        # a replicated target with a split operand: heatlike moves the operand (Heat refuses)
        r = ht.array(g)
        r += ht.array(g, split=x0.split)
        assert_matches(r, 2 * g, what)
    x = ht.array(g, split=0)
    raises_everywhere(TypeError, lambda: x.div_(2), "same_kind")
    raises_everywhere(TypeError, lambda: x.add_((2, 2)), "add_")
    raises_everywhere(ValueError, lambda: ht.ones((1, 4), split=0).add_(ht.ones((5, 4))),
                      "broadcast")
    raises_everywhere(TypeError, lambda: x.cumsum_(0.5), "integer")
    raises_everywhere(NotImplementedError, lambda: x.cumsum_(None), "axis")


def test_cumulative_diff_and_nan_reductions():
    g = global_array(11, (5, 4, 3)) / 4.0 + 1.0
    gn = g.copy()
    gn[1, 2, 0] = np.nan
    gn[4, 0, 2] = np.nan
    for what, x in layouts(g):
        for ax in range(3):
            assert_matches(ht.cumsum(x, ax), np.cumsum(g, ax), f"cumsum {ax} {what}")
            assert_matches(ht.cumprod(x, ax), np.cumprod(g, ax), f"cumprod {ax} {what}",
                           rtol=1e-5)
            for n in (1, 2, 5):
                d = ht.diff(x, n=n, axis=ax)
                assert d.split == x.split
                assert_matches(d, np.diff(g, n=n, axis=ax), f"diff {n} {ax} {what}")
            app = np.ones([1 if d == ax else g.shape[d] for d in range(3)])
            assert_matches(ht.diff(x, axis=ax, prepend=0, append=ht.array(app)),
                           np.diff(g, axis=ax, prepend=0, append=app), f"diff pend {what}")
        xn = ht.array(gn, split=x.split)
        for ax in (None, 0, (1, 2)):
            assert_matches(ht.nansum(xn, axis=ax), np.nansum(gn, axis=ax), f"nansum {what}")
            assert_matches(ht.nanprod(xn, axis=ax), np.nanprod(gn, axis=ax), f"nanprod {what}",
                           rtol=1e-5)
        assert_matches(ht.nan_to_num(xn, nan=-1.0), np.nan_to_num(gn, nan=-1.0), what)
        q, r = divmod(x, 0.75)
        assert_matches(q, g // 0.75) and assert_matches(r, g % 0.75)
    # every rank's part in the result's dtype: torch's int64 totals of bool / int32 parts are
    # cast back (they made ranks disagree on the dtype, and gathering crashed)
    gi = (global_array(12, (5, 3)) * 3).astype(np.int32) % 3
    for what, x in layouts(gi):
        for ax in range(2):
            for name in ("cumsum", "cumprod"):
                for dt in (bool, np.int32, np.int8, None):
                    expect = getattr(np, name)(gi, ax, dtype=dt)
                    got = getattr(ht, name)(x, ax, dtype=dt)
                    assert_matches(got, expect, f"{name} {ax} {dt} {what}", dtype=expect.dtype)
                    np.testing.assert_array_equal(got.numpy(), expect)
    x = ht.array(g, split=0)
    raises_everywhere(NotImplementedError, lambda: ht.cumsum(x, None), "axis=None")
    raises_everywhere(ValueError, lambda: ht.cumsum(x, 0, out=ht.empty((2, 2))), "shape")
    raises_everywhere(ValueError, lambda: ht.diff(x, n=-1), "non-negative")
    raises_everywhere(TypeError, lambda: ht.diff(x, prepend=torch.zeros(1)), "prepend")
    raises_everywhere(ValueError, lambda: ht.diff(x, axis=0, append=ht.ones((1, 2, 3))),
                      "does not match")
    raises_everywhere(TypeError, lambda: ht.divmod(x, 2, out=1), "tuple")
    raises_everywhere(ValueError, lambda: ht.divmod(x, 2, out=(1, 2, 3)), "two")
    assert COMM.size >= 1
