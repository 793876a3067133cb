"""FP16Optimizer: mixed-precision data parallelism with dynamic loss scaling (mlbench-core's).

The model runs in float16; a flat float32 copy of its parameters, :attr:`fp32_params`, is what
the inner optimizer updates (build it with ``torch.optim.SGD([fp16_opt.fp32_params], ...)`` and
hand it to :meth:`set_optimizer`). One step:

1. :meth:`backward_loss` runs backward on ``loss * scale``; the float16 gradients are summed over
   the ranks by the engine during backward (the communication layer accumulates half types in
   float32) and divided by the world size (``average_world``), by a ``denom`` given to
   :meth:`step` (``average_custom``), or left summed;
2. :meth:`step` copies them into ``fp32_params.grad``, divides by ``scale * multiplier``, clips
   to ``grad_clip``; if the gradient norm is not finite on *any* rank, every rank skips the step
   and divides the scale by ``scale_factor`` (below ``min_scale``: RuntimeError); otherwise the
   inner optimizer steps, the float16 weights are refreshed from the float32 ones, and after
   ``scale_window`` clean steps the scale grows by ``scale_factor`` (up to ``max_scale``).
"""

from __future__ import annotations

import math

import torch
from mpi4py import MPI

from ..core.agreement import raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..core.topology import get_topology
from ..engine.gradsync import GradientSync
from ..engine.reducers import AllReduce, Hierarchical
from ..engine.replicas import broadcast_module
from .centralized import world_size_error

__all__ = ["FP16Optimizer"]


class FP16Optimizer:
    """Mixed-precision optimizer with dynamic loss scaling (module docstring)."""

    def __init__(self, fp16_model: torch.nn.Module, world_size: int | None = None,
                 use_cuda: bool = False, use_horovod: bool = False, by_layer: bool = False,
                 grad_clip: float = float("inf"), init_scale: float = 1024,
                 scale_factor: float = 2, scale_window: int = 128,
                 max_scale: float | None = None, min_scale: float = 1e-4,
                 average_world: bool = False, average_custom: bool = False,
                 divide_before: bool = False, *, comm: MPICommunication | None = None) -> None:
        comm = sanitize_comm(comm)
        error = world_size_error(world_size, comm)
        world_size = comm.size
        if error is None and not isinstance(fp16_model, torch.nn.Module):
            error = TypeError(f"fp16_model must be a torch.nn.Module, got "
                              f"{type(fp16_model).__name__}")
        if error is None and average_world and average_custom:
            error = ValueError("choose one of average_world and average_custom")
        if error is None and not (init_scale > 0 and scale_factor > 1 and scale_window >= 1):
            error = ValueError("need init_scale > 0, scale_factor > 1 and scale_window >= 1")
        raise_together(error, comm)
        self.comm = comm
        self.world_size = world_size
        self.fp16_model = fp16_model
        self.grad_clip = grad_clip
        self.loss_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.max_scale = max_scale
        self.min_scale = min_scale
        self.average_custom = average_custom
        self.since_backoff = 0
        self.optimizer: torch.optim.Optimizer | None = None
        op = "avg" if average_world else "custom_avg" if average_custom else "sum"
        kind = Hierarchical if use_horovod else AllReduce
        extra = {"topology": get_topology(comm)} if use_horovod else {}
        reducer = kind(comm, op=op, divide_before=divide_before, **extra)
        broadcast_module(fp16_model, comm)
        cap = 1e-6 if by_layer else 25.0
        self.sync = GradientSync(list(fp16_model.parameters()), comm, cap, cap,
                                 reducer=reducer, hooks=not average_custom,
                                 on_backward_end=self._backward_end, grad_as_bucket_view=False)
        self.fp32_params = self.initialize_flat_fp32_weight()

    def _backward_end(self) -> None:
        self.sync.synchronize()

    def initialize_flat_fp32_weight(self) -> torch.nn.Parameter:
        """A flat float32 copy of the model's trainable parameters (the master weights)."""
        params = [p for p in self.fp16_model.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.fp16_to_fp32_flat_grad(flat, self.fp16_model, weights=True)
        return torch.nn.Parameter(flat)

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer, built over ``[self.fp32_params]``."""
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        if len(owned) != 1 or owned[0] is not self.fp32_params:
            raise ValueError("build the inner optimizer over [fp16_optimizer.fp32_params]")
        self.optimizer = optimizer

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
        (loss.float() * self.loss_scale).backward()

    def step(self, closure=None, tracker=None, multiplier: float = 1, denom=None) -> bool:
        """One step (module docstring). Returns whether the parameters were updated."""
        if self.optimizer is None:
            raise RuntimeError("call set_optimizer() first")
        if self.average_custom:
            raise_together(None if denom is not None and float(denom) > 0 else
                           ValueError("average_custom needs a positive denom in step()"),
                           self.comm)
            self.sync.reducer.set_denom(float(denom))
        self.sync.participate()
        self.sync.synchronize()
        if tracker is not None:
            tracker.record_batch_agg()
        self.fp16_to_fp32_flat_grad(self.fp32_params, self.fp16_model)
        grad = self.fp32_params.grad
        grad.div_(self.loss_scale * multiplier)
        norm = float(grad.norm())
        skip = self.comm.handle.allreduce(int(not math.isfinite(norm)), op=MPI.MAX)
        if skip:
            self.loss_scale /= self.scale_factor
            self.since_backoff = 0
            if self.loss_scale < self.min_scale:
                raise RuntimeError(f"loss scale {self.loss_scale} fell below min_scale "
                                   f"{self.min_scale}: the gradients keep overflowing")
            return False
        if self.grad_clip != float("inf") and norm > self.grad_clip:
            grad.mul_(self.grad_clip / (norm + 1e-6))
        self.optimizer.step(closure)
        self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
        if tracker is not None:
            tracker.record_batch_opt_step()
        self.since_backoff += 1
        if self.since_backoff >= self.scale_window:
            self.loss_scale *= self.scale_factor
            if self.max_scale is not None:
                self.loss_scale = min(self.loss_scale, self.max_scale)
            self.since_backoff = 0
        return True

    def zero_grad(self) -> None:
        """Reset the float16 model's gradients and the master gradient."""
        for p in self.fp16_model.parameters():
            p.grad = None
        self.fp32_params.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "fp32_params": self.fp32_params.detach().clone(),
                "loss_scale": self.loss_scale, "since_backoff": self.since_backoff,
                "engine": self.sync.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.fp32_params.copy_(state["fp32_params"])
        self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
        self.loss_scale = float(state["loss_scale"])
        self.since_backoff = int(state["since_backoff"])
        if "engine" in state:
            self.sync.load_state_dict(state["engine"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
