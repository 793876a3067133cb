"""mlbench-core's centralized optimizers as presets over the engine.

Every class keeps mlbench's constructor signature (``world_size`` defaults to the communicator's
size; ``comm=`` picks the communicator) and is a torch optimizer for the local update plus an
engine synchronizer:

* ``agg_grad=True`` (default): gradients are averaged by the engine's :class:`GradientSync`;
  its hooks start every bucket's exchange during the backward pass and the averages are in
  ``.grad`` when backward returns (mlbench averaged in ``step()``, after backward); ``step()``
  then steps the local optimizer. Unused parameters keep ``grad=None`` everywhere.
* ``agg_grad=False``: ``step()`` steps the local optimizer, then averages the weights
  (:class:`ParameterSync`).

In both modes the initial weights are broadcast from rank 0 (mlbench never made them equal in
gradient mode, and averaged them in weight mode, which shrinks independently drawn random
initializations by a factor 1/sqrt(P)). ``by_layer=True`` gives every tensor its own bucket (one
collective per tensor, as mlbench's ``by_layer``); otherwise tensors share buckets of
``bucket_cap_mb``.
``codec=`` and ``reducer=`` replace the engine's defaults (float32 values, flat all-reduce) for
any preset, e.g. ``codec=heatlike.engine.Cast(torch.bfloat16)``; ``check_finite=True`` raises
``FloatingPointError`` on every rank when the averaged gradients are not finite.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from ..core.agreement import raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..engine.codecs import Codec
from ..engine.gradsync import GradientSync
from ..engine.paramsync import ParameterSync
from ..engine.reducers import AllReduce, Reducer
from ..engine.replicas import broadcast_module, no_trainable_parameters

__all__ = ["GenericCentralizedOptimizer", "CentralizedSGD", "CentralizedAdam",
           "CustomCentralizedOptimizer", "resolve_world_size"]


def world_size_error(world_size: int | None, comm: MPICommunication) -> ValueError | None:
    """mlbench passed the world size explicitly; here it must match the communicator (None: it
    does, or was left out)."""
    if world_size is None or (isinstance(world_size, int) and not isinstance(world_size, bool)
                              and world_size == comm.size):
        return None
    return ValueError(f"world_size={world_size!r} does not match the communicator's "
                      f"{comm.size} ranks (leave it out to use the communicator's)")


def resolve_world_size(world_size: int | None, comm: MPICommunication) -> int:
    """The communicator's size; ValueError when ``world_size`` is given and differs."""
    error = world_size_error(world_size, comm)
    if error is not None:
        raise error
    return comm.size


def _check_lr(lr) -> Exception | None:
    if lr is required:
        return TypeError("lr is required")
    if not isinstance(lr, (int, float)) or lr < 0:
        return ValueError(f"lr must be a non-negative number, got {lr!r}")
    return None


class GenericCentralizedOptimizer:
    """Centralized (synchronous) data parallelism: aggregate, then step (module docstring).

    Subclasses set ``self.optimizer`` to the local torch optimizer.
    """

    def __init__(self, world_size: int | None = None, model: torch.nn.Module | None = None,
                 use_cuda: bool = False, by_layer: bool = False, divide_before: bool = False,
                 agg_grad: bool = True, *, comm: MPICommunication | None = None,
                 codec: Codec | None = None, reducer: Reducer | None = None,
                 bucket_cap_mb: float = 25.0, check_finite: bool = False, _op: str = "avg",
                 _hooks: bool = True) -> None:
        comm = sanitize_comm(comm)
        error = world_size_error(world_size, comm)
        world_size = comm.size
        if error is None and not isinstance(model, torch.nn.Module):
            error = TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if error is None:
            error = no_trainable_parameters(model, type(self).__name__)
        raise_together(error, comm)
        self.comm = comm
        self.world_size = world_size
        self.model = model
        self.use_cuda = use_cuda
        self.by_layer = by_layer
        self.agg_grad = agg_grad
        self.optimizer: torch.optim.Optimizer | None = None
        if reducer is None:
            reducer = AllReduce(comm, op=_op, divide_before=divide_before)
        cap = 1e-6 if by_layer else bucket_cap_mb
        broadcast_module(model, comm)
        if agg_grad:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self.sync = GradientSync([p for _, p in named], comm, cap, cap, codec=codec,
                                     reducer=reducer, hooks=_hooks,
                                     on_backward_end=self._backward_end,
                                     check_finite=check_finite, names=[n for n, _ in named])
        else:
            self.sync = ParameterSync(list(model.parameters()), comm, codec=codec,
                                      reducer=reducer, bucket_cap_mb=cap)

    def _backward_end(self) -> None:
        self.sync.synchronize()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _aggregate(self, denom: float | None = None) -> None:
        """Complete this step's gradient averaging (every rank takes part)."""
        if denom is not None:
            self.sync.reducer.set_denom(denom)
        self.sync.participate()
        self.sync.synchronize()

    def _track(self, tracker, phase: str) -> None:
        """Report a finished phase (and, after aggregation, the bytes sent) to ``tracker``."""
        if tracker is None:
            return
        if phase == "agg":
            sent = self.sync.bytes_sent
            tracker.add_bytes(sent - getattr(self, "_bytes_reported", 0),
                              type(self.sync.reducer).__name__)
            self._bytes_reported = sent
        tracker.record(phase)

    def step(self, closure=None, tracker=None):
        """Aggregate the gradients and step (``agg_grad``), or step and average the weights."""
        if self.agg_grad:
            self._aggregate()
            self._track(tracker, "agg")
            loss = self.optimizer.step(closure)
            self._track(tracker, "opt_step")
            return loss
        loss = self.optimizer.step(closure)
        self._track(tracker, "opt_step")
        self.sync.synchronize()
        self._track(tracker, "agg")
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The local optimizer's state and the engine's (bucket plan, counters, codec residuals
        and warm starts)."""
        return {"optimizer": self.optimizer.state_dict(), "engine": self.sync.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["engine"])

    def __repr__(self) -> str:
        mode = "gradients" if self.agg_grad else "weights"
        return (f"{type(self).__name__}({self.world_size} ranks, averaging {mode}, "
                f"codec {self.sync.codec}, {self.optimizer!r})")


class CentralizedSGD(GenericCentralizedOptimizer):
    """Centralized SGD (optionally with momentum): averaged gradients, torch SGD step."""

    def __init__(self, world_size: int | None = None, model: torch.nn.Module | None = None,
                 lr=required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, use_cuda: bool = False,
                 by_layer: bool = False, agg_grad: bool = True, **engine) -> None:
        raise_together(_check_lr(lr), sanitize_comm(engine.get("comm")))
        super().__init__(world_size, model, use_cuda, by_layer, False, agg_grad, **engine)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                         dampening=dampening, weight_decay=weight_decay,
                                         nesterov=nesterov)


class CentralizedAdam(GenericCentralizedOptimizer):
    """Centralized Adam: averaged gradients, torch Adam step."""

    def __init__(self, world_size: int | None = None, model: torch.nn.Module | None = None,
                 lr=1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, use_cuda: bool = False, by_layer: bool = False,
                 agg_grad: bool = True, **engine) -> None:
        raise_together(_check_lr(lr), sanitize_comm(engine.get("comm")))
        super().__init__(world_size, model, use_cuda, by_layer, False, agg_grad, **engine)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay, amsgrad=amsgrad)


class CustomCentralizedOptimizer(GenericCentralizedOptimizer):
    """Any torch ``optimizer`` with gradient clipping and a choice of averaging.

    ``average_world``: divide the summed gradients by the world size; ``average_custom``: by the
    ``denom`` given to each ``step()`` (then the aggregation happens in ``step()``, when it is
    known); neither: the plain sum. ``divide_before`` divides each rank's contribution first.
    ``grad_clip``: clip the aggregated gradients to this L2 norm."""

    def __init__(self, model: torch.nn.Module | None = None, world_size: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, use_cuda: bool = False,
                 by_layer: bool = False, agg_grad: bool = True, grad_clip: float = float("inf"),
                 average_world: bool = False, average_custom: bool = False,
                 divide_before: bool = False, **engine) -> None:
        comm = sanitize_comm(engine.get("comm"))
        error = None
        if not isinstance(optimizer, torch.optim.Optimizer):
            error = TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        elif average_world and average_custom:
            error = ValueError("choose one of average_world and average_custom")
        elif divide_before and not (average_world or average_custom):
            error = ValueError("divide_before needs average_world or average_custom")
        elif not grad_clip > 0:
            error = ValueError(f"grad_clip must be positive, got {grad_clip!r}")
        raise_together(error, comm)
        op = "avg" if average_world else "custom_avg" if average_custom else "sum"
        super().__init__(world_size, model, use_cuda, by_layer, divide_before, agg_grad,
                         _op=op, _hooks=not average_custom, **engine)
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        self.average_custom = average_custom

    def step(self, closure=None, tracker=None, denom=None):
        """Aggregate (dividing by ``denom`` with ``average_custom``), clip, step."""
        if self.average_custom and self.agg_grad:
            raise_together(None if denom is not None and float(denom) > 0 else
                           ValueError("average_custom needs a positive denom in step()"),
                           self.comm)
        if not self.agg_grad:
            return super().step(closure, tracker)
        self._aggregate(float(denom) if self.average_custom else None)
        self._track(tracker, "agg")
        if self.grad_clip != float("inf"):
            params = [p for g in self.optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        loss = self.optimizer.step(closure)
        self._track(tracker, "opt_step")
        return loss
