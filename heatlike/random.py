"""Random DNDarrays whose values do not depend on the number of ranks.

Element ``i`` (its index in the C-order flattening of the global array) of the ``c``-th random
call after ``seed(s)`` is a function of ``(s, c, i)`` only. The ``c``-th call reads one stream
of 64-bit words: numpy's PCG64DXSM bit generator seeded with ``numpy.random.SeedSequence([s,
c])``, whose ``advance(n)`` jumps ``n`` words ahead in O(log n) steps, so any position of the
stream can be read directly. Element ``i`` takes its values from a fixed position of that
stream:

* float32 / float16 / bfloat16 uniforms: 32-bit half-word ``i`` (the low half of word ``i // 2``
  first), turned into ``(h >> 8) * 2**-24`` as numpy's ``Generator.random(dtype=float32)`` does
  (the half types keep the top 11 / 8 bits of that, truncated);
* float64 uniforms: word ``i``, ``(w >> 11) * 2**-53`` (numpy's ``next_double``);
* normal samples: float64 uniforms ``2i`` and ``2i + 1`` (Box-Muller);
* integers and permutation keys: the top 63 bits of word ``i``.

Each rank jumps numpy's generator (C code) to the start of each contiguous run of its own
elements in the global flattening and draws exactly those values (one run for ``split=0`` or a
replicated array, one per outer index otherwise; large parts are filled by several threads, each
from its own position), so the concatenation of the local parts equals the one-rank result for
the same seed, whatever the layout and the number of threads; no communication is needed. Values
are made on the host and moved to the array's device.

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
from concurrent.futures import ThreadPoolExecutor

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
           "ranf", "sample", "uniform", "normal", "standard_normal", "randint",
           "random_integer", "permutation", "randperm", "stream"]

_state: dict = {"seed": None, "counter": 0}


def seed(value: int | None = None, comm: MPICommunication | None = None) -> None:
    """Restart the generator from ``value`` (a non-negative integer below 2**64; None: a seed
    drawn by rank 0 from the operating system and broadcast, a collective call).

    As in Heat, torch's global generator is seeded with the same value too
    (``torch.manual_seed``), so ``torch.rand`` and friends also agree on every rank after it."""
    torch.manual_seed(_restart(value, comm))


def _restart(value: int | None, comm: MPICommunication | None = None) -> int:
    """Restart heatlike's stream from ``value`` (None: drawn by rank 0 and broadcast) without
    touching torch's generator (lazy seeding and :func:`set_state` must not); returns the seed."""
    if value is None:
        comm = sanitize_comm(comm)
        value = comm.bcast(secrets.randbits(63) if comm.rank == 0 else None, root=0)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) < 2 ** 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {value!r}")
    _state["seed"] = int(value)
    _state["counter"] = 0
    return int(value)


def get_state() -> tuple[str, int | None, int]:
    """``("PCG64DXSM", seed, calls made since seeding)``."""
    return "PCG64DXSM", _state["seed"], _state["counter"]


def set_state(state: tuple) -> None:
    """Restore a state returned by :func:`get_state`: ``(name, seed, counter)``; torch's
    generator is left alone (a checkpoint restores it itself). Heat's states (``("Threefry",
    seed, counter[, ...])``) are accepted too and do what Heat's ``set_state`` does: continue
    from ``seed`` after ``counter`` calls (the values are heatlike's generator's, not Heat's) and
    seed torch's generator with ``seed``."""
    if not isinstance(state, (tuple, list)) or len(state) < 3:
        raise TypeError("state must be a tuple (name, seed, counter)")
    name, value, counter = state[0], state[1], state[2]
    if name not in ("PCG64DXSM", "Philox", "Threefry"):
        raise ValueError(f"unknown generator {name!r}")
    if isinstance(counter, bool) or not isinstance(counter, (int, np.integer)) or counter < 0:
        raise ValueError(f"counter must be a non-negative integer, got {counter!r}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                              or not 0 <= int(value) < 2 ** 64):
        raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {value!r}")
    _state["seed"] = None if value is None else int(value)
    _state["counter"] = int(counter)
    if name == "Threefry" and value is not None:
        torch.manual_seed(int(value))


def _next_call(comm: MPICommunication) -> tuple[int, int]:
    if _state["seed"] is None:
        _restart(None, comm)
    call = _state["counter"]
    _state["counter"] += 1
    return _state["seed"], call


def stream(seed_value: int, call: int, start: int, count: int) -> np.ndarray:
    """Words ``start`` to ``start + count - 1`` (uint64) of the stream of call ``call`` after
    ``seed(seed_value)`` (module docstring): numpy's PCG64DXSM seeded with
    ``SeedSequence([seed_value, call])``."""
    out = np.empty(count, dtype=np.uint64)
    _Stream(seed_value, call, "u64").fill(out, [(start, count)])
    return out


class _Stream:
    """One call's stream, read in runs. ``kind``: ``"f64"`` (one word per value, numpy's
    ``next_double``), ``"f32"`` (one 32-bit half-word per value, low half first, numpy's
    ``next_float``) or ``"u64"`` (the raw words). The generator jumps to the start of each run
    with ``advance`` (O(log n), numpy's C code; it also drops a half-word kept from the previous
    run), and a run starting before the current position restarts it."""

    _DTYPE = {"f64": np.float64, "f32": np.float32, "u64": np.uint64}

    def __init__(self, seed_value: int, call: int, kind: str) -> None:
        self.seed_seq = np.random.SeedSequence([int(seed_value), int(call)])
        self.kind = kind
        self._restart()

    def _restart(self) -> None:
        self.bg = np.random.PCG64DXSM(self.seed_seq)
        self.gen = np.random.Generator(self.bg)
        self.pos = 0  # in values of this kind

    def _read(self, out: np.ndarray) -> None:
        if self.kind == "u64":
            out[:] = self.gen.integers(0, 2 ** 64, size=out.size, dtype=np.uint64)
        else:
            self.gen.random(out.size, dtype=self._DTYPE[self.kind], out=out)

    def _goto(self, first: int) -> None:
        if first == self.pos:
            return
        if first < self.pos:
            self._restart()
        if self.kind == "f32":
            word, at = first // 2, -(-self.pos // 2)
            self.bg.advance(word - at)  # also drops a buffered half-word
            if first % 2:
                self.gen.random(1, dtype=np.float32)
        else:
            self.bg.advance(first - self.pos)
        self.pos = first

    def fill(self, out: np.ndarray, runs: list[tuple[int, int]]) -> None:
        """Write the values of ``runs`` (``(first value, count)``, ascending) into ``out``,
        one after the other."""
        pos = 0
        for first, count in runs:
            if count == 0:
                continue
            self._goto(first)
            self._read(out[pos:pos + count])
            self.pos = first + count
            pos += count


def _runs(shape: tuple[int, ...], split: int | None, lo: int, hi: int, per: int
          ) -> list[tuple[int, int]]:
    """The contiguous runs ``(first value, count)`` of the local part (``[lo, hi)`` along
    ``split``) in the global C-order flattening, ``per`` stream values per element, ascending."""
    size = int(np.prod(shape, dtype=np.int64))
    if split is None:
        return [(0, size * per)]
    outer = int(np.prod(shape[:split], dtype=np.int64))
    inner = int(np.prod(shape[split + 1:], dtype=np.int64))
    n = shape[split]
    if hi <= lo or inner == 0 or outer == 0:
        return []
    if lo == 0 and hi == n:
        return [(0, size * per)]
    length = (hi - lo) * inner * per
    return [((o * n + lo) * inner * per, length) for o in range(outer)]


_PARALLEL_MIN = 1 << 20  # values per thread below which one thread fills everything
_pool: ThreadPoolExecutor | None = None


def _split_runs(runs: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """``runs`` cut into ``parts`` groups of consecutive values of about equal size."""
    total = sum(c for _, c in runs)
    target = -(-total // parts)
    groups: list[list[tuple[int, int]]] = [[]]
    room = target
    for first, count in runs:
        while count:
            take = min(count, room)
            groups[-1].append((first, take))
            first, count, room = first + take, count - take, room - take
            if room == 0 and len(groups) < parts:
                groups.append([])
                room = target
    return [g for g in groups if g]


def _aligned_empty(n: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialized numpy array in memory from torch's allocator (64-byte aligned, where
    numpy's own is only 16-byte aligned): torch's vectorized kernels over the tensor made from
    it run at full speed (a sum over a 16-byte aligned array measured about 10% slower)."""
    itemsize = np.dtype(dtype).itemsize
    return torch.empty(n * itemsize, dtype=torch.uint8).numpy().view(dtype)


def _values(kind: str, shape: tuple[int, ...], split: int | None, lo: int, hi: int, per: int,
            seed_value: int, call: int) -> torch.Tensor:
    """The local part's stream values, ``(local numel, per)``: float64 / float32, or the raw
    words as int64 bit patterns for ``"u64"``. Large parts are filled by as many threads as
    torch may use on this rank (``torch.get_num_threads()``; numpy releases the GIL while it
    fills), each reading its own slice of the stream: the values do not depend on the number
    of threads."""
    global _pool
    runs = _runs(shape, split, lo, hi, per)
    total = sum(c for _, c in runs)
    out = _aligned_empty(total, _Stream._DTYPE[kind])
    threads = min(torch.get_num_threads(), max(1, total // _PARALLEL_MIN))
    if threads <= 1:
        _Stream(seed_value, call, kind).fill(out, runs)
    else:
        if _pool is None or _pool._max_workers < threads:  # type: ignore[attr-defined]
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="heatlike-rng")
        jobs, pos = [], 0
        for group in _split_runs(runs, threads):
            n = sum(c for _, c in group)
            jobs.append(_pool.submit(_Stream(seed_value, call, kind).fill, out[pos:pos + n],
                                     group))
            pos += n
        for job in jobs:
            job.result()
    if kind == "u64":
        out = out.view(np.int64)
    return torch.from_numpy(out).reshape(-1, per)


def _size(args: tuple) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return _shape(args[0])
    return _shape(args)


def _generate(shape: tuple[int, ...], split: int | None, per: int, kind: str, device: object,
              comm: MPICommunication | None) -> tuple[torch.Tensor, tuple]:
    """This rank's stream values, ``(local numel, per)`` (see :func:`_values`), and ``(gshape,
    split, counts, comm, local shape, torch device)``."""
    comm = sanitize_comm(comm)
    s, counts, lshape = _layout(shape, split, comm)
    lo, hi = (0, 0) if s is None else distribution.ranges(counts)[comm.rank]
    dev = torch_device(sanitize_device(device))
    seed_value, call = _next_call(comm)
    values = _values(kind, shape, s, lo, hi, per, seed_value, call)
    return values, (shape, s, counts, comm, lshape, dev)


def _wrap(values: torch.Tensor, dtype: torch.dtype, meta: tuple) -> DNDarray:
    gshape, s, counts, comm, lshape, dev = meta
    t = values.reshape(lshape)
    return DNDarray._make(t.to(device=dev, dtype=dtype), gshape, s, counts, comm)


def _top(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The top ``bits`` bits of the 64-bit words held as int64 (non-negative int64)."""
    return (words >> (64 - bits)) & ((1 << bits) - 1)


_HALF_BITS = {torch.float16: 11, torch.bfloat16: 8}


def _uniform(shape: tuple[int, ...], split: int | None, dtype: torch.dtype, device: object,
             comm: MPICommunication | None) -> DNDarray:
    """Uniform [0, 1) values of ``dtype``: float64 from one stream word each (53 bits), the
    other types from one 32-bit half-word each (24 bits; float16 / bfloat16 keep the top 11 / 8
    of them, truncated so that no value rounds up to 1)."""
    kind = "f64" if dtype is torch.float64 else "f32"
    values, meta = _generate(shape, split, 1, kind, device, comm)
    v = values[:, 0]
    bits = _HALF_BITS.get(dtype)
    if bits is not None:
        v = v.mul(float(1 << bits)).floor_().mul_(2.0 ** -bits)
    return _wrap(v, dtype, meta)


def _float_dtype(dtype: object) -> torch.dtype:
    dt = torch.get_default_dtype() if dtype is None else canonical_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"dtype must be a floating point type, got {dt}")
    return dt


def rand(*shape: int, dtype: object = None, split: int | None = None, device: object = None,
         comm: MPICommunication | None = None) -> DNDarray:
    """Uniform samples from [0, 1) of the given shape (``rand(3, 4)`` or ``rand((3, 4))``)."""
    return _uniform(_size(shape), split, _float_dtype(dtype), device, comm)


def _size_or_shape(size: object, shape: object) -> object:
    """numpy's ``size`` or Heat's ``shape`` keyword (None: one sample)."""
    if shape is not None:
        if size not in ((), None):
            raise TypeError("give the size or Heat's shape=, not both")
        return shape
    return () if size is None else size


def random(size: int | Sequence[int] | None = (), dtype: object = None,
           split: int | None = None, device: object = None,
           comm: MPICommunication | None = None, *, shape: object = None) -> DNDarray:
    """Uniform samples from [0, 1) (numpy's ``random.random(size)``; Heat's ``shape=``)."""
    size = _size_or_shape(size, shape)
    return rand(*_size((size,)), dtype=dtype, split=split, device=device, comm=comm)


random_sample = ranf = sample = random


def uniform(low: float = 0.0, high: float = 1.0, size: int | Sequence[int] = (),
            dtype: object = None, split: int | None = None, device: object = None,
            comm: MPICommunication | None = None) -> DNDarray:
    """Uniform samples from [low, high): ``low + (high - low) u`` in float64 with ``u`` of
    :func:`random`, then cast; a value that rounds to ``high`` in the result's dtype becomes the
    largest one below it."""
    u = random(size, dtype=torch.float64, split=split, device=device, comm=comm)
    dt = _float_dtype(dtype)
    v = (u.larray * (high - low) + low).to(dt)
    if high > low:
        top = torch.tensor(high, dtype=dt, device=v.device)
        below = torch.nextafter(top, torch.tensor(low, dtype=dt, device=v.device))
        v = torch.where(v >= top, below, v)
    return u._rewrap(v)


def randn(*shape: int, dtype: object = None, split: int | None = None, device: object = None,
          comm: MPICommunication | None = None) -> DNDarray:
    """Standard normal samples (Box-Muller on two 53-bit uniforms, stream values ``2i`` and
    ``2i + 1`` of element ``i``, in float64, then cast)."""
    dt = _float_dtype(dtype)
    values, meta = _generate(_size(shape), split, 2, "f64", device, comm)
    u1 = 1.0 - values[:, 0]  # in (0, 1]: log(u1) is finite
    u2 = values[:, 1]
    z = torch.sqrt(torch.log(u1).mul_(-2.0)).mul_(torch.cos(u2 * (2.0 * np.pi)))
    return _wrap(z, dt, meta)


def standard_normal(size: int | Sequence[int] | None = (), dtype: object = None,
                    split: int | None = None, device: object = None,
                    comm: MPICommunication | None = None, *, shape: object = None
                    ) -> DNDarray:
    """Standard normal samples of the given size (numpy's and Heat's ``standard_normal``; Heat's
    ``shape=``): :func:`randn`."""
    size = _size_or_shape(size, shape)
    return randn(*_size((size,)), dtype=dtype, split=split, device=device, comm=comm)


def normal(mean: float | DNDarray = 0.0, std: float | DNDarray = 1.0,
           size: int | Sequence[int] | None = (), dtype: object = None,
           split: int | None = None, device: object = None,
           comm: MPICommunication | None = None, *, shape: object = None) -> DNDarray:
    """Normal samples ``mean + std z`` with ``z`` of :func:`randn`, in float64, then cast.
    ``mean`` and ``std`` may be numbers or arrays (DNDarrays of any split, numpy arrays,
    lists), broadcast against the samples; without a size the samples take their broadcast
    shape (numpy's rule; Heat's ``shape=`` is accepted). The result is split along ``split``
    whatever the parameters' layouts. A negative ``std`` raises ValueError on every rank."""
    size = _size_or_shape(size, shape)
    dt = _float_dtype(dtype)
    scalars = all(isinstance(v, (int, float, np.integer, np.floating))
                  and not isinstance(v, bool) for v in (mean, std))
    if scalars:
        if std < 0:
            raise ValueError(f"std must be non-negative, got {std}")
        z = randn(*_size((size,)), dtype=torch.float64, split=split, device=device, comm=comm)
        return z._rewrap((z.larray * std + mean).to(dt))
    from .core.factories import array

    def as_array(v: object) -> DNDarray:
        return v if isinstance(v, DNDarray) else array(v, dtype=torch.float64, comm=comm)

    mean, std = as_array(mean), as_array(std)
    if bool((std < 0).any()):  # the same answer on every rank
        raise ValueError("std must be non-negative")
    if size == ():
        size = tuple(np.broadcast_shapes(mean.gshape, std.gshape))
    z = randn(*_size((size,)), dtype=torch.float64, split=split, device=device,
              comm=mean.comm)
    result = (mean + std * z).astype(dt, copy=False)
    return result if result.split == split else result.resplit(split)


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
    info = torch.iinfo(dt)
    if low < info.min:
        raise ValueError(f"low is out of bounds for {dt} ({low} < {info.min})")
    if high - 1 > info.max:
        raise ValueError(f"high is out of bounds for {dt} ({high} > {info.max} + 1)")
    if high - low >= 2 ** 63:
        raise ValueError(f"randint draws from ranges of fewer than 2**63 integers, got "
                         f"[{low}, {high})")
    words, meta = _generate(_size((size,)), split, 1, "u64", device, comm)
    values = _top(words[:, 0], 63).remainder_(high - low).add_(low)
    return _wrap(values, dt, meta)


random_integer = randint


def randperm(n: int, dtype: object = None, split: int | None = 0, device: object = None,
             comm: MPICommunication | None = None) -> DNDarray:
    """A random permutation of ``0..n-1``, split along 0 (balanced; ``split=None``: the whole
    permutation on every rank, Heat's default). Heat's order of arguments."""
    if split not in (0, None):
        raise ValueError(f"randperm: split must be 0 or None, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    n = int(n)
    comm = sanitize_comm(comm)
    words, (_, _, counts, comm, _, dev) = _generate((n,), 0, 1, "u64", device, comm)
    keys = _top(words[:, 0], 63).to(dev)
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
    comm.Alltoallv((pairs, sc), (got, rc))
    local = got[torch.argsort(got[:, 0], stable=True), 1].contiguous()
    new_counts = tuple(comm.allgather(int(local.numel())))
    out = DNDarray._make(local, (n,), 0, new_counts, comm).balance_()
    if split is None:
        out = out.resplit(None)
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
