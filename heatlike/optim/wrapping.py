"""WrappedOptimizer: the ``torch.optim.Optimizer`` face of every heatlike optimizer.

A heatlike optimizer drives a local torch optimizer (the one that computes the update) and the
engine (which moves gradients or weights between ranks). To torch it must look like any other
optimizer, so that LR schedulers, ``torch.amp.GradScaler``, ``clip_grad_norm_`` recipes,
optimizer hooks and checkpoint code work unchanged. :class:`WrappedOptimizer` is that face:

* ``isinstance(opt, torch.optim.Optimizer)`` holds;
* ``param_groups``, ``state`` and ``defaults`` *are* the local optimizer's (the same objects, not
  copies), so a scheduler that sets ``group["lr"]`` changes the learning rate the local optimizer
  uses, and ``add_param_group`` adds to it;
* ``state_dict()`` has torch's format (``"state"``, ``"param_groups"``) with the engine's state
  under the extra key ``"engine"``; ``load_state_dict`` accepts it, and accepts a plain torch
  state dict too (the engine's state is then left as it is);
* step pre/post hooks and state-dict hooks registered on the wrapper run as on any optimizer.

Subclasses call :meth:`_wrap` (instead of ``torch.optim.Optimizer.__init__``) once, with the local
optimizer or None when it comes later (``self.optimizer = ...`` then wraps it), override
:meth:`step` (without calling ``super().step()``: torch runs the step hooks around every class's
``step``), and, when they hold engine state, :meth:`_engine_state` and :meth:`_load_engine_state`.

Helpers shared with the optimizers that are torch optimizers themselves:

* :func:`synchronized_check`: which parameters of an optimizer the engine does not synchronize
  (a parameter trained with its local gradient would silently diverge between ranks);
* :func:`amp_skip`: ``torch.amp.GradScaler``'s protocol for optimizers that set
  ``_step_supports_amp_scaling`` (their gradients are still per-rank when the scaler looks at them,
  so the skip decision is agreed on by all ranks inside ``step``);
* :func:`track`: the mlbench tracker protocol.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..engine.codecs import Codec, label_memory, rescale_memory
from ..engine.hooks import EagerSteps

__all__ = ["WrappedOptimizer", "materialized_group", "synchronized_check",
           "unsynchronized_grads", "amp_skip", "track", "driving_grad_scaler", "refuse_unscalable",
           "watch_unscalable", "LossScaleTracker"]

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


class WrappedOptimizer(EagerSteps, torch.optim.Optimizer):
    """Base of heatlike's optimizers: a ``torch.optim.Optimizer`` whose parameter groups, state and
    defaults are those of the local optimizer ``self.optimizer`` (see the module docstring)."""

    def _wrap(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Become a torch optimizer (call once, from ``__init__``), the face of ``optimizer``
        (or of the one later assigned to ``self.optimizer``)."""
        for name in _HOOK_DICTS:
            if name not in self.__dict__:
                self.__dict__[name] = OrderedDict()
        self._patch_step_function()
        self.__dict__.setdefault("_local_optimizer", None)
        if optimizer is not None:
            self._set_local(optimizer)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The local torch optimizer (None until it is set)."""
        return self.__dict__.get("_local_optimizer")

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if "_optimizer_step_pre_hooks" not in self.__dict__:
            self._wrap()
        self._set_local(optimizer)

    def _set_local(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the local optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer) or \
                getattr(optimizer, "_synchronizes_itself", False):
            raise TypeError(f"the local optimizer must be a plain torch optimizer, got "
                            f"heatlike's {type(optimizer).__name__}, which synchronizes itself")
        self.__dict__["_local_optimizer"] = optimizer

    def close(self) -> None:
        """Collective: free the communicators of this optimizer's synchronizers (their private
        channels), for programs that build many optimizers in one process: MPI has room for a
        couple of thousand communicators, and a dropped optimizer cannot free them safely. A step
        afterwards raises RuntimeError (it would not synchronize)."""
        for synchronizer in self._synchronizers():
            synchronizer.close()

    def _synchronizers(self) -> list:
        """What :meth:`close` closes (default: the ``sync`` attribute, if any)."""
        sync = self.__dict__.get("sync")
        return [sync] if sync is not None else []

    def _local(self) -> torch.optim.Optimizer:
        local = self.__dict__.get("_local_optimizer")
        if local is None:
            raise RuntimeError(f"{type(self).__name__} has no local optimizer yet")
        return local

    # the local optimizer's own objects (data descriptors: torch's code that assigns them, e.g.
    # Optimizer.__setstate__, goes to the local optimizer too)
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._local().param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._local().param_groups = value

    @property
    def state(self):
        return self._local().state

    @state.setter
    def state(self, value) -> None:
        self._local().state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._local().defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._local().defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the local optimizer (subclasses refuse parameters their engine does not
        synchronize)."""
        self._local().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._local().zero_grad(set_to_none=set_to_none)

    # -- state ---------------------------------------------------------------------------------

    def _engine_state(self) -> dict | None:
        """What the engine needs to resume exactly (None: nothing)."""
        return None

    def _load_engine_state(self, state: dict) -> None:
        """Restore :meth:`_engine_state`."""

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict of the local optimizer, plus ``"engine"``."""
        state = super().state_dict()
        engine = self._engine_state()
        if engine is not None:
            state["engine"] = engine
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` (or a plain torch optimizer state dict)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        engine = state_dict.pop("engine", None)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._local().load_state_dict(state_dict)
        if engine is not None:
            self._load_engine_state(engine)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


def _params_of(groups: Iterable[dict]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


def materialized_group(param_group: dict) -> dict:
    """``param_group`` with its parameters as a list (torch accepts a tensor or an iterable)."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    group = dict(param_group)
    params = group.get("params", [])
    if isinstance(params, torch.Tensor):
        group["params"] = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, "
                        "not sets")
    else:
        group["params"] = list(params)
    return group


def synchronized_check(params: Iterable[torch.Tensor], synchronized: Iterable[torch.Tensor],
                       who: str) -> tuple[Exception | None, list[torch.Tensor]]:
    """Split ``params`` (an optimizer's) into those the engine synchronizes and the rest.

    Returns ``(error, frozen)``: ``error`` is a ValueError naming the trainable parameters
    (``requires_grad``) the engine does not synchronize (None if there are none); ``frozen`` are
    the unsynchronized ones that do not require gradients, which the caller watches in ``step()``
    (:func:`unsynchronized_grads`)."""
    known = {id(p) for p in synchronized}
    missing = [p for p in params if id(p) not in known]
    trainable = [p for p in missing if p.requires_grad]
    if trainable:
        shapes = ", ".join(str(tuple(p.shape)) for p in trainable[:3])
        return ValueError(
            f"{who} synchronizes the parameters it was built with; {len(trainable)} parameter(s) "
            f"of shapes {shapes}{' ...' if len(trainable) > 3 else ''} are not among them and "
            "would be trained with each rank's own gradient. Build the optimizer with every "
            "parameter to train (a group with lr=0 keeps one still until later)"), []
    return None, missing


def unsynchronized_grads(frozen: list[torch.Tensor], who: str) -> None:
    """RuntimeError when a parameter that was frozen when the engine was built (so is not
    synchronized) requires gradients or has one now: a local step would train it with this
    rank's own gradient and the replicas would drift apart."""
    for p in frozen:
        if p.requires_grad or p.grad is not None:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} did not require gradients when {who} was "
                "built, so it is not synchronized, but it "
                f"{'requires gradients' if p.requires_grad else 'has a gradient'} now: build "
                f"{who} after unfreezing it (a parameter group with lr=0 keeps a trainable "
                "parameter still until then)")


def amp_skip(opt: torch.optim.Optimizer, comm, params: Iterable[torch.Tensor] | None = None,
             agree: bool = True) -> bool:
    """``torch.amp.GradScaler``'s protocol for an optimizer with ``_step_supports_amp_scaling``:
    call first thing in ``step()``; True means skip the step.

    The scaler sets ``opt.found_inf`` (from this rank's gradients) and ``opt.grad_scale`` (None
    when ``scaler.unscale_(opt)`` already ran) and calls ``step()`` on every rank whatever it
    found. When ``agree``, the ranks combine their ``found_inf`` (collective, only when a scaler
    drives the step), so every rank skips if any rank's gradients are not finite; otherwise the
    gradients of ``params`` are divided by ``grad_scale``. Without a scaler: False, nothing
    sent."""
    found_inf = opt.__dict__.get("found_inf")
    grad_scale = opt.__dict__.get("grad_scale")
    if found_inf is None and grad_scale is None:
        return False
    local = bool(found_inf) if found_inf is not None else False
    if agree and comm.size > 1:
        local = comm.any_rank(local)
    if local:
        return True
    if grad_scale is not None:
        inverse = torch.as_tensor(grad_scale).double().reciprocal().float()
        for p in params if params is not None else _params_of(opt.param_groups):
            if p.grad is not None:
                p.grad.mul_(inverse.to(p.grad.device))
    return False


def track(tracker, phase: str, nbytes: int | None = None, label: str = "world") -> None:
    """Report a finished phase (``"agg"`` or ``"opt_step"``) to an mlbench-style ``tracker``:
    ``tracker.record_batch_<phase>()``; before it, ``tracker.add_bytes(nbytes, label)`` when the
    tracker has that method (heatlike's :class:`~heatlike.utils.Tracker` does, mlbench's not)."""
    if tracker is None:
        return
    if nbytes is not None:
        add_bytes = getattr(tracker, "add_bytes", None)
        if add_bytes is not None:
            add_bytes(nbytes, label)
    getattr(tracker, f"record_batch_{phase}")()


def driving_grad_scaler() -> torch.amp.GradScaler | None:
    """The ``torch.amp.GradScaler`` whose ``step()`` (or ``unscale_``-then-``step``) is calling
    the optimizer step running now, found on the call stack; None without one."""
    frame = sys._getframe(1)
    for _ in range(24):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in ("step", "_maybe_opt_step") and "self" in code.co_varnames:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.amp.GradScaler):
                return candidate
        frame = frame.f_back
    return None


def current_loss_scale(scaler: torch.amp.GradScaler | None) -> float:
    """The scale ``scaler`` multiplies losses by now (1 without an enabled scaler)."""
    if scaler is None or not scaler.is_enabled() or scaler._scale is None:
        return 1.0
    return float(scaler._scale)


def refuse_unscalable(codec: Codec, scaler: torch.amp.GradScaler | None) -> None:
    """ValueError where ``scaler`` (enabled) drives a step whose gradients ``codec`` exchanged
    although its result does not scale with its input (:attr:`Codec.scale_equivariant`: Sign's
    vote counts, Threshold's fixed threshold, Clipped's fixed limit): the scaler's unscaling
    would divide a result that carries no scale, a silently different model. Every rank drives
    its step with the same scaler, so every rank raises."""
    if scaler is None or not scaler.is_enabled() or codec.scale_equivariant:
        return
    raise ValueError(
        f"{codec.name} does not scale with its input, so torch.amp.GradScaler's unscaling of "
        "its result would change the update: train it without a GradScaler (bfloat16 autocast "
        "needs none), or use a codec that scales (ScaledSign for Sign, TopK for Threshold)")


#: gradient synchronizations whose codec does not scale (DataParallel with a torch optimizer
#: stepped by the program itself): a GradScaler stepping such an optimizer is refused
_UNSCALABLE: weakref.WeakSet = weakref.WeakSet()
_step_hook: list = [None]


def watch_unscalable(sync) -> None:
    """Refuse (:func:`refuse_unscalable`) an enabled ``torch.amp.GradScaler`` that steps a torch
    optimizer over parameters of ``sync`` (a :class:`~heatlike.engine.GradientSync`) whose
    codec does not scale with its input, where the program steps that optimizer itself (no
    heatlike optimizer is on the path to see the scaler). One global optimizer step pre-hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``) serves every such
    synchronization while one is alive; the step raises before it updates anything, on every
    rank (each steps through the same scaler)."""
    if sync.codec.scale_equivariant:
        return
    _UNSCALABLE.add(sync)
    if _step_hook[0] is None:
        _step_hook[0] = register_optimizer_step_pre_hook(_refuse_scaled_steps)


def _refuse_scaled_steps(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    if not _UNSCALABLE:
        return
    scaler = driving_grad_scaler()
    if scaler is None or not scaler.is_enabled():
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for sync in list(_UNSCALABLE):
        if not sync.closed and any(key in stepped for key in sync._where):
            refuse_unscalable(sync.codec, scaler)


class LossScaleTracker:
    """Keeps a stateful codec's error-feedback memory in the units of the gradients it is given
    when ``torch.amp.GradScaler`` scales them (gradient mode: the gradients are exchanged during
    backward, scaled).

    A residual made from gradients at scale s holds s e; the next exchange, at scale s' (the
    scaler grows the scale after ``growth_interval`` clean steps and backs it off after an
    overflow), must add s' e. At each step the optimizer finds the scaler driving it
    (:func:`driving_grad_scaler`), labels the residuals just made with the scale of this step's
    gradients (:func:`~heatlike.engine.codecs.label_memory`), and gives the codec the scaler's
    scale as its :attr:`~heatlike.engine.codecs.Codec.loss_scale`: before the next exchange
    the residuals are multiplied by s' / s (:func:`~heatlike.engine.codecs.rescale_memory`).
    So the model is that of the run without a scaler (power-of-two scales: exactly).
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.scaler: weakref.ref | None = None

    def step(self, scaler: torch.amp.GradScaler | None) -> None:
        """At a step whose gradients ``scaler`` scaled (None: unscaled)."""
        if scaler is None and self.scaler is None:
            return  # no scaler so far: the residuals are in the gradients' own units
        label_memory(self.codec.states, current_loss_scale(scaler))
        if scaler is None:
            self.scaler, self.codec.loss_scale = None, None
        elif self.scaler is None or self.scaler() is not scaler:
            ref = self.scaler = weakref.ref(scaler)
            self.codec.loss_scale = lambda: current_loss_scale(ref())

    def settle(self) -> None:
        """Bring every residual to the scaler's current scale (before the state is saved: a
        resumed optimizer's first exchange, before it has met its scaler, then adds residuals
        in the units of the saved scaler's next gradients)."""
        source = self.codec.loss_scale
        if source is not None:
            scale = source()
            for state in self.codec.states.values():
                rescale_memory(state, scale)
