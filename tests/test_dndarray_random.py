"""heatlike.random: Philox known answers, values independent of the number of ranks and of the
layout, distribution sanity, permutations."""

import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, assert_matches, raises_everywhere

import heatlike as hl
from heatlike import random as hr

pytestmark = pytest.mark.mpi


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    mask = 0xFFFFFFFF
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((mask,) * 4, (mask, mask), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expect in cases:
        out = hr.philox([np.array([c], dtype=np.uint64) for c in counter], key)
        assert [int(w[0]) for w in out] == list(expect)


def _single_rank(fn, *args, **kwargs):
    """What one process alone produces (the same seed, call number 0)."""
    hr.seed(1234)
    return fn(*args, comm=hl.MPI_SELF, **kwargs).numpy()


@pytest.mark.parametrize("name", ["rand", "randn"])
def test_values_do_not_depend_on_ranks_or_split(name):
    fn = getattr(hr, name)
    for shape in ((7,), (5, 3), (2, 3, 4), (1, 9), (0, 2)):
        reference = _single_rank(fn, *shape, dtype=hl.float64)
        for split in [None, *range(len(shape))]:
            hr.seed(1234)
            x = fn(*shape, dtype=hl.float64, split=split)
            assert x.split == split and x.dtype is torch.float64 and x.balanced
            assert_matches(x, reference, f"{name} {shape} split={split}", rtol=0, atol=0)
    ints = _single_rank(hr.randint, -5, 17, size=(6, 4))
    for split in (None, 0, 1):
        hr.seed(1234)
        assert_matches(hr.randint(-5, 17, size=(6, 4), split=split), ints, rtol=0, atol=0)
    perm = _single_rank(hr.permutation, 23)
    hr.seed(1234)
    assert_matches(hr.permutation(23), perm, rtol=0, atol=0)


def test_successive_calls_differ_and_seed_restarts():
    hr.seed(7)
    a = hr.rand(50, split=0).numpy()
    b = hr.rand(50, split=0).numpy()
    assert not np.array_equal(a, b)
    state = hr.get_state()
    c = hr.rand(50, split=0).numpy()
    hr.set_state(state)
    np.testing.assert_array_equal(hr.rand(50, split=0).numpy(), c)
    hr.seed(7)
    np.testing.assert_array_equal(hr.rand(50, split=0).numpy(), a)
    hr.seed()  # drawn on rank 0, broadcast: all ranks agree
    values = COMM.allgather(hr.rand(5).numpy().tolist())
    assert all(v == values[0] for v in values)


def test_distributions():
    hr.seed(99)
    n = 20000
    u = hr.rand(n, split=0, dtype=hl.float64).numpy()
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.02
    for dt in (hl.float32, hl.float16, hl.bfloat16):
        v = hr.rand(1000, dtype=dt, split=0)
        assert v.dtype is dt and float(v.max().item()) < 1.0 and float(v.min().item()) >= 0
    z = hr.randn(n, split=0, dtype=hl.float64).numpy()
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1.0) < 0.05
    k = hr.randint(3, 9, size=n, split=0).numpy()
    assert k.min() == 3 and k.max() == 8 and abs(k.mean() - 5.5) < 0.1
    assert hr.randint(4, size=3, dtype=hl.int16).dtype is torch.int16
    g = hr.normal(2.0, 3.0, (n,), split=0).numpy()
    assert abs(g.mean() - 2.0) < 0.15 and abs(g.std() - 3.0) < 0.15
    w = hr.uniform(-2.0, 4.0, n, split=0).numpy()
    assert -2.0 <= w.min() and w.max() < 4.0
    r = hr.random((3, 2), split=1)
    assert r.gshape == (3, 2) and r.split == 1


def test_permutation():
    hr.seed(5)
    for n in (0, 1, 3, 17, 200):
        p = hr.permutation(n)
        assert p.split == 0 and p.balanced and p.dtype is torch.int64
        np.testing.assert_array_equal(np.sort(p.numpy()), np.arange(n))
    g = np.arange(30, dtype=np.float64).reshape(10, 3)
    for split in (None, 0, 1):
        hr.seed(11)
        x = hr.permutation(hl.array(g, split=split))
        got = x.numpy()
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, g.tolist()))
        hr.seed(11)
        order = hr.permutation(10).numpy()
        np.testing.assert_array_equal(got, g[order])
    raises_everywhere(ValueError, lambda: hr.randint(5, 5), "high <= low")
    raises_everywhere(ValueError, lambda: hr.rand(3, dtype=hl.int32), "floating")
    raises_everywhere(ValueError, lambda: hr.seed(-1), "seed")
