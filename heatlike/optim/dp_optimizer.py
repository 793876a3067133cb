"""DataParallelOptimizer: a torch optimizer driven by :class:`heatlike.nn.DataParallel`.

Heat's semantics (``heat.optim.DataParallelOptimizer``):

* ``blocking=True``: the averaged gradients are in ``.grad`` at the end of ``backward()`` (so they
  can be inspected or clipped) and :meth:`step` updates the parameters at once;
* ``blocking=False`` (default): ``backward()`` only launches the reductions and :meth:`step`
  defers the update. Right before a layer's next forward, the reductions of the buckets holding its
  parameters are awaited and those parameters updated; the rest is applied at the end of that
  forward at the latest. ``model.eval()`` / ``model.train(False)``, :meth:`flush`, the module's
  ``state_dict()`` and this optimizer's ``state_dict()`` apply everything pending first. So the
  gradient communication overlaps both the backward pass and the next forward.

A deferred update uses the hyperparameters (``lr``, ...) the param groups had when :meth:`step`
was called, so an LR scheduler stepped in between does not leak into it. Deferred updates step
the torch optimizer once per bucket with the other parameters' gradients hidden, which is exact
for optimizers whose update is per parameter (SGD, Adam, AdamW, RMSprop, Adagrad, ...); use
``blocking=True`` for optimizers that couple parameters (LBFGS, global-norm based ones).
``zero_grad()`` while updates are pending is applied right after each bucket's update. Code
that reads a parameter (or its gradient) between :meth:`step` and the next forward, such as a
regularizer computed before ``model(x)`` or an EMA updated after ``step()``, applies its pending
update first and sees what a blocking step gives
(:class:`~heatlike.nn.deferred.ApplyBeforeRead`).

The wrapper is a ``torch.optim.Optimizer`` (:class:`~heatlike.optim.wrapping.WrappedOptimizer`):
its ``param_groups``, ``state`` and ``defaults`` are the torch optimizer's, so LR schedulers,
optimizer hooks and ``state_dict`` work as with the torch optimizer itself. Torch idioms that
touch gradients between ``backward()`` and ``step()``:

* blocking mode is DDP's: the averages are in ``.grad`` when ``backward()`` returns, so
  ``clip_grad_norm_``, ``GradScaler`` (``scaler.step(opt)``, ``scaler.unscale_(opt)``) and
  gradient inspection see exactly what they see under DDP;
* non-blocking mode: reading ``param_groups`` while the gradients are still being averaged
  (``GradScaler.unscale_`` and ``scaler.step`` do) first completes the averaging, and the next
  :meth:`step` then applies the update at once, so the AMP recipe needs no change;
  :meth:`synchronize` does the same explicitly (call it before ``clip_grad_norm_`` or anything
  else that reads or changes ``.grad``). A gradient changed in place or replaced while its
  average was still in flight (``clip_grad_norm_`` without :meth:`synchronize`) makes
  :meth:`step` raise ``RuntimeError`` instead of silently dropping the change.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from ..nn.deferred import ApplyBeforeRead, drop_guard, make_inert, on_stack, push_under
from .wrapping import (
    LossScaleTracker,
    WrappedOptimizer,
    driving_grad_scaler,
    refuse_unscalable,
    unsynchronized_grads,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..nn.data_parallel import DataParallel

__all__ = ["DataParallelOptimizer"]


class DataParallelOptimizer(WrappedOptimizer):
    """Wrap ``torch_optimizer`` for data-parallel training with :class:`heatlike.nn.DataParallel`.

    Pass it as ``DataParallel(module, optimizer=dp_optimizer)``; the module's trainable parameters
    must be exactly the optimizer's.
    """

    eager_methods = ("synchronize", "flush", "apply")

    def __init__(self, torch_optimizer: torch.optim.Optimizer, blocking: bool = False) -> None:
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(f"torch_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(torch_optimizer).__name__}")
        if not isinstance(blocking, bool):  # as in Heat: no truthiness ("asdf" is an error)
            raise TypeError(f"blocking must be a bool, got {type(blocking).__name__}")
        self._wrap(torch_optimizer)  # refuses heatlike's own optimizers
        self.blocking = blocking
        self._model: DataParallel | None = None
        self._pending: list[int] = []  # buckets stepped by step() but not yet applied
        self._hyperparams: list[dict] | None = None
        self._zero_request: bool | None = None  # set_to_none of a deferred zero_grad
        # a codec with error feedback: its residuals follow GradScaler's scale (set at _attach)
        self._scales: LossScaleTracker | None = None
        self._guard: ApplyBeforeRead | None = None  # between step() and the next forward
        self._applying = False
        self._read_error: FloatingPointError | None = None  # raised at the next forward

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The local torch optimizer (Heat's name; also ``self.optimizer``)."""
        return self.optimizer

    # Heat's attribute names
    @property
    def blocking_parameter_updates(self) -> bool:
        return self.blocking

    @blocking_parameter_updates.setter
    def blocking_parameter_updates(self, blocking: bool) -> None:
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking_parameter_updates must be a bool, got "
                            f"{type(blocking).__name__}")
        if self._model is not None and blocking != self.blocking:
            raise RuntimeError("the mode is fixed once DataParallel is built: pass "
                               "blocking_parameter_updates to DataParallel (Heat's way) or "
                               "blocking to this optimizer")
        self.blocking = blocking

    @property
    def update_next(self) -> bool:
        """Whether a deferred update is waiting for the next forward pass."""
        return bool(self._pending)

    @property
    def params_ref(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's groups; in non-blocking mode, reading them between ``backward()``
        and :meth:`step` first completes the gradient averaging (see the module docstring)."""
        if self._in_flight():
            self.synchronize()
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    def add_param_group(self, param_group: dict) -> None:
        if self._model is not None:
            raise RuntimeError("DataParallel synchronizes the parameters it was built with: add "
                               "parameter groups to the optimizer before wrapping the module")
        self.optimizer.add_param_group(param_group)

    def _attach(self, model: DataParallel) -> None:
        self._model = model
        if model.grad_sync.codec.stateful:
            self._scales = LossScaleTracker(model.grad_sync.codec)

    def _settle_scales(self) -> None:
        """Before the engine's state is saved: the residuals at the scaler's current scale."""
        if self._scales is not None:
            self._scales.settle()

    def _require_model(self) -> DataParallel:
        if self._model is None:
            raise RuntimeError("this DataParallelOptimizer is not attached to a model: build "
                               "heatlike.nn.DataParallel(module, optimizer=this_optimizer)")
        return self._model

    def _in_flight(self) -> bool:
        """Non-blocking mode, between backward() and step(): averages still being computed."""
        model = self.__dict__.get("_model")
        return model is not None and not self.blocking and not self._pending and \
            bool(model.grad_sync.pending())

    def synchronize(self) -> None:
        """Complete the gradient averaging of the last ``backward()`` now: ``.grad`` then holds
        the averages, and the next :meth:`step` applies the update at once (non-blocking mode;
        in blocking mode the averages are already there)."""
        sync = self._require_model().grad_sync
        if not self.blocking and not self._pending:
            sync.synchronize()

    # -- stepping ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Update the parameters with the averaged gradients (blocking, or after
        :meth:`synchronize`), or schedule the update for the next forward pass (non-blocking)."""
        model = self._require_model()
        sync = model.grad_sync
        unsynchronized_grads(model._frozen, "DataParallel")
        if closure is not None and not self.blocking:
            raise ValueError("step(closure) needs blocking=True: a deferred update cannot "
                             "re-evaluate the model")
        self.flush()
        changed = sync.changed_in_flight()
        if changed:
            raise RuntimeError(
                f"the gradients of {changed[:3]}{' ...' if len(changed) > 3 else ''} were "
                "changed between backward() and step() while their average was still being "
                "computed (non-blocking DataParallelOptimizer), e.g. by clip_grad_norm_: call "
                "optimizer.synchronize() before touching .grad, or use blocking=True")
        scaler = driving_grad_scaler()
        refuse_unscalable(sync.codec, scaler)
        sync.participate()
        if self._scales is not None:  # the residuals just made are at the driving scaler's scale
            self._scales.step(scaler)
        if self.blocking:
            sync.synchronize()
            return self.optimizer.step(closure)
        if sync.check_finite:  # the step's verdict before any bucket is applied (no collective)
            sync.agree_finite()
        pending = sync.pending()
        if not pending:  # averaged already (synchronize(), GradScaler): nothing to overlap
            return self.optimizer.step()
        self._pending = pending
        self._hyperparams = [{k: _value_now(v) for k, v in g.items() if k != "params"}
                             for g in self.optimizer.param_groups]
        # the step is taken, with these hyperparameters: an LR scheduler built on the torch
        # optimizer may step now (torch's flag, else it warns that its first value is skipped)
        self.optimizer._opt_called = True
        self._arm_guard()
        return None

    def _arm_guard(self) -> None:
        """Put :class:`~heatlike.nn.deferred.ApplyBeforeRead` on this thread's mode stack (or
        re-arm it there): a read of a parameter before the next forward pass applies its
        pending update first."""
        guard, buckets = self._guard, self._require_model().grad_sync.buckets
        if guard is None:
            guard = self._guard = ApplyBeforeRead(self, buckets)
            weakref.finalize(self, make_inert, guard)  # (the stack is changed by calls only)
        else:
            guard.__init__(self, buckets)
        if not on_stack(guard):
            push_under(guard)

    def _disarm_guard(self) -> None:
        """Nothing to guard any more (applied, or the forward pass takes over): the guard off
        the mode stack, or, where it cannot be taken off now (inside its own call, another
        thread), left inert until the next try."""
        if self._guard is not None:
            drop_guard(self._guard)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; with updates pending, right after each of them is applied."""
        if self._pending:
            self._zero_request = set_to_none
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def flush(self) -> None:
        """Apply every pending deferred update now (and raise the error of one applied for a
        read since ``step()``, where the other ranks meet theirs)."""
        if self._pending:
            self.apply(list(self._pending))
        self._disarm_guard()  # (one made inert inside its own call is taken off here)
        self._raise_read_error()

    def _raise_read_error(self) -> None:
        error, self._read_error = self._read_error, None
        if error is not None:
            raise error

    def apply(self, buckets: Sequence[int]) -> None:
        """Apply the deferred update of the given pending buckets (waiting for their
        reductions)."""
        todo = [b for b in buckets if b in self._pending]
        if not todo:
            return
        sync = self._require_model().grad_sync
        self._applying = True
        try:
            self._apply(sync, todo)
        finally:
            self._applying = False
        if self._guard is not None:
            if self._pending:
                self._guard.owner = {k: b for k, b in self._guard.owner.items()
                                     if b in self._pending}
            else:
                self._disarm_guard()

    def _apply(self, sync, todo: list[int]) -> None:
        changed = sync.changed_in_flight(todo)
        if changed:
            raise RuntimeError(
                f"the gradients of {changed[:3]}{' ...' if len(changed) > 3 else ''} were reset "
                "or changed after step() while their average was still being computed "
                "(non-blocking DataParallelOptimizer), e.g. through a .grad tensor kept from "
                "before step() or from another thread: call optimizer.zero_grad() or the "
                "DataParallel wrapper's zero_grad(), which reset them once the pending update "
                "is applied, or model.flush() first")
        updated: list[torch.nn.Parameter] = []
        for b in todo:
            try:
                updated += sync.unpack(b)
            except FloatingPointError:  # check_finite: the same bucket fails on every rank
                self._skip_pending()
                raise
            self._pending.remove(b)
        with self._hyperparameters_of_step():
            self._step_only(updated)
        if self._zero_request is not None:
            for p in updated:
                if self._zero_request:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            if not self._pending:
                self._zero_requested()

    def _zero_requested(self) -> None:
        """Nothing is pending any more: the ``zero_grad()`` asked for since ``step()``, if any."""
        if self._zero_request is not None:
            self.optimizer.zero_grad(set_to_none=self._zero_request)
            self._zero_request = None

    def _skip_pending(self) -> None:
        """Drop the rest of the deferred step (its averages were not finite): the engine has
        ended the cycle, the gradients are reset as a ``zero_grad()`` since ``step()`` asked, and
        the next forward runs as after a skipped step (before, every later forward raised
        again)."""
        self._pending = []
        self._disarm_guard()
        self._zero_requested()

    def _step_only(self, params: Sequence[torch.nn.Parameter]) -> None:
        """One torch ``step()`` that updates only ``params`` (the others' gradients hidden)."""
        keep = {id(p) for p in params}
        hidden = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in keep:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad

    @contextlib.contextmanager
    def _hyperparameters_of_step(self) -> Iterator[None]:
        groups = self.optimizer.param_groups
        if self._hyperparams is None or len(self._hyperparams) != len(groups):
            yield
            return
        current = [{k: g[k] for k in saved} for g, saved in zip(groups, self._hyperparams)]
        for g, saved in zip(groups, self._hyperparams):
            g.update(saved)
        try:
            yield
        finally:
            for g, now in zip(groups, current):
                g.update(now)

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The torch optimizer's state dict, every pending update applied first."""
        self.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.flush()
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        mode = "blocking" if self.blocking else "non-blocking"
        return f"DataParallelOptimizer({mode}, {self.torch_optimizer!r})"


def _value_now(value: object) -> object:
    """A hyperparameter's value as it is now: tensors (a tensor ``lr``, tensor ``betas``) are
    copied, since LR schedulers change them in place (``fill_``) before a deferred update runs."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_value_now(v) for v in value)
    return value
