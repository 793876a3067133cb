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
from ..engine.codecs import Codec, codec_error
from ..engine.paramsync import ParameterSync, weights_codec_error
from ..engine.reducers import Gossip
from ..engine.replicas import broadcast_module
from .centralized import _check_lr
from .wrapping import WrappedOptimizer, amp_skip, materialized_group, synchronized_check, track

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


class DecentralizedSGD(WrappedOptimizer):
    """mlbench's DecentralizedSGD: local SGD step, then gossip with ``neighbors``.

    ``rank`` (if given) must be this rank of ``comm``; ``neighbors`` is this rank's neighbor
    list (None: a ring). ``graph=`` takes a :class:`NeighborGraph` instead; ``weights`` chooses
    Metropolis-Hastings (default) or uniform mixing. ``sync_initial`` (default True) starts all
    ranks from rank 0's weights, broadcast when the optimizer is built: per-rank weights loaded
    into the model before that are overwritten (build the optimizer, then load, as
    ``checkpoint.load`` does, or pass ``sync_initial=False``). Rank 0 may have neighbors like
    any other rank.

    ``codec``: none (the weights travel as float32), or a cast to bfloat16 / float16
    (``"bf16"``, ``"fp16"``), which sends each rank's change since its last mix, never its
    weights, and keeps this rank's own term at full precision (CHOCO-gossip with step 1:
    :mod:`heatlike.engine.paramsync`); other codecs raise ValueError on every rank. The first
    step mixes the weights exactly.

    A ``torch.optim.Optimizer`` (:class:`~heatlike.optim.wrapping.WrappedOptimizer`) whose
    ``param_groups``, ``state`` and ``defaults`` are the local torch SGD's; ``state_dict()`` is
    torch's with the gossip's state under ``"engine"``; ``add_param_group`` accepts only model
    parameters (the gossip mixes the model). ``torch.amp.GradScaler``: the scaler calls
    ``step()`` on every rank and the ranks agree there, so any rank's non-finite gradient makes
    every rank skip the step (local step and gossip).
    """

    def __init__(self, rank: int | None = None, neighbors: Sequence[int] | None = None,
                 model: torch.nn.Module | None = None, lr=required, momentum: float = 0,
                 dampening: float = 0, weight_decay: float = 0, nesterov: bool = False,
                 average_world: bool = True, use_cuda: bool = False, by_layer: bool = False, *,
                 comm: MPICommunication | None = None, graph: NeighborGraph | None = None,
                 weights: str = "metropolis", codec: Codec | str | None = None,
                 sync_initial: bool = True) -> None:
        self._wrap()
        comm = sanitize_comm(comm)
        error = _check_lr(lr)
        if error is None and not isinstance(model, torch.nn.Module):
            error = TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if error is None and rank is not None and rank != comm.rank:
            error = ValueError(f"rank={rank!r} but this process is rank {comm.rank} of comm")
        if error is None and not average_world:
            error = ValueError("DecentralizedSGD averages with its neighbors; "
                               "average_world=False is not supported")
        if error is None:
            codec, error = codec_error(codec)
        if error is None:
            error = weights_codec_error(codec, mixes=True)
        raise_together(error, comm)
        self._owns_graph = graph is None
        if graph is None:
            graph = NeighborGraph.ring(comm, weights) if neighbors is None else \
                NeighborGraph(comm, neighbors, weights)
        self.comm = comm
        self.graph = graph
        self.model = model
        self.use_cuda = use_cuda
        if sync_initial:
            broadcast_module(model, comm)
        self.sync = ParameterSync(list(model.parameters()), comm, codec=codec,
                                  reducer=Gossip(graph), bucket_cap_mb=1e-6 if by_layer else 25)
        self._step_supports_amp_scaling = True  # gradients are per rank: agree in step()
        self._bytes_reported = 0
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                         dampening=dampening, weight_decay=weight_decay,
                                         nesterov=nesterov)

    def add_param_group(self, param_group: dict) -> None:
        """Collective: the gossip mixes the model's parameters, so only those may be added
        (ValueError on every rank otherwise)."""
        group = materialized_group(param_group)
        error, _ = synchronized_check(group.get("params", []), self.sync.tensors,
                                      type(self).__name__)
        raise_together(error, self.comm)
        self._local().add_param_group(group)

    def step(self, closure=None, tracker=None):
        """Local step, then mix the model with the neighbors' (collective over the graph;
        ``tracker``: ``record_batch_opt_step()`` after the local step, ``record_batch_agg()``
        after the gossip)."""
        local = self._local()
        if amp_skip(self, self.comm):
            return None
        loss = local.step(closure)
        track(tracker, "opt_step")
        self.sync.synchronize()
        sent = self.sync.bytes_sent
        track(tracker, "agg", sent - self._bytes_reported, "Gossip")
        self._bytes_reported = sent
        return loss

    def close(self) -> None:
        """Collective: free the gossip channel's communicators and the graph's (when this
        optimizer built the graph), for programs that build many optimizers in one process."""
        super().close()
        if self._owns_graph:
            self.graph.free()

    def _engine_state(self) -> dict:
        return self.sync.state_dict()

    def _load_engine_state(self, state: dict) -> None:
        self.sync.load_state_dict(state)
