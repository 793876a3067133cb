"""DNDarray construction, layout metadata, conversion and factories, against numpy."""

import numpy as np
import pytest
import torch
from _dndarray_helpers import (
    COMM,
    assert_matches,
    check_layout,
    global_array,
    layouts,
    raises_everywhere,
    still_in_step,
    uneven_counts,
)

import heatlike as hl

pytestmark = pytest.mark.mpi

SHAPES = [(0,), (1,), (3,), (7,), (2, 5), (5, 1), (0, 3), (3, 4, 2), (1, 2, 6)]


def test_array_every_layout_roundtrips():
    for i, shape in enumerate(SHAPES):
        g = global_array(i, shape)
        for what, x in layouts(g, seed=i):
            assert_matches(x, g, f"{shape} {what}", gather=True)
            assert x.gshape == x.shape == g.shape and x.ndim == g.ndim and x.size == g.size
            assert x.dtype is torch.float64 and x.device == "cpu" and x.comm is COMM
            t = x.to_torch()
            assert isinstance(t, torch.Tensor) and tuple(t.shape) == shape
            np.testing.assert_array_equal(t.numpy(), g)


def test_balanced_layout_and_lshape_map():
    size = COMM.size
    for n in (0, 1, size - 1, size, 2 * size + 1, 10):
        x = hl.zeros((n, 3), split=0)
        base, extra = divmod(n, size)
        expect = [base + (r < extra) for r in range(size)]
        assert list(x.counts) == expect
        assert x.lshape_map.tolist() == [[c, 3] for c in expect]
        assert x.create_lshape_map(force_check=True).tolist() == x.lshape_map.tolist()
        assert x.balanced and x.is_balanced()
        assert x.counts_displs() == (tuple(expect), tuple(np.cumsum([0] + expect[:-1])))
        assert x.is_distributed() == (size > 1)
        y = hl.ones((3, n), split=1)
        assert list(y.counts) == expect and y.lshape == (3, expect[COMM.rank])
    r = hl.zeros((4, 2))
    assert r.split is None and r.counts is None and r.balanced
    assert r.lshape_map.tolist() == [[4, 2]] * size


def test_is_split_unbalanced_and_balance():
    for n in (0, 2, 5, 9):
        g = global_array(n, (n, 3))
        counts = uneven_counts(n, COMM.size, seed=n)
        lo = sum(counts[:COMM.rank])
        x = hl.array(g[lo:lo + counts[COMM.rank]], is_split=0)
        assert list(x.counts) == counts
        assert x.balanced == (counts == list(hl.core.distribution.balanced_counts(n, COMM.size)))
        assert_matches(x, g, "unbalanced")
        y = x.copy()
        assert y.balance_() is y
        assert y.balanced
        assert_matches(y, g, "balanced")
        assert_matches(hl.balance(x), g, "hl.balance")
        target = list(reversed(counts))
        x.redistribute_(target)
        assert list(x.counts) == target
        assert_matches(x, g, "redistributed")
    # dtypes of the pieces are promoted
    piece = np.ones(2, dtype=np.int32 if COMM.rank % 2 else np.float32)
    x = hl.array(piece, is_split=0)
    assert x.dtype is torch.float32
    assert x.gshape == (2 * COMM.size,)


def test_constructor_wraps_local_tensors():
    g = global_array(3, (6, 2))
    counts = uneven_counts(6, COMM.size, seed=1)
    lo = sum(counts[:COMM.rank])
    local = torch.from_numpy(g[lo:lo + counts[COMM.rank]].copy())
    x = hl.DNDarray(local, split=0)  # shapes exchanged
    assert x.gshape == (6, 2) and list(x.counts) == counts
    assert_matches(x, g)
    y = hl.DNDarray(local, (6, 2), 0, counts=counts)
    assert_matches(y, g)
    z = hl.DNDarray(torch.from_numpy(g.copy()))
    assert z.split is None and z.gshape == (6, 2)


def test_larray_setter():
    x = hl.zeros((5, 2), split=0)
    x.larray = torch.ones(x.lshape, dtype=torch.float64)
    assert x.dtype is torch.float64
    assert_matches(x, np.ones((5, 2)))
    with pytest.raises(ValueError, match="local shape"):
        x.larray = torch.ones(x.lshape[0] + 1, 2)
    with pytest.raises(TypeError):
        x.larray = np.ones(x.lshape)


def test_conversions():
    g = global_array(4, (3, 4))
    for what, x in layouts(g):
        assert x.tolist() == g.tolist(), what
        np.testing.assert_array_equal(np.asarray(x), g)
        y = x.astype(np.int32)
        assert y.dtype is torch.int32 and y.split == x.split
        assert_matches(y, g.astype(np.int32), what)
        assert_matches(x.astype("float32"), g.astype(np.float32), what)
        assert_matches(x.astype(hl.bfloat16), g.astype(np.float32), what)
    one = hl.array(np.array([[2.5]]), split=1)
    assert one.item() == 2.5 and float(one) == 2.5 and int(one) == 2 and bool(one)
    assert len(hl.zeros((4, 2), split=1)) == 4
    rows = [r.numpy() for r in hl.array(g, split=0)]
    np.testing.assert_array_equal(np.stack(rows), g)
    raises_everywhere(ValueError, lambda: hl.zeros(3, split=0).item(), "size 1")
    raises_everywhere(ValueError, lambda: bool(hl.zeros(3, split=0)), "ambiguous")


def test_dtypes_accepted():
    cases = [(float, torch.float32), (int, torch.int64), (bool, torch.bool),
             (np.float64, torch.float64), ("int16", torch.int16), ("f4", torch.float32),
             (torch.uint8, torch.uint8), ("bfloat16", torch.bfloat16),
             (np.dtype(">i4"), torch.int32), (complex, torch.complex64)]
    for spec, expect in cases:
        assert hl.zeros(2, dtype=spec).dtype is expect, spec
    for bad in ("nonsense", object, np.dtype("U3"), 3.5):
        raises_everywhere(TypeError, lambda bad=bad: hl.zeros(2, dtype=bad))
    assert hl.array([1.5, 2]).dtype is torch.float32
    assert hl.array([1, 2]).dtype is torch.int64
    assert hl.array(np.arange(3, dtype=np.int16), split=0).dtype is torch.int16


def test_factories():
    size = COMM.size
    for split in (None, 0, 1):
        for shape in ((0, 3), (1, 4), (size + 1, 3), (5, 2)):
            assert_matches(hl.zeros(shape, split=split), np.zeros(shape), f"zeros {shape}")
            assert_matches(hl.ones(shape, dtype=int, split=split), np.ones(shape, int))
            assert_matches(hl.full(shape, 7, split=split), np.full(shape, 7), dtype=torch.int64)
            assert_matches(hl.full(shape, 2.5, split=split), np.full(shape, 2.5),
                           dtype=torch.float32)
            assert_matches(hl.full(shape, True, split=split), np.full(shape, True),
                           dtype=torch.bool)
            e = hl.empty(shape, split=split)
            check_layout(e)
            assert e.gshape == shape
            for k in (-1, 0, 2):
                assert_matches(hl.eye(shape[0], shape[1], k=k, split=split),
                               np.eye(shape[0], shape[1], k=k), f"eye {shape} {k}")
        assert_matches(hl.eye(4, split=split), np.eye(4))
    for split in (None, 0):
        for args in ((0,), (1,), (7,), (2, 11, 3), (10, 2, -3), (5, 1), (0.5, 3.0, 0.25),
                     (-1.0, 1.0, 0.3)):
            assert_matches(hl.arange(*args, split=split), np.arange(*args), f"arange {args}")
        assert hl.arange(3).dtype is torch.int64 and hl.arange(3.0).dtype is torch.float32
        assert_matches(hl.arange(4, dtype=hl.float64, split=split), np.arange(4.0))
        for args, dtype in (((0.5, 5, 1.5), np.int64), ((-2.7, 3.1, 0.7), np.int32),
                            ((5.5, -3, -1.25), np.int64), ((0.1, 1.0, 0.3), np.float64),
                            ((1, 2.5, 0.1), np.float64)):  # numpy's step, to the bit
            got = hl.arange(*args, dtype=dtype, split=split).numpy()
            want = np.arange(*args, dtype=dtype)
            assert got.dtype == want.dtype and np.array_equal(got, want), f"{args} {got}"
        for num in (0, 1, 2, 5, 13):
            for endpoint in (True, False):
                got = hl.linspace(-1.0, 2.0, num, endpoint=endpoint, dtype=hl.float64,
                                  split=split)
                assert_matches(got, np.linspace(-1.0, 2.0, num, endpoint=endpoint),
                               f"linspace {num} {endpoint}", rtol=0, atol=1e-15)
        x, step = hl.linspace(0, 1, 5, retstep=True, split=split)
        assert step == 0.25 and x.dtype is torch.float32
    raises_everywhere(ValueError, lambda: hl.zeros((2, -1)), "negative")
    raises_everywhere(ValueError, lambda: hl.arange(1, 5, 0), "step")


def test_like_factories_keep_layout():
    g = global_array(9, (7, 3))
    for what, x in layouts(g):
        for fn, value in ((hl.zeros_like, 0), (hl.ones_like, 1)):
            y = fn(x)
            assert y.split == x.split and y.counts == x.counts and y.dtype == x.dtype, what
            assert_matches(y, np.full(g.shape, value), what)
        y = hl.full_like(x, 3, dtype=hl.int32)
        assert y.dtype is torch.int32 and y.counts == x.counts
        assert_matches(y, np.full(g.shape, 3))
        e = hl.empty_like(x)
        assert e.counts == x.counts and e.gshape == x.gshape
        z = hl.zeros_like(x, split=1)
        assert z.split == 1 and z.balanced
        assert_matches(z, np.zeros(g.shape))
        assert hl.zeros_like(x, split=None).split is None


def test_array_from_torch_and_lists_and_dndarray():
    t = torch.arange(12.0).reshape(3, 4)
    for split in (None, 0, 1):
        x = hl.array(t, split=split)
        assert_matches(x, t.numpy())
        x.larray.fill_(-1)
        assert t[0, 0].item() == 0.0  # copied
    x = hl.array([[1, 2], [3, 4]], split=0, dtype=hl.float64)
    assert x.dtype is torch.float64
    y = hl.array(x, split=1)
    assert y.split == 1
    assert_matches(y, np.array([[1.0, 2], [3, 4]]))
    assert hl.asarray(x) is x
    assert hl.array(5.0).gshape == () and hl.array(5.0).item() == 5.0
    assert hl.array([1, 2], ndmin=3).gshape == (1, 1, 2)


def test_repr():
    for shape in ((3,), (2, 3), (20, 60), (0, 2)):
        g = global_array(2, shape)
        for what, x in layouts(g):
            text = str(x)
            if COMM.rank == 0:
                expect = np.array2string(g, separator=", ", prefix="DNDarray(")
                assert text.startswith("DNDarray(" + expect), (what, text)
            assert f"shape={shape}" in text and f"split={x.split}" in text
            assert "dtype=float64" in text and "device=cpu" in text
    big = hl.arange(10 ** 4, split=0)
    text = str(big)
    if COMM.rank == 0:
        assert "[   0,    1,    2, ..., 9997, 9998, 9999]" in text, text
    still_in_step()


def test_repr_is_local():
    """repr() communicates nothing, so one rank alone may take it (pytest's failure reports,
    debuggers and loggers do); Heat's repr is local too. str() / print() gather."""
    g = global_array(3, (7, 2))
    x = hl.array(g, split=0)
    if COMM.rank == 0:
        text = repr(x)
        assert "shape=(7, 2)" in text and "split=0" in text
        lo, hi = x.displs[0], x.displs[0] + x.counts[0]
        if COMM.size > 1:
            assert f"rank 0 of {COMM.size} holds [{lo}:{hi}] of axis 0" in text
    still_in_step()
    r = repr(hl.array(g))
    assert r.startswith("DNDarray(" + np.array2string(g, separator=", ", prefix="DNDarray("))


def test_construction_errors():
    raises_everywhere(ValueError, lambda: hl.array(np.zeros((2, 3)), split=2), "split axis 2")
    raises_everywhere(ValueError, lambda: hl.zeros((2, 3), split=-3), "out of range")
    raises_everywhere(TypeError, lambda: hl.zeros((2, 3), split=1.0), "split")
    raises_everywhere(ValueError, lambda: hl.array([1, 2], split=0, is_split=0), "exclusive")
    bad_ndim = np.zeros((2, 3)) if COMM.rank == 0 else np.zeros(3)
    if COMM.size > 1:
        raises_everywhere(ValueError, lambda: hl.array(bad_ndim, is_split=0), "dimensions")
        bad_rest = np.zeros((2, 3 + COMM.rank))
        raises_everywhere(ValueError, lambda: hl.array(bad_rest, is_split=0), "differ outside")
        # split=: the whole array on every rank; before, a rank with another shape or dtype got
        # other counts, and numpy() read memory no rank wrote
        last = COMM.size - 1
        longer = np.arange(10 + (COMM.rank == last), dtype=np.float32)
        raises_everywhere(ValueError, lambda: hl.array(longer, split=0),
                          f"rank {last}: (11,) float32")
        wider = np.zeros(4, dtype=np.float64 if COMM.rank == 0 else np.float32)
        raises_everywhere(ValueError, lambda: hl.array(wider, split=0), "rank 0: (4,) float64")
        odd = object() if COMM.rank == last else [1.0, 2.0]
        raises_everywhere(TypeError, lambda: hl.array(odd, split=0), f"on rank {last}")
    raises_everywhere(ValueError, lambda: hl.array(np.zeros((2, 3)), is_split=2), "out of range")
    raises_everywhere(TypeError, lambda: hl.array(np.array(["a"])), "numpy dtype")
    raises_everywhere(ValueError, lambda: hl.zeros(3, device="tpu"), "device")
