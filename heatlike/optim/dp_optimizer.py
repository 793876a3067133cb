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
``zero_grad()`` while updates are pending is applied right after each bucket's update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..nn.data_parallel import DataParallel

__all__ = ["DataParallelOptimizer"]


class DataParallelOptimizer:
    """Wrap ``torch_optimizer`` for data-parallel training with :class:`heatlike.nn.DataParallel`.

    Pass it as ``DataParallel(module, optimizer=dp_optimizer)``; the module's trainable parameters
    must be exactly the optimizer's.
    """

    def __init__(self, torch_optimizer: torch.optim.Optimizer, blocking: bool = False) -> None:
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(f"torch_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(torch_optimizer).__name__}")
        self.torch_optimizer = torch_optimizer
        self.blocking = bool(blocking)
        self._model: DataParallel | None = None
        self._pending: list[int] = []  # buckets stepped by step() but not yet applied
        self._hyperparams: list[dict] | None = None
        self._zero_request: bool | None = None  # set_to_none of a deferred zero_grad

    # Heat's attribute names
    @property
    def blocking_parameter_updates(self) -> bool:
        return self.blocking

    @property
    def update_next(self) -> bool:
        """Whether a deferred update is waiting for the next forward pass."""
        return bool(self._pending)

    @property
    def params_ref(self) -> list[torch.nn.Parameter]:
        return [p for g in self.torch_optimizer.param_groups for p in g["params"]]

    @property
    def param_groups(self) -> list[dict]:
        return self.torch_optimizer.param_groups

    @property
    def state(self):
        return self.torch_optimizer.state

    def _attach(self, model: DataParallel) -> None:
        self._model = model

    def _require_model(self) -> DataParallel:
        if self._model is None:
            raise RuntimeError("this DataParallelOptimizer is not attached to a model: build "
                               "heatlike.nn.DataParallel(module, optimizer=this_optimizer)")
        return self._model

    # -- stepping ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Update the parameters with the averaged gradients (blocking), or schedule the update
        for the next forward pass (non-blocking)."""
        sync = self._require_model().grad_sync
        if closure is not None and not self.blocking:
            raise ValueError("step(closure) needs blocking=True: a deferred update cannot "
                             "re-evaluate the model")
        self.flush()
        sync.participate()
        if self.blocking:
            sync.synchronize()
            return self.torch_optimizer.step(closure)
        self._pending = sync.pending()
        self._hyperparams = [{k: v for k, v in g.items() if k != "params"}
                             for g in self.torch_optimizer.param_groups]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; with updates pending, right after each of them is applied."""
        if self._pending:
            self._zero_request = set_to_none
        else:
            self.torch_optimizer.zero_grad(set_to_none=set_to_none)

    def flush(self) -> None:
        """Apply every pending deferred update now."""
        if self._pending:
            self.apply(list(self._pending))

    def apply(self, buckets: Sequence[int]) -> None:
        """Apply the deferred update of the given pending buckets (waiting for their
        reductions)."""
        todo = [b for b in buckets if b in self._pending]
        if not todo:
            return
        sync = self._require_model().grad_sync
        updated: list[torch.nn.Parameter] = []
        for b in todo:
            updated += sync.unpack(b)
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
                self.torch_optimizer.zero_grad(set_to_none=self._zero_request)
                self._zero_request = None

    def _step_only(self, params: Sequence[torch.nn.Parameter]) -> None:
        """One torch ``step()`` that updates only ``params`` (the others' gradients hidden)."""
        keep = {id(p) for p in params}
        hidden = []
        for group in self.torch_optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in keep:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self.torch_optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad

    @contextlib.contextmanager
    def _hyperparameters_of_step(self) -> Iterator[None]:
        groups = self.torch_optimizer.param_groups
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
        self.flush()
        return self.torch_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.flush()
        self.torch_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        mode = "blocking" if self.blocking else "non-blocking"
        return f"DataParallelOptimizer({mode}, {self.torch_optimizer!r})"
