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

__all__ = ["eager", "on_gradient", "last_active_hook", "remove_when_dropped", "run_eagerly",
           "at_backward_end", "EagerSteps"]

try:  # the frame-evaluation switches torch.compiler.disable sets, in torch's C extension
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
        set_eval_frame,
    )
    _SKIP = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)
except (ImportError, AttributeError, TypeError):  # another torch: torch.compiler.disable
    set_eval_frame = None


def eager(fn: Callable) -> Callable:
    """``fn`` as ``torch.compiler.disable(fn, recursive=True)`` makes it: plain Python under
    ``torch.compile``, a graph break where compiled code calls it, and run with dynamo's frame
    evaluation off where dynamo's callback is still on (a hook called by a backward pass started
    in compiled code). ``torch.compiler.disable`` imports ``torch._dynamo`` (about a second and
    90 MB per process, sympy included) even in a program that never compiles; this sets the same
    C-level switches without it: the wrapper's frame is never converted (its code's execution
    strategy is SKIP), it turns frame evaluation off around ``fn`` and on again after, and it
    carries the attributes by which dynamo's tracer recognizes a disabled function. Where this
    torch lacks those switches, it is ``torch.compiler.disable``."""
    if set_eval_frame is None:
        return torch.compiler.disable(fn, recursive=True)

    @functools.wraps(fn)
    def eagerly(*args, **kwargs):
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    set_code_exec_strategy(eagerly.__code__, _SKIP)
    eagerly._torchdynamo_disable = True
    eagerly._torchdynamo_disable_msg = None
    eagerly._torchdynamo_disable_recursive = True
    eagerly._torchdynamo_orig_callable = fn
    eagerly._torchdynamo_wrapper_id = id(eagerly)
    return eagerly


@eager
def run_eagerly(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` as plain Python, never traced by ``torch.compile`` (in compiled
    code: a graph break). heatlike's work around the user's computation (hooks, callbacks,
    optimizer steps) starts and checks collectives, which dynamo cannot trace; a backward pass
    run from inside a compiled function calls its hooks and end-of-backward callbacks with
    dynamo's frame evaluation still on."""
    return fn(*args, **kwargs)


def at_backward_end(fn: Callable[[], None]) -> None:
    """Queue ``fn`` to run, eagerly, when the current backward pass ends (the autograd engine's
    callback)."""
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(run_eagerly, fn))


class EagerSteps:
    """Mixin of heatlike's optimizers: ``step`` and ``zero_grad``, and the methods a class names
    in ``eager_methods``, as every subclass defines them, run as plain Python under
    ``torch.compile`` (a graph break around each call). They start, wait for and check
    collectives, which dynamo cannot trace (a whole compiled training step, forward, backward and
    ``step()``, otherwise failed inside the communication code on every rank but one-rank runs),
    and keep state that later eager calls read (FP16Optimizer's loss scale of the last backward,
    set in compiled code, was not seen by its eager ``step()``: the update was not unscaled)."""

    eager_methods: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("step", "zero_grad", *cls.eager_methods):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_heatlike_eager", False):
                wrapped = eager(fn)
                wrapped._heatlike_eager = True
                setattr(cls, name, wrapped)


def on_gradient(param: torch.Tensor, method: Callable[[torch.Tensor], None],
                passive: bool = False) -> RemovableHandle:
    """Register the bound ``method`` as ``param``'s post-accumulate-grad hook, holding its object
    weakly: once the object is gone the hook does nothing. The hook runs as plain Python as a
    whole: a backward pass started in compiled code would otherwise trace it up to the call and
    compile what follows the call once per parameter (a recompilation each, until dynamo's
    cache limit). ``passive``: the hook never changes ``.grad`` (it only polls), so a hook
    registered before it may take the gradient as final (:func:`last_active_hook`)."""
    ref = weakref.WeakMethod(method)

    @eager
    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    hook._heatlike_passive = passive
    return param.register_post_accumulate_grad_hook(hook)


def last_active_hook(param: torch.Tensor, hook_id: int) -> bool:
    """Whether the post-accumulate-grad hook ``hook_id`` of ``param`` is followed only by
    passive ones (:func:`on_gradient`): when it runs, ``.grad`` is final for this backward
    pass."""
    hooks = param._post_accumulate_grad_hooks
    for key in reversed(hooks or ()):
        if key == hook_id:
            return True
        if not getattr(hooks[key], "_heatlike_passive", False):
            return False
    return False


def remove_when_dropped(owner: object, handles: list[RemovableHandle]) -> None:
    """Remove ``handles`` from their tensors or modules when ``owner`` is garbage-collected
    (removing a hook only drops it from its dictionary: safe wherever the collector runs)."""
    weakref.finalize(owner, _remove, list(handles))


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
