"""Deferred parameter updates applied as the next forward pass first uses each parameter.

A non-blocking :class:`~heatlike.optim.DataParallelOptimizer` records its update at ``step()``
and leaves the gradients' all-reduces in flight. During the next forward pass through
:class:`~heatlike.nn.DataParallel`, :class:`ApplyBeforeUse` (a ``TorchFunctionMode``) sees
every torch function call; the first call that takes a parameter whose update is pending waits
for that parameter's bucket and applies the bucket's update before the call runs. Later layers'
buckets stay in flight while earlier layers compute.

Watching uses rather than module calls is what makes this correct for any module: a module may
use a parameter of a submodule it never calls (``nn.MultiheadAttention`` passes
``out_proj.weight`` to ``F.multi_head_attention_forward``; tied weights are read through
another module), and a hook before each module's forward would let such a call run with the
old value. The cost is a Python call per torch function in a forward pass with updates
pending (about 2-3 us each on one CPU core).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ApplyBeforeUse"]


class ApplyBeforeUse(TorchFunctionMode):
    """While active: before a torch function runs, apply the pending deferred updates of the
    buckets holding the parameters among its arguments (direct, or in a list or tuple
    argument). ``optimizer`` is the non-blocking DataParallelOptimizer, ``buckets`` its model's
    gradient buckets (``grad_sync.buckets``)."""

    def __init__(self, optimizer, buckets) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.owner = {id(p): b for b in optimizer._pending for p in buckets[b].params}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.owner:
            hit = set()
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    b = self.owner.get(id(a))
                    if b is not None:
                        hit.add(b)
                elif isinstance(a, (list, tuple)):
                    for t in a:
                        b = self.owner.get(id(t))
                        if b is not None:
                            hit.add(b)
            if hit:
                self.optimizer.apply(sorted(hit))
                pending = set(self.optimizer._pending)
                self.owner = {k: b for k, b in self.owner.items() if b in pending}
        return func(*args, **kwargs)
