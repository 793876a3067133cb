"""Heat's statistics and manipulation functions against numpy (scipy's formulas for skew and
kurtosis) on every rank, for every layout, balanced and unbalanced; bad input raises on every
rank."""

import warnings

import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, assert_matches, global_array, layouts, raises_everywhere

import heatlike as ht

pytestmark = pytest.mark.mpi


def _skew(a, axis, bias):
    d = a - a.mean(axis=axis, keepdims=True)
    m2, m3 = (d ** 2).mean(axis=axis), (d ** 3).mean(axis=axis)
    g = m3 / m2 ** 1.5
    n = a.size if axis is None else a.shape[axis]
    return g if bias else g * np.sqrt(n * (n - 1)) / (n - 2)


def _kurtosis(a, axis, bias, fisher=True):
    d = a - a.mean(axis=axis, keepdims=True)
    m2, m4 = (d ** 2).mean(axis=axis), (d ** 4).mean(axis=axis)
    g = m4 / m2 ** 2
    n = a.size if axis is None else a.shape[axis]
    if not bias:
        g = ((n * n - 1.0) * g - 3.0 * (n - 1) ** 2) / ((n - 2) * (n - 3)) + 3.0
    return g - 3.0 if fisher else g


def test_moments_ptp_average():
    g = global_array(1, (9, 6, 5)) / 3.0
    w1 = np.abs(global_array(2, (6,))) + 1.0
    for what, x in layouts(g):
        for ax in (None, 0, 1, 2):
            for unbiased in (True, False):
                assert_matches(ht.skew(x, ax, unbiased=unbiased), _skew(g, ax, not unbiased),
                               f"skew {ax} {what}", rtol=1e-5, atol=1e-8)
                assert_matches(ht.kurtosis(x, ax, unbiased=unbiased),
                               _kurtosis(g, ax, not unbiased), f"kurt {ax} {what}",
                               rtol=1e-5, atol=1e-8)
            assert_matches(ht.kurtosis(x, ax, Fischer=False), _kurtosis(g, ax, False, False),
                           "pearson", rtol=1e-5)
            assert_matches(ht.ptp(x, ax), np.ptp(g, axis=ax), f"ptp {ax} {what}")
            assert_matches(ht.average(x, ax), np.average(g, axis=ax), f"average {ax} {what}")
            if ax is not None and x.split is not None:
                r = ht.ptp(x, ax)
                assert r.split == (None if ax == x.split else x.split - (ax < x.split))
        avg, wsum = ht.average(x, axis=1, weights=ht.array(w1, split=0), returned=True)
        e_avg, e_w = np.average(g, axis=1, weights=w1, returned=True)
        assert_matches(avg, e_avg, what) and assert_matches(wsum, e_w, what)
        w3 = np.abs(g) + 0.5
        assert_matches(ht.average(x, axis=(0, 2), weights=ht.array(w3, split=x.split)),
                       np.average(g, axis=(0, 2), weights=w3), what)
    x = ht.array(g, split=0)
    raises_everywhere(TypeError, lambda: ht.average(g), "DNDarray")
    raises_everywhere(TypeError, lambda: ht.average(x, weights=w1), "DNDarray")
    raises_everywhere(TypeError, lambda: ht.average(x, weights=ht.array(w1)), "axis")
    raises_everywhere(ValueError, lambda: ht.average(x, 0, weights=ht.array(w1)), "length")
    raises_everywhere(ZeroDivisionError, lambda: ht.average(x, 1, weights=ht.zeros(6)), "zero")
    raises_everywhere(TypeError, lambda: ht.skew(x, axis=[0, 1]), "axis")
    raises_everywhere(ValueError, lambda: ht.kurtosis(x, axis=5), "axis")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_percentiles_are_numpy_s_bits(dtype):
    """numpy's interpolation to the bit (the form by the side of the nearer end, the weight
    rounded from float64; float32 differed in the last bit), and beside an infinity the
    infinity where numpy's formula makes inf - inf = nan."""
    rng = np.random.default_rng(5)
    for n in (2, 5, 8, 11):
        g = rng.standard_normal((n, 3)).astype(dtype)
        for what, x in layouts(g):
            for q in (7, 20, 33.3, 50, 64, 80, 99):
                for method in ("linear", "midpoint"):
                    got = ht.percentile(x, q, axis=0, interpolation=method).numpy()
                    want = np.percentile(g, q, axis=0, method=method)
                    assert got.dtype == want.dtype and np.array_equal(got, want), \
                        f"{n} {q} {method} {what}: {got} != {want}"
    g = np.array([-np.inf, 1.0, 3.0, 4.0], dtype=dtype)
    for what, x in layouts(g):
        assert_matches(ht.percentile(x, 20), np.array(-np.inf, dtype=dtype), what)  # numpy: nan
        assert_matches(ht.percentile(x, 50), np.percentile(g, 50), what)


@pytest.mark.parametrize("method", ["linear", "lower", "higher", "midpoint", "nearest"])
def test_percentile_and_median(method):
    g = global_array(3, (7, 6, 5))
    for what, x in layouts(g):
        for ax in (None, 0, 1, 2, (0, 1), (1, 2)):
            for q in (37.5, [0, 15.9, 50, 100]):
                for keep in (False, True):
                    e = np.percentile(g, q, axis=ax, method=method, keepdims=keep)
                    r = ht.percentile(x, q, axis=ax, interpolation=method, keepdims=keep)
                    assert_matches(r, e, f"{q} {ax} {keep} {what}")
        assert_matches(ht.median(x, axis=1), np.median(g, axis=1), what)
    x = ht.array(g, split=0)
    assert_matches(ht.percentile(x, ht.array([10.0, 90.0], split=0)),
                   np.percentile(g, [10, 90]))
    out = ht.empty((3,), dtype=ht.float64)
    assert ht.percentile(x, (20, 50, 80), out=out) is out
    assert_matches(out, np.percentile(g, (20, 50, 80)))
    gn = g.copy()
    gn[0, 0, 0] = np.nan
    assert_matches(ht.percentile(ht.array(gn, split=0), 50, axis=0),
                   np.percentile(gn, 50, axis=0))
    raises_everywhere(TypeError, lambda: ht.percentile(g, 5), "DNDarray")
    raises_everywhere(ValueError, lambda: ht.percentile(x, 101), "[0, 100]")
    raises_everywhere(ValueError, lambda: ht.percentile(x, float("nan")), "[0, 100]")
    raises_everywhere(TypeError, lambda: ht.percentile(x, ht.ones((2, 2))), "1-D")
    raises_everywhere(TypeError, lambda: ht.percentile(x, ["a"]), "numbers")
    raises_everywhere(ValueError, lambda: ht.percentile(x, 5, interpolation="Homer"), "Homer")
    raises_everywhere(TypeError, lambda: ht.percentile(ht.array([1j, 2j]), 5), "complex")
    raises_everywhere(ValueError, lambda: ht.percentile(x, 5, out=ht.empty(2)), "shape")


def test_the_median_of_an_empty_axis_is_nan_and_a_percentile_raises():
    """numpy's median over an empty axis: NaN with a RuntimeWarning, at every world size and
    layout (before: ValueError, and at one rank NaN for some layouts); its percentile raises
    IndexError, heatlike's a clear ValueError on every rank."""
    for shape, axis in [((4, 0), 1), ((0,), None), ((0, 3), 0), ((0, 3), 1), ((4, 0), None)]:
        g = np.zeros(shape, dtype=np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            expect = np.median(g, axis=axis)
        for what, x in layouts(g):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = ht.median(x, axis=axis)
            assert_matches(got, expect, f"{shape} {axis} {what}", dtype=expect.dtype)
            assert any("median of an empty slice" in str(w.message) for w in caught) == \
                (g.size == 0 and expect.size > 0), (shape, axis, what)
    raises_everywhere(ValueError, lambda: ht.percentile(ht.zeros((4, 0), split=0), 30, axis=1),
                      "empty")


def test_counting_histograms_and_buckets():
    gi = np.abs(global_array(4, (23,))).astype(np.int64)
    w = global_array(5, (23,)) / 2.0
    gf = global_array(6, (8, 5)) / 3.0
    for what, x in layouts(gi):
        assert_matches(ht.bincount(x), np.bincount(gi), what)
        assert_matches(ht.bincount(x, minlength=20), np.bincount(gi, minlength=20), what)
        wx = ht.array(w, is_split=0) if False else ht.array(w, split=x.split)
        if x.balanced:
            assert_matches(ht.bincount(x, weights=wx), np.bincount(gi, weights=w), what)
    for what, x in layouts(gf):
        h = ht.histc(x, bins=7)
        e = torch.histc(torch.from_numpy(gf), bins=7)
        assert h.split is None and torch.equal(h.larray, e), what
        assert torch.equal(ht.histc(x, 4, min=-1, max=1).larray,
                           torch.histc(torch.from_numpy(gf), 4, min=-1, max=1))
        assert ht.equal(ht.histogram(x, 7), h)
        bins = np.array([-2.0, -1.0, 0.0, 0.5, 2.0])
        for right in (False, True):
            assert_matches(ht.digitize(x, ht.array(bins), right=right),
                           np.digitize(gf, bins, right=right), what)
            assert_matches(ht.digitize(x, ht.array(bins[::-1].copy()), right=right),
                           np.digitize(gf, bins[::-1], right=right), what)
            assert_matches(ht.bucketize(x, torch.from_numpy(bins), right=right),
                           torch.bucketize(torch.from_numpy(gf), torch.from_numpy(bins),
                                           right=right).numpy(), what)
    raises_everywhere(ValueError, lambda: ht.digitize(ht.arange(3.0), ht.array([0.0, 2.0, 1.0])),
                      "monotonically")  # numpy's error (it gave indices of no meaning)
    raises_everywhere(ValueError, lambda: ht.bincount(ht.array([-1, 2])), "negative")
    raises_everywhere(TypeError, lambda: ht.bincount(ht.array([1.5])), "integers")
    raises_everywhere(NotImplementedError, lambda: ht.histogram(ht.ones(3), [1, 2]), "bins")
    raises_everywhere(NotImplementedError, lambda: ht.histogram(ht.ones(3), density=True),
                      "density")
    if COMM.size > 1:
        raises_everywhere(RuntimeError, lambda: ht.bucketize(ht.ones(3), ht.arange(4, split=0)),
                          "distributed")


def _on_the_last_rank(g: np.ndarray) -> ht.DNDarray:
    """``g`` split along axis 0 with every row on the last rank (the others hold none)."""
    return ht.array(g if COMM.rank == COMM.size - 1 else g[:0], is_split=0)


def test_counting_where_ranks_hold_nothing():
    """Ranks without elements: weighted bincount has the weights' dtype on every rank (an empty
    part counted as int64 and was summed as such: float64 bit patterns on those ranks), and
    histc checks its range on every rank (torch checked it only where there was data, and the
    others waited in the sum: a hang)."""
    gi, w = np.array([0, 1, 1, 3]), np.array([0.5, 1.0, 2.0, 4.0])
    x, wx = _on_the_last_rank(gi), _on_the_last_rank(w)
    got = ht.bincount(x, weights=wx)
    assert got.dtype == torch.float64
    assert_matches(got, np.bincount(gi, weights=w), "weights")
    assert ht.bincount(x, weights=_on_the_last_rank(w.astype(np.float32))).dtype == \
        torch.float32
    bad = _on_the_last_rank(np.array([1.0, np.nan, 2.0]))
    raises_everywhere(RuntimeError, lambda: ht.histc(bad, bins=3), "not finite")
    raises_everywhere(RuntimeError, lambda: ht.histc(_on_the_last_rank(np.ones(3)), 3, min=3,
                                                     max=1), "larger than min")


def test_variance_with_ddof_beyond_the_count_is_numpys():
    """``ddof >= N``: numpy divides by max(N - ddof, 0), inf (or NaN where the sum is 0); the
    divisor went negative (variance -2, standard deviation NaN)."""
    row = np.arange(4.0).reshape(1, 4)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy: "Degrees of freedom <= 0"
        expected = np.var([3.0, 5.0], ddof=3), np.std([3.0, 5.0], ddof=3), \
            np.var(row, axis=0, ddof=2)
    for what, x in layouts(np.array([3.0, 5.0])):
        assert_matches(ht.var(x, ddof=3), expected[0], what)
        assert_matches(ht.std(x, ddof=3), expected[1], what)
    for what, x in layouts(row):
        assert_matches(ht.var(x, axis=0, ddof=2), expected[2], what)


def test_cov():
    g = global_array(7, (4, 9)) / 2.0
    y = global_array(8, (2, 9))
    for what, x in layouts(g):
        assert_matches(ht.cov(x), np.cov(g), what)
        assert_matches(ht.cov(x, ht.array(y)), np.cov(g, y), what)
        assert_matches(ht.cov(x.T, rowvar=False, bias=True), np.cov(g.T, rowvar=False,
                                                                   bias=True), what)
        assert_matches(ht.cov(x, ddof=2), np.cov(g, ddof=2), what)
    v = global_array(17, (7,))
    for what, x in layouts(v):  # one variable: 0-d, as numpy squeezes (was (1, 1))
        assert_matches(ht.cov(x), np.cov(v), what)
        assert_matches(ht.cov(ht.expand_dims(x, 0)), np.cov(v[None]), what)
    raises_everywhere(TypeError, lambda: ht.cov(g), "DNDarray")
    raises_everywhere(ValueError, lambda: ht.cov(ht.zeros((1, 2, 3))), "dimensions")
    raises_everywhere(TypeError, lambda: ht.cov(ht.array(g), ddof="x"), "ddof")
    raises_everywhere(ValueError, lambda: ht.cov(ht.array(g), ddof=100), "ddof")


def test_reshaping_and_joining():
    g = global_array(9, (6, 4, 5))
    for what, x in layouts(g):
        assert_matches(ht.moveaxis(x, 0, -1), np.moveaxis(g, 0, -1), what)
        assert_matches(ht.moveaxis(x, [0, 1], [2, 0]), np.moveaxis(g, [0, 1], [2, 0]), what)
        b = ht.broadcast_to(x[:, :1, :], (6, 3, 5))
        assert_matches(b, np.broadcast_to(g[:, :1, :], (6, 3, 5)), what)
        bs = ht.broadcast_arrays(x, ht.array(g[0, 0]))
        for r, e in zip(bs, np.broadcast_arrays(g, g[0, 0])):
            assert_matches(r, e, what)
        for fn in ("hstack", "vstack", "row_stack", "column_stack", "dstack"):
            a2 = x[:, :, 0]
            e2 = g[:, :, 0]
            assert_matches(getattr(ht, fn)([a2, a2]), getattr(np, {"row_stack": "vstack"}.get(
                fn, fn))([e2, e2]), f"{fn} {what}")
        assert_matches(ht.column_stack([x[:, 0, 0], x[:, 1, 1]]),
                       np.column_stack([g[:, 0, 0], g[:, 1, 1]]), what)
        for fn in ("vstack", "column_stack", "dstack", "hstack"):  # 3-D arrays as they are
            assert_matches(getattr(ht, fn)([x, x]), getattr(np, fn)([g, g]), f"{fn} 3-D {what}")
        for axis in range(3):
            for ios in (2, [1, 3], [0, 9]):
                if isinstance(ios, int) and g.shape[axis] % ios:
                    continue
                for r, e in zip(ht.split(x, ios, axis=axis), np.split(g, ios, axis=axis)):
                    assert_matches(r, e, f"split {ios} {axis} {what}")
        for r, e in zip(ht.hsplit(x, 2), np.hsplit(g, 2)):
            assert_matches(r, e, what)
        for r, e in zip(ht.vsplit(x, [2]), np.vsplit(g, [2])):
            assert_matches(r, e, what)
        for r, e in zip(ht.dsplit(x, [1, 4]), np.dsplit(g, [1, 4])):
            assert_matches(r, e, what)
        assert ht.shape(x) == g.shape
    raises_everywhere(ValueError, lambda: ht.split(ht.array(g, split=0), 4), "equal division")
    raises_everywhere(ValueError, lambda: ht.vsplit(ht.arange(3), 1), "2 or more")
    raises_everywhere(ValueError, lambda: ht.broadcast_to(ht.ones(3), (2, 4)), "broadcast")
    raises_everywhere(TypeError, lambda: ht.broadcast_arrays(ht.ones(3), 4), "DNDarray")
    for fn in ("vstack", "column_stack", "dstack", "hstack"):  # 0-d arrays (numpy's atleast_*)
        scalar = np.float32(2.5)
        assert_matches(getattr(ht, fn)([ht.array(scalar), ht.array(scalar)]),
                       getattr(np, fn)([scalar, scalar]), f"{fn} 0-d")
    raises_everywhere(ValueError, lambda: ht.moveaxis(ht.ones((2, 2)), [0, 1], [0]), "same")


def test_flip_roll_rot_pad_tile_repeat():
    g = global_array(10, (5, 4, 3))
    for what, x in layouts(g):
        for ax in (None, 0, 1, 2, (0, 2)):
            assert_matches(ht.flip(x, ax), np.flip(g, ax), f"flip {ax} {what}")
        assert_matches(ht.fliplr(x), np.fliplr(g), what)
        assert_matches(ht.flipud(x), np.flipud(g), what)
        for shift, ax in ((2, 0), (-1, 1), (7, None), ((1, -2), (0, 2)), (3, 2)):
            r = ht.roll(x, shift, ax)
            assert r.split == x.split
            assert_matches(r, np.roll(g, shift, ax), f"roll {shift} {ax} {what}")
        for k in range(-1, 4):
            assert_matches(ht.rot90(x, k, (0, 2)), np.rot90(g, k, (0, 2)), f"rot90 {k} {what}")
        for pw, cv in ((1, 0), ((2, 1), 7), (((1, 0), (0, 2), (3, 1)), ((1, 2), (3, 4), (5, 6)))):
            assert_matches(ht.pad(x, pw, constant_values=cv),
                           np.pad(g, pw, constant_values=cv), f"pad {pw} {what}")
        # fewer pairs than axes pad the last axes (Heat's convention)
        assert_matches(ht.pad(x, ((1, 2), (0, 1))), np.pad(g, ((0, 0), (1, 2), (0, 1))), what)
        b = g > 0  # booleans padded with a boolean constant, as numpy allows
        assert_matches(ht.pad(ht.array(b, split=x.split), 1, constant_values=True),
                       np.pad(b, 1, constant_values=True), f"pad bool {what}")
        for reps in (2, (2, 1), (1, 2, 1, 2)):
            assert_matches(ht.tile(x, reps), np.tile(g, reps), f"tile {reps} {what}")
        assert_matches(ht.repeat(x, 2), np.repeat(g, 2), what)
        for ax in range(3):
            r = np.arange(g.shape[ax]) % 3
            assert_matches(ht.repeat(x, r, axis=ax), np.repeat(g, r, axis=ax), f"rep {what}")
            assert_matches(ht.repeat(x, 2, axis=ax), np.repeat(g, 2, axis=ax), f"rep {what}")
    assert_matches(ht.repeat([1, 2], 2), np.repeat([1, 2], 2))
    x = ht.array(g, split=0)
    raises_everywhere(ValueError, lambda: ht.fliplr(ht.arange(3)), "2 dimensions")
    raises_everywhere(ValueError, lambda: ht.rot90(x, 1, (0, 0)), "differ")
    raises_everywhere(NotImplementedError, lambda: ht.pad(x, 1, mode="edge"), "edge")
    raises_everywhere(TypeError, lambda: ht.pad(x, "(1,3)"), "pad_width")
    raises_everywhere(ValueError, lambda: ht.pad(x, ((1, 2, 3),)), "one or two")
    raises_everywhere(ValueError, lambda: ht.repeat(x, [1, 2], axis=0), "repeats")
    raises_everywhere(TypeError, lambda: ht.repeat("[1, 2]", 2), "array")
    raises_everywhere(ValueError, lambda: ht.tile(x, -1), "non-negative")


def test_unique_slices_with_nans_and_scans_of_0d_arrays_as_numpy():
    """``unique(axis=)``: slices holding a NaN sort last, as numpy's (torch's order put them
    first); ``cumsum``/``cumprod`` of a 0-d array give one element (before: AxisError)."""
    g = np.array([[np.nan, 1.0, -np.inf, np.nan], [np.nan, 3.0, np.inf, np.nan],
                  [-0.0, 0.0, 1.0, -0.0]])
    for what, x in layouts(g):
        for ax in (0, 1):
            values, inverse = np.unique(g, axis=ax, return_inverse=True)
            got, got_inverse = ht.unique(x, axis=ax, return_inverse=True)
            np.testing.assert_array_equal(got.numpy(), values, f"{ax} {what}")
            np.testing.assert_array_equal(got_inverse.numpy(), inverse.reshape(-1))
    z = ht.array(3.0)
    assert_matches(ht.cumsum(z, 0), np.cumsum(np.array(3.0), 0))
    assert_matches(ht.cumprod(z, -1), np.cumprod(np.array(3.0), -1))


def test_sort_topk_unique():
    g = global_array(11, (7, 6))
    for what, x in layouts(g):
        for ax in (0, 1, -1):
            for desc in (False, True):
                v, i = ht.sort(x, axis=ax, descending=desc)
                ev = np.sort(g, axis=ax)
                ev = np.flip(ev, axis=ax) if desc else ev
                assert_matches(v, ev, f"sort {ax} {desc} {what}")
                assert_matches(ht.array(np.take_along_axis(g, i.numpy(), axis=ax)), ev, what)
                assert v.split == x.split and i.split == x.split
                assert v.counts == x.counts and i.counts == x.counts, (what, ax)  # layout kept
            if ax != 1:
                flat = x.flatten() if x.split in (None, 0) else None
                if flat is not None:
                    fv, fi = ht.sort(flat)
                    assert fv.counts == flat.counts == fi.counts, what
                    assert_matches(fv, np.sort(g.reshape(-1)), what)
            vals, idx = ht.topk(x, 3, dim=ax)
            srt = -np.sort(-g, axis=ax)
            assert_matches(vals, np.take(srt, range(3), axis=ax), f"topk {ax} {what}")
            assert_matches(ht.array(np.take_along_axis(g, idx.numpy(), axis=ax)),
                           np.take(srt, range(3), axis=ax), what)
            low, _ = ht.topk(x, 2, dim=ax, largest=False)
            assert_matches(low, np.take(np.sort(g, axis=ax), range(2), axis=ax), what)
        u = ht.unique(x)
        assert_matches(u, np.unique(g), what)
        u, inv = ht.unique(x, return_inverse=True)
        np.testing.assert_array_equal(u.numpy()[inv.numpy()], g)
        for ax in (0, 1):
            assert_matches(ht.unique(x, axis=ax), np.unique(g, axis=ax), what)
        r = ht.unique_inverse(x)
        np.testing.assert_array_equal(r.values.numpy()[r.inverse_indices.numpy()], g)
        assert_matches(ht.unique_values(x), np.unique(g), what)
    # NaNs merged into one, as numpy's equal_nan=True (were one value each)
    gn = np.array([1.0, np.nan, 2.0, np.nan, 1.0, np.nan])
    for split in (None, 0):
        u, inv = ht.unique(ht.array(gn, split=split), return_inverse=True)
        eu, einv = np.unique(gn, return_inverse=True)
        np.testing.assert_array_equal(u.numpy(), eu)
        np.testing.assert_array_equal(inv.numpy().reshape(-1), einv.reshape(-1))
    raises_everywhere(ValueError, lambda: ht.topk(ht.ones(3), 4), "out of range")
    raises_everywhere(TypeError, lambda: ht.sort(g), "DNDarray")


def test_diagonals_triangles_unfold():
    v = global_array(12, (6,))
    g = global_array(13, (5, 7))
    for what, x in layouts(v):
        for k in (0, 2, -3):
            d = ht.diag(x, k)
            assert_matches(d, np.diag(v, k), f"diag {k} {what}")
            assert d.split == (0 if x.split is not None else None)
    for what, x in layouts(g):
        for k in (0, 1, -2, 6, -4):
            assert_matches(ht.diagonal(x, k), np.diagonal(g, k), f"diagonal {k} {what}")
            assert_matches(ht.diagonal(x, k, 1, 0), np.diagonal(g, k, 1, 0), what)
            assert_matches(ht.diag(x, k), np.diag(g, k), what)
            assert_matches(ht.tril(x, k), np.tril(g, k), f"tril {k} {what}")
            assert_matches(ht.triu(x, k), np.triu(g, k), f"triu {k} {what}")
            assert_matches(x.tril(k), np.tril(g, k), what)
        for dim in (0, 1):
            for size, step in ((2, 1), (3, 2), (5, 3)):
                e = torch.from_numpy(g).unfold(dim, size, step).numpy()
                assert_matches(ht.unfold(x, dim, size, step), e, f"unfold {dim} {what}")
        y = x.copy()
        y.fill_diagonal(-1.0)
        e = g.copy()
        np.fill_diagonal(e, -1.0)
        assert_matches(y, e, what)
    g3 = global_array(14, (3, 4, 5))
    for what, x in layouts(g3):
        assert_matches(ht.diagonal(x, 1, 0, 2), np.diagonal(g3, 1, 0, 2), what)
    raises_everywhere(ValueError, lambda: ht.diag(ht.array(v), offset=None), "offset")
    raises_everywhere(ValueError, lambda: ht.diag(ht.array(1.0)), "dimension")
    raises_everywhere(ValueError, lambda: ht.diagonal(ht.ones((2, 2)), 0, 1, 1), "differ")
    raises_everywhere(ValueError, lambda: ht.unfold(ht.ones(4), 0, 5), "exceeds")
    raises_everywhere(ValueError, lambda: ht.unfold(ht.ones(4), 0, 2, 0), "step")
    raises_everywhere(ValueError, lambda: ht.ones(3).fill_diagonal(0), "2-D")


def test_layout_helpers():
    """collect / collect_, redistribute_ with Heat's target_map, halos, balance(copy=)."""
    size, rank = COMM.size, COMM.rank
    g = global_array(15, (2 * size + 1, 3))
    x = ht.array(g, split=0)
    c = ht.collect(x, size - 1)
    assert c.counts == tuple(0 if r != size - 1 else g.shape[0] for r in range(size))
    assert_matches(c, g) and x.balanced
    x.collect_(0)
    assert x.counts[0] == g.shape[0]
    tm = torch.zeros((size, 2), dtype=torch.int64)
    tm[:, 0] = torch.tensor(ht.core.distribution.balanced_counts(g.shape[0], size))
    x.redistribute_(target_map=tm)
    assert x.balanced and x.lshape_map[:, 0].tolist() == tm[:, 0].tolist()
    assert_matches(x, g)
    y = x[1:]
    b = ht.balance(y, copy=True)
    assert b is not y and b.balanced
    assert ht.balance(y) is y and y.balanced
    x.get_halo(1)
    counts = x.counts
    if rank > 0 and counts[rank]:
        lo = x.displs[rank]
        np.testing.assert_array_equal(x.halo_prev.numpy(), g[lo - 1:lo])
    if rank < size - 1 and counts[rank]:
        hi = x.displs[rank] + counts[rank]
        np.testing.assert_array_equal(x.halo_next.numpy(), g[hi:hi + 1])
    lo = x.displs[rank] - (1 if x.halo_prev is not None else 0)
    np.testing.assert_array_equal(x.array_with_halos.numpy(),
                                  g[lo:lo + x.array_with_halos.shape[0]])
    raises_everywhere(TypeError, lambda: x.get_halo("1"), "integer")
    raises_everywhere(ValueError, lambda: x.get_halo(-1), "non-negative")
    if size > 1:
        raises_everywhere(ValueError, lambda: x.get_halo(g.shape[0]), "larger")
    raises_everywhere(TypeError, lambda: x.collect_(1.0), "integer")
    raises_everywhere(ValueError, lambda: x.collect_(size), "out of range")
    raises_everywhere(TypeError, lambda: x.redistribute_(target_map="x"), "target_map")
    raises_everywhere(ValueError, lambda: x.redistribute_(target_map=torch.zeros((size, 2))),
                      "sum")
    raises_everywhere(ValueError, lambda: x.redistribute_(target_map=torch.zeros((2, 4))),
                      "shape")
    assert x.tolist(keepsplit=True) == g[x.displs[rank]:x.displs[rank] + x.counts[rank]].tolist()
    assert x.tolist() == g.tolist()
    assert x.stride() == x.larray.stride()
    assert x.strides == tuple(s * 8 for s in x.larray.stride())
    x.lloc[0:1] = 5.0 if x.lshape[0] else 0.0
    assert x.lloc[0:1].dtype is torch.float64


def test_zero_size_and_zero_dimensional_edge_cases_are_numpys():
    """(before: TypeError, a torch RuntimeError, IndexError, and vstack of scalars (2,))."""
    empty = np.zeros((0, 3))
    for split in (None, 0, 1):
        x = ht.array(empty, split=split)
        for axis in (0, 1):
            assert_matches(ht.unique(x, axis=axis), np.unique(empty, axis=axis), f"{split}")
    assert_matches(ht.repeat(ht.zeros((0,)), []), np.repeat(np.zeros(0), []))
    five = ht.array(5)
    assert_matches(ht.repeat(five, 3, axis=0), np.repeat(np.array(5), 3, axis=0))
    assert_matches(ht.repeat(five, 2), np.repeat(np.array(5), 2))
    one, two = np.array(1), np.array(2)
    for name in ("vstack", "hstack", "column_stack"):
        got = getattr(ht, name)([ht.array(one), ht.array(two)])
        assert_matches(got, getattr(np, name)([one, two]), name)
