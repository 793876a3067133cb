"""x[key] and x[key] = value in global coordinates against numpy, for every layout."""

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
)

import heatlike as hl

pytestmark = pytest.mark.mpi

KEYS_1D = [0, -1, 3, slice(None), slice(1, 5), slice(None, None, 2), slice(-2, None),
           slice(None, None, -1), slice(5, 0, -2), slice(10, -10, -3), slice(3, 3),
           slice(-100, 100), (None, slice(1, None)), Ellipsis, [0, 3, 3, -1], [],
           np.array([5, 1, 2])]
KEYS_2D = [1, -2, (0, 1), (-1, -1), slice(1, 3), (slice(None), 2), (slice(None), slice(None, 2)),
           (slice(None, None, -1), slice(1, None, 2)), (Ellipsis, 0), (Ellipsis, slice(None, 3)),
           (None, 2, slice(None)), (slice(None), None), (slice(4, None, -2), -1),
           (0, slice(None, None, -1)), ([2, 0, 2], slice(1, 3)), (slice(None), [3, 0]),
           (-1, [1, 1]), (slice(None, None, 3), None, slice(None, None, -2))]
KEYS_3D = [(0, 1, 2), (slice(None), 0), (Ellipsis, 1), (1, slice(None, None, -1), None),
           (slice(None, None, 2), slice(1, 3), slice(None, None, -1)), (slice(None), [0, 2]),
           (None, Ellipsis, None), (-1,)]


def _check_getitem(shape, keys, seed):
    g = global_array(seed, shape)
    for what, x in layouts(g, seed=seed):
        for key in keys:
            tag = f"{shape} {what} [{key!r}]"
            assert_matches(x[key], g[key], tag)


def test_getitem_basic_and_integer_arrays():
    _check_getitem((7,), KEYS_1D, 1)
    _check_getitem((5, 4), KEYS_2D, 2)
    _check_getitem((3, 4, 3), KEYS_3D, 3)
    _check_getitem((1, 3), [0, (slice(None), 1), (slice(None, None, -1), 0)], 4)


def test_getitem_slices_layout():
    g = global_array(5, (9, 2))
    x = hl.array(g, split=0)
    y = x[1:8:3]
    assert y.split == 0 and sum(y.counts) == 3
    z = x[::-1]
    assert z.split == 0 and z.balanced
    w = x[4]
    assert w.split is None
    v = x[:, 1]
    assert v.split == 0 and v.counts == x.counts
    assert_matches(x[hl.argmax(x[:, 0])], g[np.argmax(g[:, 0])])  # a 0-d DNDarray index
    assert v.larray.data_ptr() == x.larray[:, 1].data_ptr() or v.larray.numel() == 0


def test_getitem_index_arrays_distributed():
    g = global_array(6, (8, 3))
    idx = np.array([7, 0, 3, 3, -8, 5])
    for what, x in layouts(g):
        for wi, i in layouts(idx):
            assert_matches(x[i], g[idx], f"{what} idx {wi}")
            assert_matches(hl.take(x, i, axis=0), g[idx], f"{what} idx {wi}")
            assert_matches(x.T[:, i], g.T[:, idx], f"{what} idx {wi}")
        assert_matches(x[torch.tensor([1, 2])], g[[1, 2]], what)
        assert_matches(x[[True, False] * 4], g[[True, False] * 4], what)
        assert_matches(x[:, np.array([True, False, True])], g[:, [True, False, True]], what)
    raises_everywhere(IndexError, lambda: hl.array(g, split=0)[[8]], "out of bounds")
    raises_everywhere(IndexError, lambda: hl.array(g, split=0)[hl.array([0, 9], split=0)],
                      "out of bounds")


def test_getitem_masks():
    for i, shape in enumerate([(7,), (5, 4), (3, 4, 2), (0, 3), (2, 1)]):
        g = global_array(i, shape)
        for what, x in layouts(g, seed=i):
            for k in range(1, len(shape) + 1):
                m = global_array(20 + i + k, shape[:k], dtype=bool)
                expect = g[m]
                for wm, mask in layouts(m, seed=i + k):
                    assert_matches(x[mask], expect, f"{shape} {what} mask{k} {wm}")
                assert_matches(x[m], expect, f"{shape} {what} numpy mask{k}")
            assert_matches(x[x > 0], g[g > 0], what)
            assert_matches(x[torch.from_numpy(g < 0)], g[g < 0], what)
            # a mask in a one-element tuple is the mask (numpy's x[(m,)]; it was an IndexError)
            assert_matches(x[(x > 0,)], g[(g > 0,)], what)
            y = x.copy()
            y[(y > 0,)] = -1.0
            h = g.copy()
            h[(h > 0,)] = -1.0
            assert_matches(y, h, f"{what} setitem")


def test_setitem_basic():
    keys = [(1,), (slice(1, 4), 0), (slice(None, None, -2),), (Ellipsis, -1), (slice(None), None),
            (slice(None, None, 3), slice(None, None, -1)), (-1, slice(1, 3)), (4, 2),
            (slice(3, 0, -1), [0, 2])]
    g = global_array(7, (6, 3))
    for key in keys:
        sel_shape = g[key].shape
        values = [5.0, global_array(8, sel_shape), global_array(9, sel_shape[-1:])]
        for what, _ in layouts(g):
            for vi, value in enumerate(values):
                for value_layout in (["numpy"] + [w for w, _ in layouts(np.asarray(value))]
                                     if np.ndim(value) else ["scalar"]):
                    x = layout(g, what)
                    counts = x.counts
                    expect = g.copy()
                    expect[key] = value
                    if value_layout in ("numpy", "scalar"):
                        v = value
                    else:
                        v = layout(np.asarray(value), value_layout)
                    x[key] = v
                    tag = f"[{key!r}] = value{vi} ({value_layout}) into {what}"
                    assert x.counts == counts, tag
                    assert_matches(x, expect, tag)


#: an integer and an index array apart (a slice, ``None`` or ``...`` between them): numpy puts the
#: index array's axis first; side by side it stays in place
KEYS_APART = [(0, slice(None), [1, 2]), (2, None, [1, 0]), (Ellipsis, 0, [2, 0, 0]),
              (-1, slice(None, None, -1), np.array([True, False, True])),
              ([3, 1], slice(1, None), 0), (0, None, slice(None), [1, 2], None),
              (slice(None), 0, [1, 2]), (1, [0, 3], slice(None))]


def test_separated_integer_and_index_array_put_the_array_axis_first_as_numpy():
    _check_getitem((5, 4, 3), KEYS_APART, 10)
    g = global_array(11, (5, 4, 3))
    for key in KEYS_APART:
        sel_shape = g[key].shape
        values = [global_array(12, sel_shape), global_array(13, sel_shape[-1:])]
        for what, _ in layouts(g):
            for vi, value in enumerate(values):
                for value_layout, v in [("numpy", value), *layouts(value)]:
                    x = layout(g, what)
                    expect = g.copy()
                    expect[key] = value
                    x[key] = v
                    assert_matches(x, expect, f"[{key!r}] = value{vi} ({value_layout}) into {what}")


def test_zero_dimensional_boolean_indices_add_an_axis_as_numpy():
    """``x[True]``, ``x[np.False_]`` and ``z[z > 0]`` for a 0-d ``z``: a new first axis holding
    ``x`` once or not at all (before: IndexError)."""
    g = global_array(3, (5, 2))
    for what, x in layouts(g):
        for key in (True, False, np.True_, np.array(False), torch.tensor(True)):
            assert_matches(x[key], g[bool(key)], f"{key!r} {what}")
    z = hl.array(3.0)
    assert_matches(z[z > 0], np.array([3.0]))
    assert_matches(z[z < 0], np.array([], dtype=np.float32))


def test_setitem_masks_and_dtypes():
    g = global_array(10, (5, 4))
    for what, _ in layouts(g):
        for k in (1, 2):
            m = global_array(11 + k, g.shape[:k], dtype=bool)
            n_true = int(m.sum())
            for wm, mask in [("numpy", m)] + list(layouts(m, seed=k)):
                x = layout(g, what)
                expect = g.copy()
                expect[m] = -1.5
                x[mask] = -1.5
                assert_matches(x, expect, f"{what} mask{k} {wm} scalar")
                val = global_array(13, (n_true, *g.shape[k:]))
                for wv, v in [("numpy", val)] + list(layouts(val, seed=3)):
                    x = layout(g, what)
                    expect = g.copy()
                    expect[m] = val
                    x[mask] = v
                    assert_matches(x, expect, f"{what} mask{k} {wm} value {wv}")
        x = layout(g, what)
        expect = g.copy()
        expect[expect > 2] = 0
        x[x > 2] = 0
        assert_matches(x, expect, what)
    xi = hl.arange(6, split=0)
    xi[1:3] = 7.9  # numpy casts to the array's dtype
    assert_matches(xi, np.array([0, 7, 7, 3, 4, 5]), dtype=torch.int64)
    x = hl.array(global_array(1, (4, 4)), split=1)
    expect = global_array(1, (4, 4))
    x[1:] = x[:-1]  # overlapping source and target
    expect[1:] = expect[:-1].copy()
    assert_matches(x, expect)


def test_indexing_errors():
    x = hl.zeros((4, 3), split=0)
    raises_everywhere(IndexError, lambda: x[4], "out of bounds")
    raises_everywhere(IndexError, lambda: x[0, -4], "out of bounds")
    raises_everywhere(IndexError, lambda: x[0, 0, 0], "too many indices")
    raises_everywhere(IndexError, lambda: x[..., ...], "single ellipsis")
    raises_everywhere(IndexError, lambda: x["a"], "valid indices")
    raises_everywhere(IndexError, lambda: x[np.ones(3, bool)], "boolean index did not match")
    raises_everywhere(IndexError, lambda: x[[0.5]], "integer")
    raises_everywhere(ValueError, lambda: x[::0], "zero")
    raises_everywhere(ValueError, lambda: x.__setitem__(slice(None), np.ones(4)), "broadcast")
    raises_everywhere(ValueError, lambda: x.__setitem__(x > 0, np.ones(5)), "broadcast")
    raises_everywhere(IndexError, lambda: x.__setitem__(5, 1.0), "out of bounds")
    assert COMM.size >= 1
