"""Random DNDarrays whose values do not depend on the number of ranks.

Generation is counter-based: element ``i`` (its index in the C-order flattening of the global
array) of the ``c``-th random call after ``seed(s)`` is a function of ``(s, c, i)`` only. Its
random words are those numbered ``i * per`` to ``i * per + per - 1`` (``per``: 1 for float32, 2
for float64 and integers, 4 for normal samples), and word ``w`` is word ``w % 4`` of the
Philox4x32-10 block cipher (Salmon et al., SC'11) applied to the counter ``(w // 4, c)`` with key
``s``. Each rank evaluates it for its own elements (vectorized numpy, in chunks), so the
concatenation of the local parts equals the one-rank result for the same seed, whatever the
layout; no communication is needed. Values are generated on the host and moved to the array's
device.

Every call is collective in the sense that all ranks must make the same sequence of calls (each
advances the shared call counter). Without :func:`seed`, rank 0 draws a seed from the operating
system at the first call and broadcasts it.

:func:`permutation` sorts random 63-bit keys of the indices ``0..n-1`` with a distributed bucket
sort (keys are uniform, so key ranges make balanced buckets): one ``Alltoallv`` of (key, index)
pairs to the bucket owners, a local sort, one ``Alltoallv`` to rebalance. The result is the
argsort of the keys, again independent of the number of ranks.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

from .core import distribution
from .core.communication import MPICommunication, sanitize_comm
from .core.devices import sanitize_device, torch_device
from .core.dndarray import DNDarray
from .core.factories import _layout, _shape
from .core.indexing import take
from .core.types import canonical_dtype

__all__ = ["seed", "get_state", "set_state", "rand", "randn", "random", "random_sample",
           "uniform", "normal", "randint", "permutation", "randperm", "philox"]

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10

_state: dict = {"seed": None, "counter": 0}


def seed(value: int | None = None, comm: MPICommunication | None = None) -> None:
    """Restart the generator from ``value`` (a non-negative integer below 2**64; None: a seed
    drawn by rank 0 from the operating system and broadcast, a collective call)."""
    if value is None:
        comm = sanitize_comm(comm)
        value = comm.bcast(secrets.randbits(63) if comm.rank == 0 else None, root=0)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) < 2 ** 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {value!r}")
    _state["seed"] = int(value)
    _state["counter"] = 0


def get_state() -> tuple[str, int | None, int]:
    """``("Philox", seed, calls made since seeding)``."""
    return "Philox", _state["seed"], _state["counter"]


def set_state(state: tuple[str, int, int]) -> None:
    """Restore a state returned by :func:`get_state`."""
    name, value, counter = state
    if name != "Philox":
        raise ValueError(f"unknown generator {name!r}")
    seed(value)
    _state["counter"] = int(counter)


def _next_call(comm: MPICommunication) -> tuple[int, int]:
    if _state["seed"] is None:
        seed(None, comm)
    call = _state["counter"]
    _state["counter"] += 1
    return _state["seed"], call


def philox(counter: Sequence[np.ndarray], key: tuple[int, int]) -> list[np.ndarray]:
    """Philox4x32-10 of the counters ``(c0, c1, c2, c3)`` (uint64 arrays of 32-bit values) under
    ``key`` (two 32-bit integers); returns four uint64 arrays of 32-bit words. A product of two
    32-bit values fits a uint64 exactly, so ``mulhi``/``mullo`` are a shift and a mask."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = int(key[0]), int(key[1])
    m0, m1, mask = np.uint64(_M0), np.uint64(_M1), np.uint64(_MASK)
    shift = np.uint64(32)
    for _ in range(_ROUNDS):
        p0 = c0 * m0
        p1 = c2 * m1
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & mask,
                          (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & mask)
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return [c0, c1, c2, c3]


_CHUNK = 1 << 16


def _words(index: np.ndarray, per: int, seed_value: int, call: int) -> np.ndarray:
    """``(len(index), per)`` random 32-bit words (uint32) of the elements with the given global
    indices (ascending), ``per`` in {1, 2, 4}. Word ``w`` of the call is word ``w % 4`` of Philox
    at counter ``(w // 4, call)``; element ``i`` owns words ``i * per ... i * per + per - 1``, so
    one Philox evaluation serves ``4 / per`` consecutive elements."""
    key = (seed_value & _MASK, (seed_value >> 32) & _MASK)
    out = np.empty((index.size, per), dtype=np.uint32)
    hi_call, lo_call = np.uint64((call >> 32) & _MASK), np.uint64(call & _MASK)
    lanes = np.arange(per, dtype=np.int64)
    for start in range(0, index.size, _CHUNK):
        w = index[start:start + _CHUNK] * per
        c = w >> 2
        first = np.empty(c.size, dtype=bool)
        first[:1] = True
        np.not_equal(c[1:], c[:-1], out=first[1:])
        unique = c[first].astype(np.uint64)
        words = np.empty((unique.size, 4), dtype=np.uint32)
        for j, word in enumerate(philox((unique & np.uint64(_MASK), unique >> np.uint64(32),
                                         np.full_like(unique, lo_call),
                                         np.full_like(unique, hi_call)), key)):
            words[:, j] = word
        pos = (np.cumsum(first) - 1) * 4 + (w & 3)
        out[start:start + c.size] = words.reshape(-1)[pos[:, None] + lanes]
    return out


def _global_index(shape: tuple[int, ...], split: int | None, lo: int, hi: int) -> np.ndarray:
    """C-order global indices of the local part (``[lo, hi)`` along ``split``), ascending."""
    if split is None:
        return np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    outer = int(np.prod(shape[:split], dtype=np.int64))
    inner = int(np.prod(shape[split + 1:], dtype=np.int64))
    n = shape[split]
    idx = (np.arange(outer, dtype=np.int64)[:, None, None] * (n * inner)
           + np.arange(lo, hi, dtype=np.int64)[None, :, None] * inner
           + np.arange(inner, dtype=np.int64)[None, None, :])
    return idx.reshape(-1)


def _size(args: tuple) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return _shape(args[0])
    return _shape(args)


def _generate(shape: tuple[int, ...], split: int | None, per: int, device: object,
              comm: MPICommunication | None) -> tuple[np.ndarray, tuple]:
    """This rank's random words, ``(local numel, per)``, and ``(gshape, split, counts, comm,
    local shape, torch device)``."""
    comm = sanitize_comm(comm)
    s, counts, lshape = _layout(shape, split, comm)
    lo, hi = (0, 0) if s is None else distribution.ranges(counts)[comm.rank]
    dev = torch_device(sanitize_device(device))
    seed_value, call = _next_call(comm)
    words = _words(_global_index(shape, s, lo, hi), per, seed_value, call)
    return words, (shape, s, counts, comm, lshape, dev)


def _wrap(values: np.ndarray, dtype: torch.dtype, meta: tuple) -> DNDarray:
    gshape, s, counts, comm, lshape, dev = meta
    t = torch.from_numpy(np.ascontiguousarray(values).reshape(lshape))
    return DNDarray._make(t.to(device=dev, dtype=dtype), gshape, s, counts, comm)


_TWO_53 = 2.0 ** -53


def _unit53(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Uniform float64 in [0, 1) from 27 + 26 random bits."""
    return ((hi >> 5).astype(np.float64) * 67108864.0 + (lo >> 6)) * _TWO_53


def _unit(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Uniform values in [0, 1) with as many random bits as ``dtype``'s significand (float64:
    two words per element, otherwise one)."""
    if dtype is torch.float64:
        return _unit53(words[:, 0], words[:, 1])
    bits = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    values = (words[:, 0] >> (32 - bits)).astype(np.float32)
    values *= np.float32(2.0 ** -bits)
    return values


def _float_dtype(dtype: object) -> torch.dtype:
    dt = torch.get_default_dtype() if dtype is None else canonical_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"dtype must be a floating point type, got {dt}")
    return dt


def rand(*shape: int, dtype: object = None, split: int | None = None, device: object = None,
         comm: MPICommunication | None = None) -> DNDarray:
    """Uniform samples from [0, 1) of the given shape (``rand(3, 4)`` or ``rand((3, 4))``)."""
    dt = _float_dtype(dtype)
    words, meta = _generate(_size(shape), split, 2 if dt is torch.float64 else 1, device, comm)
    return _wrap(_unit(words, dt), dt, meta)


def random(size: int | Sequence[int] = (), dtype: object = None, split: int | None = None,
           device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """Uniform samples from [0, 1) (numpy's ``random.random(size)``)."""
    return rand(*_size((size,)), dtype=dtype, split=split, device=device, comm=comm)


random_sample = random


def uniform(low: float = 0.0, high: float = 1.0, size: int | Sequence[int] = (),
            dtype: object = None, split: int | None = None, device: object = None,
            comm: MPICommunication | None = None) -> DNDarray:
    """Uniform samples from [low, high)."""
    u = random(size, dtype=torch.float64, split=split, device=device, comm=comm)
    return u._rewrap((u.larray * (high - low) + low).to(_float_dtype(dtype)))


def randn(*shape: int, dtype: object = None, split: int | None = None, device: object = None,
          comm: MPICommunication | None = None) -> DNDarray:
    """Standard normal samples (Box-Muller on two 53-bit uniforms, in float64, then cast)."""
    dt = _float_dtype(dtype)
    words, meta = _generate(_size(shape), split, 4, device, comm)
    u1 = 1.0 - _unit53(words[:, 0], words[:, 1])  # in (0, 1]: log(u1) is finite
    u2 = _unit53(words[:, 2], words[:, 3])
    return _wrap(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2), dt, meta)


def normal(mean: float = 0.0, std: float = 1.0, size: int | Sequence[int] = (),
           dtype: object = None, split: int | None = None, device: object = None,
           comm: MPICommunication | None = None) -> DNDarray:
    """Normal samples with the given mean and standard deviation."""
    z = randn(*_size((size,)), dtype=torch.float64, split=split, device=device, comm=comm)
    return z._rewrap((z.larray * std + mean).to(_float_dtype(dtype)))


def randint(low: int, high: int | None = None, size: int | Sequence[int] = (),
            dtype: object = None, split: int | None = None, device: object = None,
            comm: MPICommunication | None = None) -> DNDarray:
    """Integers uniform in ``[low, high)`` (``[0, low)`` when ``high`` is None), from 63 random
    bits reduced modulo the range (bias below ``range / 2**63``)."""
    if high is None:
        low, high = 0, low
    low, high = int(low), int(high)
    if high <= low:
        raise ValueError(f"high <= low ({high} <= {low})")
    dt = torch.int64 if dtype is None else canonical_dtype(dtype)
    if dt.is_floating_point or dt.is_complex or dt is torch.bool:
        raise ValueError(f"dtype must be an integer type, got {dt}")
    words, meta = _generate(_size((size,)), split, 2, device, comm)
    values = _bits63(words) % np.uint64(high - low)
    return _wrap(values.astype(np.int64) + low, dt, meta)


def _bits63(words: np.ndarray) -> np.ndarray:
    """63 random bits per element from its two words (uint64)."""
    hi = (words[:, 0] & 0x7FFFFFFF).astype(np.uint64)
    return (hi << np.uint64(32)) | words[:, 1].astype(np.uint64)


def randperm(n: int, dtype: object = None, device: object = None,
             comm: MPICommunication | None = None) -> DNDarray:
    """A random permutation of ``0..n-1``, split along 0 (balanced)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    n = int(n)
    comm = sanitize_comm(comm)
    words, (_, _, counts, comm, _, dev) = _generate((n,), 0, 2, device, comm)
    keys = torch.from_numpy(_bits63(words).astype(np.int64)).to(dev)
    lo = distribution.ranges(counts)[comm.rank][0]
    pairs = torch.stack([keys, torch.arange(lo, lo + keys.numel(), device=dev)], dim=1)
    size = comm.size
    bounds = torch.tensor([(2 ** 63 // size) * i for i in range(1, size)], dtype=torch.int64,
                          device=keys.device)
    bucket = torch.bucketize(keys, bounds, right=True)
    order = torch.argsort(bucket, stable=True)
    pairs = pairs[order].contiguous()
    send = torch.bincount(bucket, minlength=size).cpu()
    recv = torch.empty_like(send)
    comm.Alltoall(send, recv)
    sc, rc = send.tolist(), recv.tolist()
    got = torch.empty((sum(rc), 2), dtype=torch.int64, device=keys.device)
    comm.Alltoallv((pairs, [2 * c for c in sc]), (got, [2 * c for c in rc]))
    local = got[torch.argsort(got[:, 0], stable=True), 1].contiguous()
    new_counts = tuple(comm.allgather(int(local.numel())))
    out = DNDarray._make(local, (n,), 0, new_counts, comm).balance_()
    return out if dtype is None else out.astype(dtype, copy=False)


def permutation(x: int | DNDarray | object, comm: MPICommunication | None = None) -> DNDarray:
    """A random permutation of ``range(x)`` for an integer, else a copy of ``x`` with its first
    axis shuffled (the rows are fetched from their owners; see :func:`heatlike.take`)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return randperm(int(x), comm=comm)
    if not isinstance(x, DNDarray):
        from .core.factories import array

        x = array(x, comm=comm)
    if x.ndim == 0:
        raise ValueError("x must be an integer or at least one-dimensional")
    perm = randperm(x.gshape[0], device=x.device, comm=x.comm)
    return take(x, perm, axis=0)
