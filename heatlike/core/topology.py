"""Who runs on which node: node ids, local ranks, node-local and cross-node communicators.

The node of every rank is found, in this order of precedence, from

1. the ``node_ids`` argument of :class:`Topology` (one node id per rank of ``comm``);
2. ``HEATLIKE_NODE_IDS=0,0,1,1`` (explicit, any placement, for tests);
3. ``HEATLIKE_RANKS_PER_NODE=k``: consecutive blocks of k ranks form a node (the last block may be
   smaller), so a laptop or a CI machine can emulate several nodes;
4. ``Split_type(COMM_TYPE_SHARED)``: the ranks that share memory, i.e. the real node.

Node ids are numbered 0..N-1 in the order of each node's lowest rank. Nothing assumes block
placement or equal node sizes: ranks {0, 2} on one node and {1, 3} on another work, and so do
nodes of 2 and 1 ranks.

Communicators (all owned by the Topology and freed by :meth:`Topology.free`):

* ``node_comm``: the ranks of this rank's node, ordered by rank;
* ``cross_comm``: the ranks with this rank's local rank, one per node, ordered by node id ("group
  i = local rank i of every node"; on unequal nodes the higher groups span fewer nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mpi4py import MPI

from .agreement import gather_or_raise
from .communication import MPICommunication, sanitize_comm
from .env import env_int, env_int_list

__all__ = ["Topology", "get_topology", "detect_node_ids", "NeighborGraph"]


def _env_node_ids(size: int) -> list[int] | None:
    ids = env_int_list("HEATLIKE_NODE_IDS")
    if ids is not None:
        if len(ids) != size:
            raise ValueError(f"HEATLIKE_NODE_IDS lists {len(ids)} ranks but the communicator "
                             f"has {size}")
        return ids
    k = env_int("HEATLIKE_RANKS_PER_NODE", None, minimum=1)
    if k is not None:
        return [r // k for r in range(size)]
    return None


def _normalize(ids: Sequence[int]) -> list[int]:
    """Renumber node labels 0..N-1 in the order of each node's lowest rank."""
    order: dict[int, int] = {}
    for label in ids:
        order.setdefault(label, len(order))
    return [order[label] for label in ids]


def detect_node_ids(comm: MPICommunication) -> list[int]:
    """Collective: the node id of every rank of ``comm`` (overrides, then shared memory)."""
    ids = _env_node_ids(comm.size)
    return _normalize(ids) if ids is not None else _shared_memory_node_ids(comm)


def _shared_memory_node_ids(comm: MPICommunication) -> list[int]:
    """Collective: node ids from the groups of ranks that share memory."""
    shared = comm.handle.Split_type(MPI.COMM_TYPE_SHARED, comm.rank)
    try:
        leader = shared.allreduce(comm.rank, op=MPI.MIN)
    finally:
        shared.Free()
    return _normalize(comm.allgather(leader))


@dataclass(eq=False)
class Topology:
    """The node layout of ``comm`` and the communicators that follow it.

    Collective over ``comm`` at construction. ``cross_method`` chooses how the cross-node
    communicators are built: ``"split"`` (``MPI_Comm_split``) or ``"group"``
    (``MPI_Comm_create_group`` over the ranks of the group, as DASO's ``use_mpi_groups``).
    """

    comm: MPICommunication
    node_ids: tuple[int, ...] = field(default=())
    cross_method: str = "split"

    def __post_init__(self) -> None:
        self.comm = sanitize_comm(self.comm)
        comm = self.comm
        error, ids = None, None
        try:
            if self.cross_method not in ("split", "group"):
                raise ValueError(f"cross_method must be 'split' or 'group', got "
                                 f"{self.cross_method!r}")
            if self.node_ids:
                if len(self.node_ids) != comm.size:
                    raise ValueError(f"node_ids lists {len(self.node_ids)} ranks but the "
                                     f"communicator has {comm.size}")
                ids = _normalize(self.node_ids)
            else:
                ids = _env_node_ids(comm.size)
                ids = None if ids is None else _normalize(ids)
        except ValueError as bad:
            error = bad
        # every rank must see the same layout, or the splits below would not match: the given
        # or configured layouts (None: from shared memory), or any rank's error, on every rank
        layouts = gather_or_raise(None if ids is None else tuple(ids), error, comm,
                                  "Topology: the node layout")
        if len(set(layouts)) != 1:
            raise ValueError("ranks disagree on the node layout (check HEATLIKE_NODE_IDS / "
                             "HEATLIKE_RANKS_PER_NODE are the same everywhere)")
        if ids is None:
            ids = _shared_memory_node_ids(comm)
        self.node_ids = tuple(ids)
        self.node = ids[comm.rank]
        self.num_nodes = max(ids) + 1
        self.node_ranks: tuple[tuple[int, ...], ...] = tuple(
            tuple(r for r in range(comm.size) if ids[r] == n) for n in range(self.num_nodes))
        self.local_sizes = tuple(len(ranks) for ranks in self.node_ranks)
        self.local_rank = self.node_ranks[self.node].index(comm.rank)
        self.local_size = self.local_sizes[self.node]
        self.local_ranks = tuple(self.node_ranks[ids[r]].index(r) for r in range(comm.size))
        self.node_comm = comm.Split(color=self.node, key=comm.rank)
        if self.cross_method == "split":
            self.cross_comm = comm.Split(color=self.local_rank, key=self.node)
        else:
            self.cross_comm = comm.Create_group(self.cross_ranks(self.local_rank))

    def cross_ranks(self, local_rank: int) -> tuple[int, ...]:
        """Ranks (of ``comm``) in cross-node group ``local_rank``: that local rank on every node
        that has it, in node order."""
        return tuple(ranks[local_rank] for ranks in self.node_ranks if local_rank < len(ranks))

    @property
    def num_cross_groups(self) -> int:
        """How many cross-node groups exist (the largest node's size)."""
        return max(self.local_sizes)

    @property
    def is_leader(self) -> bool:
        """Whether this rank is local rank 0 of its node."""
        return self.local_rank == 0

    def free(self) -> None:
        """Free the node-local and cross-node communicators."""
        for c in (self.node_comm, self.cross_comm):
            if c is not None:
                c.Free()

    def __repr__(self) -> str:
        return (f"Topology(nodes={self.num_nodes}, local_sizes={self.local_sizes}, "
                f"rank={self.comm.rank}, node={self.node}, local_rank={self.local_rank})")


def get_topology(comm: MPICommunication | None = None) -> Topology:
    """Collective on the first call for a communicator: its :class:`Topology` (cached on it)."""
    comm = sanitize_comm(comm)
    topo = comm.__dict__.get("_topology")
    if topo is None:
        topo = Topology(comm)
        comm.__dict__["_topology"] = topo
    return topo


# ---------------------------------------------------------------------------- neighbor graphs


class NeighborGraph:
    """An undirected, connected graph over the ranks of ``comm`` with mixing weights, for gossip.

    Built collectively from each rank's own neighbor list (mlbench's ``neighbors`` argument) or
    from one of the constructors (:meth:`ring`, :meth:`torus`, :meth:`exponential`,
    :meth:`complete`). The lists are checked together: every entry a valid rank other than the
    owner, the relation symmetric (j lists i when i lists j), the graph connected (so every rank
    is included); otherwise ValueError on every rank. Rank 0 is a rank like any other.

    Weights of ``x_i <- W_ii x_i + sum_j W_ij x_j``:

    * ``"metropolis"`` (default): W_ij = 1 / (1 + max(d_i, d_j)), W_ii = 1 - sum_j W_ij. Doubly
      stochastic from local degrees, so gossip preserves the average of the models on any graph;
      on a regular graph it equals the uniform weights.
    * ``"uniform"``: every W_ij and W_ii = 1 / (d_i + 1) (mlbench's); preserves the average only
      on regular graphs.

    ``graph_comm`` is the MPI distributed-graph communicator (``MPI_Dist_graph_create_adjacent``)
    whose neighborhood collectives carry the gossip.
    """

    def __init__(self, comm: MPICommunication | None, neighbors: Sequence[int],
                 weights: str = "metropolis") -> None:
        from .agreement import raise_together

        comm = sanitize_comm(comm)
        error = None
        try:
            mine = sorted({int(j) for j in neighbors})
        except (TypeError, ValueError):
            mine, error = [], TypeError(f"neighbors must be a list of ranks, got {neighbors!r}")
        if weights not in ("metropolis", "uniform"):
            error = ValueError(f"weights must be 'metropolis' or 'uniform', got {weights!r}")
        raise_together(error, comm)
        answers = comm.allgather((mine, weights))
        adjacency = [a for a, _ in answers]
        kinds = [w for _, w in answers]
        error = _graph_error(adjacency)
        if error is None and len(set(kinds)) > 1:  # a mixing matrix needs one rule everywhere
            error = ValueError(f"the ranks chose different weights: {kinds[:8]}")
        raise_together(error, comm)
        self.comm = comm
        self.adjacency = adjacency
        self.neighbors = mine
        self.kind = weights
        degree = [len(a) for a in adjacency]
        me = comm.rank
        if weights == "uniform":
            self.weights = [1.0 / (degree[me] + 1)] * len(mine)
        else:
            self.weights = [1.0 / (1 + max(degree[me], degree[j])) for j in mine]
        self.self_weight = 1.0 - sum(self.weights)
        self.graph_comm = comm.Create_dist_graph_adjacent(mine, mine)

    @classmethod
    def from_adjacency(cls, comm: MPICommunication | None, adjacency: Sequence[Sequence[int]],
                       weights: str = "metropolis") -> NeighborGraph:
        """The graph given as every rank's neighbor list (identical on every rank)."""
        comm = sanitize_comm(comm)
        if len(adjacency) != comm.size:
            from .agreement import raise_together

            raise_together(ValueError(f"adjacency lists {len(adjacency)} ranks, the "
                                      f"communicator has {comm.size}"), comm)
        return cls(comm, adjacency[comm.rank], weights)

    @classmethod
    def ring(cls, comm: MPICommunication | None = None, weights: str = "metropolis"):
        comm = sanitize_comm(comm)
        r, p = comm.rank, comm.size
        return cls(comm, [j for j in ((r - 1) % p, (r + 1) % p) if j != r], weights)

    @classmethod
    def torus(cls, comm: MPICommunication | None = None, rows: int | None = None,
              weights: str = "metropolis"):
        """2-D torus of ``rows`` x (P / rows) ranks (default: the most square factorization)."""
        comm = sanitize_comm(comm)
        p = comm.size
        if rows is None:
            rows = max(d for d in range(1, int(p ** 0.5) + 1) if p % d == 0)
        if p % rows:
            from .agreement import raise_together

            raise_together(ValueError(f"rows={rows} does not divide {p} ranks"), comm)
        cols = p // rows
        i, j = divmod(comm.rank, cols)
        around = {((i + di) % rows) * cols + (j + dj) % cols
                  for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1))}
        return cls(comm, sorted(around - {comm.rank}), weights)

    @classmethod
    def exponential(cls, comm: MPICommunication | None = None, weights: str = "metropolis"):
        """Neighbors at distance 1, 2, 4, ... in both directions around the ring."""
        comm = sanitize_comm(comm)
        r, p = comm.rank, comm.size
        hops = [1 << k for k in range(max(1, p.bit_length())) if (1 << k) < p]
        return cls(comm, sorted({(r + h) % p for h in hops} | {(r - h) % p for h in hops} - {r}),
                   weights)

    @classmethod
    def complete(cls, comm: MPICommunication | None = None, weights: str = "metropolis"):
        comm = sanitize_comm(comm)
        return cls(comm, [j for j in range(comm.size) if j != comm.rank], weights)

    def free(self) -> None:
        self.graph_comm.Free()

    def __repr__(self) -> str:
        return f"NeighborGraph(rank {self.comm.rank}: neighbors {self.neighbors}, {self.kind})"


def _graph_error(adjacency: list[list[int]]) -> ValueError | None:
    p = len(adjacency)
    for i, nbrs in enumerate(adjacency):
        for j in nbrs:
            if not 0 <= j < p:
                return ValueError(f"rank {i} lists neighbor {j}, not a rank of {p}")
            if j == i:
                return ValueError(f"rank {i} lists itself as a neighbor")
            if i not in adjacency[j]:
                return ValueError(f"the graph is not symmetric: rank {i} lists {j} but rank {j} "
                                  f"does not list {i}")
    seen, todo = {0}, [0]
    while todo:
        for j in adjacency[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    if len(seen) != p:
        missing = sorted(set(range(p)) - seen)
        return ValueError(f"the graph is not connected: ranks {missing[:8]} cannot be reached "
                          "from rank 0")
    return None
