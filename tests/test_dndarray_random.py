"""heatlike.random: the stream's definition, values independent of the number of ranks and of the
layout, distribution sanity, permutations."""

import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, assert_matches, raises_everywhere

import heatlike as hl
from heatlike import random as hr

pytestmark = pytest.mark.mpi


def test_stream_is_numpys_pcg64dxsm():
    """The definition (heatlike.random docstring): call c after seed(s) reads numpy's PCG64DXSM
    seeded with SeedSequence([s, c]); float64 element i is word i, float32 element i half-word i
    (numpy's Generator.random conversions), integers the top 63 bits of word i."""
    n = 37

    def bits():
        return np.random.PCG64DXSM(np.random.SeedSequence([99, 2]))

    words = bits().random_raw(n)
    np.testing.assert_array_equal(hr.stream(99, 2, 5, 9), words[5:14])
    for expect, make in [
            ((words >> np.uint64(11)) * 2.0 ** -53,
             lambda: hr.rand(n, dtype=hl.float64, split=0)),
            (np.random.Generator(bits()).random(n, dtype=np.float32),
             lambda: hr.rand(n, split=0)),
            (((words >> np.uint64(1)) % np.uint64(1000)).astype(np.int64),
             lambda: hr.randint(0, 1000, size=n, split=0))]:
        hr.seed(99)
        hr.rand(1)  # calls 0 and 1 are used up
        hr.rand(1)
        np.testing.assert_array_equal(make().numpy(), expect)
    assert hr.get_state() == ("PCG64DXSM", 99, 3)


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
    # every float type, bit for bit, on shapes whose runs start at odd stream positions
    for dt in (hl.float32, hl.float16, hl.bfloat16, hl.float64):
        for shape in ((37, 5), (3, 41), (5, 7, 3)):
            reference = _single_rank(hr.rand, *shape, dtype=dt)
            for split in [None, *range(len(shape))]:
                hr.seed(1234)
                x = hr.rand(*shape, dtype=dt, split=split)
                assert_matches(x, reference, f"{dt} {shape} {split}", rtol=0, atol=0)
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
        assert v.dtype == dt and float(v.max().item()) < 1.0 and float(v.min().item()) >= 0
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


def test_heat_s_names_keywords_and_array_parameters():
    """Heat's ``normal(mean, std, shape)`` with DNDarray parameters (any split; before: a
    TypeError about devices), numpy arrays and numpy's broadcast shape without a size; a
    negative std raises on every rank (it returned samples); Heat's ``shape=`` keyword and its
    names ``standard_normal``, ``ranf``, ``sample``, ``random_integer``, ``randperm(split=)``."""
    mean, std = np.array([-1.0, 2.0, 0.5]), np.array([0.5, 2.0, 1.0])
    hr.seed(3)
    z = hr.standard_normal((3,), dtype=hl.float64).numpy()
    expect = (mean + std * z).astype(np.float32)
    for m_split in (None, 0):
        for s_split in (None, 0):
            hr.seed(3)
            got = hr.normal(hl.array(mean, split=m_split), hl.array(std, split=s_split),
                            shape=(3,))
            assert got.dtype is torch.float32
            np.testing.assert_array_equal(got.numpy(), expect)
    hr.seed(3)
    np.testing.assert_array_equal(hr.normal(mean, std).numpy(), expect)  # numpy's shape rule
    m = hl.array(np.arange(6.0).reshape(2, 3), split=0)
    for split in (None, 0, 1, 2):  # the split asked for, not the mean's (it was split along 1)
        assert hr.normal(m, 2.0, (4, 2, 3), split=split).split == split
    hr.seed(3)
    assert hr.normal(mean.reshape(3, 1), 1.0).gshape == (3, 1)
    raises_everywhere(ValueError, lambda: hr.normal(0.0, -1.0, (3,)), "non-negative")
    raises_everywhere(ValueError, lambda: hr.normal(0.0, hl.array([1.0, -1.0], split=0), (2,)),
                      "non-negative")
    raises_everywhere(TypeError, lambda: hr.random((2,), shape=(3,)), "not both")
    for fn in (hr.random, hr.random_sample, hr.ranf, hr.sample, hr.standard_normal):
        hr.seed(1)
        a = fn(shape=(4, 2), split=1)
        hr.seed(1)
        b = fn((4, 2))
        assert a.gshape == (4, 2) and a.split == 1
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    hr.seed(2)
    k = hr.random_integer(0, 5, (6,))
    hr.seed(2)
    np.testing.assert_array_equal(k.numpy(), hr.randint(0, 5, (6,)).numpy())
    hr.seed(4)
    whole = hr.randperm(9, split=None)
    hr.seed(4)
    assert whole.split is None
    np.testing.assert_array_equal(whole.numpy(), hr.randperm(9).numpy())
    raises_everywhere(ValueError, lambda: hr.randperm(4, split=1), "split")
    hr.seed(4)
    np.testing.assert_array_equal(hr.randperm(9, hl.int64, None).numpy(), whole.numpy())  # Heat's
    assert hr.randperm(9, hl.int32, None).split is None  # order: (n, dtype, split, device, comm)


def test_values_do_not_depend_on_threads():
    """Large parts are filled by several threads, each from its own stream position."""
    threads = torch.get_num_threads()
    shape = (1024, 2100)  # above the per-thread minimum for 2 and 3 threads
    try:
        got = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            hr.seed(21)
            got.append((hr.rand(*shape, split=1).numpy(), hr.randn(*shape, split=0).numpy(),
                        hr.randint(0, 7, size=shape, split=0).numpy()))
    finally:
        torch.set_num_threads(threads)
    for other in got[1:]:
        for a, b in zip(got[0], other):
            np.testing.assert_array_equal(a, b)


def test_set_state_leaves_torch_alone():
    """seed() seeds torch's generator too (as Heat's does); set_state() of heatlike's own state
    must not, or a checkpoint that restores torch's state first would have it overwritten."""
    hr.seed(3)
    a = torch.rand(3)
    state = hr.get_state()
    torch_state = torch.get_rng_state()
    hr.set_state(("PCG64DXSM", 5, 2))
    assert hr.get_state() == ("PCG64DXSM", 5, 2)
    assert torch.equal(torch.get_rng_state(), torch_state)
    hr.set_state(state)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), a)
    # a Heat state does what Heat's set_state does: torch's generator is seeded too
    hr.set_state(("Threefry", 3, 0))
    assert hr.get_state() == ("PCG64DXSM", 3, 0)
    assert torch.equal(torch.rand(3), a)
    raises_everywhere(ValueError, lambda: hr.set_state(("Mersenne", 1, 0)), "Mersenne")
    raises_everywhere(ValueError, lambda: hr.set_state(("PCG64DXSM", 1, -1)), "counter")
    raises_everywhere(TypeError, lambda: hr.set_state(5), "tuple")


def test_randint_refuses_bounds_its_dtype_or_range_cannot_hold():
    """numpy's rule: bounds outside the dtype raise (int8 values wrapped around to negatives);
    ranges of 2**63 integers or more raise (the modulus overflowed: values outside the range)."""
    raises_everywhere(ValueError, lambda: hr.randint(0, 1000, size=(4,), dtype=hl.int8),
                      "high is out of bounds")
    raises_everywhere(ValueError, lambda: hr.randint(-200, 5, size=(4,), dtype=hl.int8),
                      "low is out of bounds")
    raises_everywhere(ValueError, lambda: hr.randint(-2 ** 62, 2 ** 62, size=(4,)),
                      "fewer than 2**63")
    x = hr.randint(-128, 128, size=(64,), dtype=hl.int8, split=0)
    values = x.numpy()
    assert values.dtype == np.int8 and values.min() >= -128 and values.max() <= 127
    big = hr.randint(-2 ** 62, 2 ** 62 - 1, size=(64,), split=0).numpy()
    assert big.min() >= -2 ** 62 and big.max() < 2 ** 62 - 1


def test_uniform_never_returns_high_in_a_narrow_dtype():
    """[low, high) also after the cast: float16 rounded 244 of a million draws up to 1.0."""
    hr.seed(5)
    for dtype, n in ((torch.float16, 200_000), (torch.bfloat16, 200_000)):
        x = hr.uniform(0.0, 1.0, n, dtype=dtype, split=0)
        assert x.dtype == dtype
        assert float(x.max().item()) < 1.0 and float(x.min().item()) >= 0.0
    y = hr.uniform(3.0, 1.0, 1000, dtype=torch.float16)  # numpy's (high, low] when reversed
    assert float(y.max().item()) <= 3.0 and float(y.min().item()) >= 1.0
