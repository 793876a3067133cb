"""Timing and result records shared by the benchmark suites.

Timing rule: a collective takes as long as its slowest rank, so every timed block starts after a
barrier and its duration is the maximum over ranks; repeated rounds interleave the variants being
compared (the machine is shared and noisy, so variants measured in the same minute are compared)
and the median over rounds is reported.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from mpi4py import MPI

__all__ = ["Record", "Results", "timed_rounds", "describe_environment"]


@dataclass
class Record:
    """One measurement (one line of ``--json`` output)."""

    suite: str
    case: str
    world_size: int
    topology: str
    metric: str
    value: float
    unit: str


class Results:
    """Records collected on rank 0."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def add(self, suite: str, case: str, metric: str, value: float, unit: str,
            comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
        self.records.append(Record(suite, case, comm.Get_size(), topology_label(), metric,
                                   float(value), unit))

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in self.records], f, indent=1)


def topology_label() -> str:
    per_node = os.environ.get("HEATLIKE_RANKS_PER_NODE")
    return f"emulated nodes of {per_node} ranks" if per_node else "as launched"


def timed_rounds(variants: dict[str, Callable[[], None]], iters: int, rounds: int,
                 comm: MPI.Intracomm = MPI.COMM_WORLD, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each variant (max over ranks per round, rounds interleaved)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            samples[name].append(elapsed / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def describe_environment(comm: MPI.Intracomm = MPI.COMM_WORLD) -> str:
    lib = MPI.Get_library_version().splitlines()[0].strip()
    return (f"{comm.Get_size()} ranks ({topology_label()}), {lib}, mpi4py "
            f"{__import__('mpi4py').__version__}, torch {torch.__version__}, "
            f"{platform.node()} with {os.cpu_count()} CPUs")
