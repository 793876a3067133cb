"""Raising the same error on every rank.

A check whose inputs can differ between ranks (a module built differently on one rank, an
optimizer given other parameters) must not raise on some ranks only: the others would go on into
the next collective and wait forever. :func:`raise_together` shares each rank's verdict with one
small allgather and raises on every rank if any rank found a problem, naming the rank.
"""

from __future__ import annotations

from .communication import MPICommunication, sanitize_comm

__all__ = ["raise_together"]

_ALLOWED = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}


def raise_together(error: Exception | None, comm: MPICommunication | None = None) -> None:
    """Collective. Raise on every rank if ``error`` is not None on any rank.

    The exception raised has the type of the first failing rank's error (ValueError, TypeError
    or RuntimeError; others become RuntimeError) and its message, prefixed with that rank."""
    comm = sanitize_comm(comm)
    mine = None if error is None else (type(error).__name__, str(error))
    verdicts = comm.handle.allgather(mine)
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            kind, message = verdict
            where = f"on rank {rank}: " if comm.size > 1 else ""
            raise _ALLOWED.get(kind, RuntimeError)(where + message) from error
