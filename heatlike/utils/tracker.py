"""Tracker: where the time of a training step goes, and how many bytes it sends.

mlbench's optimizers accept a ``tracker`` and call ``record_batch_agg()`` after the aggregation
and ``record_batch_opt_step()`` after the local step; training loops call ``batch_start()``,
``record_batch_load()``, ``record_batch_fwd_pass()``, ``record_batch_comp_loss()``,
``record_batch_backprop()`` and ``batch_end()``. Each ``record_*`` stores the time since the
previous mark under that phase; ``add_bytes`` counts bytes per communicator label.
:meth:`summary` gives the median of every phase and the mean bytes per step.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

__all__ = ["Tracker"]

PHASES = ("load", "init", "fwd_pass", "comp_loss", "backprop", "agg", "opt_step", "comp_metrics")


class Tracker:
    """Per-step phase timings and bytes sent (module docstring)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._mark = 0.0

    def batch_start(self) -> None:
        self._current = {"phases": defaultdict(float), "bytes": defaultdict(int),
                         "start": time.perf_counter()}
        self._mark = self._current["start"]

    def record(self, phase: str) -> None:
        """Time since the last mark goes to ``phase``."""
        if self._current is None:
            self.batch_start()
        now = time.perf_counter()
        self._current["phases"][phase] += now - self._mark
        self._mark = now

    def add_bytes(self, nbytes: int, label: str = "world") -> None:
        if self._current is None:
            self.batch_start()
        self._current["bytes"][label] += int(nbytes)

    def batch_end(self) -> None:
        if self._current is None:
            return
        current = self._current
        self.steps.append({"phases": dict(current["phases"]), "bytes": dict(current["bytes"]),
                           "total": time.perf_counter() - current["start"]})
        self._current = None

    def __getattr__(self, name: str):
        # record_batch_<phase>() for mlbench's phase names
        if name.startswith("record_batch_") and name[len("record_batch_"):] in PHASES:
            phase = name[len("record_batch_"):]
            return lambda: self.record(phase)
        raise AttributeError(name)

    def summary(self) -> dict:
        """Median seconds per phase and per step, mean bytes per step per label."""
        if not self.steps:
            return {"steps": 0}
        phases = sorted({p for s in self.steps for p in s["phases"]})
        labels = sorted({b for s in self.steps for b in s["bytes"]})
        return {
            "steps": len(self.steps),
            "step_s": statistics.median(s["total"] for s in self.steps),
            "phase_s": {p: statistics.median(s["phases"].get(p, 0.0) for s in self.steps)
                        for p in phases},
            "bytes_per_step": {b: sum(s["bytes"].get(b, 0) for s in self.steps) / len(self.steps)
                               for b in labels},
        }
