"""Reducers: how ranks combine what codecs send (``heatlike.engine.exchange``).

A reducer answers the codec's rounds: ``combine`` a tensor in place (``Sum``), ``gather`` every
rank's tensors (``Gather``); around the codec it applies ``prepare`` (division before the sum) and
``finish`` (division after). All collectives are non-blocking phases of the exchange.

* :class:`AllReduce`: one all-reduce per ``Sum`` over the communicator; ``op="avg"`` divides the
  sum by the number of ranks, ``"custom_avg"`` by ``denom`` (settable per step), ``"sum"``,
  ``"min"``, ``"max"`` reduce plainly; ``divide_before`` divides each contribution first
  (float16 overflow safety). ``Gather`` uses ``Allgather`` (``Allgatherv`` after exchanging the
  counts when sizes vary). Over several nodes of equal size a ``Sum`` runs node-aware on a
  private channel (:func:`node_aware_sum`, pipelined in chunks): float16/bfloat16 always, so
  that half precision halves the bytes that cross the links, other types from 1 MiB on
  (``HEATLIKE_NODE_AWARE=0`` leaves those to MPI's all-reduce).
* :class:`Hierarchical`: ``Sum`` in three phases over the node-local and cross-node communicators:
  reduce-scatter in the node, concurrent all-reduces of the shards across the nodes (one per
  local rank), all-gather in the node (:func:`node_aware_sum`, what Horovod's hierarchical
  all-reduce does); on nodes of different sizes, a reduce to each node's local rank 0, an
  all-reduce among those and a node-local broadcast.
* :class:`Gossip`: ``Sum`` becomes a neighbor mix ``x_i <- sum_j W_ij x_j`` over a
  :class:`~heatlike.core.topology.NeighborGraph` (one ``Neighbor_allgather`` on the MPI
  distributed-graph communicator); for codecs whose payload is the values themselves.

``bytes_sent`` counts the payload bytes this rank handed to collectives (for gossip, once per
neighbor it sends to).

Channels: ``open_channel()`` (collective) returns private duplicates of the reducer's
communicators, marked ``serial``; ``combine``, ``gather`` and ``start_flags`` take one as
``channel=`` to run there instead of on the shared communicators. The engine runs every exchange
that is more than one collective on a channel, one exchange after another
(:class:`~heatlike.engine.exchange.Lane`), so the ranks always issue its collectives in the same
order.
"""

from __future__ import annotations

import functools
import math

import torch
from mpi4py import MPI

from ..core.buffer_pool import pool as buffer_pool
from ..core.communication import IN_PLACE, MPICommunication, Request, sanitize_comm
from ..core.env import env_flag, env_int
from ..core.topology import NeighborGraph, Topology

__all__ = ["Reducer", "AllReduce", "Hierarchical", "Gossip", "node_aware_sum",
           "node_aware_chunk_bytes", "node_aware_min_bytes", "node_aware_enabled"]

_OPS = {"avg": MPI.SUM, "custom_avg": MPI.SUM, "sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def divide(x: torch.Tensor, denom: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x / denom`` into ``out`` (default: ``x``, in place). Where ``1 / denom`` is exact in
    ``x``'s dtype (``denom`` a power of two, e.g. 2, 4 or 8 ranks) as a multiplication by it:
    the same bits as the division, since both round the same real number, and several times
    faster on the CPU (4 MB of float32 here: 28 us against 195 us)."""
    reciprocal = _exact_reciprocal(float(denom), x.dtype)
    if reciprocal is None:
        return torch.div(x, denom, out=out) if out is not None else x.div_(denom)
    return torch.mul(x, reciprocal, out=out) if out is not None else x.mul_(reciprocal)


@functools.lru_cache(maxsize=64)
def _exact_reciprocal(denom: float, dtype: torch.dtype) -> float | None:
    """``1 / denom`` when ``denom`` is a power of two whose reciprocal ``dtype`` holds exactly
    (a float16 cannot hold 2**-25), else None."""
    if not dtype.is_floating_point or not denom > 0 or math.frexp(denom)[0] != 0.5:
        return None
    reciprocal = 1.0 / denom
    return reciprocal if float(torch.tensor(reciprocal, dtype=dtype)) == reciprocal else None


class Reducer:
    """Base class: a sum over ``comm`` without division."""

    mixes = False        # a Sum round is a neighbor mix, not a sum (only for value payloads)
    single_phase = True  # a Sum round is one collective

    def __init__(self, comm: MPICommunication | None = None) -> None:
        self.comm = sanitize_comm(comm)
        self.bytes_sent = 0

    def open_channel(self):
        """Collective: private serial duplicates of the communicators (see the module
        docstring)."""
        return self.comm.Dup(serial=True)

    @staticmethod
    def _world(channel):
        """The whole-communicator part of an ``open_channel()`` result (None: no channel)."""
        return channel["world"] if isinstance(channel, dict) else channel

    def prepare(self, values: torch.Tensor):
        """Before the codec runs (default: nothing); returns what :meth:`finish` of the same
        exchange needs (settings changed while it is in flight do not apply to it)."""

    def finish(self, values: torch.Tensor, token=None,
               support: slice | torch.Tensor | None = None) -> None:
        """After the codec's last round (default: nothing). ``support``: where ``values`` can be
        nonzero (None: anywhere)."""

    def combine(self, t: torch.Tensor, channel=None):
        """Operation: sum ``t`` over the ranks, in place."""
        self.bytes_sent += _nbytes(t)
        yield (channel or self.comm).Iallreduce(IN_PLACE, t, MPI.SUM)

    def start_flags(self, flags: torch.Tensor, channel=None) -> Request:
        """Start the exact sum of per-parameter use counters (nothing to do on one rank)."""
        comm = self._world(channel) or self.comm
        if comm.size == 1:
            return Request(iter(()))
        return comm.Iallreduce(IN_PLACE, flags, MPI.SUM)

    def gather(self, tensors: list[torch.Tensor], variable: bool = False, channel=None):
        """Operation returning ``result[r][i]``: tensor i of rank r. On one rank: copies of
        ``tensors``, no communication (and no staging of device buffers)."""
        comm = self._world(channel) or self.comm
        if comm.size == 1:
            self.bytes_sent += sum(_nbytes(t) for t in tensors)
            return [[t.clone() for t in tensors]]
        if not variable and len(tensors) > 1 and len({t.device for t in tensors}) == 1:
            return (yield from self._gather_packed(tensors, comm))
        parts = []
        for t in tensors:
            self.bytes_sent += _nbytes(t)
            t = t.contiguous()
            if variable:
                counts = torch.empty(comm.size, dtype=torch.int64)
                yield comm.Iallgather(torch.tensor([t.numel()]), counts)
                counts = counts.tolist()
                out = torch.empty(sum(counts), dtype=t.dtype, device=t.device)
                yield comm.Iallgatherv(t, (out, counts))
                parts.append(list(out.split(counts)))
            elif not t.numel():  # empty on every rank (fixed sizes): nothing to send
                parts.append([t.clone() for _ in range(comm.size)])
            else:
                out = torch.empty(comm.size * t.numel(), dtype=t.dtype, device=t.device)
                yield comm.Iallgather(t, out)
                parts.append(list(out.view(comm.size, -1)))
        return [list(per_rank) for per_rank in zip(*parts)]

    def _gather_packed(self, tensors: list[torch.Tensor], comm):
        """Operation: :meth:`gather` of fixed-size tensors as one all-gather of their bytes (each
        padded to 16 bytes, the largest element size (complex128), so every piece is aligned for
        its dtype)."""
        pieces, layout = [], []
        for t in tensors:
            self.bytes_sent += _nbytes(t)
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            pad = -raw.numel() % 16
            pieces.append(raw if not pad else torch.cat([raw, raw.new_zeros(pad)]))
            layout.append((t.dtype, t.shape, raw.numel(), raw.numel() + pad))
        packed = torch.cat(pieces)
        if not packed.numel():  # every tensor empty, on every rank (fixed sizes): no collective
            return [[t.clone() for t in tensors] for _ in range(comm.size)]
        out = torch.empty(comm.size * packed.numel(), dtype=torch.uint8, device=packed.device)
        yield comm.Iallgather(packed, out)
        result = []
        for row in out.view(comm.size, -1):
            per_rank, offset = [], 0
            for dtype, shape, used, width in layout:
                per_rank.append(row[offset:offset + used].view(dtype).view(shape))
                offset += width
            result.append(per_rank)
        return result


class AllReduce(Reducer):
    """Flat all-reduce over ``comm`` (see the module docstring for ``op``)."""

    def __init__(self, comm: MPICommunication | None = None, op: str = "avg",
                 divide_before: bool = False, denom: float | None = None) -> None:
        super().__init__(comm)
        self._layered: bool | None = None
        self.configure(op, divide_before, denom)

    @property
    def single_phase(self) -> bool:
        """A ``Sum`` is one collective, unless large float sums run node-aware
        (:meth:`node_aware`). Collective on the first call."""
        return not self.node_aware

    @property
    def node_aware(self) -> bool:
        """Whether sums of at least :func:`node_aware_min_bytes` run as the pipelined
        :func:`node_aware_sum` on a channel: ``comm`` spans several nodes with the same number
        (> 1) of ranks each and ``HEATLIKE_NODE_AWARE`` is not 0. On the virtual cluster (2
        nodes x 2 ranks, 1 Gbit/s, MPICH over TCP) a 16 MiB float32 sum took 150 ms this way
        and 212 ms as MPI's all-reduce. Collective on the first call (the topology)."""
        if self._layered is None:
            from ..core.topology import get_topology

            self._layered = (self.comm.size > 1 and node_aware_enabled()
                             and _layered(get_topology(self.comm)))
        return self._layered

    def configure(self, op: str = "avg", divide_before: bool = False,
                  denom: float | None = None) -> None:
        """Change the reduction (same communicators, same channels)."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        if op == "custom_avg" and denom is not None and denom <= 0:
            raise ValueError("op='custom_avg' needs a positive denom")
        if divide_before and op not in ("avg", "custom_avg"):
            raise ValueError("divide_before only applies to op='avg' or 'custom_avg'")
        self.op = op
        self.divide_before = divide_before
        self.denom = float(self.comm.size if op == "avg" else (denom or 1.0))

    def set_denom(self, denom: float) -> None:
        """The denominator of ``custom_avg`` for the next exchanges."""
        if not denom > 0:
            raise ValueError(f"denom must be positive, got {denom!r}")
        self.denom = float(denom)

    @property
    def _divides(self) -> bool:
        return self.op in ("avg", "custom_avg")

    @property
    def sums(self) -> bool:
        """Whether the reduction adds (use counters may then ride in the payload)."""
        return self.op not in ("min", "max")

    def prepare(self, values: torch.Tensor) -> float:
        if self._divides and self.divide_before:
            divide(values, self.denom)
        return self.denom

    def open_channel(self):
        """Collective: a private serial duplicate of ``comm``; where ``comm`` spans several nodes
        with the same number (> 1) of ranks each, also of its node-local and cross-node
        communicators, over which half-precision sums run node-aware (:meth:`combine`)."""
        world = self.comm.Dup(serial=True)
        from ..core.topology import get_topology

        topo = get_topology(self.comm)
        if not _layered(topo):
            return world
        return {"world": world, "node": topo.node_comm.Dup(serial=True),
                "cross": topo.cross_comm.Dup(serial=True)}

    def combine(self, t: torch.Tensor, channel=None):
        """Sum ``t`` in place. On a channel over several equal nodes, node-aware
        (:func:`node_aware_sum`): float16/bfloat16 always, so that what crosses the links is
        half of the float32 sum's bytes; other types from :func:`node_aware_min_bytes` on where
        :attr:`node_aware`. MPI's own all-reduce otherwise."""
        self.bytes_sent += _nbytes(t)
        if (self._world(channel) or self.comm).size == 1:  # the sum of one rank: no staging
            return
        if isinstance(channel, dict) and (
                t.dtype in (torch.float16, torch.bfloat16)
                or (self.node_aware and _nbytes(t) >= node_aware_min_bytes())):
            yield from node_aware_sum(t, _OPS[self.op], channel["node"], channel["cross"])
        else:
            yield (self._world(channel) or self.comm).Iallreduce(IN_PLACE, t, _OPS[self.op])

    def gather(self, tensors: list[torch.Tensor], variable: bool = False, channel=None):
        if self.op in ("min", "max"):
            raise ValueError(f"op={self.op!r} needs a linear codec (identity or cast)")
        return (yield from super().gather(tensors, variable, channel))

    def finish(self, values: torch.Tensor, token: float | None = None,
               support: slice | torch.Tensor | None = None) -> None:
        if not self._divides or self.divide_before:
            return
        denom = self.denom if token is None else token
        if support is None:
            divide(values, denom)
        elif isinstance(support, slice):
            divide(values[support], denom)
        else:  # indices, perhaps repeated: each position divided once (a repeated one gets
            # the same quotient twice); 3.7x faster than indexing with the tensor
            values.index_copy_(0, support, divide(values.index_select(0, support), denom))


class Hierarchical(AllReduce):
    """All-reduce in three phases over the node-local and cross-node communicators
    (``topology`` defaults to the communicator's). On nodes of equal size (> 1 rank):
    :func:`node_aware_sum`, every local rank carrying its shard across the links at the same time.
    On nodes of different sizes: a reduce to each node's local rank 0, an all-reduce among those,
    and a node-local broadcast. Float32/float64 sums under :func:`node_aware_min_bytes` take
    MPI's one all-reduce instead, as :class:`AllReduce`'s do: they are latency-bound, and three
    phases cost three latencies (a 151K-parameter CNN's 0.6 MB sum on two nodes at 10 Gbit/s
    stepped 1.16x slower than flat in three phases)."""

    single_phase = False

    def __init__(self, comm: MPICommunication | None = None, op: str = "avg",
                 divide_before: bool = False, denom: float | None = None,
                 topology: Topology | None = None) -> None:
        super().__init__(comm, op, divide_before, denom)
        if topology is None:
            from ..core.topology import get_topology

            topology = get_topology(self.comm)
        self.topology = topology

    def open_channel(self):
        topo = self.topology
        return {"world": self.comm.Dup(serial=True), "node": topo.node_comm.Dup(serial=True),
                "cross": topo.cross_comm.Dup(serial=True)}

    def combine(self, t: torch.Tensor, channel=None):
        topo, op = self.topology, _OPS[self.op]
        node = channel["node"] if channel else topo.node_comm
        cross = channel["cross"] if channel else topo.cross_comm
        self.bytes_sent += _nbytes(t)
        if self.comm.size == 1:  # the sum of one rank: no staging
            return
        if t.dtype not in (torch.float16, torch.bfloat16) and _nbytes(t) < node_aware_min_bytes():
            yield (self._world(channel) or self.comm).Iallreduce(IN_PLACE, t, op)
            return
        if len(set(topo.local_sizes)) == 1:
            yield from node_aware_sum(t, op, node, cross)
            return
        if node.size > 1:
            yield node.Ireduce(IN_PLACE if topo.is_leader else t, t if topo.is_leader else None,
                               op, 0, _agree=False)
        if topo.is_leader and topo.num_nodes > 1:
            yield cross.Iallreduce(IN_PLACE, t, op)
        if node.size > 1:
            yield node.Ibcast(t, 0)


def _layered(topo: Topology) -> bool:
    """Whether node-aware sums apply: several nodes, all of the same size > 1."""
    return topo.num_nodes > 1 and len(set(topo.local_sizes)) == 1 and topo.local_sizes[0] > 1


def node_aware_sum(t: torch.Tensor, op: MPI.Op, node: MPICommunication,
                   cross: MPICommunication, chunk_bytes: int | None = None):
    """Operation: ``t`` (contiguous) reduced with ``op`` over every rank, in place, as Horovod's
    hierarchical all-reduce does it. With L ranks per node and n elements:

    1. reduce-scatter inside the node: local rank i gets shard i (about n / L elements) of the
       node's sum;
    2. all-reduce of shard i among the ranks with local rank i, one per node: the L cross-node
       all-reduces run at the same time, each over a 1/L share of the buffer, so a node's link
       carries what one flat all-reduce of the buffer between the nodes would, and no rank idles;
    3. all-gather inside the node.

    Pipelined: the buffer is cut into chunks of ``chunk_bytes`` (default
    :func:`node_aware_chunk_bytes`); up to :data:`PIPELINE_DEPTH` chunks are reduce-scattered
    ahead, chunk i crosses the links while chunk i + 1 is reduced inside the node and chunk
    i - 1 gathered, so the link never waits for the node-local phases. Every rank issues the
    chunks' collectives in the same order (reduce-scatters and all-gathers interleaved on
    ``node``, all-reduces in chunk order on ``cross``), and MPI progresses all of them while
    the operation waits for any one.

    For float16/bfloat16 every phase accumulates in float32 and rounds once (heatlike's half
    reductions), so the node's partial sum is rounded to the half type once more than in a flat
    sum before it crosses the link. Every node must have the same number of ranks."""
    flat = t.view(-1)
    if node.size == 1:
        yield cross.Iallreduce(IN_PLACE, flat, op)
        return
    if cross.size == 1:
        yield node.Iallreduce(IN_PLACE, flat, op)
        return
    size, rank = node.size, node.rank
    n = flat.numel()
    if chunk_bytes is None:
        chunk_bytes = node_aware_chunk_bytes()
    per = max(size, chunk_bytes // flat.element_size())
    pieces = [flat[s:s + per] for s in range(0, n, per)] or [flat]
    counts = [[m // size + (1 if i < m % size else 0) for i in range(size)]
              for m in (p.numel() for p in pieces)]
    shards = [torch.empty(c[rank], dtype=flat.dtype, device=flat.device) for c in counts]

    def scatter(i: int) -> Request:
        return node.Ireduce_scatter(pieces[i], shards[i], counts[i], op)

    chunks = len(pieces)
    scattered = [scatter(i) for i in range(min(PIPELINE_DEPTH, chunks))]
    crossing = None
    gathers = []
    for i in range(chunks):
        yield scattered[i]
        this = cross.Iallreduce(IN_PLACE, shards[i], op)
        if i + PIPELINE_DEPTH < chunks:
            scattered.append(scatter(i + PIPELINE_DEPTH))
        if crossing is not None:
            yield crossing
            gathers.append(node.Iallgatherv(shards[i - 1], (pieces[i - 1], counts[i - 1])))
        crossing = this
    yield crossing
    gathers.append(node.Iallgatherv(shards[-1], (pieces[-1], counts[-1])))
    yield from gathers


PIPELINE_DEPTH = 3  # chunks of a node-aware sum reduce-scattered ahead of the one on the links


def node_aware_chunk_bytes() -> int:
    """Bytes per chunk of :func:`node_aware_sum`: ``HEATLIKE_NODE_AWARE_CHUNK_KB`` KiB
    (default 1024). On the virtual cluster's 1 Gbit/s links a 16 MiB sum took 150 ms in 1 MiB
    chunks, 188 ms in 4 MiB chunks and 201 ms unchunked (the link alone: 146 ms)."""
    return env_int("HEATLIKE_NODE_AWARE_CHUNK_KB", 1024, minimum=1) * 1024


def node_aware_min_bytes() -> int:
    """Sums smaller than this (``HEATLIKE_NODE_AWARE_MIN_KB`` KiB, default 8192) run as MPI's
    own all-reduce even over equal nodes, and through :class:`Hierarchical` too. Below it the
    node-aware sum's three phases and their chunks cost more than its overlap saves: on the
    virtual cluster (2 nodes x 2 ranks, MPICH over TCP) a residual MLP with fourteen 1.6 MB
    gradients stepped 13% faster at 10 Gbit/s with MPI's all-reduce and as fast at 1 Gbit/s,
    while a 16.7 MB gradient still gained 13% node-aware at 1 Gbit/s (docs/multinode.md).
    Half-precision sums excepted (MPI cannot sum them: heatlike's flat half-precision sum would
    send every rank's blocks across the links)."""
    return env_int("HEATLIKE_NODE_AWARE_MIN_KB", 8192, minimum=0) * 1024


def node_aware_enabled() -> bool:
    """Whether float sums over several equal nodes run node-aware (:class:`AllReduce`):
    ``HEATLIKE_NODE_AWARE=0`` leaves every float32/float64 sum to MPI's own all-reduce.
    Must be the same on every rank."""
    return bool(env_flag("HEATLIKE_NODE_AWARE", True))


class Gossip(Reducer):
    """Average with neighbors: a ``Sum`` round computes ``x_i <- W_ii x_i + sum_j W_ij x_j``."""

    mixes = True

    def __init__(self, graph: NeighborGraph) -> None:
        super().__init__(graph.comm)
        self.graph = graph

    def open_channel(self):
        return self.graph.graph_comm.Dup(serial=True)

    def exchange(self, t: torch.Tensor, received: torch.Tensor, channel=None) -> Request | None:
        """Start sending ``t`` to every neighbor and receiving each neighbor's ``t`` into the
        rows of ``received`` (degree x ``t.numel()``); None without neighbors."""
        degree = len(self.graph.neighbors)
        if not degree:
            return None
        self.bytes_sent += _nbytes(t) * degree
        return (channel or self.graph.graph_comm).Ineighbor_allgather(t, received)

    def add_neighbors(self, into: torch.Tensor, received: torch.Tensor) -> None:
        """``into += sum_j W_ij x_j`` over the rows ``x_j`` of ``received`` (:meth:`exchange`)."""
        degree = len(self.graph.neighbors)
        for w, x in zip(self.graph.weights, received.view(degree, -1) if degree else ()):
            into.add_(x.to(into.dtype), alpha=w)

    def combine(self, t: torch.Tensor, channel=None):
        degree = len(self.graph.neighbors)
        if not degree:  # a single rank: nothing to mix
            return
        # degree x the model, kept for the next mix (heatlike.core.buffer_pool)
        raw = buffer_pool.take(degree * _nbytes(t), t.device)
        received = raw.view(t.dtype)
        yield self.exchange(t, received, channel)
        t.mul_(self.graph.self_weight)
        self.add_neighbors(t, received)
        buffer_pool.give(raw)

    def gather(self, tensors, variable=False, channel=None):
        raise ValueError("gossip averages values: use a codec that sends them (identity or cast)")
        yield  # pragma: no cover

    def start_flags(self, flags: torch.Tensor, channel=None) -> Request:
        raise ValueError("gossip averaging is for models, not gradient buckets with flags")
