"""resplit, reshape, transpose, concatenate, stack, squeeze, expand_dims, flatten against numpy,
from every layout (replicated, balanced, unbalanced, empty local parts)."""

import itertools

import numpy as np
import pytest
import torch
from _dndarray_helpers import (
    COMM,
    assert_matches,
    global_array,
    layouts,
    raises_everywhere,
    unbalanced,
)

import heatlike as hl

pytestmark = pytest.mark.mpi

SHAPES = [(0,), (1,), (6,), (3, 5), (1, 4), (5, 0), (2, 3, 4), (4, 1, 3)]


def test_resplit_every_pair_of_layouts():
    for i, shape in enumerate(SHAPES):
        g = global_array(i, shape)
        for what, x in layouts(g, seed=i):
            for axis in [None, *range(len(shape))]:
                y = x.resplit(axis)
                assert y.split == axis and y.balanced, (what, axis)
                assert_matches(y, g, f"{shape} {what} -> {axis}")
                assert y.larray.data_ptr() != x.larray.data_ptr() or y.larray.numel() == 0
                z = hl.resplit(x, axis)
                assert_matches(z, g)
            w = x.copy()
            w.resplit_(len(shape) - 1)
            assert w.split == len(shape) - 1
            assert_matches(w, g, what)
    still_value = hl.arange(8, split=0)
    still_value.resplit_(None)
    assert still_value.split is None and still_value.lshape == (8,)


def test_resplit_moves_each_element_once():
    """resplit sends exactly the elements that change owner, in one Alltoallv (the rest is a
    local copy)."""
    g = global_array(3, (6, 8))
    x = hl.array(g, split=0)
    calls = []
    original = type(COMM).Alltoallv

    def counting(self, sendbuf, recvbuf):
        calls.append(sum(sendbuf[1]))
        return original(self, sendbuf, recvbuf)

    type(COMM).Alltoallv = counting
    try:
        y = x.resplit(1)
    finally:
        type(COMM).Alltoallv = original
    stays = x.lshape[0] * y.lshape[1]  # this rank's share of both layouts: copied locally
    assert len(calls) == (1 if COMM.size > 1 else 0)
    assert sum(calls) + stays == x.lnumel
    assert_matches(y, g)


def test_reshape():
    cases = [((12,), (3, 4)), ((3, 4), (12,)), ((3, 4), (2, 6)), ((2, 3, 4), (6, 4)),
             ((2, 3, 4), (4, -1)), ((4, 6), (4, 2, 3)), ((5,), (5, 1)), ((1, 5), (5,)),
             ((0, 3), (3, 0)), ((6,), (1, 1, 6)), ((1,), ())]
    for i, (src, dst) in enumerate(cases):
        g = global_array(i, src)
        expect = g.reshape(dst)
        for what, x in layouts(g, seed=i):
            tag = f"{src} {what} -> {dst}"
            y = x.reshape(dst)
            assert_matches(y, expect, tag)
            if x.split is None:
                assert y.split is None
            elif expect.ndim:
                assert y.split == min(x.split, expect.ndim - 1), tag
            for new_split in range(expect.ndim):
                assert_matches(hl.reshape(x, dst, new_split=new_split), expect, tag)
        assert_matches(hl.reshape(hl.array(g, split=0), src), g)
    x = hl.arange(24, split=0).reshape(4, 6)
    assert_matches(x.reshape(2, 12), np.arange(24).reshape(2, 12))
    assert_matches(x.flatten(), np.arange(24))
    assert_matches(hl.ravel(x.T), np.arange(24).reshape(4, 6).T.ravel())
    raises_everywhere(ValueError, lambda: x.reshape(5, 5), "cannot reshape")
    raises_everywhere(ValueError, lambda: x.reshape(-1, -1), "one unknown")
    raises_everywhere(ValueError, lambda: x.reshape(4, 6, new_split=2), "out of range")


def test_reshape_keeps_rows_without_communication():
    g = global_array(1, (9, 2, 3))
    x = unbalanced(g, 0, seed=4)
    y = x.reshape(9, 6)
    assert y.counts == x.counts  # the rows stay where they are
    assert_matches(y, g.reshape(9, 6))


def test_transpose_swapaxes_expand_squeeze():
    for i, shape in enumerate([(3, 5), (2, 3, 4), (4, 1, 3), (1, 1)]):
        g = global_array(i, shape)
        nd = len(shape)
        for what, x in layouts(g, seed=i):
            assert_matches(x.T, g.T, what)
            for perm in itertools.permutations(range(nd)):
                y = x.transpose(perm)
                assert_matches(y, g.transpose(perm), f"{what} {perm}")
                assert y.counts == x.counts
            assert_matches(hl.swapaxes(x, 0, -1), np.swapaxes(g, 0, -1), what)
            for axis in range(-nd - 1, nd + 1):
                assert_matches(x.expand_dims(axis), np.expand_dims(g, axis), f"{what} {axis}")
            assert_matches(hl.expand_dims(x, (0, 2)), np.expand_dims(g, (0, 2)), what)
            assert_matches(x.squeeze(), g.squeeze(), what)
            for axis in range(nd):
                if shape[axis] == 1:
                    assert_matches(hl.squeeze(x, axis), g.squeeze(axis), f"{what} {axis}")
    x = hl.zeros((3, 1), split=0)
    raises_everywhere(ValueError, lambda: x.squeeze(0), "size not equal to one")
    raises_everywhere(ValueError, lambda: x.transpose(0, 0), "axes don't match")
    raises_everywhere(ValueError, lambda: x.transpose(0, 2), "out of bounds")
    raises_everywhere(ValueError, lambda: x.expand_dims(3), "out of bounds")


def test_concatenate_and_stack():
    parts = [((2, 3), (4, 3), (0, 3)), ((3, 1), (3, 4), (3, 2))]
    for axis, shapes in enumerate(parts):
        gs = [global_array(10 + j, s) for j, s in enumerate(shapes)]
        expect = np.concatenate(gs, axis=axis)
        options = [list(layouts(g, seed=j)) for j, g in enumerate(gs)]
        for combo in itertools.product(*options):
            what = " | ".join(w for w, _ in combo)
            y = hl.concatenate([x for _, x in combo], axis=axis)
            assert_matches(y, expect, f"axis {axis}: {what}")
            if any(x.split is not None for _, x in combo) and y.split == axis:
                assert y.balanced
        assert_matches(hl.concatenate([gs[0], hl.array(gs[1], split=0), gs[2]], axis=axis),
                       expect)
    g = global_array(5, (3, 4))
    h = global_array(6, (3, 4))
    for (wa, a), (wb, b) in itertools.product(layouts(g), layouts(h)):
        for axis in (0, 1, 2, -1):
            assert_matches(hl.stack([a, b, a], axis=axis), np.stack([g, h, g], axis=axis),
                           f"{wa} {wb} {axis}")
    ints = hl.arange(4, split=0)
    mixed = hl.concatenate([ints, hl.ones(2, split=0)])
    assert mixed.dtype is torch.float32
    assert_matches(mixed, np.concatenate([np.arange(4), np.ones(2)]))
    a = hl.zeros((2, 3), split=0)
    raises_everywhere(ValueError, lambda: hl.concatenate([a, hl.zeros((2, 4))]), "dimension 1")
    raises_everywhere(ValueError, lambda: hl.concatenate([a, hl.zeros(3)]), "dimensions")
    raises_everywhere(ValueError, lambda: hl.concatenate([a, a], axis=2), "out of bounds")
    raises_everywhere(TypeError, lambda: hl.concatenate(a), "sequence")
    raises_everywhere(ValueError, lambda: hl.stack([a, hl.zeros((3, 2))]), "same shape")


def test_split_with_negative_indices_is_numpys():
    """Negative split indices count from the end, as in numpy (a[0:-2] was cut to a[0:0])."""
    g = global_array(4, (7, 2))
    for what, x in layouts(g):
        for indices in ([-2], [3, -1], [-5, 6], [2, -6]):
            parts, expected = hl.split(x, indices), np.split(g, indices)
            assert len(parts) == len(expected), (what, indices)
            for p, e in zip(parts, expected):
                assert_matches(p, e, f"{what} split {indices}")


def test_clip_by_bounds_that_broadcast_along_the_split_axis():
    """A bound with more rows than x along x's split axis: the result takes the broadcast
    shape with a consistent layout (it kept x's one-row layout and left rows uninitialised)."""
    g = global_array(5, (1, 5))
    low = np.zeros((4, 5))
    for what, x in layouts(g):
        assert_matches(hl.clip(x, low, 3.0), np.clip(g, low, 3.0), f"{what}", gather=True)
        assert_matches(hl.clip(x, hl.array(low, split=0), 3.0), np.clip(g, low, 3.0),
                       f"{what}, a split bound", gather=True)
