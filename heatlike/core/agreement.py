"""Raising the same error on every rank.

A check whose inputs can differ between ranks (a module built differently on one rank, an
optimizer given other parameters) must not raise on some ranks only: the others would go on into
the next collective and wait forever. :func:`raise_together` shares each rank's verdict with one
small allgather and raises on every rank if any rank found a problem, naming the rank.
:func:`agree_on` does the same for settings that must be equal on every rank (a bucket size, a
codec, a batch size): a constructor given different values on different ranks would otherwise
issue different collectives.
"""

from __future__ import annotations

from . import checks as _checks
from .communication import MPICommunication, sanitize_comm

__all__ = ["raise_together", "agree_on", "gather_or_raise"]

_ALLOWED = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError,
            "FloatingPointError": FloatingPointError, "FileNotFoundError": FileNotFoundError}


def raise_together(error: Exception | None, comm: MPICommunication | None = None,
                   kinds: tuple[type[Exception], ...] = ()) -> None:
    """Collective. Raise on every rank if ``error`` is not None on any rank.

    The exception raised has the type of the first failing rank's error (ValueError, TypeError,
    RuntimeError, FloatingPointError, FileNotFoundError or one of ``kinds``; others become
    RuntimeError) and its message, prefixed with that rank."""
    comm = sanitize_comm(comm)
    mine = None if error is None else (type(error).__name__, str(error))
    _raise_first(_checks.gather_objects(comm, mine, "raise_together"), comm, error, kinds)


def gather_or_raise(payload: object, error: Exception | None,
                    comm: MPICommunication | None = None, what: str = "allgather",
                    kinds: tuple[type[Exception], ...] = ()) -> list:
    """Collective: every rank's ``payload`` in rank order (an allgather), or, where any rank
    passes an ``error`` instead, that error raised on every rank as :func:`raise_together`
    does (``kinds``: further exception types kept as they are). For a check whose failure must
    travel with data the ranks exchange anyway: one collective, not two."""
    comm = sanitize_comm(comm)
    mine = (None, payload) if error is None else ((type(error).__name__, str(error)), None)
    gathered = _checks.gather_objects(comm, mine, what)
    _raise_first([verdict for verdict, _ in gathered], comm, error, kinds)
    return [data for _, data in gathered]


def _raise_first(verdicts: list, comm: MPICommunication, error: Exception | None,
                 kinds: tuple[type[Exception], ...]) -> None:
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            kind, message = verdict
            where = f"on rank {rank}: " if comm.size > 1 else ""
            allowed = {**_ALLOWED, **{k.__name__: k for k in kinds}}
            raise allowed.get(kind, RuntimeError)(where + message) from error


def agree_on(settings: dict, comm: MPICommunication | None = None, what: str = "") -> None:
    """Collective. Raise ValueError on every rank unless ``settings`` (name -> value, compared
    by ``repr``) are the same on every rank; the message names the first differing setting and
    its value on each rank."""
    comm = sanitize_comm(comm)
    if comm.size == 1:
        return
    mine = {k: repr(v) for k, v in settings.items()}
    everyone = _checks.gather_objects(comm, mine, f"agree_on({what or 'settings'})")
    for name in mine:
        values = [e.get(name) for e in everyone]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            where = f" of {what}" if what else ""
            raise ValueError(f"setting {name!r}{where} differs between ranks ({shown}); "
                             "every rank must pass the same value")
    if any(set(e) != set(mine) for e in everyone):
        raise ValueError(f"the settings{' of ' + what if what else ''} differ between ranks")
