"""Decentralized SGD: local steps, then averaging with graph neighbors only (gossip).

Each rank takes a local torch SGD step, then mixes its model with its neighbors',
``x_i <- W_ii x_i + sum_j W_ij x_j`` (one neighborhood all-gather per bucket on the MPI
distributed-graph communicator of a :class:`~heatlike.core.topology.NeighborGraph`). With the
default Metropolis-Hastings weights the mixing matrix is doubly stochastic, so the average model
is preserved and the models contract towards it (:func:`consensus_distance` measures how far
they are apart).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch.optim.optimizer import required

from ..core.agreement import raise_together
from ..core.communication import IN_PLACE, MPICommunication, sanitize_comm
from ..core.topology import NeighborGraph
from ..engine.codecs import Codec
from ..engine.paramsync import ParameterSync
from ..engine.reducers import Gossip
from ..engine.replicas import broadcast_module
from .centralized import _check_lr

__all__ = ["DecentralizedSGD", "consensus_distance"]


@torch.no_grad()
def consensus_distance(model: torch.nn.Module | Sequence[torch.Tensor],
                       comm: MPICommunication | None = None) -> float:
    """Collective: ``(1/P) sum_i ||x_i - mean_j x_j||^2`` over the ranks' parameter vectors."""
    comm = sanitize_comm(comm)
    tensors = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    mean = x.clone()
    comm.Allreduce(IN_PLACE, mean, MPI.SUM)
    mean /= comm.size
    spread = ((x - mean) ** 2).sum().reshape(1)
    comm.Allreduce(IN_PLACE, spread, MPI.SUM)
    return float(spread[0]) / comm.size


class DecentralizedSGD:
    """mlbench's DecentralizedSGD: local SGD step, then gossip with ``neighbors``.

    ``rank`` (if given) must be this rank of ``comm``; ``neighbors`` is this rank's neighbor
    list (None: a ring). ``graph=`` takes a :class:`NeighborGraph` instead; ``weights`` chooses
    Metropolis-Hastings (default) or uniform mixing. ``sync_initial`` (default True) starts all
    ranks from rank 0's weights. Rank 0 may have neighbors like any other rank.
    """

    def __init__(self, rank: int | None = None, neighbors: Sequence[int] | None = None,
                 model: torch.nn.Module | None = None, lr=required, momentum: float = 0,
                 dampening: float = 0, weight_decay: float = 0, nesterov: bool = False,
                 average_world: bool = True, use_cuda: bool = False, by_layer: bool = False, *,
                 comm: MPICommunication | None = None, graph: NeighborGraph | None = None,
                 weights: str = "metropolis", codec: Codec | None = None,
                 sync_initial: bool = True) -> None:
        comm = sanitize_comm(comm)
        error = _check_lr(lr)
        if error is None and not isinstance(model, torch.nn.Module):
            error = TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if error is None and rank is not None and rank != comm.rank:
            error = ValueError(f"rank={rank!r} but this process is rank {comm.rank} of comm")
        if error is None and not average_world:
            error = ValueError("DecentralizedSGD averages with its neighbors; "
                               "average_world=False is not supported")
        raise_together(error, comm)
        if graph is None:
            graph = NeighborGraph.ring(comm, weights) if neighbors is None else \
                NeighborGraph(comm, neighbors, weights)
        self.comm = comm
        self.graph = graph
        self.model = model
        if sync_initial:
            broadcast_module(model, comm)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                         dampening=dampening, weight_decay=weight_decay,
                                         nesterov=nesterov)
        self.sync = ParameterSync(list(model.parameters()), comm, codec=codec,
                                  reducer=Gossip(graph), bucket_cap_mb=1e-6 if by_layer else 25)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, closure=None, tracker=None):
        """Local step, then mix the model with the neighbors'."""
        loss = self.optimizer.step(closure)
        if tracker is not None:
            tracker.record_batch_opt_step()
        self.sync.synchronize()
        if tracker is not None:
            tracker.record_batch_agg()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "engine": self.sync.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["engine"])
