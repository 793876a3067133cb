"""Rank-aware logging.

``get_logger(name)`` returns a standard :mod:`logging` logger under the ``heatlike`` hierarchy whose
lines start with ``[rank r/P]``. By default only rank 0 prints; ``HEATLIKE_LOG_RANKS=all`` (or a
comma-separated list of ranks) widens that, ``HEATLIKE_LOG_LEVEL`` sets the level (default INFO).
A single record can ask to be printed on every rank with ``extra={"all_ranks": True}``.
"""

from __future__ import annotations

import logging
import sys

from mpi4py import MPI

from .env import env_choice, env_int_list, env_str

__all__ = ["get_logger", "RankFilter"]

_ROOT = "heatlike"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_configured = False


def _parse_ranks() -> frozenset[int] | None:
    """``HEATLIKE_LOG_RANKS``: ``all`` (or ``*``: None) or comma-separated ranks (default 0)."""
    value = env_str("HEATLIKE_LOG_RANKS", "0")
    if value.lower() in ("all", "*"):
        return None
    try:
        return frozenset(env_int_list("HEATLIKE_LOG_RANKS", [0], minimum=0))
    except ValueError as e:
        raise ValueError(f"{e}, or 'all'") from None


class RankFilter(logging.Filter):
    """Adds ``rank`` / ``size`` to every record and drops records from ranks not selected."""

    def __init__(self, ranks: frozenset[int] | None = frozenset({0})) -> None:
        super().__init__()
        self.ranks = ranks
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.size = MPI.COMM_WORLD.Get_size()

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        record.size = self.size
        if self.ranks is None or getattr(record, "all_ranks", False):
            return True
        return self.rank in self.ranks


def _configure() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger(_ROOT)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[rank %(rank)d/%(size)d] %(name)s %(levelname)s: "
                                           "%(message)s"))
    handler.addFilter(RankFilter(_parse_ranks()))
    root.addHandler(handler)
    root.setLevel(env_choice("HEATLIKE_LOG_LEVEL", "INFO", _LEVELS))
    root.propagate = False
    _configured = True


def get_logger(name: str = _ROOT) -> logging.Logger:
    """A logger under ``heatlike`` whose lines carry the rank; rank 0 prints by default."""
    _configure()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
