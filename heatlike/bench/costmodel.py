"""An alpha-beta cost model of every algorithm's communication per training step.

This is a **model, not a measurement**: it predicts how the per-step time of each algorithm would
grow with the number of ranks from two link parameters and a handful of textbook formulas. It
ignores contention beyond what the parameters capture, the overlap of communication with the
backward pass (non-blocking modes, bucketing), the codecs' own compute (top-k selection,
PowerSGD's orthogonalization), the algorithm the MPI library actually picks, stragglers and noise.
Use it to compare algorithms and to see where latency or bandwidth starts to dominate; the
``costmodel`` suite prints it next to the step times measured at the sizes actually run, and the
distance between the two is part of the result.

Links. A message of n bytes over a link takes ``alpha + n * beta`` (latency alpha, inverse
bandwidth beta). There are two links: node-local (between ranks of one node) and cross-node.
``--links local_us:local_GBps,cross_us:cross_GBps`` gives them (``1.5:20,4:12.5`` = 1.5 us and
20 GB/s inside a node, 4 us and 12.5 GB/s between nodes); otherwise they come from the ``comm``
suite's ring ``Sendrecv`` measurement (:func:`heatlike.bench.comm.measure_links`; on one node
the cross-node link is taken equal to the node-local one).

Overhead. Where it is measured (``bench cluster``), every collective the engine issues also costs
its rank a fixed ``overhead`` o beyond alpha and beta (``Links.overhead``): issuing it and testing
it from Python, and, where ranks share cores, waiting for one. A pipelined sum issues three per
chunk.

Layout. P ranks, L ranks per node (``--ranks-per-node``), N = ceil(P / L) nodes. A collective over
all ranks that is not node-aware runs at the pace of its slowest link: the cross-node one when
N > 1. The cross-node beta is that of a node's link (all its ranks' flows together): ``bench
cluster`` measures it so on the virtual cluster.

Primitives, for n bytes per rank on p ranks over link (alpha, beta):

* all-reduce as MPI libraries run it for large buffers (recursive halving, then doubling):
  ``2 ceil(log2 p) alpha + 2 (p - 1)/p n beta``; on full nodes of L ranks (N nodes) first inside
  the nodes, then between them with the L ranks' shards sharing the node's link:
  ``halving(n, L, local) + halving(n, N, cross)`` (on the virtual cluster MPICH's all-reduce put
  exactly that on each node's link); the ring, ``2 (p - 1) (alpha + n/p beta)``, is kept as a
  primitive;
* all-gather of k bytes from every rank: ``(p - 1) (alpha + k beta)``;
* reduce to one rank and broadcast from one rank: ``2 (p - 1) (alpha + n/p beta)`` each
  (reduce-scatter + gather; scatter + all-gather);
* hierarchical all-reduce (heatlike's ``node_aware_sum``): node-local reduce-scatter
  ``(L - 1) (alpha + n/L beta)`` + the L shards all-reduced across the N nodes at once, sharing
  the node's link: ``halving(n, N, cross)`` + node-local all-gather of the n/L shards, each
  phase on chunks of c bytes (1 MiB) in a pipeline: the slowest phase's time for every chunk
  but one plus the three phases of one chunk;
* the engine's all-reduce (every preset that sums): the hierarchical all-reduce on several full
  nodes of more than one rank from the node-aware threshold on (8 MiB), the library's otherwise;
* neighbor exchange of n bytes with d neighbors: ``d (alpha + n beta)``.

Per algorithm, with m parameters (float32, 4m bytes), matrices ``a_i x b_i`` (tensors of more
than one dimension, flattened after the first), and ``m_1`` elements in 1-D tensors:

=====================================  ==================================================
all-reduce presets (DataParallel,      engine all-reduce of 4m
centralized SGD/Adam, clipping,
DistOpt fused)
bf16 cast, FP16Optimizer, DistOpt      all-reduce of 2m (bf16 cast on several equal
half                                   nodes: hierarchical all-reduce of 2m)
hierarchical                           hierarchical all-reduce of 4m (the library's
                                       under the node-aware threshold, 8 MiB)
PowerSGD rank r                        all-reduce of ``4 (r sum a_i + m_1)`` then of
                                       ``4 r sum b_i``
top-k ratio q (also DistOpt sparse)    all-gather of ``8 ceil(q m)`` (index and value)
random-k ratio q, shared               all-reduce of ``4 ceil(q m)``
sparsified SGD (blocks of 1024)        all-gather of ``8 sum min(1024, m_i)``; shared
                                       blocks: all-reduce of ``4 sum min(1024, m_i)``
sign / scaled sign                     all-gather of ``ceil(m / 8)`` bytes (one bit each)
decentralized (ring gossip)            neighbor exchange of 4m with 2 neighbors
DistOpt partial                        all-reduce of one partition, ``4m / partitions``
                                       on average (partitions of the engine's bucket plan)
DASO (cycling phase: global sync      node-local all-reduce of 4m every step, and
every k = 4 steps)                     every k steps an all-reduce of 2m (bfloat16)
                                       among the N nodes carried in L shards at once and
                                       a node-local all-gather of the merged 4m (a run's
                                       own schedule, warmup included:
                                       ``daso_step_times``)
=====================================  ==================================================

Predicted step time = measured compute time of one step (forward, backward and local optimizer
step of the same model and per-rank batch, no communication, all ranks starting together and the
step ending with the slowest: :func:`local_step_time`; weak scaling, so it does not change with P)
+ predicted communication time; no overlap of communication with computation is assumed, so for
the non-blocking modes the prediction is an upper bound. Where the ranks take turns on the cores
(``Layout.overlap`` false) the phases of a pipelined sum do not overlap each other either.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Link", "Links", "Layout", "ring_allreduce", "halving_allreduce",
           "library_allreduce", "allgather", "reduce", "bcast", "hierarchical_allreduce",
           "engine_allreduce", "neighbor_exchange", "Shapes", "MODELS", "comm_time",
           "daso_parts", "daso_step_times",
           "payload_bytes", "predict", "parse_links", "RANKS", "run", "local_step_time",
           "synchronous_step_time"]

#: the predicted world sizes
RANKS = tuple(2 ** k for k in range(3, 13))  # 8 .. 4096


@dataclass(frozen=True)
class Link:
    """``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    @classmethod
    def from_us_gbps(cls, latency_us: float, gbps: float) -> Link:
        """From a latency in microseconds and a bandwidth in GB/s (1e9 bytes per second)."""
        if latency_us < 0 or gbps <= 0:
            raise ValueError(f"need latency >= 0 and bandwidth > 0, got {latency_us} us, "
                             f"{gbps} GB/s")
        return cls(latency_us * 1e-6, 1.0 / (gbps * 1e9))

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return 1.0 / self.beta

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta

    def __str__(self) -> str:
        return f"alpha {self.alpha * 1e6:.2f} us, {self.bandwidth / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class Links:
    """The two links, and ``overhead``: seconds each collective the engine issues costs its
    rank beyond the links' alpha and beta (issuing it, testing it from Python, waiting for a
    core where ranks share them); 0 for a pure alpha-beta model."""

    local: Link
    cross: Link
    overhead: float = 0.0


def parse_links(spec: str) -> Links:
    """``"local_us:local_GBps,cross_us:cross_GBps"`` (the cross-node pair may be left out: then
    it equals the node-local one)."""
    try:
        parts = [tuple(float(v) for v in p.split(":")) for p in spec.split(",") if p.strip()]
        if not 1 <= len(parts) <= 2 or any(len(p) != 2 for p in parts):
            raise ValueError
        links = [Link.from_us_gbps(*p) for p in parts]
    except ValueError:
        raise ValueError(f"--links takes local_us:local_GBps[,cross_us:cross_GBps] with "
                         f"positive bandwidths, got {spec!r}") from None
    return Links(links[0], links[-1])


@dataclass(frozen=True)
class Layout:
    """``ranks`` ranks, ``ranks_per_node`` per node (the last node may hold fewer).
    ``overlap``: whether the phases of a pipelined collective on different chunks run at the
    same time (each rank has a core of its own); where ranks take turns on the cores (more ranks
    than cores: :func:`heatlike.bench._common.cores_per_rank` below 1) the copies, sums and
    transport work of the phases add up instead."""

    ranks: int
    ranks_per_node: int
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.ranks_per_node < 1:
            raise ValueError(f"need ranks >= 1 and ranks_per_node >= 1, got {self}")

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)

    @property
    def local(self) -> int:
        """Ranks on a (full) node."""
        return min(self.ranks, self.ranks_per_node)

    def flat_link(self, links: Links) -> Link:
        """The link that paces a collective over all ranks."""
        return links.cross if self.nodes > 1 else links.local


# -- primitives ---------------------------------------------------------------------------------

def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    """``2 (p - 1) (alpha + nbytes/p beta)``; 0 for one rank."""
    return 2 * (p - 1) * (link.alpha + nbytes / p * link.beta) if p > 1 else 0.0


def allgather(kbytes: float, p: int, link: Link) -> float:
    """``(p - 1) (alpha + k beta)``: every rank's k bytes to every rank (ring)."""
    return (p - 1) * (link.alpha + kbytes * link.beta) if p > 1 else 0.0


def reduce(nbytes: float, p: int, link: Link) -> float:
    """Reduce to one rank as reduce-scatter + gather: ``2 (p - 1) (alpha + nbytes/p beta)``."""
    return 2 * (p - 1) * (link.alpha + nbytes / p * link.beta) if p > 1 else 0.0


def bcast(nbytes: float, p: int, link: Link) -> float:
    """Broadcast as scatter + all-gather: ``2 (p - 1) (alpha + nbytes/p beta)``."""
    return 2 * (p - 1) * (link.alpha + nbytes / p * link.beta) if p > 1 else 0.0


def halving_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling (Rabenseifner;
    what MPI libraries run for large buffers): ``2 ceil(log2 p) alpha + 2 (p - 1)/p n beta``."""
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def library_allreduce(nbytes: float, layout: Layout, links: Links) -> float:
    """The MPI library's all-reduce of n bytes over all ranks. On full nodes of several ranks,
    with ranks placed in blocks, recursive halving exchanges inside the nodes first and then
    between them, the L ranks of a node sending their shards at once over its link (on the
    virtual cluster MPICH's all-reduce put exactly ``2 (N - 1)/N n`` per step on each node's
    link): ``halving(n, L, local) + halving(n, N, cross)``, the cross part at the node link's
    beta. Otherwise :func:`halving_allreduce` over all ranks at the pace of the flat link."""
    local, nodes = layout.local, layout.nodes
    if nodes > 1 and local > 1 and layout.ranks % layout.ranks_per_node == 0:
        return (halving_allreduce(nbytes, local, links.local)
                + halving_allreduce(nbytes, nodes, links.cross))
    return halving_allreduce(nbytes, layout.ranks, layout.flat_link(links))


def hierarchical_allreduce(nbytes: float, layout: Layout, links: Links,
                           chunk: float | None = None) -> float:
    """heatlike's node-aware sum: node-local reduce-scatter + the shards all-reduced across the
    nodes concurrently (their bytes share the node's link: an all-reduce of n among N ranks)
    + node-local all-gather, pipelined in chunks of ``chunk`` bytes (default the engine's,
    :func:`heatlike.engine.reducers.node_aware_chunk_bytes`): the slowest phase for every chunk
    but one, plus all three phases of one chunk (filling and draining the pipeline). Without
    ``layout.overlap`` every chunk pays its three phases one after the other."""
    from ..engine.reducers import node_aware_chunk_bytes

    local, nodes = layout.local, layout.nodes
    chunk = float(chunk or node_aware_chunk_bytes())
    chunks = max(1, math.ceil(nbytes / chunk))
    size = nbytes / chunks

    def phases(n: float) -> tuple[float, float, float]:
        # the reduce-scatter costs the all-gather's terms; each phase is one collective
        inside = allgather(n / local, local, links.local) + links.overhead
        return inside, halving_allreduce(n, nodes, links.cross) + links.overhead, inside

    if not layout.overlap:
        return chunks * sum(phases(size))
    return (chunks - 1) * max(phases(size)) + sum(phases(size))


def _node_aware(layout: Layout) -> bool:
    """Whether heatlike's sums run node-aware on this layout: full nodes of more than one rank,
    several of them."""
    return layout.nodes > 1 and layout.local > 1 and layout.ranks % layout.ranks_per_node == 0


def engine_allreduce(nbytes: float, layout: Layout, links: Links) -> float:
    """The engine's all-reduce of n bytes (:class:`heatlike.engine.AllReduce`): node-aware
    (:func:`hierarchical_allreduce`) on several full nodes from
    :func:`~heatlike.engine.reducers.node_aware_min_bytes` on (unless ``HEATLIKE_NODE_AWARE=0``),
    the library's otherwise."""
    from ..engine.reducers import node_aware_enabled, node_aware_min_bytes

    if _node_aware(layout) and node_aware_enabled() and nbytes >= node_aware_min_bytes():
        return hierarchical_allreduce(nbytes, layout, links)
    return library_allreduce(nbytes, layout, links) + links.overhead


def neighbor_exchange(nbytes: float, degree: int, link: Link) -> float:
    """``degree (alpha + nbytes beta)``: this rank's n bytes to each neighbor, one at a time."""
    return degree * link.time(nbytes)


# -- the algorithms -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    """What the model needs to know about the parameters."""

    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, module_or_shapes) -> Shapes:
        if hasattr(module_or_shapes, "parameters"):
            return cls(tuple(tuple(p.shape) for p in module_or_shapes.parameters()))
        return cls(tuple(tuple(s) for s in module_or_shapes))

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def matrices(self) -> list[tuple[int, int]]:
        """(rows, columns) of every tensor of more than one dimension (flattened after dim 0)."""
        return [(s[0], math.prod(s[1:])) for s in self.shapes if len(s) > 1]

    @property
    def vector_elements(self) -> int:
        return sum(math.prod(s) for s in self.shapes if len(s) <= 1)

    def partitions(self, threshold: int) -> int:
        """How many buckets the engine plans for DistOpt's partial update with ``threshold``
        elements (parameters in reverse order, capped at ``4 * threshold`` bytes)."""
        import torch

        from ..engine.buckets import plan_buckets

        tensors = [torch.empty(s) for s in reversed(self.shapes)]
        cap = 4 * threshold
        return len(plan_buckets(tensors, cap, cap, flags=False))


Model = Callable[[Shapes, Layout, Links], tuple[float, float]]


def _allreduce(factor: float) -> Model:
    def model(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
        n = factor * s.total
        return engine_allreduce(n, lay, links), n
    return model


def _hierarchical(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
    """Three phases, or the library's all-reduce under the node-aware threshold."""
    from ..engine.reducers import node_aware_min_bytes

    n = 4.0 * s.total
    if n < node_aware_min_bytes():
        return library_allreduce(n, lay, links) + links.overhead, n
    return hierarchical_allreduce(n, lay, links), n


def _half_cast(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
    """The bf16 cast: node-aware on several full nodes of more than one rank, else the
    library's all-reduce."""
    n = 2.0 * s.total
    if _node_aware(lay):
        return hierarchical_allreduce(n, lay, links), n
    return library_allreduce(n, lay, links) + links.overhead, n


def _powersgd(rank: int) -> Model:
    def model(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
        first = 4.0 * (rank * sum(a for a, _ in s.matrices) + s.vector_elements)
        second = 4.0 * rank * sum(b for _, b in s.matrices)
        return (engine_allreduce(first, lay, links)
                + engine_allreduce(second, lay, links)), first + second
    return model


def _gather(kbytes: Callable[[Shapes], float]) -> Model:
    def model(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
        k = kbytes(s)
        return allgather(k, lay.ranks, lay.flat_link(links)) + links.overhead, k
    return model


def _allreduce_of(nbytes: Callable[[Shapes], float]) -> Model:
    def model(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
        n = nbytes(s)
        return engine_allreduce(n, lay, links), n
    return model


def _gossip(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
    degree = min(2, lay.ranks - 1)
    n = 4.0 * s.total
    return neighbor_exchange(n, degree, lay.flat_link(links)) + links.overhead, degree * n


def _partial(threshold: int) -> Model:
    def model(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
        n = 4.0 * s.total / s.partitions(threshold)
        return engine_allreduce(n, lay, links), n
    return model


def daso_parts(s: Shapes, lay: Layout, links: Links) -> dict[str, float]:
    """Seconds of DASO's kinds of communication, where the ranks of a node hold the same
    parameters (every batch averaged inside the node, DASO's cycling default: each rank computes
    its own shard): ``"local"``, the node's gradient all-reduce of 4m (a batch that averages
    inside the node); ``"send"``, nothing inside the node (a batch that starts a global
    synchronization); ``"cross"``, the shards' bfloat16 all-reduce across the nodes (every local
    rank carrying its shard at once, sharing the node's link); ``"collect"``, the merged shards
    all-gathered inside the node (the batch that merges); ``"gradients"``, the warmup's
    bfloat16 gradient all-reduce over every rank (the engine's, as for the bf16 codec)."""
    n = 4.0 * s.total
    local, nodes = lay.local, lay.nodes
    o = links.overhead
    return {"local": halving_allreduce(n, local, links.local) + o, "send": 0.0,
            "cross": halving_allreduce(n / 2, nodes, links.cross) + o,
            "collect": allgather(n / local, local, links.local) + o if local > 1 else 0.0,
            "gradients": _half_cast(s, lay, links)[0]}


def daso_step_times(s: Shapes, lay: Layout, links: Links, schedule: dict[str, int],
                    compute_s: float = 0.0) -> list[float]:
    """The communication seconds of every step of a DASO run whose steps are counted by kind in
    ``schedule``. A key names what the step did, joined by ``+``: ``"gradients"`` (the
    warmup's all-reduce over every rank), ``"local"``, ``"send"``,
    ``"merge"`` (of the synchronization sent in the same step: blocking), ``"merge@k"`` (of one
    sent k steps before); ``""`` for none of them. The value is the number of such steps. A
    blocking merge pays the whole cross-node sum; a later one only what of it did not fit into
    the k steps' computation (``compute_s`` each) it overlapped."""
    parts = daso_parts(s, lay, links)
    times = []
    for kind, count in schedule.items():
        seconds = 0.0
        for token in filter(None, kind.split("+")):
            if token.startswith("merge"):
                late = int(token.partition("@")[2] or 0)
                seconds += max(0.0, parts["cross"] - late * compute_s) + parts["collect"]
            else:
                seconds += parts[token]
        times += [seconds] * count
    return times


def _daso(every: int) -> Model:
    """The cycling phase: a global synchronization every ``every`` steps, local averaging in
    every step."""
    def model(s: Shapes, lay: Layout, links: Links) -> tuple[float, float]:
        n = 4.0 * s.total
        local, nodes = lay.local, lay.nodes
        parts = daso_parts(s, lay, links)
        # per rank: every step its node's gradient all-reduce; per global sync a shard of the
        # bfloat16 change across the nodes, and its merged shard to the node's other ranks
        per_sync = (n / 2 / local if nodes > 1 else 0.0) + \
            (n / local * (local - 1) if local > 1 else 0.0)
        return (parts["local"] + (parts["send"] + parts["cross"] + parts["collect"]) / every,
                (n if local > 1 else 0.0) + per_sync / every)
    return model


def _blocks(s: Shapes) -> int:
    return sum(min(1024, m) for m in s.numels)


#: algorithm (a key of heatlike.recipes.ALGORITHMS) -> (pattern, model); a model maps
#: (shapes, layout, links) to (seconds of communication per step, payload bytes per rank)
MODELS: dict[str, tuple[str, Model]] = {
    "allreduce": ("all-reduce 4m", _allreduce(4)),
    "allreduce-nonblocking": ("all-reduce 4m", _allreduce(4)),
    "centralized-sgd": ("all-reduce 4m", _allreduce(4)),
    "centralized-adam": ("all-reduce 4m", _allreduce(4)),
    "custom-clip": ("all-reduce 4m", _allreduce(4)),
    "hierarchical": ("hierarchical 4m", _hierarchical),
    "bf16": ("node-aware 2m", _half_cast),
    "fp16-optimizer": ("all-reduce 2m", _allreduce(2)),
    "powersgd-2": ("2 all-reduces, r=2", _powersgd(2)),
    "topk-1%": ("all-gather 8k, k=1%", _gather(lambda s: 8.0 * math.ceil(0.01 * s.total))),
    "randomk-10%": ("all-reduce 4k, k=10%",
                    _allreduce_of(lambda s: 4.0 * math.ceil(0.1 * s.total))),
    "sparsified-sgd": ("all-gather 8k, blocks", _gather(lambda s: 8.0 * _blocks(s))),
    "sparsified-sgd-shared": ("all-reduce 4k, blocks", _allreduce_of(lambda s: 4.0 * _blocks(s))),
    "sign": ("all-gather m/8", _gather(lambda s: math.ceil(s.total / 8))),
    "ef-sign": ("all-gather m/8", _gather(lambda s: math.ceil(s.total / 8))),
    "decentralized": ("neighbors 2 x 4m", _gossip),
    "distopt-fused": ("all-reduce 4m", _allreduce(4)),
    "distopt-half": ("all-reduce 2m", _allreduce(2)),
    "distopt-partial": ("all-reduce 4m/parts", _partial(4096)),
    "distopt-sparse": ("all-gather 8k, k=1%",
                       _gather(lambda s: 8.0 * math.ceil(0.01 * s.total))),
    "daso": ("node 4m + cross 2m / 4", _daso(4)),
}


def comm_time(name: str, shapes: Shapes, layout: Layout, links: Links) -> float:
    """Predicted communication seconds per step of algorithm ``name``."""
    return MODELS[name][1](shapes, layout, links)[0]


def payload_bytes(name: str, shapes: Shapes, layout: Layout, links: Links) -> float:
    """Modelled payload bytes per rank per step (what the engine counts as ``bytes_sent``)."""
    return MODELS[name][1](shapes, layout, links)[1]


def predict(names: Sequence[str], shapes: Shapes, compute_s: float, links: Links,
            ranks: Sequence[int] = RANKS, ranks_per_node: int = 4) -> dict[str, dict[int, float]]:
    """``{algorithm: {P: predicted step seconds}}`` = compute + modelled communication."""
    return {name: {p: compute_s + comm_time(name, shapes, Layout(p, ranks_per_node), links)
                   for p in ranks} for name in names}


def prediction_table(pred: dict[str, dict[int, float]]) -> list[str]:
    """Lines of a table of predicted step times in ms (one row per algorithm)."""
    ranks = sorted({p for row in pred.values() for p in row})
    lines = [f"{'algorithm':>22} " + " ".join(f"{p:>8d}" for p in ranks)]
    for name, row in pred.items():
        lines.append(f"{name:>22} " + " ".join(f"{row[p] * 1e3:8.2f}" for p in ranks))
    return lines


# -- the suite ----------------------------------------------------------------------------------

def measure_compute(widths: Sequence[int], batch: int, steps: int) -> float:
    """Collective: :func:`local_step_time` of an MLP of ``widths`` on ``batch`` random
    samples."""
    import torch
    from mpi4py import MPI

    from ..recipes import mlp

    comm = MPI.COMM_WORLD
    g = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(batch, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (batch,), generator=g)
    return local_step_time(mlp(list(widths), seed=0), x, y, steps, comm)


def synchronous_step_time(step: Callable[[], object], steps: int, comm) -> float:
    """Collective over the mpi4py communicator ``comm``: the median over ``steps`` calls of
    ``step`` of the time from a barrier until the slowest rank is done (a one-value all-reduce
    after the call, which a synchronous training step's exchange also waits for). On cores
    shared by several ranks the slowest rank of each step is later than the slowest rank's
    median step."""
    import numpy as np
    from mpi4py import MPI

    done, times = np.zeros(1), np.empty(steps)
    for i in range(steps):
        comm.Barrier()
        start = time.perf_counter()
        step()
        comm.Allreduce(MPI.IN_PLACE, done)
        times[i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return float(np.median(times))


def local_step_time(net, x, y, steps: int, comm) -> float:
    """Collective over the mpi4py communicator ``comm``: the computation of a synchronous
    training step of ``net`` on ``(x, y)`` (forward, cross-entropy backward, SGD step with
    momentum) without its gradients' communication, all ranks at once
    (:func:`synchronous_step_time`, after one untimed step that allocates)."""
    import torch

    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    step()
    return synchronous_step_time(step, steps, comm)


def _links_from(results, spec: str | None, quick: bool) -> tuple[Links, str]:
    """The links to use and where they come from: --links, the comm suite's records, or a
    measurement now."""
    if spec:
        return parse_links(spec), "given (--links)"
    found = {}
    for link in ("local", "cross"):
        case = f"p2p {'node-local' if link == 'local' else 'cross-node'}"
        alpha = results.value("comm", case, "latency")
        bandwidth = results.value("comm", case, "bandwidth")
        if alpha is not None and bandwidth is not None:
            found[link] = Link.from_us_gbps(alpha, bandwidth)
    source = "measured by the comm suite"
    if not found:
        from .comm import measure_links, record_links

        measured = measure_links(quick)
        record_links(results, measured)
        found = {k: Link(v.alpha, 1.0 / v.bandwidth) for k, v in measured.items() if v}
        source = "measured now (ring Sendrecv)"
    if not found:  # a single rank: nothing to measure
        return Links(Link(0.0, 1e-12), Link(0.0, 1e-12)), \
            "none (one rank, nothing to measure; pass --links), so communication counts as 0"
    local = found.get("local", found.get("cross"))
    cross = found.get("cross")
    if cross is None:
        source += "; no cross-node link here, taken equal to the node-local one"
    return Links(local, cross or local), source


def run(results, quick: bool = False, algorithms: str | None = None, links: str | None = None,
        ranks_per_node: int = 4) -> dict:
    """The ``costmodel`` suite: prediction table next to the measured points; returns the
    prediction ``{algorithm: {P: seconds}}``."""
    from mpi4py import MPI

    from ..core.communication import MPI_WORLD
    from ..core.topology import Topology
    from ..recipes import mlp
    from ..utils.launch import configure_threads
    from ._common import cores_per_rank, describe_environment, oversubscription_note, say
    from .algorithms import LARGE, LARGE_BATCH, choose_algorithms, large_step_stats

    comm = MPI.COMM_WORLD
    configure_threads(comm)
    names = choose_algorithms(algorithms, False)  # the model is cheap: all of them
    measure_here = [] if results.find("algorithms", "large step time") else \
        choose_algorithms(algorithms, quick)
    shapes = Shapes.of(mlp(LARGE, seed=0))
    chosen, source = _links_from(results, links, quick)
    compute = measure_compute(LARGE, LARGE_BATCH, 3 if quick else 10)
    topo = Topology(MPI_WORLD)
    here = Layout(comm.Get_size(), max(topo.local_sizes), overlap=cores_per_rank(comm) >= 1)
    topo.free()
    say(f"# costmodel: alpha-beta MODEL (not a measurement) of the per-step communication, "
        f"MLP {'-'.join(map(str, LARGE))} ({shapes.total / 1e6:.2f}M parameters), batch "
        f"{LARGE_BATCH} per rank; {describe_environment(comm)}")
    say(f"# links {source}: node-local {chosen.local}; cross-node {chosen.cross}")
    note = oversubscription_note(comm)
    if note and not links:
        say(f"# {note}; pass --links for the links of a real machine")
    say(f"# compute per step (measured, no communication): {compute * 1e3:.2f} ms; "
        f"prediction = compute + communication, no overlap")
    results.add("costmodel", "links", "local alpha", chosen.local.alpha * 1e6, "us",
                source=source)
    results.add("costmodel", "links", "local bandwidth", chosen.local.bandwidth / 1e9, "GB/s",
                source=source)
    results.add("costmodel", "links", "cross alpha", chosen.cross.alpha * 1e6, "us",
                source=source)
    results.add("costmodel", "links", "cross bandwidth", chosen.cross.bandwidth / 1e9, "GB/s",
                source=source)
    results.add("costmodel", "compute", "compute time", compute * 1e3, "ms",
                widths="-".join(map(str, LARGE)), batch=LARGE_BATCH)
    say(f"# at the size run: {here.ranks} ranks, {here.nodes} node(s) of up to "
        f"{here.ranks_per_node}")
    say(f"{'algorithm':>22} {'pattern':>24} {'model MB':>9} {'meas. MB':>9} {'model ms':>9} "
        f"{'meas. ms':>9} {'meas/model':>10}")
    for name in names:
        model_s = compute + comm_time(name, shapes, here, chosen)
        model_b = payload_bytes(name, shapes, here, chosen)
        measured = results.value("algorithms", name, "large step time")
        measured_b = results.value("algorithms", name, "large bytes per step")
        if measured is None and name in measure_here:
            step, measured_b, _ = large_step_stats(name, 2 if quick else 5)
            measured = step * 1e3
            results.add("costmodel", name, "measured step time", measured, "ms",
                        ranks=here.ranks)
            results.add("costmodel", name, "measured bytes per step", measured_b, "bytes",
                        ranks=here.ranks)
        results.add("costmodel", name, "model step time", model_s * 1e3, "ms", ranks=here.ranks,
                    ranks_per_node=here.ranks_per_node, at="size run")
        results.add("costmodel", name, "model bytes per step", model_b, "bytes",
                    ranks=here.ranks)
        if measured is None:
            say(f"{name:>22} {MODELS[name][0]:>24} {model_b / 1e6:9.3f} {'-':>9} "
                f"{model_s * 1e3:9.2f} {'-':>9} {'-':>10}")
        else:
            say(f"{name:>22} {MODELS[name][0]:>24} {model_b / 1e6:9.3f} "
                f"{measured_b / 1e6:9.3f} {model_s * 1e3:9.2f} {measured:9.2f} "
                f"{measured / (model_s * 1e3):10.2f}")
    pred = predict(names, shapes, compute, chosen, RANKS, ranks_per_node)
    for name, row in pred.items():
        for p, seconds in row.items():
            results.add("costmodel", name, "model step time", seconds * 1e3, "ms", ranks=p,
                        ranks_per_node=ranks_per_node)
    say(f"# predicted step time (ms) at P ranks, {ranks_per_node} ranks per node (a model)")
    for line in prediction_table(pred):
        say(line)
    return pred


def main(argv: list[str] | None = None) -> int:
    """``python -m heatlike.bench.costmodel --links ... --compute-ms ...``: the prediction table
    without running anything (one process)."""
    p = argparse.ArgumentParser(prog="python -m heatlike.bench.costmodel",
                                description="Predicted step times (a model, not a "
                                            "measurement; see the module docstring).")
    p.add_argument("--links", required=True, metavar="LOCAL_US:LOCAL_GBPS,CROSS_US:CROSS_GBPS")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="measured compute time of one step (default 0: communication only)")
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--widths", default="784,1024,1024,10", help="MLP layer widths")
    p.add_argument("--algorithms", default=None, help="comma-separated (default: all)")
    args = p.parse_args(argv)
    from ..recipes import mlp

    widths = [int(w) for w in args.widths.split(",")]
    names = [n.strip() for n in args.algorithms.split(",")] if args.algorithms else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown algorithms {unknown}")
    shapes = Shapes.of(mlp(widths, seed=0))
    pred = predict(names, shapes, args.compute_ms * 1e-3, parse_links(args.links), RANKS,
                   args.ranks_per_node)
    print(f"# predicted step time (ms), MLP {'-'.join(map(str, widths))}, "
          f"{args.ranks_per_node} ranks per node, compute {args.compute_ms} ms (a model)")
    for line in prediction_table(pred):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
