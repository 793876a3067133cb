"""Gradient hooks that do not keep their owner alive.

torch keeps a parameter's post-accumulate-grad hooks in a dictionary that its C++ side holds.
The garbage collector cannot see that reference, so a hook that is a bound method of an object
holding the parameter (a gradient synchronization holds its parameters) forms a cycle that is
never freed: a model and its wrapper dropped together stay in memory with their gradient buckets
and their communicators, and their hooks keep running. :func:`on_gradient` registers a hook that
reaches its owner through a weak reference and removes itself once the owner is gone.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["on_gradient", "remove_when_dropped", "eagerly", "at_backward_end"]


@torch.compiler.disable(recursive=True)
def eagerly(fn: Callable, *args):
    """``fn(*args)`` as plain Python, never traced by ``torch.compile``. A backward pass run from
    inside a compiled function calls its hooks and end-of-backward callbacks with dynamo's frame
    evaluation still on, which would trace them; they start and check collectives."""
    return fn(*args)


def at_backward_end(fn: Callable[[], None]) -> None:
    """Queue ``fn`` to run, eagerly, when the current backward pass ends (the autograd engine's
    callback)."""
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(eagerly, fn))


def on_gradient(param: torch.Tensor,
                method: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Register the bound ``method`` as ``param``'s post-accumulate-grad hook, holding its object
    weakly: once the object is gone the hook does nothing."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            eagerly(bound, p)

    return param.register_post_accumulate_grad_hook(hook)


def remove_when_dropped(owner: object, handles: list[RemovableHandle]) -> None:
    """Remove ``handles`` from their tensors or modules when ``owner`` is garbage-collected
    (removing a hook only drops it from its dictionary: safe wherever the collector runs)."""
    weakref.finalize(owner, _remove, list(handles))


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
