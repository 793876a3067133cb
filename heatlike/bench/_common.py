"""Timing, result records and console output shared by the benchmark suites.

Timing rule: a collective takes as long as its slowest rank, so every timed block starts after a
barrier and its duration is the maximum over ranks; repeated rounds interleave the variants being
compared (the machine is shared and noisy, so variants measured in the same minute are compared)
and the median over rounds is reported.

Records: every measurement is one :class:`Record` (suite, case, world size, topology, metric,
value, unit, and ``params``: the numbers that locate it, e.g. the message size in bytes, the
epoch, the task), collected in :class:`Results` on every rank and written by rank 0
(``--json``: a JSON list with one object per record).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from mpi4py import MPI

from ..core.env import env_int, env_int_list

__all__ = ["Record", "Results", "timed_rounds", "describe_environment", "topology_label",
           "progress", "say", "set_progress", "oversubscription_note"]

FIELDS = ("suite", "case", "world_size", "topology", "metric", "value", "unit", "params")


@dataclass
class Record:
    """One measurement (one object of ``--json`` output)."""

    suite: str
    case: str
    world_size: int
    topology: str
    metric: str
    value: float
    unit: str
    params: dict[str, Any] = field(default_factory=dict)


class Results:
    """Records collected on every rank (rank 0 writes them), plus in-memory training curves that
    later suites of the same run may reuse (``curves[(task, algorithm)]``)."""

    def __init__(self, records: Iterable[Record] = ()) -> None:
        self.records: list[Record] = list(records)
        self.curves: dict[tuple[str, str], dict] = {}

    def add(self, suite: str, case: str, metric: str, value: float, unit: str,
            comm: MPI.Intracomm = MPI.COMM_WORLD, **params: Any) -> None:
        size = comm.Get_size() if hasattr(comm, "Get_size") else comm.size
        self.records.append(Record(suite, case, size, topology_label(), metric,
                                   float(value), unit, params))

    def find(self, suite: str | None = None, metric: str | None = None,
             case: str | None = None) -> list[Record]:
        """Records matching every given field."""
        return [r for r in self.records if (suite is None or r.suite == suite)
                and (metric is None or r.metric == metric) and (case is None or r.case == case)]

    def value(self, suite: str, case: str, metric: str) -> float | None:
        """The last matching record's value, or None."""
        found = self.find(suite, metric, case)
        return found[-1].value if found else None

    def to_list(self) -> list[dict]:
        return [_jsonable(asdict(r)) for r in self.records]

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_list(), f, indent=1)

    @classmethod
    def from_list(cls, items: Iterable[dict]) -> Results:
        """Records from ``--json`` output (missing ``params`` become empty)."""
        records = []
        for item in items:
            missing = [k for k in FIELDS[:-1] if k not in item]
            if missing:
                raise ValueError(f"record {item!r} lacks {missing}")
            value = item["value"]
            records.append(Record(item["suite"], item["case"], int(item["world_size"]),
                                  item["topology"], item["metric"],
                                  math.nan if value is None else float(value), item["unit"],
                                  dict(item.get("params") or {})))
        return cls(records)

    @classmethod
    def read_json(cls, path: str) -> Results:
        with open(path) as f:
            return cls.from_list(json.load(f))


def _jsonable(item: dict) -> dict:
    """NaN and infinities (not JSON) become null."""
    value = item["value"]
    if isinstance(value, float) and not math.isfinite(value):
        item["value"] = None
    return item


_REAL_LAYOUT: str | None = None


def detect_layout(comm: MPI.Intracomm = MPI.COMM_WORLD) -> str:
    """Collective: describe how the ranks sit on the real nodes (shared-memory groups), cached
    for :func:`topology_label`."""
    global _REAL_LAYOUT
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    leaders = comm.allgather(leader)
    _REAL_LAYOUT = _describe_nodes(leaders, emulated=False)
    return _REAL_LAYOUT


def _describe_nodes(ids: list, emulated: bool) -> str:
    sizes: dict = {}
    for i in ids:
        sizes[i] = sizes.get(i, 0) + 1
    counts = list(sizes.values())
    kind = "emulated node" if emulated else "node"
    if len(set(counts)) == 1:
        ranks = f"{counts[0]} rank{'s' if counts[0] > 1 else ''}"
        return f"{len(counts)} {kind}{'s' if len(counts) > 1 else ''} x {ranks}"
    return f"{len(counts)} {kind}s of {','.join(map(str, counts))} ranks"


def topology_label(size: int | None = None) -> str:
    """How the ranks are laid out: the emulation set by ``HEATLIKE_NODE_IDS`` /
    ``HEATLIKE_RANKS_PER_NODE`` if any, else the real nodes (:func:`detect_layout`)."""
    size = MPI.COMM_WORLD.Get_size() if size is None else size
    explicit = env_int_list("HEATLIKE_NODE_IDS")
    if explicit is not None:
        return _describe_nodes(explicit, emulated=True)
    per_node = env_int("HEATLIKE_RANKS_PER_NODE", None, minimum=1)
    if per_node is not None:
        return _describe_nodes([r // per_node for r in range(size)], emulated=True)
    return _REAL_LAYOUT or "as launched"


def _kernel_id() -> str:
    """What identifies the kernel (the machine) this process runs on: its boot id, else the
    host name. The nodes of the virtual cluster share one kernel and its cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return platform.node()


def _ranks_and_cores(comm: MPI.Intracomm) -> tuple[int, int]:
    """Collective: (ranks of ``comm`` on this rank's kernel, cores this rank may run on)."""
    kernel = _kernel_id()
    sharing = comm.allgather(kernel).count(kernel)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return sharing, cores or 1


def cores_per_rank(comm: MPI.Intracomm = MPI.COMM_WORLD) -> float:
    """Collective: the fewest cores any rank has to itself: the cores a rank may run on, divided
    by the ranks of ``comm`` on the same kernel (the nodes of the virtual cluster, each in its
    own network namespace, count together). Below 1 the ranks take turns on the cores."""
    ranks, cores = _ranks_and_cores(comm)
    return comm.allreduce(cores / ranks, op=MPI.MIN)


def oversubscription_note(comm: MPI.Intracomm = MPI.COMM_WORLD) -> str | None:
    """Collective: a warning when more ranks than cores share this machine (latencies then
    include waiting for a core), else None."""
    ranks, cores = _ranks_and_cores(comm)
    if ranks > cores:
        return (f"note: {ranks} ranks share {cores} cores here, so measured latencies and step "
                f"times include waiting for a core")
    return None


def timed_rounds(variants: dict[str, Callable[[], None]], iters: int, rounds: int,
                 comm: MPI.Intracomm = MPI.COMM_WORLD, warmup: int = 2,
                 finish: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds per call of each variant (max over ranks per round, rounds interleaved,
    every other round in reverse order so that no variant always runs right after another);
    ``finish`` (e.g. ``torch.cuda.synchronize``) runs before each clock stops."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    if finish is not None:
        finish()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for i in range(rounds):
        for name, fn in order if i % 2 == 0 else order[::-1]:
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            if finish is not None:
                finish()
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            samples[name].append(elapsed / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def describe_environment(comm: MPI.Intracomm = MPI.COMM_WORLD) -> str:
    lib = MPI.Get_library_version().splitlines()[0].strip()
    size = comm.Get_size()
    return (f"{size} rank{'s' if size > 1 else ''} ({topology_label()}), {lib}, mpi4py "
            f"{__import__('mpi4py').__version__}, torch {torch.__version__}, "
            f"{platform.node()} with {os.cpu_count()} CPUs")


# -- console output: tables on stdout, progress bars on stderr, rank 0 only ---------------------

_PROGRESS: bool | None = None  # None: only when stdout and stderr are terminals


def set_progress(enabled: bool | None) -> None:
    """Turn the progress bars on (``--progress``), off (``--no-progress``), or, with None (the
    default), on only when stdout and stderr are terminals: bars written into a file or a pipe
    next to the tables would tangle with them (under MPICH's mpiexec both are pipes)."""
    global _PROGRESS
    _PROGRESS = enabled


def _bars() -> bool:
    if _PROGRESS is not None:
        return _PROGRESS
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def _rank0() -> bool:
    return MPI.COMM_WORLD.Get_rank() == 0


def progress(items: Iterable, desc: str, total: int | None = None) -> Iterator:
    """``items`` with a tqdm progress bar on rank 0's stderr (plain iteration elsewhere, when
    the bars are off, see :func:`set_progress`, or without tqdm)."""
    if not (_rank0() and _bars()):
        return iter(items)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is part of the examples extra
        return iter(items)
    return iter(tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False,
                     dynamic_ncols=True, mininterval=0.5))


def say(line: str = "") -> None:
    """Print a line on rank 0's stdout without breaking an active progress bar."""
    if not _rank0():
        return
    tqdm = _tqdm() if _bars() else None
    if tqdm is not None:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)


def _tqdm():
    """tqdm's class, or None when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm
