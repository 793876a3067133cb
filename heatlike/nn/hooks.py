"""The hooks heatlike's wrappers put on a user's module, and what a copy of the module keeps of
them.

A wrapper (``DataParallel``, ``DataParallelMultiGPU``) registers forward hooks on the module it
wraps; they belong to that wrapper and its communication state (communicators, buckets and
synchronizations in flight). A deep copy of the module (``copy.deepcopy``, an EMA copy,
``torch.optim.swa_utils.AveragedModel``) or a pickled one (``torch.save(model)``) is a plain
module, as a copy of DDP's ``.module`` is: its hooks do nothing. Without this the copy would drag
the wrapper along (and fail: MPI communicators cannot be copied), or call the original wrapper
from the copy's forward pass.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..engine.hooks import eager, run_eagerly

__all__ = ["WrapperHook", "InertHook", "run_eagerly", "compiled_parts"]


def compiled_parts(module: torch.nn.Module) -> bool:
    """Whether ``torch.compile`` runs some of ``module``'s forward pass: the module or a submodule
    is compiled (``torch.compile(m)``, ``m.compile()``) or has a compiled ``forward``. Module hooks
    inside compiled code may be left out of the graph, or skipped altogether when a graph
    compiled before they were registered is reused."""
    if "torch._dynamo" not in sys.modules:  # torch.compile imports it: nothing is compiled
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    for m in module.modules():
        if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None \
                or hasattr(m.forward, "_torchdynamo_orig_callable"):
            return True
    return False


class InertHook:
    """What a copied or unpickled module keeps of a wrapper's hook: a hook that does nothing."""

    __slots__ = ()

    def __call__(self, *args, **kwargs) -> None:
        return None


class WrapperHook:
    """``fn`` as a module hook whose deep copies and pickles are :class:`InertHook`.

    Under ``torch.compile`` a hook is never traced into a graph: it waits for communication and
    changes parameters and flags in place, which must happen when the hook is called. An
    essential hook runs as plain Python as a whole (a graph break around the call; traced up to
    the call, it was compiled once per hook signature, a forward pre-hook's and a forward hook's
    arguments differing); an ``optional`` one (work that only helps, such as polling
    communication in flight) does nothing inside compiled code, so that it costs no graph
    break."""

    __slots__ = ("fn",)

    def __new__(cls, fn: Callable, optional: bool = False) -> WrapperHook:
        if optional and cls is WrapperHook:
            cls = _OptionalHook
        return super().__new__(cls)

    def __init__(self, fn: Callable, optional: bool = False) -> None:
        self.fn = fn

    @eager
    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook()

    def __reduce__(self):
        return (InertHook, ())


class _OptionalHook(WrapperHook):
    """A :class:`WrapperHook` whose work only helps: skipped inside compiled code."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return None
        return run_eagerly(self.fn, *args, **kwargs)
