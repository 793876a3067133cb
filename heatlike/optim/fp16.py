"""FP16Optimizer: mixed-precision data parallelism with dynamic loss scaling (mlbench-core's).

The model runs in float16; a flat float32 copy of its parameters, :attr:`fp32_params`, is what
the inner optimizer updates (build it with ``torch.optim.SGD([fp16_opt.fp32_params], ...)`` and
hand it to :meth:`set_optimizer`). One step:

1. :meth:`backward_loss` runs backward on ``loss * scale``; the float16 gradients are summed over
   the ranks by the engine during backward (the communication layer accumulates half types in
   float32) and divided by the world size (``average_world``) or left summed (``average_custom``
   divides by the ``denom`` given to :meth:`step`, which must be the same on every rank;
   neither: the sum);
2. :meth:`step` copies them into the float32 master gradient ``fp32_params.grad``, divides it by
   ``scale * multiplier`` (and ``denom``), clips it to ``grad_clip`` (> 0); if the gradient
   norm is not finite on *any* rank, every rank skips the step and divides the scale by
   ``scale_factor`` (at or below ``min_scale``: RuntimeError); otherwise the inner optimizer
   steps, the float16 weights are refreshed from the float32 ones, and after
   ``scale_window`` clean steps the scale grows by ``scale_factor`` (up to ``max_scale``).

``scale`` is the one :meth:`backward_loss` applied since the last step, 1 when the loss went
backward another way: with ``torch.amp.GradScaler`` (``scaler.scale(loss).backward()``,
``scaler.step(fp16_optimizer)``, ``scaler.update()``) the scaler does the loss scaling. Reading
``param_groups`` between backward and step, as the scaler does, copies the aggregate into
``fp32_params.grad`` right away; the scaler unscales that average, so all ranks make the same
decision, and :meth:`step` uses it as it is.

The optimizer is a ``torch.optim.Optimizer``
(:class:`~heatlike.optim.wrapping.WrappedOptimizer`) whose ``param_groups``, ``state`` and
``defaults`` are the inner optimizer's (after :meth:`set_optimizer`); ``state_dict()`` is torch's
with the master weights, the loss scale and the engine's state under ``"engine"``.
"""

from __future__ import annotations

import math

import torch

from ..core.agreement import raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..core.topology import get_topology
from ..engine.gradsync import GradientSync
from ..engine.hooks import at_backward_end, on_gradient, remove_when_dropped
from ..engine.reducers import AllReduce, Hierarchical
from ..engine.replicas import broadcast_module
from .centralized import agreed_denom, world_size_error
from .wrapping import WrappedOptimizer, materialized_group, synchronized_check, track

__all__ = ["FP16Optimizer"]


class FP16Optimizer(WrappedOptimizer):
    """Mixed-precision optimizer with dynamic loss scaling (module docstring)."""

    eager_methods = ("backward_loss",)

    def __init__(self, fp16_model: torch.nn.Module, world_size: int | None = None,
                 use_cuda: bool = False, use_horovod: bool = False, by_layer: bool = False,
                 grad_clip: float = float("inf"), init_scale: float = 1024,
                 scale_factor: float = 2, scale_window: int = 128,
                 max_scale: float | None = None, min_scale: float = 1e-4,
                 average_world: bool = False, average_custom: bool = False,
                 divide_before: bool = False, *, comm: MPICommunication | None = None) -> None:
        self._wrap()
        comm = sanitize_comm(comm)
        error = world_size_error(world_size, comm)
        world_size = comm.size
        if error is None and not isinstance(fp16_model, torch.nn.Module):
            error = TypeError(f"fp16_model must be a torch.nn.Module, got "
                              f"{type(fp16_model).__name__}")
        if error is None and average_world and average_custom:
            error = ValueError("choose one of average_world and average_custom")
        if error is None and divide_before and not (average_world or average_custom):
            error = ValueError("divide_before needs average_world or average_custom")
        if error is None and not (init_scale > 0 and scale_factor > 1 and scale_window >= 1):
            error = ValueError("need init_scale > 0, scale_factor > 1 and scale_window >= 1")
        if error is None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                              or not grad_clip > 0):  # a negative bound would flip the gradient
            error = ValueError(f"grad_clip must be positive, got {grad_clip!r}")
        raise_together(error, comm)
        self.comm = comm
        self.world_size = world_size
        self.fp16_model = fp16_model
        self.use_cuda = use_cuda
        self.grad_clip = grad_clip
        self.loss_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.max_scale = max_scale
        self.min_scale = min_scale
        self.average_custom = average_custom
        self.divide_before = divide_before
        self.since_backoff = 0
        self._applied_scale: float | None = None  # what backward_loss multiplied the loss by
        self._averaged = False  # the float16 gradients hold this step's aggregate
        self._master_ready = False  # ... and fp32_params.grad holds it too
        op = "avg" if average_world or (average_custom and divide_before) else "sum"
        kind = Hierarchical if use_horovod else AllReduce
        extra = {"topology": get_topology(comm)} if use_horovod else {}
        reducer = kind(comm, op=op, divide_before=divide_before, **extra)
        broadcast_module(fp16_model, comm)
        cap = 1e-6 if by_layer else 25.0
        self.sync = GradientSync(list(fp16_model.parameters()), comm, cap, cap,
                                 reducer=reducer, on_backward_end=self._backward_end,
                                 grad_as_bucket_view=False)
        self.fp32_params = self.initialize_flat_fp32_weight()
        # the master weights' layout: the parameters that required gradients when it was built
        self._trainable = [p for p in fp16_model.parameters() if p.requires_grad]
        self._queued = False
        self._hooks = []
        if getattr(self.sync, "passthrough", False):  # one rank: the engine installs no hooks
            self._hooks = [on_gradient(p, self._on_grad)
                           for p in fp16_model.parameters() if p.requires_grad]
            remove_when_dropped(self, self._hooks)

    def _on_grad(self, _param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            at_backward_end(self._backward_end)

    def _backward_end(self) -> None:
        self._queued = False
        self.sync.synchronize()
        self._averaged = True

    def _check_layout(self) -> None:
        """RuntimeError where a parameter was frozen or unfrozen since the master weights were
        laid out: the copies between them and the model would read and write other parameters'
        places (mlbench-core's do: a layer frozen there overwrites the next one)."""
        now = [p for p in self.fp16_model.parameters() if p.requires_grad]
        if len(now) != len(self._trainable) or any(a is not b for a, b in
                                                   zip(now, self._trainable)):
            raise RuntimeError(
                "parameters of the model were frozen or unfrozen after FP16Optimizer was built: "
                "its float32 master weights hold the parameters that required gradients then. "
                "Build FP16Optimizer (and its inner optimizer) after freezing or unfreezing")

    def _fill_master(self) -> None:
        """Copy the aggregated float16 gradients into ``fp32_params.grad`` (once per step)."""
        self._check_layout()
        self.fp16_to_fp32_flat_grad(self.fp32_params, self.fp16_model)
        self._averaged = False
        self._master_ready = True

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups. Read between backward and :meth:`step` (as
        ``GradScaler`` does), it first fills ``fp32_params.grad`` with the aggregate, which
        :meth:`step` then uses as it is."""
        if self.__dict__.get("_averaged"):
            self._fill_master()
        return self._local().param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self._local().param_groups = value

    def initialize_flat_fp32_weight(self) -> torch.nn.Parameter:
        """A flat float32 copy of the model's trainable parameters (the master weights)."""
        params = [p for p in self.fp16_model.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.fp16_to_fp32_flat_grad(flat, self.fp16_model, weights=True)
        return torch.nn.Parameter(flat)

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer, built over ``[self.fp32_params]``."""
        if not isinstance(optimizer, torch.optim.Optimizer) or \
                isinstance(optimizer, WrappedOptimizer):
            raise TypeError(f"the inner optimizer must be a plain torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        if len(owned) != 1 or owned[0] is not self.fp32_params:
            raise ValueError("build the inner optimizer over [fp16_optimizer.fp32_params]")
        self.optimizer = optimizer

    def add_param_group(self, param_group: dict) -> None:
        """The master weights are one flat tensor, already in the inner optimizer: any other
        parameter raises ValueError on every rank (collective)."""
        group = materialized_group(param_group)
        error, _ = synchronized_check(group.get("params", []), [self.fp32_params],
                                      type(self).__name__)
        raise_together(error, self.comm)
        self._local().add_param_group(group)

    @staticmethod
    @torch.no_grad()
    def fp16_to_fp32_flat_grad(fp32_params: torch.Tensor, fp16_model: torch.nn.Module,
                               weights: bool = False) -> None:
        """Copy the float16 model's gradients (or, with ``weights``, its parameters) into the
        flat float32 tensor ``fp32_params`` (``.grad`` for gradients)."""
        params = [p for p in fp16_model.parameters() if p.requires_grad]
        if weights:
            target = fp32_params
        else:
            if fp32_params.grad is None:
                fp32_params.grad = torch.zeros_like(fp32_params)
            target = fp32_params.grad
        offset = 0
        for p in params:
            n = p.numel()
            src = p if weights else p.grad
            if src is None:
                target[offset:offset + n].zero_()
            else:
                target[offset:offset + n].copy_(src.reshape(-1))
            offset += n

    @staticmethod
    @torch.no_grad()
    def fp32_to_fp16_weights(fp16_model: torch.nn.Module, fp32_params: torch.Tensor) -> None:
        """Copy the flat float32 master weights into the float16 model."""
        offset = 0
        for p in fp16_model.parameters():
            if p.requires_grad:
                n = p.numel()
                p.copy_(fp32_params[offset:offset + n].view(p.shape))
                offset += n

    def backward_loss(self, loss: torch.Tensor) -> None:
        """Backward of ``loss * scale`` (in float32)."""
        self._applied_scale = self.loss_scale
        (loss.float() * self.loss_scale).backward()

    def step(self, closure=None, tracker=None, multiplier: float = 1, denom=None) -> bool:
        """One step (module docstring). Returns whether the parameters were updated.

        Collective. ``tracker``: ``record_batch_agg()`` after the aggregation,
        ``record_batch_opt_step()`` after the update (or the skip)."""
        if self.optimizer is None:
            raise RuntimeError("call set_optimizer() first")
        self._check_layout()
        if self.average_custom:
            denom = agreed_denom(denom, self.comm)
        self.sync.participate()
        self.sync.synchronize()
        if not self._master_ready:  # nobody read param_groups since backward: copy now
            self._fill_master()
        self._master_ready = self._averaged = False
        track(tracker, "agg")
        own_scaling = self._applied_scale is not None
        divisor = (self._applied_scale or 1.0) * multiplier
        self._applied_scale = None
        if self.average_custom:
            divisor *= float(denom) / (self.sync.reducer.denom if self.divide_before else 1.0)
        grad = self.fp32_params.grad
        if divisor != 1:
            grad.div_(divisor)
        norm = float(grad.norm())
        skip = self.comm.any_rank(not math.isfinite(norm))
        if skip:
            if own_scaling:
                self.loss_scale /= self.scale_factor
                self.since_backoff = 0
            track(tracker, "opt_step")
            if self.loss_scale <= self.min_scale:  # mlbench's test: at min_scale, stop
                raise RuntimeError(f"loss scale {self.loss_scale} reached min_scale "
                                   f"{self.min_scale}: the gradients keep overflowing")
            return False
        if self.grad_clip != float("inf") and norm > self.grad_clip:
            grad.mul_(self.grad_clip / (norm + 1e-6))
        self.optimizer.step(closure)
        self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
        track(tracker, "opt_step")
        if own_scaling:
            self.since_backoff += 1
            if self.since_backoff >= self.scale_window:
                self.loss_scale *= self.scale_factor
                if self.max_scale is not None:
                    self.loss_scale = min(self.loss_scale, self.max_scale)
                self.since_backoff = 0
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the float16 model's gradients and the master gradient."""
        for p in self.fp16_model.parameters():
            p.grad = None
        self.fp32_params.grad = None
        self._master_ready = self._averaged = False

    def _engine_state(self) -> dict:
        """The master weights, the loss scale and the gradient synchronizer's state."""
        return {"fp32_params": self.fp32_params.detach().clone(),
                "loss_scale": self.loss_scale, "since_backoff": self.since_backoff,
                "sync": self.sync.state_dict()}

    def _load_engine_state(self, state: dict) -> None:
        with torch.no_grad():
            self.fp32_params.copy_(state["fp32_params"])
        self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
        self.loss_scale = float(state["loss_scale"])
        self.since_backoff = int(state["since_backoff"])
        self.sync.load_state_dict(state["sync"])

    def __repr__(self) -> str:
        return (f"FP16Optimizer({self.world_size} ranks, loss scale {self.loss_scale}, "
                f"{self.optimizer!r})")
