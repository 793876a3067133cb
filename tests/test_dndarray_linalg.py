"""matmul / @ for every split combination (balanced, unbalanced, empty local parts), 1-D and
stacked operands, against numpy."""

import itertools

import numpy as np
import pytest
import torch
from _dndarray_helpers import assert_matches, global_array, layouts, raises_everywhere

import heatlike as hl

pytestmark = pytest.mark.mpi

SHAPES = [((5, 4), (4, 3)), ((1, 6), (6, 2)), ((3, 2), (2, 7)), ((4, 3), (3, 1)),
          ((2, 0), (0, 3)), ((0, 3), (3, 2))]


def test_matmul_every_layout_pair():
    for i, (sa, sb) in enumerate(SHAPES):
        ga, gb = global_array(i, sa), global_array(50 + i, sb)
        expect = ga @ gb
        for (wa, a), (wb, b) in itertools.product(layouts(ga, i), layouts(gb, i + 9)):
            tag = f"{sa} {wa} @ {sb} {wb}"
            y = a @ b
            assert_matches(y, expect, tag, rtol=1e-12)
            if a.split == 0 and b.split is None:
                assert y.split == 0 and y.counts == a.counts, tag
            if a.split is None and b.split == 1:
                assert y.split == 1 and y.counts == b.counts, tag
        assert_matches(hl.matmul(hl.array(ga, split=0), gb), expect)
        assert_matches(ga @ hl.array(gb, split=1), expect)


def test_matmul_vectors_stacks_and_dtypes():
    m = global_array(1, (4, 3))
    v = global_array(2, (3,))
    w = global_array(3, (4,))
    for (wm, x), (wv, y), (ww, z) in itertools.product(layouts(m), layouts(v), layouts(w)):
        tag = f"{wm} {wv} {ww}"
        assert_matches(x @ y, m @ v, tag)
        assert_matches(z @ x, w @ m, tag)
        assert_matches(hl.dot(z, z), w @ w, tag)
    s = global_array(4, (3, 4, 2))
    t = global_array(5, (2, 5))
    u = global_array(6, (3, 2, 5))
    for (ws, x), (wt, y) in itertools.product(layouts(s), layouts(t)):
        assert_matches(x @ y, s @ t, f"{ws} {wt}")
    for (ws, x), (wu, y) in itertools.product(layouts(s), layouts(u)):
        assert_matches(hl.matmul(x, y), s @ u, f"{ws} {wu}")
    a = hl.array(m.astype(np.int64), split=0)
    b = hl.array(v.astype(np.int32), split=0)
    assert (a @ b).dtype is torch.int64
    assert_matches(a @ b, m.astype(np.int64) @ v.astype(np.int32))
    f = hl.array(m, split=1).astype(hl.float32)
    assert (f @ hl.array(v)).dtype is torch.float64
    bm = global_array(7, (4, 3), dtype=bool)
    bv = global_array(8, (3, 2), dtype=bool)
    assert_matches(hl.array(bm, split=1) @ hl.array(bv, split=0), bm @ bv)


def test_matmul_errors():
    a = hl.zeros((4, 3), split=0)
    raises_everywhere(ValueError, lambda: a @ hl.zeros((4, 3), split=0), "mismatch")
    raises_everywhere(ValueError, lambda: a @ hl.zeros(5, split=0), "mismatch")
    raises_everywhere(ValueError, lambda: hl.matmul(a, hl.array(2.0)), "not have enough")


def test_dot_is_numpys_for_scalars_and_refuses_more_than_two_dimensions():
    g = global_array(31, (4, 3))
    for what, x in layouts(g):
        assert_matches(hl.dot(hl.array(2.0), x), np.dot(2.0, g), what)
        assert_matches(hl.dot(x, 3), np.dot(g, 3), what)
        assert_matches(hl.dot(x, hl.array(g.T.copy())), np.dot(g, g.T), what, rtol=1e-5)
    stack = hl.array(global_array(32, (2, 3, 4)))
    # numpy's dot of stacks is not matmul's (shape (2, 3, 2, 5), not (2, 3, 5)): refused
    raises_everywhere(NotImplementedError, lambda: hl.dot(stack, hl.ones((2, 4, 5))), "matmul")
