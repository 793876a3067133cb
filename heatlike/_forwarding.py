"""Module attribute forwarding: Heat's ``heat.nn``, ``heat.nn.functional`` and ``heat.optim``
hand every name they do not define to torch (``heat.nn.Linear is torch.nn.Linear``)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

_MISSING = object()


def forward_to(name: str, namespace: dict, target: ModuleType
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for module ``name`` (whose globals are ``namespace``): a name the
    module does not define is looked up in ``target``; one neither has raises AttributeError.
    Private names (leading underscore) are never forwarded."""

    def __getattr__(attr: str):
        found = getattr(target, attr, _MISSING) if not attr.startswith("_") else _MISSING
        if found is not _MISSING:
            return found
        raise AttributeError(f"module {name!r} has no attribute {attr!r} (neither {name} nor "
                             f"{target.__name__} defines it)")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | {n for n in dir(target) if not n.startswith("_")})

    return __getattr__, __dir__
