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

from collections.abc import Callable

__all__ = ["WrapperHook", "InertHook"]


class InertHook:
    """What a copied or unpickled module keeps of a wrapper's hook: a hook that does nothing."""

    __slots__ = ()

    def __call__(self, *args, **kwargs) -> None:
        return None


class WrapperHook:
    """``fn`` as a module hook whose deep copies and pickles are :class:`InertHook`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook()

    def __reduce__(self):
        return (InertHook, ())
