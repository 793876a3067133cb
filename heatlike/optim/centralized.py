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
any preset, e.g. ``codec=heatlike.engine.Cast(torch.bfloat16)``; in weight mode a lossy codec is
given the change since the last synchronized weights, never the weights
(``x <- x_ref + (1/P) sum_r C(x_r - x_ref)``, :mod:`heatlike.engine.paramsync`).
``check_finite=True`` raises ``FloatingPointError`` on every rank when the averaged gradients are
not finite.

Every preset is a ``torch.optim.Optimizer`` (:class:`~heatlike.optim.wrapping.WrappedOptimizer`):
``param_groups``, ``state`` and ``defaults`` are the local optimizer's, so LR schedulers work, and
``state_dict()`` is torch's with the engine's state under ``"engine"``. ``torch.amp.GradScaler``:
in gradient mode the averages are in ``.grad`` when the scaler checks them, so every rank makes the
same decision; in weight mode the scaler calls ``step()`` on every rank and the ranks agree there
(any rank's non-finite gradient makes every rank skip). A codec with error feedback in gradient
mode compresses the scaled gradients; its residuals follow the scaler's scale from step to step
(:class:`LossScaleTracker`). Because the averaging happens during backward, ``clip_grad_norm_``
between ``backward()`` and ``step()`` clips the average.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from ..core.agreement import gather_or_raise, raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..engine.codecs import Codec, codec_error
from ..engine.gradsync import GradientSync
from ..engine.paramsync import ParameterSync
from ..engine.reducers import AllReduce, Reducer
from ..engine.replicas import broadcast_module, no_trainable_parameters
from .wrapping import (
    LossScaleTracker,
    WrappedOptimizer,
    amp_skip,
    driving_grad_scaler,
    materialized_group,
    refuse_unscalable,
    synchronized_check,
    track,
    unsynchronized_grads,
)

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


def agreed_denom(denom, comm: MPICommunication) -> float:
    """Collective: ``step(denom=)`` of ``average_custom`` as a float, positive and the same on
    every rank; ValueError on every rank otherwise, naming each rank's value.

    The gradients are summed over the ranks during backward, before ``step()`` is called, and
    the sum is divided by one denominator: a per-rank ``denom`` (each rank's own token count)
    would give every rank another model. mlbench divided by each rank's own ``denom`` (after
    the sum, or, with ``divide_before``, before it), so its replicas diverged, or each rank's
    contribution was weighed by its own count."""
    error, value = None, None
    try:
        value = None if denom is None else float(denom)
    except (TypeError, ValueError, RuntimeError):
        error = TypeError(f"denom must be a number or a one-element tensor, got {denom!r}")
    if error is None and (value is None or not value > 0):
        error = ValueError(f"average_custom needs a positive denom in step(), got {denom!r}")
    values = gather_or_raise(value, error, comm, "the step's denom")
    if len(set(values)) > 1:
        shown = ", ".join(f"rank {r}: {v:g}" for r, v in enumerate(values))
        raise ValueError(f"denom differs between ranks ({shown}): the gradients are summed over "
                         "the ranks during backward and the sum is divided by one denominator; "
                         "pass the same denom on every rank (e.g. the count over all ranks)")
    return value


def _check_lr(lr) -> Exception | None:
    if lr is required:
        return TypeError("lr is required")
    if not isinstance(lr, (int, float)) or lr < 0:
        return ValueError(f"lr must be a non-negative number, got {lr!r}")
    return None


class GenericCentralizedOptimizer(WrappedOptimizer):
    """Centralized (synchronous) data parallelism: aggregate, then step (module docstring).

    A ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are those of
    the local torch optimizer, which subclasses assign to ``self.optimizer``; every parameter of
    it must be one the engine synchronizes (ValueError otherwise, on every rank), and so must
    every parameter given to :meth:`add_param_group` later.
    """

    def __init__(self, world_size: int | None = None, model: torch.nn.Module | None = None,
                 use_cuda: bool = False, by_layer: bool = False, divide_before: bool = False,
                 agg_grad: bool = True, *, comm: MPICommunication | None = None,
                 codec: Codec | str | None = None, reducer: Reducer | None = None,
                 bucket_cap_mb: float = 25.0, check_finite: bool = False, _op: str = "avg",
                 _hooks: bool = True) -> None:
        self._wrap()
        comm = sanitize_comm(comm)
        error = world_size_error(world_size, comm)
        world_size = comm.size
        if error is None and not isinstance(model, torch.nn.Module):
            error = TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if error is None:
            error = no_trainable_parameters(model, type(self).__name__)
        if error is None:
            codec, error = codec_error(codec)  # a name ("bf16", ...) or a codec
        raise_together(error, comm)
        self.comm = comm
        self.world_size = world_size
        self.model = model
        self.use_cuda = use_cuda
        self.by_layer = by_layer
        self.agg_grad = agg_grad
        self._frozen: list[torch.Tensor] = []  # in the local optimizer, not synchronized
        self._bytes_reported = 0
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
            self._synchronized = list(self.sync.params)
            if self.sync.codec.stateful:
                # error feedback keeps residuals of the scaled gradients: GradScaler calls
                # step() on every rank with its scale, which the residuals follow
                self._scales = LossScaleTracker(self.sync.codec)
                self._step_supports_amp_scaling = True
        else:
            self.sync = ParameterSync(list(model.parameters()), comm, codec=codec,
                                      reducer=reducer, bucket_cap_mb=cap)
            self._synchronized = list(self.sync.tensors)
            # the gradients are this rank's own when GradScaler checks them: agree in step()
            self._step_supports_amp_scaling = True

    def _backward_end(self) -> None:
        self.sync.synchronize()

    # -- the local optimizer and its parameters ----------------------------------------------

    def _set_local(self, optimizer: torch.optim.Optimizer) -> None:
        if "sync" not in self.__dict__:  # a subclass assigning before __init__ built the engine
            raise RuntimeError("assign self.optimizer after GenericCentralizedOptimizer.__init__")
        error = None
        if not isinstance(optimizer, torch.optim.Optimizer) or \
                isinstance(optimizer, WrappedOptimizer):
            error = TypeError(f"the local optimizer must be a plain torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
            frozen = []
        else:
            error, frozen = synchronized_check([p for g in optimizer.param_groups
                                                for p in g["params"]], self._synchronized,
                                               type(self).__name__)
        raise_together(error, self.comm)
        super()._set_local(optimizer)
        self._frozen = frozen

    def add_param_group(self, param_group: dict) -> None:
        """Collective (every rank adds the same group): add a parameter group to the local
        optimizer. Its parameters must be ones the engine synchronizes (ValueError on every rank
        otherwise): the engine is built for the model's parameters at construction."""
        param_group = materialized_group(param_group)
        error, frozen = synchronized_check(param_group.get("params", []), self._synchronized,
                                           type(self).__name__)
        raise_together(error, self.comm)
        self._local().add_param_group(param_group)
        self._frozen += frozen

    # -- stepping ------------------------------------------------------------------------------

    def _aggregate(self) -> None:
        """Complete this step's gradient averaging (every rank takes part)."""
        self.sync.participate()
        self.sync.synchronize()

    def _new_bytes(self) -> int:
        sent = self.sync.bytes_sent
        new, self._bytes_reported = sent - self._bytes_reported, sent
        return new

    def step(self, closure=None, tracker=None):
        """Aggregate the gradients and step (``agg_grad``), or step and average the weights.

        ``tracker``: an mlbench-style tracker; ``record_batch_agg()`` is called after the
        aggregation, ``record_batch_opt_step()`` after the local step (and ``add_bytes`` with the
        bytes sent, when the tracker has it)."""
        return self._centralized_step(closure, tracker)

    def _centralized_step(self, closure, tracker, before_local=None):
        local = self._local()
        name = type(self).__name__
        if self.agg_grad:
            self._aggregate()
            refuse_unscalable(self.sync.codec, driving_grad_scaler())
            scales = self.__dict__.get("_scales")
            if scales is not None:
                scaled = "found_inf" in self.__dict__ or "grad_scale" in self.__dict__
                scales.step(driving_grad_scaler() if scaled else None)
                # the averages are the same on every rank, and so is the scaler's verdict
                if amp_skip(self, self.comm, agree=False):
                    track(tracker, "agg", self._new_bytes(), type(self.sync.reducer).__name__)
                    return None
            track(tracker, "agg", self._new_bytes(), type(self.sync.reducer).__name__)
            if before_local is not None:
                before_local()
            unsynchronized_grads(self._frozen, name)
            loss = local.step(closure)
            track(tracker, "opt_step")
            return loss
        if amp_skip(self, self.comm):  # GradScaler found an inf on some rank: all skip
            return None
        unsynchronized_grads(self._frozen, name)
        loss = local.step(closure)
        track(tracker, "opt_step")
        self.sync.synchronize()
        track(tracker, "agg", self._new_bytes(), type(self.sync.reducer).__name__)
        return loss

    # -- state -----------------------------------------------------------------------------------

    def _engine_state(self) -> dict:
        """The engine's state: bucket plan, counters, codec residuals and warm starts."""
        scales = self.__dict__.get("_scales")
        if scales is not None:
            scales.settle()
        return self.sync.state_dict()

    def _load_engine_state(self, state: dict) -> None:
        self.sync.load_state_dict(state)

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

    Gradient mode (``agg_grad=True``): ``average_world`` divides the summed gradients by the world
    size; ``average_custom`` by the ``denom`` given to each ``step()``; neither leaves the sum.
    The sum is formed during backward in every case (``average_custom`` divides by ``denom`` in
    ``step()``; with ``divide_before`` each rank's contribution is divided by the world size before
    the sum, for overflow safety, and ``step()`` rescales by ``world_size / denom``).
    ``grad_clip``: clip the aggregated gradients to this L2 norm.

    Weight mode (``agg_grad=False``): the local step, then the weights are averaged over the
    world; it needs ``average_world=True`` (a custom denominator or a plain sum would scale the
    weights: ValueError on every rank).
    """

    def __init__(self, model: torch.nn.Module | None = None, world_size: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, use_cuda: bool = False,
                 by_layer: bool = False, agg_grad: bool = True, grad_clip: float = float("inf"),
                 average_world: bool = False, average_custom: bool = False,
                 divide_before: bool = False, **engine) -> None:
        comm = sanitize_comm(engine.get("comm"))
        error = None
        if not isinstance(optimizer, torch.optim.Optimizer) or \
                isinstance(optimizer, WrappedOptimizer):
            error = TypeError(f"optimizer must be a plain torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        elif average_world and average_custom:
            error = ValueError("choose one of average_world and average_custom")
        elif divide_before and not (average_world or average_custom):
            error = ValueError("divide_before needs average_world or average_custom")
        elif not grad_clip > 0:
            error = ValueError(f"grad_clip must be positive, got {grad_clip!r}")
        elif not agg_grad and not average_world:
            error = ValueError(
                "agg_grad=False averages the weights over the ranks after the local step: pass "
                "average_world=True (" + ("average_custom divides by a per-step denominator, "
                "which would scale the weights" if average_custom else
                "without an averaging mode the weights would be summed over the ranks") + ")")
        raise_together(error, comm)
        if average_world or (average_custom and divide_before):
            op = "avg"
        else:
            op = "sum"
        super().__init__(world_size, model, use_cuda, by_layer, divide_before, agg_grad,
                         _op=op, **engine)
        self.grad_clip = grad_clip
        self.average_world = average_world
        self.average_custom = average_custom
        self.divide_before = divide_before
        self.optimizer = optimizer

    def step(self, closure=None, tracker=None, denom=None):
        """Aggregate (dividing by ``denom`` with ``average_custom``), clip, step (collective
        check of ``denom``: ValueError on every rank unless it is positive and the same on every
        rank, :func:`agreed_denom`)."""
        if self.average_custom:
            denom = agreed_denom(denom, self.comm)

        def before_local() -> None:
            params = [p for p in self.sync.params if p.grad is not None]
            if self.average_custom:
                factor = (self.sync.reducer.denom if self.divide_before else 1.0) / float(denom)
                with torch.no_grad():
                    for p in params:
                        p.grad.mul_(factor)
            if self.grad_clip != float("inf"):
                torch.nn.utils.clip_grad_norm_(params, self.grad_clip)

        return self._centralized_step(closure, tracker, before_local)
