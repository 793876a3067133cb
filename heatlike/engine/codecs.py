"""Codecs: what a tensor looks like on the wire.

Each codec turns a flat float tensor ``x`` (a bucket of gradients, parameters or updates) into
communication rounds (``heatlike.engine.exchange``) and leaves the sum over ranks, exact or
approximated, in ``x``. Codecs with error feedback keep a residual ``e`` per tensor key: they
compress ``x + e`` and keep what they did not send, ``e <- x + e - sent``, so nothing is lost,
only delayed (Stich et al. 2018; Karimireddy et al. 2019). Their state is in ``state_dict()``.
A tensor that no rank had a gradient for in a step keeps its residual as it was: the engine
puts it back (:meth:`Codec.residual_in`), since that exchange's result reaches no parameter.

=================  ==============================================  =========  ===================
codec              sends per rank (n floats in)                    linear     decode
=================  ==============================================  =========  ===================
Identity           n floats                                        yes        sum
Cast(bf16/fp16)    n half floats (float32 accumulation)            yes        sum
TopK(k)            k (index, value) pairs, largest |x + e|          no         scatter-add
RandomK(k)         k values at indices drawn from a seed all ranks  yes        scatter
                   share (``shared=False``: own indices, + index)
RandomBlock(k)     k consecutive values, an aligned block drawn     yes        scatter
                   from a seed all ranks share
Threshold(t)       (index, value) of every |x + e| >= t             no         scatter-add
Sign               1 bit per value (2 when some rank has zeros)     no         sum of signs
Sign(scaled=True)  as Sign, + mean |x + e|                          no         sum of scaled signs
PowerSGD(r)        r (n_i + m_i) per matrix, 1-D tensors as is       two rounds P Q^T
Clipped(c, v)      clamp to [-v, v], then codec c                   as c       as c
Warmup(c, s)       n floats in the first s exchanges, then as c    as c       sum, then as c
=================  ==============================================  =========  ===================

"Linear": every round is a ``Sum``, so the codec works with any reducer, gossip included; the
others gather every rank's payload.

Non-finite values are never hidden: when any rank's input (with its residual) holds a NaN or an
infinity, the decoded result holds one too, on every rank. Codecs whose payload could drop it (a
sign bit, entries not selected) send one extra value, 0 or NaN, that is added to the result
(Sign's marker is also 1 when the input holds a zero; a NaN marker is added all the same).
So a check of the result (``GradientSync(check_finite=True)``, AMP's ``GradScaler``) sees the
same verdict on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..core.buffer_pool import pool as buffer_pool
from .buckets import pack, unpack
from .exchange import Context, Gather, Rounds, Sum

__all__ = ["all_finite", "Codec", "Identity", "Cast", "TopK", "RandomK", "RandomBlock",
           "Threshold", "Sign", "ScaledSign", "PowerSGD", "Clipped", "Warmup", "PerTensor",
           "CODEC_NAMES", "codec_from", "codec_error", "rescale_memory", "label_memory",
           "LOSS_SCALE"]


class Codec:
    """Base class (see the module docstring). Subclasses implement :meth:`rounds`."""

    name = "codec"
    linear = True          # only Sum rounds
    single_round = False   # one Sum round that is one collective on any communicator
    carries_flags = False  # small integers in the tensor survive exactly (flags may ride along)
    stateful = False       # keeps state between exchanges (residuals, warm starts)
    #: the result for inputs scaled by s is s times the result for the inputs (GradScaler's
    #: scale then divides out of the decoded gradients exactly as out of plain ones)
    scale_equivariant = True

    #: where the values given to the codec carry a loss scale that changes between exchanges
    #: (``torch.amp.GradScaler``): a function returning the scale of the values of the
    #: exchange about to run; :meth:`state_for` then brings the key's error-feedback residual
    #: to that scale (:func:`rescale_memory`). None: the values carry no changing scale.
    loss_scale = None

    def __init__(self) -> None:
        self.states: dict = {}

    def state_for(self, key: object) -> dict:
        """The state kept for ``key`` (a fresh dict the first time); where :attr:`loss_scale`
        is set, its residuals brought to the current loss scale first."""
        state = self.states.setdefault(key, {})
        if self.loss_scale is not None:
            rescale_memory(state, self.loss_scale())
        return state

    def pre(self, x: torch.Tensor) -> None:
        """Applied to the raw values before the reducer scales them (default: nothing)."""

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        raise NotImplementedError

    def residual_in(self, state: dict, i: int, offset: int, numel: int) -> torch.Tensor | None:
        """The part of a bucket's error-feedback residual that belongs to its tensor ``i``
        (elements ``offset`` to ``offset + numel`` of the bucket's values), from ``state``, the
        bucket's state; None where the codec keeps no residual there."""
        residual = state.get("residual")
        if residual is None or residual.numel() < offset + numel:
            return None
        return residual.view(-1)[offset:offset + numel]

    def state_dict(self) -> dict:
        """A copy of the per-bucket state (codecs update their tensors in place)."""
        return {"codec": self.name, "states": {k: _copied(v) for k, v in self.states.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("codec") != self.name:
            raise ValueError(f"state of codec {state.get('codec')!r} given to {self.name!r}")
        self.states = {k: _copied(v) for k, v in state["states"].items()}

    def __repr__(self) -> str:
        return self.name


#: the key under which a state records the loss scale its residuals are in (absent: 1)
LOSS_SCALE = "loss_scale"


def rescale_memory(state: dict, scale: float) -> None:
    """Bring the error-feedback residuals of one key's ``state`` to loss scale ``scale``.

    A residual is in the units of the values it was made from: with a loss scale s (AMP's
    ``GradScaler`` multiplies the loss, hence the gradients, by s) it holds s e for the true
    error e. When the scale of the next exchange is s', adding s e to s' g would weigh the
    delayed part wrongly by s / s'; so every residual (under the key ``"residual"``, at any
    depth: :class:`PerTensor` keeps one per tensor) is multiplied by s' / s first, and the
    state records s' (:data:`LOSS_SCALE`). Warm-start queries (PowerSGD's Q) only give a
    direction and are left alone."""
    old = float(state.get(LOSS_SCALE, 1.0))
    scale = float(scale)
    if old != scale:
        _scale_residuals(state, scale / old)
    state[LOSS_SCALE] = scale


def label_memory(states: dict, scale: float) -> None:
    """Record that the residuals of every state in ``states`` (a codec's ``states``) are at
    loss scale ``scale`` (they were made by an exchange of values at that scale); nothing is
    rescaled."""
    for state in states.values():
        state[LOSS_SCALE] = float(scale)


def _scale_residuals(state: dict, factor: float) -> None:
    for key, value in state.items():
        if isinstance(value, dict):
            _scale_residuals(value, factor)
        elif key == "residual" and isinstance(value, torch.Tensor):
            value.mul_(factor)


def _copied(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else _copied(v) if isinstance(v, dict)
            else v for k, v in state.items()}


class Identity(Codec):
    """Send the values as they are."""

    name = "identity"
    carries_flags = True
    single_round = True

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        yield Sum(x)


class Cast(Codec):
    """Send the values as ``dtype`` (torch.bfloat16, torch.float16 or torch.float32). The
    communication layer sums half types in float32, so each rank's contribution is rounded once
    and the sum once."""

    carries_flags = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"Cast supports bfloat16, float16 and float32, got {dtype}")
        self.dtype = dtype
        self.single_round = dtype is torch.float32  # half types: multi-phase on serial channels
        self.name = f"cast-{str(dtype).removeprefix('torch.')}"

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        wire = x.to(self.dtype)
        yield Sum(wire)
        x.copy_(wire)


def _with_residual(x: torch.Tensor, ctx: Context, error_feedback: bool) -> torch.Tensor:
    """``x + e``, in a tensor the codec reads before it writes its result into ``x``: the
    residual itself, updated in place (the codec subtracts what it sends and keeps the rest as
    the next residual), or ``x`` itself without error feedback."""
    if not error_feedback:
        return x
    residual = ctx.state.get("residual")
    if residual is None or residual.shape != x.shape:
        return x.clone()
    if residual.dtype != x.dtype or residual.device != x.device:
        return x + residual.to(x)
    return residual.add_(x)


class _Feedback(Codec):
    """Error feedback: compress ``x + e`` and keep the rest in ``e``."""

    def __init__(self, error_feedback: bool) -> None:
        super().__init__()
        self.error_feedback = error_feedback
        self.stateful = error_feedback

    def _with_residual(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return _with_residual(x, ctx, self.error_feedback)

    def _keep(self, ctx: Context, total: torch.Tensor, sent: torch.Tensor) -> None:
        if self.error_feedback:
            ctx.state["residual"] = total - sent


def _count(n: int, k: int | None, ratio: float | None) -> int:
    if k is not None:
        return max(0, min(int(k), n))
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


def _check_k(k: int | None, ratio: float | None) -> None:
    if (k is None) == (ratio is None):
        raise ValueError("give exactly one of k and ratio")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")


def largest(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the 1-D tensor ``a``, in no particular order
    (NaN counts as largest, as in ``torch.topk``). For a large ``a`` and a small ``k`` it first
    keeps the entries not below a threshold estimated from an evenly strided sample of ``a``
    (about 1.5 k of them are expected to pass), then selects among those: one comparison and one
    compaction over ``a`` instead of ``torch.topk``'s selection, about 10x faster on the CPU for
    millions of entries. The result is exact: when fewer than ``k`` entries pass, it falls back
    to ``torch.topk`` over all of ``a``."""
    n = a.numel()
    if n < 1 << 16 or 8 * k > n:
        return torch.topk(a, k, sorted=False).indices
    stride = n // (1 << 15)
    m = len(range(0, n, stride))
    above = min(m, math.ceil(1.5 * k * m / n) + 8)
    if a.device.type == "cpu" and a.dtype is not torch.bfloat16:
        values = a.numpy()
        # numpy's introselect on the sample: a third to a half of torch.kthvalue's time
        threshold = np.partition(values[::stride], m - above)[m - above]
        # numpy's comparison with a scalar and in-place negation: about 2x torch's here
        keep = np.less(values, threshold)
        np.logical_not(keep, out=keep)  # NaN is not below the threshold: kept
        candidates = np.flatnonzero(keep)
        if candidates.size < k:
            return torch.topk(a, k, sorted=False).indices
        # numpy's introselect orders NaN last, as the largest: 6x torch.topk's time here
        chosen = np.argpartition(values[candidates], candidates.size - k)[candidates.size - k:]
        return torch.from_numpy(candidates[chosen])
    threshold = torch.kthvalue(a[::stride], m - above + 1).values
    candidates = flat_nonzero(~(a < threshold))
    if candidates.numel() < k:
        return torch.topk(a, k, sorted=False).indices
    return candidates[torch.topk(a.index_select(0, candidates), k, sorted=False).indices]


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The indices (int64) of the true entries of the 1-D bool tensor ``mask``, ascending. On the
    CPU through numpy's ``flatnonzero``, about 5x faster than ``torch.nonzero`` for millions of
    entries."""
    if mask.device.type != "cpu":
        return torch.nonzero(mask).view(-1)
    return torch.from_numpy(np.flatnonzero(mask.numpy()))


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def _scatter_add(x: torch.Tensor, gathered: list, ctx: Context) -> None:
    """``x`` = the sum of every rank's (index, value) pairs (NaN everywhere if a rank's poison
    marker says its input was not finite); ``ctx.support`` the indices."""
    x.zero_()
    support = []
    poisoned = False
    for indices, values, *poison in gathered:
        indices = indices.long()
        x.index_add_(0, indices, values)
        support.append(indices)
        if poison and bool(poison[0].ne(0).any()):  # a rank's input was not finite
            x.add_(poison[0].to(x.dtype))
            poisoned = True
    support = torch.cat(support) if support and not poisoned else None
    # scaling a few positions by index beats a pass over x only while they are few
    ctx.support = support if support is not None and 8 * support.numel() < x.numel() else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite. The sum of a tensor is finite when every entry is
    (NaN and infinities propagate), so one reduction without a temporary answers the common case;
    only a non-finite sum, which huge finite entries can also give, is confirmed entry by entry."""
    return not t.numel() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _poison(total: torch.Tensor) -> torch.Tensor:
    """One value, NaN if ``total`` holds a non-finite entry, else 0 (see the module
    docstring)."""
    bad = not all_finite(total)
    return torch.full((1,), float("nan") if bad else 0.0, dtype=torch.float32,
                      device=total.device)


def _keep_finite(ctx: Context, residual: torch.Tensor, finite: bool) -> None:
    """Keep ``residual`` as the key's error-feedback memory, or, where the exchange's input was
    not finite (an overflow GradScaler skips), none: a residual of inf - inf = NaN would make
    every later exchange of the tensor NaN."""
    if finite:
        ctx.state["residual"] = residual
    else:
        ctx.state.pop("residual", None)


class TopK(_Feedback):
    """Send the k entries of largest magnitude (k, or ``ceil(ratio * n)``) as (index, value)
    pairs; ``index_add`` the pairs of every rank."""

    linear = False

    def __init__(self, k: int | None = None, ratio: float | None = None,
                 error_feedback: bool = True) -> None:
        _check_k(k, ratio)
        super().__init__(error_feedback)
        self.k, self.ratio = k, ratio
        self.name = f"topk-{k if k is not None else ratio}"

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        total = self._with_residual(x, ctx)
        k = _count(x.numel(), self.k, self.ratio)
        if total.device.type == "cpu":  # |total| in a pooled buffer: a fresh one of millions
            # of entries paid its page faults at every exchange (CUDA's allocator reuses its own)
            raw = buffer_pool.take(total.numel() * total.element_size(), total.device)
            indices = largest(torch.abs(total, out=raw.view(total.dtype)), k)
            buffer_pool.give(raw)
        else:
            indices = largest(total.abs(), k)
        values = total.index_select(0, indices)  # 3x faster than total[indices] here
        if self.error_feedback:  # the residual: total less what is sent (distinct indices)
            total.index_add_(0, indices, values, alpha=-1)
            # a NaN or infinity is among the largest, so it is sent: a total that is not
            # finite shows in the values, and its residual is dropped (inf - inf would be NaN)
            _keep_finite(ctx, total, all_finite(values))
        gathered = yield Gather([indices.to(_index_dtype(x.numel())), values])
        _scatter_add(x, gathered, ctx)


class Threshold(_Feedback):
    """Send every entry with ``|x + e| >= threshold`` as an (index, value) pair; the count
    varies between ranks and steps."""

    linear = False
    scale_equivariant = False  # (a loss scale moves the entries across the fixed threshold)

    def __init__(self, threshold: float, error_feedback: bool = True) -> None:
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {threshold!r}")
        super().__init__(error_feedback)
        self.threshold = float(threshold)
        self.name = f"threshold-{threshold}"

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        total = self._with_residual(x, ctx)
        indices = flat_nonzero((total.abs() >= self.threshold) | total.isnan())
        values = total.index_select(0, indices)
        if self.error_feedback:  # the residual: total less what is sent (distinct indices)
            total.index_add_(0, indices, values, alpha=-1)
            _keep_finite(ctx, total, all_finite(values))  # (NaN and infinities are sent)
        gathered = yield Gather([indices.to(_index_dtype(x.numel())), values], variable=True)
        _scatter_add(x, gathered, ctx)


class _RandomSubset(_Feedback):
    """Send k entries of ``x + e`` chosen at random by :meth:`_select` (from a generator seeded
    per bucket and step). ``shared=True``: every rank draws the same entries from a common seed,
    so only values travel and they are summed (linear); ``shared=False``: each rank draws its own
    and sends (index, value) pairs. One more value, the non-finite marker, always travels."""

    kind = ""

    def __init__(self, k: int | None = None, ratio: float | None = None, shared: bool = True,
                 error_feedback: bool = True) -> None:
        _check_k(k, ratio)
        super().__init__(error_feedback)
        self.k, self.ratio, self.shared = k, ratio, shared
        self.linear = shared
        self.name = f"{self.kind}-{k if k is not None else ratio}{'' if shared else '-own'}"

    def _select(self, n: int, k: int, g: torch.Generator,
                device: torch.device) -> torch.Tensor | slice:
        raise NotImplementedError

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        total = self._with_residual(x, ctx)
        n = x.numel()
        chosen = self._select(n, _count(n, self.k, self.ratio),
                              ctx.generator(shared=self.shared), x.device)
        # distinct indices: index_select / index_add_ / index_copy_ (torch's advanced indexing
        # costs several times as much on the host)
        block = isinstance(chosen, slice)
        values = torch.cat([total[chosen] if block else total.index_select(0, chosen),
                            _poison(total).to(total.dtype)])
        if self.error_feedback:  # the residual: total less what is sent
            if block:
                total[chosen] -= values[:-1]
            else:
                total.index_add_(0, chosen, values[:-1], alpha=-1)
            _keep_finite(ctx, total, bool(values[-1] == 0))  # (this rank's marker)
        if self.shared:
            yield Sum(values)
            x.zero_()
            if block:
                x[chosen] = values[:-1]
            else:
                x.index_copy_(0, chosen, values[:-1])
            if bool(values[-1] != 0):  # a rank's input was not finite
                x.add_(values[-1])
            else:
                ctx.support = chosen
        else:
            indices = chosen if isinstance(chosen, torch.Tensor) else \
                torch.arange(chosen.start, chosen.stop, device=x.device)
            gathered = yield Gather([indices.to(_index_dtype(n)), values[:-1], values[-1:]])
            _scatter_add(x, gathered, ctx)


_FAST_SUBSET_MIN = 1 << 16  # below this many entries a permutation is as cheap


class RandomK(_RandomSubset):
    """Send k entries at random indices. ``shared=True``: every rank draws the same indices from
    a common seed, so only values travel and they are summed (linear); ``shared=False``: each
    rank draws its own and sends (index, value) pairs."""

    kind = "randomk"

    def _select(self, n, k, g, device):
        """k distinct indices, every k-subset equally likely. For large tensors and k well below
        n: the distinct values among slightly more than k uniform draws (a uniformly random
        subset of their number, by symmetry), k of them picked at random; O(k) instead of a
        permutation of n (which costs tens of milliseconds per million entries)."""
        if n >= _FAST_SUBSET_MIN and 4 * k <= n:
            for _ in range(8):
                drawn = torch.unique(torch.randint(n, (k + k // 4 + 16,), generator=g))
                if drawn.numel() >= k:
                    return drawn[torch.randperm(drawn.numel(), generator=g)[:k]].to(device)
        return torch.randperm(n, generator=g)[:k].to(device)


class RandomBlock(_RandomSubset):
    """Send one of the aligned blocks of k consecutive entries, drawn at random (shared between
    ranks by default, then only values travel and are summed).

    The blocks are mlbench-core's: ``[b k, (b + 1) k)`` for ``b = 0 .. floor(n / k) - 1``, each
    as likely, so every entry is sent with probability k / n when k divides n. Where it does not,
    mlbench never sent the last ``n mod k`` entries (their memory grew and was never applied);
    here one more block, the last k entries ``[n - k, n)``, is drawn as often as the others: each
    entry is sent with probability 1 / ceil(n / k), those the last block shares with the one
    before it with twice that."""

    kind = "randomblock"

    def _select(self, n, k, g, device):
        if not n or not k:
            return slice(0, 0)
        blocks = -(-n // k)  # ceil(n / k): the aligned blocks, and the tail's block if any
        start = min(int(torch.randint(0, blocks, (1,), generator=g)) * k, n - k)
        return slice(start, start + k)


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor -> uint8 tensor of ceil(n / 8) bytes (most significant bit first)."""
    flat = bits.reshape(-1)
    if flat.device.type == "cpu":  # numpy's packbits: about 40x torch's ops
        return torch.from_numpy(np.packbits(flat.numpy()))
    return _pack_bits_torch(flat)


def _pack_bits_torch(flat: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` in torch operations (device tensors)."""
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as a bool tensor."""
    return _bits(packed, n).bool()


def _bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of :func:`pack_bits`'s bytes as a uint8 tensor of 0 and 1 (on the
    host: numpy's unpackbits; torch converts uint8 to floats about 10x faster than bool)."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n))
    return _bits_torch(packed, n)


def _bits_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`_bits` in torch operations (device tensors)."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n]


def count_bits(packed: Sequence[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    """Per entry, in how many of the :func:`pack_bits` vectors ``packed`` its bit is set
    (int32, on ``device``)."""
    counts = torch.zeros(n, dtype=torch.int32, device=device)
    for start in range(0, len(packed), 255):  # uint8 sums (fast) of up to 255 vectors at a time
        part = torch.zeros(n, dtype=torch.uint8, device=device)
        for p in packed[start:start + 255]:
            part += _bits(p, n)
        counts += part.to(torch.int32)
    return counts


class Sign(_Feedback):
    """Send each entry's sign, -1, 0 or +1 (``sign(0) = 0``: a rank with no opinion on an entry
    does not vote on it). The decoded sum is the vote count ``sum_r sign_r`` (SignSGD steps along
    its sign: majority vote, no step on a tie).

    Wire format: one bit per entry (positive or not) and one float32 marker, NaN when the input
    is not finite (module docstring), 1 when it holds an exact zero, else 0. Only when some rank's
    marker is 1 does a second round follow, in which every rank sends one more bit per entry
    (nonzero or not); dense gradients without exact zeros cost 1 bit per entry.

    ``scaled=True`` also sends the mean magnitude ``s = mean |x + e|`` and decodes
    ``sum_r s_r sign_r``, which with error feedback is EF-SignSGD's compressor."""

    linear = False

    def __init__(self, scaled: bool = False, error_feedback: bool = False) -> None:
        super().__init__(error_feedback)
        self.scaled = scaled
        self.scale_equivariant = scaled  # vote counts carry no scale; s_r sign_r does
        self.name = ("scaled-sign" if scaled else "sign") + ("-ef" if error_feedback else "")

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        total = self._with_residual(x, ctx)
        positive = total > 0
        n = x.numel()
        marker = _poison(total)
        # without a non-finite entry, "some entry is neither positive nor negative" is "some
        # entry is zero"; the nonzero mask itself is only made when a second round needs it
        if not bool(marker.isnan().any()) and n and bool(total.abs().min() == 0):
            marker.fill_(1.0)
        # s as it travels (float32), so that the residual keeps exactly what is not sent
        scale = total.abs().mean().to(torch.float32).to(x.dtype) if self.scaled and n else \
            torch.ones((), dtype=x.dtype)
        if self.error_feedback:  # what is sent, s sign(total); a total that is not finite
            self._keep(ctx, total, torch.sign(total).mul_(scale))  # leaves no residual
            if bool(marker.isnan().any()):
                ctx.state.pop("residual", None)
        extra = [scale.reshape(1).to(torch.float32)] if self.scaled else []
        gathered = yield Gather([pack_bits(positive), torch.cat([*extra, marker])])
        markers = torch.stack([tail[-1] for _, tail in gathered])
        masks = None
        if bool((markers == 1).any()):  # every rank sees the same markers: all send round two
            nonzero = positive | (total < 0)  # NaN counts as neither; the marker carries it
            masks = [m for (m,) in (yield Gather([pack_bits(nonzero)]))]
        if self.scaled:  # sum_r s_r sign_r in rank order; each term (2 b - 1) m s_r is
            x.zero_()     # exactly +-s_r or 0 (bits copied into floats first: torch's mixed
            signed = torch.empty_like(x)  # uint8-float products are several times slower)
            mask = torch.empty_like(x) if masks is not None else None
            for r, (bits, tail) in enumerate(gathered):
                signed.copy_(_bits(bits, n)).mul_(2).sub_(1)
                if mask is not None:
                    signed.mul_(mask.copy_(_bits(masks[r], n)))
                x.add_(signed.mul_(tail[0].to(x.dtype)))
        else:  # the vote in integers: sum_r (2 b_r - 1) m_r = 2 sum_r b_r - sum_r m_r (b implies m)
            votes = count_bits([bits for bits, _ in gathered], n, x.device).mul_(2)
            x.copy_(votes.sub_(len(gathered) if masks is None else
                               count_bits(masks, n, x.device)))
        if bool(markers.isnan().any()):
            x.add_(float("nan"))


class ScaledSign(Sign):
    """EF-SignSGD's compressor: scaled signs with error feedback."""

    def __init__(self, error_feedback: bool = True) -> None:
        super().__init__(scaled=True, error_feedback=error_feedback)


class PowerSGD(Codec):
    """Rank-r power iteration compression (Vogels et al. 2019) with error feedback.

    Every parameter with more than one dimension is viewed as an n x m matrix M (shape[0], rest)
    and compressed to r = min(n, m, rank) columns; 1-D tensors are sent as they are. With
    M = gradient + residual and Q an m x r matrix (random from a seed all ranks share, or the last
    averaged Q with ``reuse_query``):

        P = M Q              summed over ranks (one round for all matrices and the 1-D tensors)
        P = orth(P)          (QR, in float32 for half types; the same on every rank)
        Q_r = M^T P          this rank's factor; Q = sum of Q_r over ranks (second round)
        sum of M  ~  P Q^T,  residual <- M - P Q_r^T (this rank's own compression error,
                                                      Algorithm 2 of the paper)

    With rank >= min(n, m) the approximation is exact. Compression happens at any world size
    (the result does not depend on it); the global RNG is never touched.
    """

    linear = True

    def __init__(self, rank: int = 1, reuse_query: bool = False,
                 error_feedback: bool = True) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        super().__init__()
        self.rank = rank
        self.reuse_query = reuse_query
        self.error_feedback = error_feedback
        self.stateful = error_feedback or reuse_query
        self.name = f"powersgd-{rank}"

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        state = ctx.state
        total = _with_residual(x, ctx, self.error_feedback)
        matrices, plain = [], []  # (slice, M) / slice
        offset = 0
        for i, shape in enumerate(ctx.shapes):
            n_el = math.prod(shape)
            piece = slice(offset, offset + n_el)
            offset += n_el
            if len(shape) <= 1 or n_el == 0:
                plain.append(piece)
            else:
                matrices.append((i, piece, total[piece].view(shape[0], -1)))
        queries = state.setdefault("Q", {})
        ps, qs = [], []
        for i, _, m in matrices:
            r = min(m.shape[0], m.shape[1], self.rank)
            q = queries.get(i) if self.reuse_query else None
            # a warm start is zero after a step whose M was zero on every rank: it would span
            # nothing, so a fresh query is drawn (the same on every rank: Q is the ranks' sum)
            if q is None or q.shape != (m.shape[1], r) or not bool(q.any()):
                q = torch.randn(m.shape[1], r, generator=ctx.generator(salt=i))
                q = q.to(device=x.device, dtype=x.dtype)
            qs.append(q)
            ps.append(_narrow_product(m, q))
        first = torch.cat([p.reshape(-1) for p in ps] + [total[s] for s in plain]) \
            if ps or plain else x[:0]
        yield Sum(first)
        # a rank's M not finite makes the summed factors so on every rank: the memory of this
        # exchange (residual, warm start) is then dropped everywhere, and the next starts afresh
        finite = all_finite(first)
        offset = 0
        for j, p in enumerate(ps):
            ps[j] = _orthonormal(first[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        for s in plain:
            x[s] = first[offset:offset + (s.stop - s.start)]
            offset += s.stop - s.start
        # M^T P as (P^T M)^T: the same product, without a transposed pass over M (40x faster
        # on the CPU for a 2048 x 2048 M and a QR factor of column-major layout)
        local_qs = [(p.t() @ m).t() for (_, _, m), p in zip(matrices, ps)]
        second = torch.cat([q.reshape(-1) for q in local_qs]) if matrices else x[:0]
        yield Sum(second)
        offset = 0
        for (i, piece, m), p, q_local in zip(matrices, ps, local_qs):
            q = second[offset:offset + q_local.numel()].view(q_local.shape)
            offset += q.numel()
            _outer_sum(p, q, out=x[piece].view(m.shape))
            if self.error_feedback:  # what this rank's own decompression missed, in place
                _outer_sum(p, q_local, out=m, subtract=True)
            if self.reuse_query:
                queries[i] = q / ctx.size
        if not finite:
            queries.clear()
        if self.error_feedback:
            for s in plain:
                total[s] = 0
            _keep_finite(ctx, total, finite)


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """The Q factor of ``p``'s reduced QR decomposition (orthonormal columns spanning ``p``'s),
    in ``p``'s dtype. Half types are factorized in float32 and the factor rounded back: torch
    has no QR for bfloat16 or float16 (on the CPU), and a factorization in half precision would
    lose the orthogonality the approximation relies on."""
    if p.dtype in (torch.bfloat16, torch.float16):
        return torch.linalg.qr(p.float(), mode="reduced").Q.to(p.dtype)
    return torch.linalg.qr(p, mode="reduced").Q


def _narrow_product(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``m @ q`` for a ``q`` of a few columns. On the CPU as ``(q^T m^T)^T``, one pass over
    ``m``: the direct product took 7x as long for a 2048 x 2048 ``m`` and 2 to 8 columns (3.2
    against 0.43 ms for 2 on one core), one matrix-vector product per column twice the passes."""
    if m.device.type != "cpu":
        return m @ q
    if q.shape[1] == 1:
        return m.mv(q[:, 0].contiguous()).unsqueeze(1)
    return (q.t().contiguous() @ m.t()).t()


#: at least this many entries and at most :data:`_BROADCAST_MAX_RANK` columns: ``p @ q^T`` as
#: broadcast products (:func:`_outer_sum`)
_BROADCAST_MIN_NUMEL, _BROADCAST_MAX_RANK = 1 << 19, 8


def _outer_sum(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
               subtract: bool = False) -> None:
    """``out = p @ q^T`` (``out -= p @ q^T`` with ``subtract``) for factors of a few columns.
    On the CPU, for a large ``out``, as one broadcast product per column, each at memory speed:
    the matrix product with an inner dimension of 2 took 7x as long for a 2048 x 2048 ``out``
    (2.8 against 0.4 ms on one core; from 8 columns on, or below 640 x 640, the two are even)."""
    r = p.shape[1]
    if out.device.type != "cpu" or r > _BROADCAST_MAX_RANK or out.numel() < _BROADCAST_MIN_NUMEL:
        if subtract:
            out.addmm_(p, q.t(), alpha=-1)
        else:
            torch.mm(p, q.t(), out=out)
        return
    rows = q.t().contiguous()  # broadcast over contiguous rows: a strided column is 8x slower
    for j in range(r):
        if j == 0 and not subtract:
            torch.mul(p[:, :1], rows[0], out=out)
        else:
            out.addcmul_(p[:, j:j + 1], rows[j], value=-1 if subtract else 1)


class Clipped(Codec):
    """Clamp every finite value to ``[-limit, limit]``, then send it with ``inner`` (SINGA's
    clipped half-precision all-reduce: ``Clipped(Cast(torch.float16), 100)``). Infinities are
    not clamped (SINGA's clamp made them the limit): an overflow stays visible to
    ``GradScaler`` and ``check_finite``, as with every codec."""

    def __init__(self, inner: Codec, limit: float) -> None:
        if not limit > 0:
            raise ValueError(f"clip limit must be positive, got {limit!r}")
        super().__init__()
        self.inner, self.limit = inner, float(limit)
        self.linear, self.stateful = inner.linear, inner.stateful
        self.scale_equivariant = False  # (the limit is fixed: a scale changes what is clipped)
        self.single_round = inner.single_round
        self.states = inner.states
        self.name = f"clipped-{limit}-{inner.name}"

    def pre(self, x: torch.Tensor) -> None:
        if all_finite(x):
            x.clamp_(-self.limit, self.limit)
        else:  # infinities stay: clamped to the limit, an overflow would pass unseen
            x.copy_(torch.where(torch.isinf(x), x, x.clamp(-self.limit, self.limit)))
        self.inner.pre(x)

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        yield from self.inner.rounds(x, ctx)

    def residual_in(self, state: dict, i: int, offset: int, numel: int) -> torch.Tensor | None:
        return self.inner.residual_in(state, i, offset, numel)


class Warmup(Codec):
    """Send the values as they are (an exact sum) in each tensor's first ``steps`` exchanges,
    then with ``inner``: the warm-up of compressed training (PyTorch's PowerSGD hook,
    ``start_powerSGD_iter``; deep gradient compression's warm-up epochs). Compressing from the
    first step, when gradients are large and change fast, costs accuracy that error feedback
    only slowly recovers; ``inner``'s state (residuals, warm-start factors) starts at the first
    compressed exchange. The count is the engine's per-tensor exchange counter, which a
    checkpoint keeps, so a resumed run continues the warm-up where it stopped."""

    def __init__(self, inner: Codec, steps: int) -> None:
        if not isinstance(inner, Codec):
            raise TypeError(f"Warmup wraps a codec instance, got {type(inner).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"warm-up steps must be an int >= 0, got {steps!r}")
        super().__init__()
        self.inner, self.steps = inner, steps
        # every property holds for both phases: the warm-up is Identity's single exact Sum
        self.linear, self.stateful = inner.linear, inner.stateful
        self.scale_equivariant = inner.scale_equivariant
        self.single_round, self.carries_flags = inner.single_round, inner.carries_flags
        self.states = inner.states
        self.name = f"warmup-{steps}-{inner.name}"

    def pre(self, x: torch.Tensor) -> None:
        self.inner.pre(x)

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        if ctx.step < self.steps:
            yield Sum(x)
        else:
            yield from self.inner.rounds(x, ctx)

    def residual_in(self, state: dict, i: int, offset: int, numel: int) -> torch.Tensor | None:
        return self.inner.residual_in(state, i, offset, numel)


class PerTensor(Codec):
    """``inner`` applied to each tensor of a bucket as if the tensor were alone in a bucket (its
    own k, residual and random draws), the tensors' messages travelling together: one collective
    per round for the whole bucket instead of one per tensor. mlbench's sparsified SGD sends k
    coordinates of every tensor; on a transformer of 29 tensors at 4 ranks the per-tensor
    exchanges cost more than the model's dense all-reduce did.

    Round by round, the tensors' Sum messages are summed concatenated, then their Gather
    messages gathered, position by position concatenated (a variable gather adds their sizes,
    so that each rank's pieces can be told apart); a tensor whose codec has ended sits the
    round out. The rounds of each tensor are the same on every rank, as they are for a tensor
    alone, so every rank issues the same collectives. The
    state of tensor i of bucket b is ``state_for(b)[i]``, its random draws are keyed
    ``(b, i)``. ``ctx.support`` is the union of the tensors' supports (a tensor that reports none
    contributes all its positions) and ``ctx.parts`` each tensor's own."""

    def __init__(self, inner: Codec) -> None:
        if not isinstance(inner, Codec) or isinstance(inner, PerTensor):
            raise TypeError(f"PerTensor wraps a codec instance, got {inner!r}")
        super().__init__()
        self.inner = inner
        self.linear, self.stateful = inner.linear, inner.stateful
        self.scale_equivariant = inner.scale_equivariant
        self.name = f"per-tensor-{inner.name}"

    def pre(self, x: torch.Tensor) -> None:
        self.inner.pre(x)

    def residual_in(self, state: dict, i: int, offset: int, numel: int) -> torch.Tensor | None:
        mine = state.get(i)
        return None if mine is None else self.inner.residual_in(mine, 0, 0, numel)

    def load_state_dict(self, state: dict) -> None:
        """Also takes the state of ``inner`` alone, kept with one tensor per bucket (as
        mlbench's sparsified SGD kept it): bucket b's state becomes its tensor 0's."""
        if state.get("codec") == self.inner.name:
            state = {"codec": self.name, "states": {b: {0: s} for b, s in state["states"].items()}}
        super().load_state_dict(state)

    def rounds(self, x: torch.Tensor, ctx: Context) -> Rounds:
        pieces, offset = [], 0
        for i, shape in enumerate(ctx.shapes):
            n = math.prod(shape)
            pieces.append((slice(offset, offset + n),
                           Context(key=(ctx.key, i), shapes=[shape], size=ctx.size,
                                   rank=ctx.rank, step=ctx.step, seed=ctx.seed,
                                   state=ctx.state.setdefault(i, {}))))
            offset += n
        runs = [self.inner.rounds(x[part], sub) for part, sub in pieces]
        messages = [next(run, None) for run in runs]
        while any(m is not None for m in messages):
            replies = [None] * len(messages)
            sums = [i for i, m in enumerate(messages) if isinstance(m, Sum)]
            gathers = [i for i, m in enumerate(messages) if isinstance(m, Gather)]
            if sums:
                done = yield from _summed_together([messages[i] for i in sums])
                for i, reply in zip(sums, done):
                    replies[i] = reply
            if gathers:
                done = yield from _gathered_together([messages[i] for i in gathers])
                for i, reply in zip(gathers, done):
                    replies[i] = reply
            messages = [None if m is None else _resumed(run, reply)
                        for run, m, reply in zip(runs, messages, replies)]
        parts = [sub.support for _, sub in pieces]
        ctx.parts = parts
        sizes = [part.stop - part.start if support is None else
                 support.stop - support.start if isinstance(support, slice) else
                 support.numel() for (part, _), support in zip(pieces, parts)]
        # scaling a few positions by index beats a pass over x only while they are few
        if not pieces or 8 * sum(sizes) >= x.numel():
            ctx.support = None
            return
        ctx.support = torch.cat([
            torch.arange(part.start, part.stop, device=x.device) if support is None else
            torch.arange(part.start + support.start, part.start + support.stop, device=x.device)
            if isinstance(support, slice) else support.to(torch.int64) + part.start
            for (part, _), support in zip(pieces, parts)])


def _resumed(run: Rounds, reply) -> Sum | Gather | None:
    try:
        return run.send(reply)
    except StopIteration:
        return None


def _summed_together(messages: list[Sum]):
    """One Sum of the messages' tensors packed; each tensor then holds its part."""
    tensors = [m.tensor for m in messages]
    flat = pack(tensors)
    yield Sum(flat)
    unpack(flat, tensors)
    return tensors


def _gathered_together(messages: list[Gather]):
    """One Gather of the messages' tensors concatenated position by position (the tensors of
    every message alike in number and dtype); returns, per message, what a Gather of it alone
    returns: ``result[r][j]``, tensor j of rank r."""
    widths = {len(m.tensors) for m in messages}
    if len(widths) != 1:
        raise RuntimeError("the tensors of one bucket sent gathers of different shapes")
    variable = any(m.variable for m in messages)
    columns = [torch.cat([m.tensors[j].reshape(-1) for m in messages])
               for j in range(widths.pop())]
    counts = torch.tensor([[m.tensors[j].numel() for j in range(len(columns))]
                           for m in messages], dtype=torch.int64)
    sent = columns + ([counts.view(-1)] if variable else [])
    gathered = yield Gather(sent, variable)
    replies: list[list[list[torch.Tensor]]] = [[] for _ in messages]
    for per_rank in gathered:
        sizes = per_rank[-1].view(counts.shape).tolist() if variable else counts.tolist()
        split = [list(column.split([row[j] for row in sizes]))
                 for j, column in enumerate(per_rank[:len(columns)])]
        for i, reply in enumerate(replies):
            reply.append([split[j][i].view(messages[i].tensors[j].shape)
                          if not variable else split[j][i]
                          for j in range(len(columns))])
    return replies


# names accepted wherever heatlike takes ``codec=``: lower-case, one codec each
CODEC_NAMES: dict[str, str] = {
    "none": "identity", "identity": "identity", "fp32": "identity", "float32": "identity",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}


def codec_from(spec: Codec | str | torch.dtype | None) -> Codec | None:
    """The codec meant by ``spec``, the one way every ``codec=`` argument of heatlike is read.

    A :class:`Codec` instance is returned as it is and ``None`` stays ``None`` (the caller's
    default). A name of :data:`CODEC_NAMES`, in any case, builds a fresh codec: ``"none"``,
    ``"identity"``, ``"fp32"``, ``"float32"`` send the values as they are (:class:`Identity`);
    ``"bf16"``, ``"bfloat16"`` send bfloat16 and ``"fp16"``, ``"float16"``, ``"half"`` float16
    (:class:`Cast`, summed with float32 accumulation). A torch dtype means the same
    (``torch.bfloat16``, ``torch.float16``, ``torch.float32``). Anything else raises
    ``ValueError`` (an unknown name) or ``TypeError`` (another kind of object, a codec class
    instead of an instance), listing the valid names. No communication: call sites raise the
    error on every rank together (``heatlike.core.agreement.raise_together``) before anything is
    sent.
    """
    if spec is None or isinstance(spec, Codec):
        return spec
    valid = ", ".join(repr(n) for n in CODEC_NAMES)
    if isinstance(spec, torch.dtype):
        if spec is torch.float32:
            return Identity()
        if spec in (torch.bfloat16, torch.float16):
            return Cast(spec)
        raise ValueError(f"codec={spec} is not a wire type: use torch.bfloat16, torch.float16 "
                         f"or torch.float32, a name ({valid}) or a heatlike.engine codec")
    if isinstance(spec, str):
        kind = CODEC_NAMES.get(spec.strip().lower())
        if kind is None:
            raise ValueError(f"unknown codec {spec!r}: use one of {valid}, or a codec instance "
                             "such as heatlike.engine.TopK(ratio=0.01)")
        if kind == "identity":
            return Identity()
        return Cast(torch.bfloat16 if kind == "bfloat16" else torch.float16)
    if isinstance(spec, type) and issubclass(spec, Codec):
        raise TypeError(f"codec={spec.__name__} is a class: pass an instance, e.g. "
                        f"codec={spec.__name__}(...), or one of the names {valid}")
    raise TypeError(f"codec must be a heatlike.engine codec, a name ({valid}), a torch dtype "
                    f"or None, got {type(spec).__name__}")


def codec_error(spec: object) -> tuple[Codec | None, Exception | None]:
    """``(codec_from(spec), None)``, or ``(None, error)`` when ``spec`` is not a codec: for
    constructors that gather every check into one ``raise_together``."""
    try:
        return codec_from(spec), None  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        return None, error
