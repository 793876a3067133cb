"""The exchange protocol between codecs and reducers, and its driver.

A codec describes how a flat float tensor travels as a *generator of rounds* (``Codec.rounds``).
Each round it yields one message and receives the result:

* ``Sum(tensor)``: the reducer combines ``tensor`` across ranks in place (a sum for the all-reduce
  reducers, a weighted neighbor mix for gossip) and sends back the tensor;
* ``Gather(tensors, variable)``: every rank contributes ``tensors``; the reducer sends back
  ``result[r][i]`` = tensor i of rank r (``variable``: sizes differ between ranks).

When the generator ends, the tensor it was given holds the *sum over ranks* (exact, or the
codec's approximation of it). :func:`exchange` drives one codec over one tensor with a reducer as a
heatlike operation generator (``heatlike.core._requests``): wrapped in a ``Request`` it runs
non-blocking, with the reducer's collectives as its phases and the codec's local computations
between them, and finalizes on every completion path; run by ``drive`` it blocks.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from ..core._requests import Operation, Request

__all__ = ["Sum", "Gather", "Context", "exchange", "Lane", "CodecClock", "CODEC_CLOCK"]


@dataclass
class Sum:
    """Combine ``tensor`` across ranks, in place."""

    tensor: torch.Tensor


@dataclass
class Gather:
    """Collect ``tensors`` of every rank (``variable``: their sizes differ between ranks)."""

    tensors: list[torch.Tensor]
    variable: bool = False


Rounds = Generator[Sum | Gather, object, None]


@dataclass
class Context:
    """What a codec may know about the tensor it encodes.

    ``key`` identifies the tensor across steps (its state lives under it), ``shapes`` the shapes
    of the parameters laid out one after the other in it (for codecs that see matrices), ``step``
    counts the exchanges of this key, ``size`` / ``rank`` describe the communicator, ``seed`` is
    common to all ranks (shared random choices). A codec whose result is zero outside some
    positions of ``x`` sets ``support`` to them (a slice, or indices that may repeat), so that the
    reducer scales only those; ``parts``, where a codec knows them, are the supports of the
    tensors laid out in ``x`` (over each tensor's own positions; None: anywhere)."""

    key: object
    shapes: list[torch.Size]
    size: int
    rank: int
    step: int = 0
    seed: int = 0
    state: dict = field(default_factory=dict)
    support: slice | torch.Tensor | None = None
    parts: list | None = None

    def generator(self, salt: int = 0, shared: bool = True) -> torch.Generator:
        """A generator seeded from (seed, key, step, salt), the same on every rank if
        ``shared``, else also from the rank. Never the global RNG."""
        parts = (self.seed, *_integers(self.key), self.step, salt,
                 0 if shared else self.rank + 1)
        value = 0
        for part in parts:
            value = (value * 1_000_003 + int(part)) % (2**63 - 1)
        return torch.Generator(device="cpu").manual_seed(value)


def _integers(key: object) -> tuple[int, ...]:
    """A key as integers, identical in every process (Python's hash of strings is not)."""
    if isinstance(key, int):
        return (key,)
    if isinstance(key, tuple):
        return tuple(i for k in key for i in _integers(k))
    if isinstance(key, str):
        return tuple(key.encode())
    raise TypeError(f"exchange keys are ints, strings or tuples of them, got {type(key)}")


class CodecClock:
    """Seconds this process spent inside codecs, summed over every exchange: ``pre``, the
    encoding before the first message and each step of ``rounds`` after a result came back
    (decoding, and the next round's encoding). The rest of an exchange is the reducers'
    communication. ``python -m heatlike.bench algorithms`` reports it per step."""

    seconds: float = 0.0


CODEC_CLOCK = CodecClock()


def exchange(values: torch.Tensor, codec, reducer, ctx: Context,
             flags: torch.Tensor | None = None, channel=None, scaled: bool = False) -> Operation:
    """Average (or otherwise reduce) ``values`` over ranks with ``codec`` and ``reducer``.

    Operation generator; afterwards ``values`` holds the reducer's result (e.g. the average).
    ``flags`` (per-parameter use counters of a gradient bucket, kept apart from ``values``) are
    summed exactly: gathered with the codec's first message when it is a gather of fixed sizes,
    else with a small extra all-reduce; codecs that keep small integers exact
    (``codec.carries_flags``: identity, cast) can instead be given values and flags as one tensor.
    ``channel`` (from ``reducer.open_channel()``) runs the collectives on private communicators.
    ``scaled``: the caller already applied the reducer's scaling (divided ``values`` by its
    denominator while packing them), so the reducer only combines.
    """
    clock = time.perf_counter
    began = clock()
    codec.pre(values)        # on the raw values (clipping)
    spent = clock() - began
    # then the reducer's scaling (division before the sum)
    token = None if scaled else reducer.prepare(values)
    began = clock()
    rounds = codec.rounds(values, ctx)
    message = next(rounds, None)
    spent += clock() - began
    flag_request = None
    riding = flags is not None and _flags_can_ride(message, reducer)
    if flags is not None and not riding:
        flag_request = reducer.start_flags(flags, channel=channel)
    while message is not None:
        if isinstance(message, Sum):
            yield from reducer.combine(message.tensor, channel=channel)
            result = message.tensor
        elif riding:  # the flags travel in the codec's first gather: one collective, not two
            result = yield from reducer.gather([*message.tensors, flags], False,
                                               channel=channel)
            reducer.bytes_sent -= flags.numel() * flags.element_size()  # not payload
            flags.copy_(torch.stack([per_rank[-1] for per_rank in result]).sum(
                0, dtype=torch.float64))
            result = [per_rank[:-1] for per_rank in result]
            riding = False
        else:
            result = yield from reducer.gather(message.tensors, message.variable,
                                               channel=channel)
        began = clock()
        try:
            message = rounds.send(result)
        except StopIteration:
            message = None
        spent += clock() - began
    CODEC_CLOCK.seconds += spent
    if flag_request is not None:
        yield flag_request
    if not scaled:
        reducer.finish(values, token, ctx.support)


def _flags_can_ride(message, reducer) -> bool:
    """Whether a bucket's flags can be summed by gathering them with the codec's first message:
    a gather of fixed sizes over all ranks (the reducer sums over the world)."""
    return isinstance(message, Gather) and not message.variable and \
        bool(getattr(reducer, "sums", False)) and not getattr(reducer, "mixes", False)


def _after(previous, op: Operation) -> Operation:
    """``op``, started only once ``previous`` (a Request or None) has completed."""
    if previous is not None and not previous.done:
        yield previous
    yield from op


class Lane:
    """Where a codec and reducer run their exchanges.

    An exchange that is a single collective (identity codec, single-phase reducer) runs on the
    reducer's shared communicators, any number at a time: each is issued at its start, so all
    ranks issue them in the same order. Any other exchange has later collectives that start when
    the rank's progress reaches them; those run on a private channel (collective to open, done at
    construction) one exchange after another, so their collectives are issued in the same order
    on every rank and never interleave with anything else. ``pipelined`` (the buffers are
    staged through host memory in several chunks, ``heatlike.core._staging``) makes even a
    single all-reduce such an exchange: its chunks' collectives start as progress reaches them.

    ``width`` private channels (default 1) let that many exchanges run at once: exchange k goes
    to channel ``k % width`` and waits only for the exchange before it on that channel. Every
    rank starts the same exchanges in the same order, so each channel still sees one sequence of
    collectives on every rank. Where progress is intermittent (it happens only when a rank calls
    into MPI, e.g. between the layers of a backward pass), one serial chain of multi-phase
    exchanges leaves the links idle between its phases; several chains keep them busy.
    The choice is collective: every rank must pass the same."""

    def __init__(self, codec, reducer, pipelined: bool = False, width: int = 1) -> None:
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"a lane's width must be a positive int, got {width!r}")
        self.codec, self.reducer = codec, reducer
        self.private = not (codec.single_round and reducer.single_phase) or pipelined
        self.width = width if self.private else 1
        self.channels = [reducer.open_channel() for _ in range(self.width)] \
            if self.private else []
        self._last: list = [None] * self.width
        self._turn = 0

    @property
    def channel(self):
        """The first private channel (None for a shared lane, or once closed)."""
        return self.channels[0] if self.channels else None

    def close(self) -> None:
        """Collective: free the private channels' communicators (after the last exchange has
        completed; a closed lane starts nothing more)."""
        channels, self.channels = self.channels, []
        for channel in channels:
            for comm in (channel.values() if isinstance(channel, dict) else [channel]):
                comm.Free()

    def start(self, values: torch.Tensor, ctx: Context,
              flags: torch.Tensor | None = None, scaled: bool = False) -> Request:
        if self.private and not self.channels:
            raise RuntimeError("this lane was closed (close()): it exchanges nothing more")
        if not self.private:
            return Request(exchange(values, self.codec, self.reducer, ctx, flags, None, scaled))
        k = self._turn
        self._turn = (k + 1) % self.width
        op = exchange(values, self.codec, self.reducer, ctx, flags, self.channels[k], scaled)
        request = Request(_after(self._last[k], op))
        self._last[k] = request
        return request
