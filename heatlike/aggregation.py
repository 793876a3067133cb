"""mlbench-core's aggregation API (``mlbench_core.aggregation.pytorch``) on the heatlike engine.

An :class:`Aggregation` combines tensors across ranks through one codec and one reducer:
``agg_grad(by_layer)`` / ``agg_model(by_layer)`` return the function
``(model, op="avg", denom=None) -> None`` that replaces every gradient / parameter of ``model`` by
its aggregate, one collective per tensor (``by_layer=True``) or one flat buffer for the model;
``_agg(data, op, denom)`` aggregates one tensor in place. ``op`` is ``"avg"``, ``"custom_avg"``
(divide by ``denom``), ``"sum"``, ``"min"`` or ``"max"``; mlbench's names :data:`AVG_WORLD`
(``"avg_world"``, the same as ``"avg"``) and :data:`AVG_CUSTOM` (``"avg_custom"``, the same as
``"custom_avg"``) are accepted everywhere, :class:`DecentralizedAggregation` included.

Gradients that are None on some ranks count as zeros there and stay None on the ranks where no
rank had one (mlbench crashed on None gradients).

=============================  ======================================================
class                          codec / reducer
=============================  ======================================================
AllReduceAggregation           identity / flat all-reduce (``divide_before`` option)
AllReduceAggregationHVD        identity / hierarchical all-reduce (Horovod's fusion and
                               hierarchical all-reduce, on MPI, no Horovod needed)
SparsifiedAggregation          top-k with error feedback / all-gather of (index, value)
PowerAggregation               PowerSGD rank r (warm start with ``reuse_query``) / all-reduce
DecentralizedAggregation       identity / gossip with ``neighbors``
=============================  ======================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .core.agreement import gather_or_raise, raise_together
from .core.communication import MPICommunication, sanitize_comm
from .core.topology import NeighborGraph
from .engine import codecs
from .engine.exchange import Context, Lane
from .engine.gradsync import GradientSync
from .engine.paramsync import ParameterSync
from .engine.reducers import AllReduce, Gossip, Hierarchical, Reducer
from .optim.centralized import resolve_world_size

__all__ = ["Aggregation", "AllReduceAggregation", "AllReduceAggregationHVD",
           "SparsifiedAggregation", "PowerAggregation", "DecentralizedAggregation",
           "ALLREDUCE_AGGREGATION_OPS", "AVG_WORLD", "AVG_CUSTOM"]

#: mlbench's op names: divide the sum by the world size / by ``denom``
AVG_WORLD = "avg_world"
AVG_CUSTOM = "avg_custom"
_ALIASES = {AVG_WORLD: "avg", AVG_CUSTOM: "custom_avg"}
ALLREDUCE_AGGREGATION_OPS = (AVG_WORLD, AVG_CUSTOM, "avg", "custom_avg", "sum", "min", "max")


def _canonical(op: str) -> str:
    """``op`` with mlbench's names mapped to the engine's (ValueError for unknown ops)."""
    if op not in ALLREDUCE_AGGREGATION_OPS:
        raise ValueError(f"op must be one of {ALLREDUCE_AGGREGATION_OPS}, got {op!r}")
    return _ALIASES.get(op, op)


class Aggregation:
    """Aggregate gradients or weights across ranks with ``codec`` and a reducer."""

    def __init__(self, use_cuda: bool = False, *, comm: MPICommunication | None = None,
                 codec: codecs.Codec | str | None = None) -> None:
        self.comm = sanitize_comm(comm)
        self.use_cuda = use_cuda
        codec, error = codecs.codec_error(codec)  # a name ("bf16", ...) or a codec
        raise_together(error, self.comm)
        self.codec = codec if codec is not None else codecs.Identity()
        self._plans: dict = {}
        self._calls = 0
        self._reducer_ = self._make_reducer()
        self._lane = Lane(self.codec, self._reducer_)

    def close(self) -> None:
        """Collective: free the communicators of every plan's private channel and this
        aggregation's own, for programs that build many in one process."""
        for plan in self._plans.values():
            plan.close()
        self._plans.clear()
        self._lane.close()

    def _make_reducer(self) -> Reducer:
        """The reducer every call reconfigures (subclasses: hierarchical, gossip)."""
        return AllReduce(self.comm)

    def _reducer(self, op: str, denom) -> Reducer:
        """Collective: the reducer, configured for one call. An invalid ``op`` or ``denom`` on
        any rank, or ranks that pass different ones, raise ValueError on every rank before
        anything is sent."""
        error, settings = None, None
        try:
            settings = self._settings(op, denom)
        except (TypeError, ValueError) as e:
            error = e
        everyone = gather_or_raise(settings, error, self.comm, "aggregation")
        if any(other != settings for other in everyone):
            calls = ", ".join(f"rank {r}: op={o!r}, denom={d!r}" for r, (o, d) in
                              enumerate(everyone))
            raise ValueError(f"the ranks aggregate with different arguments ({calls}): pass "
                             "the same op and denom on every rank")
        self._configure(*settings)
        return self._reducer_

    def _configure(self, op: str, denom: float | None) -> None:
        self._reducer_.configure(op, getattr(self, "divide_before", False)
                                 and op in ("avg", "custom_avg"), denom)

    def _settings(self, op: str, denom) -> tuple[str, float | None]:
        """(the engine's op name, denom as a float or None), or ValueError."""
        op = _canonical(op)
        if op == "custom_avg" and (denom is None or not float(denom) > 0):
            raise ValueError("op='custom_avg' ('avg_custom') needs a positive denom")
        if op in ("min", "max") and not isinstance(self.codec, (codecs.Identity, codecs.Cast)):
            raise ValueError(f"op={op!r} takes the elementwise {op} of the values themselves: "
                             f"{type(self.codec).__name__} aggregation sends something else "
                             "(use AllReduceAggregation)")
        return op, None if denom is None else float(denom)

    def _agg(self, data: torch.Tensor, op: str, denom=None, *,
             key: object = None) -> torch.Tensor:
        """Aggregate the tensor ``data`` in place across ranks and return it. A codec's memory
        between calls (error feedback's residual, PowerSGD's warm start) is kept per ``key``
        (any hashable naming what ``data`` holds, e.g. a parameter's name; the same on every
        rank); without one, nothing is carried from one call to the next (a residual keyed by
        size alone was another tensor's)."""
        flat = data.view(-1) if data.is_contiguous() else data.reshape(-1)
        state = {} if key is None else self.codec.state_for(("agg", key))
        ctx = Context(key=("agg",) if key is None else ("agg", key), shapes=[data.shape],
                      size=self.comm.size,
                      rank=self.comm.rank, step=self._calls, state=state)
        self._calls += 1
        self._reducer(op, denom)
        self._lane.start(flat, ctx).Wait()
        if flat.data_ptr() != data.data_ptr():
            data.copy_(flat.view(data.shape))
        return data

    def _plan(self, model: torch.nn.Module, kind: str, by_layer: bool):
        # a gradient plan may treat a one-rank sum or average as the identity when it is built,
        # so a call that divides by a custom denominator gets a plan of its own
        # keyed by the parameters, which a plan holds: a model with the id of a freed one (same
        # id on some ranks only) still gets a plan of its own, on every rank
        params = list(model.parameters())
        key = (tuple(map(id, params)), kind, by_layer,
               getattr(self._reducer_, "op", None) == "custom_avg")
        plan = self._plans.get(key)
        if plan is None:
            cap = 1e-6 if by_layer else 1e6
            if kind == "grad":
                plan = GradientSync(params, self.comm, cap, cap, codec=self.codec,
                                    reducer=self._reducer_, hooks=False,
                                    grad_as_bucket_view=False)
            else:
                plan = ParameterSync(params, self.comm, codec=self.codec,
                                     reducer=self._reducer_, bucket_cap_mb=cap)
            self._plans[key] = plan
        return plan

    def _run(self, model: torch.nn.Module, kind: str, by_layer: bool, op: str, denom) -> None:
        self._reducer(op, denom)  # checks op and denom before anything is sent
        plan = self._plan(model, kind, by_layer)
        if kind == "grad":
            plan.launch_all()
            plan.synchronize()
        else:
            plan.synchronize()

    def _agg_gradients_by_layer(self, model, op="avg", denom=None) -> None:
        self._run(model, "grad", True, op, denom)

    def _agg_gradients_by_model(self, model, op="avg", denom=None) -> None:
        self._run(model, "grad", False, op, denom)

    def _agg_weights_by_layer(self, model, op="avg", denom=None) -> None:
        self._run(model, "weight", True, op, denom)

    def _agg_weights_by_model(self, model, op="avg", denom=None) -> None:
        self._run(model, "weight", False, op, denom)

    def agg_grad(self, by_layer: bool = False) -> Callable:
        """The function aggregating a model's gradients."""
        return self._agg_gradients_by_layer if by_layer else self._agg_gradients_by_model

    def agg_model(self, by_layer: bool = False) -> Callable:
        """The function aggregating a model's weights."""
        return self._agg_weights_by_layer if by_layer else self._agg_weights_by_model


class AllReduceAggregation(Aggregation):
    """Sum all-reduce, then divide by the world size (``op="avg"``); ``divide_before`` divides
    each contribution first."""

    def __init__(self, world_size: int | None = None, divide_before: bool = False,
                 use_cuda: bool = False, *, comm: MPICommunication | None = None,
                 codec: codecs.Codec | str | None = None) -> None:
        super().__init__(use_cuda, comm=comm, codec=codec)
        self.world_size = resolve_world_size(world_size, self.comm)
        self.divide_before = divide_before


class AllReduceAggregationHVD(AllReduceAggregation):
    """What Horovod adds over a plain all-reduce, on MPI: tensor fusion (by-model aggregation
    packs all tensors into fused buffers) and hierarchical all-reduce (node-local reduce,
    cross-node all-reduce among one rank per node, node-local broadcast)."""

    def _make_reducer(self) -> Reducer:
        return Hierarchical(self.comm)


class SparsifiedAggregation(Aggregation):
    """Top-k sparsified aggregation with error feedback: each rank sends its ``k`` (or a
    ``ratio`` of) largest entries of gradient + residual as (index, value) pairs."""

    def __init__(self, model: torch.nn.Module | None = None, use_cuda: bool = False, *,
                 k: int | None = None, ratio: float | None = 0.01,
                 comm: MPICommunication | None = None) -> None:
        super().__init__(use_cuda, comm=comm,
                         codec=codecs.TopK(k=k, ratio=None if k is not None else ratio))
        self.model = model


class PowerAggregation(Aggregation):
    """PowerSGD aggregation (rank ``rank`` approximation with error feedback)."""

    def __init__(self, model: torch.nn.Module | None = None, use_cuda: bool = False,
                 reuse_query: bool = False, world_size: int | None = None, rank: int = 1, *,
                 comm: MPICommunication | None = None) -> None:
        super().__init__(use_cuda, comm=comm,
                         codec=codecs.PowerSGD(rank, reuse_query=reuse_query))
        self.world_size = resolve_world_size(world_size, self.comm)
        self.model = model


class DecentralizedAggregation(Aggregation):
    """Average with ``neighbors`` only (gossip; Metropolis-Hastings weights by default, mlbench's
    uniform weights with ``weights="uniform"``). ``op`` must be ``"avg_world"`` (mlbench's) or
    ``"avg"``."""

    def __init__(self, rank: int | None = None, neighbors: Sequence[int] | None = None,
                 use_cuda: bool = False, *, comm: MPICommunication | None = None,
                 weights: str = "metropolis") -> None:
        comm = sanitize_comm(comm)
        raise_together(ValueError(f"rank={rank!r} but this process is rank {comm.rank} of comm")
                       if rank is not None and rank != comm.rank else None, comm)
        self.graph = NeighborGraph.ring(comm, weights) if neighbors is None else \
            NeighborGraph(comm, neighbors, weights)
        super().__init__(use_cuda, comm=comm)

    def _make_reducer(self) -> Reducer:
        return Gossip(self.graph)

    def close(self) -> None:
        """Collective: free the channels (as every aggregation) and the neighbor graph's
        communicators, which this aggregation built."""
        super().close()
        self.graph.free()

    def _settings(self, op: str, denom) -> tuple[str, float | None]:
        if op not in (AVG_WORLD, "avg"):
            raise ValueError(f"decentralized aggregation averages with neighbors: op must be "
                             f"'avg_world' or 'avg', got {op!r}")
        return "avg", None

    def _configure(self, op: str, denom: float | None) -> None:
        """(a neighbor mix: nothing to configure)"""

    def _agg_gradients_by_layer(self, model, op="avg", denom=None):
        raise ValueError("decentralized aggregation mixes models; use agg_model")

    _agg_gradients_by_model = _agg_gradients_by_layer
