"""Helpers of the DNDarray tests: the same random global numpy array on every rank, every layout
of it (replicated, balanced and unbalanced along each axis), and checks against numpy."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

import heatlike as hl

COMM = hl.MPI_WORLD


def global_array(seed: int, shape: tuple[int, ...], dtype: object = np.float64) -> np.ndarray:
    """The same array on every rank: integers in [-9, 9] (exact in every dtype) for integer and
    float types, random booleans for bool."""
    rng = np.random.default_rng([seed, *shape])
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(-9, 10, shape).astype(dtype)


def uneven_counts(n: int, parts: int, seed: int) -> list[int]:
    """A random split of n into ``parts`` counts (some may be zero), the same on every rank; not
    the balanced one whenever another exists."""
    rng = np.random.default_rng([seed, n, parts, 7])
    balanced = list(hl.core.distribution.balanced_counts(n, parts))
    counts = balanced
    for _ in range(20):
        cuts = np.sort(rng.integers(0, n + 1, parts - 1))
        counts = [int(c) for c in np.diff(np.concatenate([[0], cuts, [n]]))]
        if counts != balanced:
            break
    return counts


def unbalanced(g: np.ndarray, split: int, seed: int = 0) -> hl.DNDarray:
    """``g`` split along ``split`` with an uneven layout, built from local pieces (is_split)."""
    counts = uneven_counts(g.shape[split], COMM.size, seed)
    lo = sum(counts[:COMM.rank])
    piece = np.take(g, np.arange(lo, lo + counts[COMM.rank]), axis=split)
    return hl.array(piece, is_split=split)


def layouts(g: np.ndarray, seed: int = 0, unbalanced_too: bool = True
            ) -> Iterator[tuple[str, hl.DNDarray]]:
    """Every layout of ``g``: replicated, balanced along each axis, unbalanced along each axis."""
    yield "split=None", hl.array(g)
    for s in range(g.ndim):
        yield f"split={s}", hl.array(g, split=s)
        if unbalanced_too and COMM.size > 1:
            yield f"split={s} unbalanced", unbalanced(g, s, seed + s)


def layout(g: np.ndarray, name: str, seed: int = 0) -> hl.DNDarray:
    """The layout of ``g`` that :func:`layouts` calls ``name``, built alone."""
    if name == "split=None":
        return hl.array(g)
    s = int(name.split()[0].removeprefix("split="))
    return unbalanced(g, s, seed + s) if name.endswith(" unbalanced") else hl.array(g, split=s)


def check_layout(x: hl.DNDarray) -> None:
    """The metadata agree with the local tensor."""
    assert isinstance(x.larray, torch.Tensor)
    assert x.lshape == tuple(x.lshape_map[COMM.rank].tolist()), (x.lshape, x.lshape_map)
    if x.split is None:
        assert x.lshape == x.gshape
    else:
        assert sum(x.counts) == x.gshape[x.split]
        assert x.lshape[x.split] == x.counts[COMM.rank]
        assert x.lshape[:x.split] == x.gshape[:x.split]
        assert x.lshape[x.split + 1:] == x.gshape[x.split + 1:]


def assert_matches(x: hl.DNDarray, expected: object, what: str = "", rtol: float = 1e-6,
                   atol: float = 1e-6, dtype: object = None, gather: bool = False) -> None:
    """``x`` equals ``expected`` (numpy) in global shape and values (and dtype if given). Each
    rank compares its own part with the matching slab of ``expected`` (no communication), or
    the gathered whole array with ``gather=True``."""
    assert isinstance(x, hl.DNDarray), f"{what}: got {type(x).__name__}"
    check_layout(x)
    exp = np.asarray(expected)
    assert x.gshape == exp.shape, f"{what}: shape {x.gshape} != {exp.shape}"
    if dtype is not None:
        assert x.dtype == hl.core.types.canonical_dtype(dtype), f"{what}: dtype {x.dtype}"
    if gather:
        got = x.numpy()
    else:
        t = x.larray.cpu()
        got = (t.float() if t.dtype is torch.bfloat16 else t).numpy()
        if x.split is not None:
            lo = x.displs[COMM.rank]
            exp = np.take(exp, np.arange(lo, lo + x.counts[COMM.rank]), axis=x.split)
    if exp.dtype == np.bool_ or got.dtype == np.bool_:
        np.testing.assert_array_equal(got, exp, err_msg=what)
    elif got.size and np.array_equal(got, exp):
        return
    else:
        np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)


def still_in_step(comm: hl.MPICommunication = COMM) -> None:
    """Every rank reaches this point and the next collective matches."""
    v = torch.tensor([float(comm.rank + 1)])
    comm.Allreduce(hl.IN_PLACE, v)
    assert v.item() == sum(range(1, comm.size + 1))
    comm.Barrier()


def raises_everywhere(exc: type, fn, match: str | None = None) -> str:
    """``fn()`` raises ``exc`` on this rank; all ranks saw the same message; ranks still in step."""
    try:
        fn()
    except exc as e:
        msg = str(e)
    else:
        raise AssertionError(f"{fn} did not raise {exc.__name__}")
    messages = COMM.allgather(msg)
    assert len(set(messages)) == 1, messages
    if match is not None:
        assert match in msg, msg
    still_in_step()
    return msg
