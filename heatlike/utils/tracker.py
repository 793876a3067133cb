"""Tracker: where the time of a training step goes, and how many bytes it sends.

The protocol is mlbench-core's ``Tracker``'s (``mlbench_core.utils.Tracker``), so either tracker
can be handed to either project's optimizers. Optimizers take a ``tracker`` in ``step()`` and call
``record_batch_agg()`` after the aggregation and ``record_batch_opt_step()`` after the local step;
heatlike's also call ``add_bytes(nbytes, label)`` when the tracker has that method (mlbench's has
not). Training loops call ``batch_start()``, ``record_batch_load()``, ``record_batch_init()``,
``record_batch_fwd_pass()``, ``record_batch_comp_loss()``, ``record_batch_backprop()``,
``record_batch_comp_metrics()`` and ``batch_end()``, or ``record_batch_step(name)`` for a phase
of their own. Each ``record_*`` stores the time since the previous mark under that phase
(``record_batch_load`` under ``"load"``, mlbench's ``"batch_load"``); ``add_bytes`` counts bytes
sent (and, when known, received) per communicator label. :meth:`summary` gives the median of
every phase and the mean bytes per step; ``get_total_train_time()``,
``get_total_compute_time()`` (forward, loss, backward, optimizer step),
``get_total_communication_time()`` (aggregation), ``get_total_preprocess_time()`` (loading) and
``get_total_metrics_time()`` sum over the finished steps, as mlbench's do.

Spans. Every ``record(phase)`` also keeps the interval it measured, ``[previous mark, now]``, as a
span of the phase's category (:data:`CATEGORIES`), and ``batch_end()`` keeps the whole step as a
span of category ``"step"``. Code that waits for something inside a phase reports it with
:meth:`Tracker.span` (a context manager) or :meth:`Tracker.add_span`; the engine's gradient
synchronization does this for every bucket it waits for (category ``"comm wait"``) when a tracker
is attached to it (``GradientSync.tracker``). Timestamps are ``time.perf_counter()`` seconds.

:meth:`Tracker.write_chrome_trace` gathers every rank's spans to rank 0 and writes the Chrome
trace event format (``chrome://tracing``, Perfetto): one complete event (``"ph": "X"``) per span
with ``ts`` and ``dur`` in microseconds, ``pid`` = rank (named ``"rank N"``), ``tid`` = category.
Within one rank and category, spans are disjoint or nested; phase and wait spans lie inside their
step span. Ranks on the same host share the monotonic clock; for ranks on other hosts than rank 0
the clock offset is estimated from a few round trips with rank 0 (offset = midpoint of rank 0's
send and receive times minus the other rank's time, from the shortest round trip), so their
events are placed to within half a round trip.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["Tracker", "Span", "PHASES", "CATEGORIES"]

PHASES = ("load", "init", "fwd_pass", "comp_loss", "backprop", "agg", "opt_step", "comp_metrics")
#: the phases mlbench counts as compute (``get_total_compute_time``)
COMPUTE_PHASES = ("fwd_pass", "comp_loss", "backprop", "opt_step")

#: phase -> span category (one row per category in a Chrome trace)
CATEGORIES = {"load": "data", "init": "compute", "fwd_pass": "compute", "comp_loss": "compute",
              "backprop": "compute", "agg": "aggregation", "opt_step": "optimizer",
              "comp_metrics": "compute"}

#: fixed Chrome-trace thread ids of the known categories (others follow in order of appearance)
THREADS = ("step", "data", "compute", "comm wait", "aggregation", "optimizer")


class Span(NamedTuple):
    """One timed interval on one rank (seconds of ``time.perf_counter()``)."""

    name: str
    category: str
    start: float
    end: float
    args: dict | None = None


class Tracker:
    """Per-step phase timings, bytes, and timed spans (module docstring).

    ``keep_spans=False`` keeps only the per-step sums (for very long runs); ``max_spans`` caps the
    stored spans (the oldest are kept, the rest counted in ``dropped_spans``).
    """

    def __init__(self, keep_spans: bool = True, max_spans: int = 1_000_000) -> None:
        self.steps: list[dict] = []
        self.spans: list[Span] = []
        self.keep_spans = keep_spans
        self.max_spans = int(max_spans)
        self.dropped_spans = 0
        self._current: dict | None = None
        self._mark = 0.0

    # -- steps and phases ------------------------------------------------------------------------

    @property
    def in_batch(self) -> bool:
        """Whether a step is open (``batch_start`` called, ``batch_end`` not yet)."""
        return self._current is not None

    @property
    def step_bytes(self) -> dict[str, int]:
        """Bytes sent per label so far in the open step (empty outside a step)."""
        return dict(self._current["bytes"]) if self._current is not None else {}

    def batch_start(self) -> None:
        self._current = {"phases": defaultdict(float), "bytes": defaultdict(int),
                         "received": defaultdict(int), "waits": defaultdict(float),
                         "start": time.perf_counter()}
        self._mark = self._current["start"]

    def record(self, phase: str) -> None:
        """Time since the last mark goes to ``phase`` (and becomes a span of its category)."""
        if self._current is None:
            self.batch_start()
        now = time.perf_counter()
        self._current["phases"][phase] += now - self._mark
        self._keep(Span(phase, CATEGORIES.get(phase, phase), self._mark, now))
        self._mark = now

    def add_bytes(self, nbytes: int, label: str = "world", received: int | None = None) -> None:
        """Count ``nbytes`` sent (and ``received`` bytes received, when known) on the
        communicator ``label`` in the current step."""
        if self._current is None:
            self.batch_start()
        self._current["bytes"][label] += int(nbytes)
        if received is not None:
            self._current["received"][label] += int(received)

    def batch_end(self) -> None:
        if self._current is None:
            return
        current, end = self._current, time.perf_counter()
        step = {"phases": dict(current["phases"]), "bytes": dict(current["bytes"]),
                "received": dict(current["received"]), "waits": dict(current["waits"]),
                "total": end - current["start"]}
        args = {"step": len(self.steps)}
        args.update({f"bytes sent {k}": v for k, v in step["bytes"].items()})
        args.update({f"bytes received {k}": v for k, v in step["received"].items()})
        self._keep(Span(f"step {len(self.steps)}", "step", current["start"], end, args))
        self.steps.append(step)
        self._current = None

    # -- mlbench's Tracker protocol -------------------------------------------------------------

    def record_batch_step(self, name: str) -> None:
        """Time since the last mark goes to phase ``name`` (mlbench's name for :meth:`record`)."""
        self.record("load" if name == "batch_load" else name)

    def record_batch_load(self) -> None:
        self.record("load")

    def record_batch_init(self) -> None:
        self.record("init")

    def record_batch_fwd_pass(self) -> None:
        self.record("fwd_pass")

    def record_batch_comp_loss(self) -> None:
        self.record("comp_loss")

    def record_batch_backprop(self) -> None:
        self.record("backprop")

    def record_batch_agg(self) -> None:
        self.record("agg")

    def record_batch_opt_step(self) -> None:
        self.record("opt_step")

    def record_batch_comp_metrics(self) -> None:
        self.record("comp_metrics")

    def _total(self, phases: tuple[str, ...] | None) -> float:
        if phases is None:
            return sum(s["total"] for s in self.steps)
        return sum(s["phases"].get(p, 0.0) for s in self.steps for p in phases)

    def get_total_train_time(self) -> float:
        """Seconds in finished steps (``batch_start`` to ``batch_end``)."""
        return self._total(None)

    def get_total_compute_time(self) -> float:
        """Seconds in forward, loss, backward and optimizer-step phases."""
        return self._total(COMPUTE_PHASES)

    def get_total_communication_time(self) -> float:
        """Seconds in aggregation phases."""
        return self._total(("agg",))

    def get_total_preprocess_time(self) -> float:
        """Seconds loading batches."""
        return self._total(("load",))

    def get_total_metrics_time(self) -> float:
        """Seconds computing metrics."""
        return self._total(("comp_metrics",))

    # -- spans -----------------------------------------------------------------------------------

    def add_span(self, name: str, start: float, end: float, category: str = "user",
                 **args: Any) -> None:
        """Keep ``[start, end]`` (``time.perf_counter()`` seconds) as a span; inside a step its
        duration is also added to the step's total for ``category`` (``summary()["wait_s"]``)."""
        if end < start:
            raise ValueError(f"span {name!r} ends before it starts ({end} < {start})")
        if self._current is not None:
            self._current["waits"][category] += end - start
        self._keep(Span(name, category, float(start), float(end), args or None))

    @contextlib.contextmanager
    def span(self, name: str, category: str = "user", **args: Any) -> Iterator[None]:
        """Time the ``with`` block as a span (see :meth:`add_span`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_span(name, start, time.perf_counter(), category, **args)

    def _keep(self, span: Span) -> None:
        if not self.keep_spans:
            return
        if len(self.spans) >= self.max_spans:
            self.dropped_spans += 1
            return
        self.spans.append(span)

    # -- results ---------------------------------------------------------------------------------

    def summary(self) -> dict:
        """Median seconds per phase, per step and per span category (``wait_s``); mean bytes sent
        (and received, where counted) per step per label."""
        if not self.steps:
            return {"steps": 0}
        n = len(self.steps)
        phases = sorted({p for s in self.steps for p in s["phases"]})
        labels = sorted({b for s in self.steps for b in s["bytes"]})
        received = sorted({b for s in self.steps for b in s.get("received", {})})
        waits = sorted({c for s in self.steps for c in s.get("waits", {})})
        out = {
            "steps": n,
            "step_s": statistics.median(s["total"] for s in self.steps),
            "phase_s": {p: statistics.median(s["phases"].get(p, 0.0) for s in self.steps)
                        for p in phases},
            "bytes_per_step": {b: sum(s["bytes"].get(b, 0) for s in self.steps) / n
                               for b in labels},
        }
        if received:
            out["bytes_received_per_step"] = {
                b: sum(s.get("received", {}).get(b, 0) for s in self.steps) / n for b in received}
        if waits:
            out["wait_s"] = {c: statistics.median(s.get("waits", {}).get(c, 0.0)
                                                  for s in self.steps) for c in waits}
        return out

    def chrome_events(self, pid: int = 0, offset: float = 0.0, origin: float = 0.0) -> list[dict]:
        """This tracker's spans as Chrome trace events of process ``pid``: complete events with
        ``ts = (start + offset - origin) * 1e6`` and ``dur`` in microseconds, plus the process
        and thread name metadata."""
        return _events(pid, [tuple(s) for s in self.spans], offset, origin)

    def write_chrome_trace(self, path: str, comm=None) -> dict | None:
        """Collective over ``comm`` (an mpi4py communicator or MPICommunication; default
        ``heatlike.MPI_WORLD``): gather every rank's spans to rank 0 and write them there as a
        Chrome trace (``{"traceEvents": [...]}``, module docstring) to ``path``. Returns the trace
        on rank 0 and None elsewhere. The exchanges are heatlike's checked ones (a deadline,
        ended ranks and different calls raise instead of blocking), span arguments pickle cannot
        send raise ``TypeError`` on every rank, and a trace rank 0 cannot write (a file it
        cannot create, an argument JSON cannot hold) raises its error on every rank and leaves
        ``path`` as it was."""
        from ..core.agreement import raise_together
        from ..core.communication import MPI_WORLD, sanitize_comm

        comm = sanitize_comm(MPI_WORLD if comm is None else comm)
        offset = _clock_offset(comm)
        spans = [tuple(s) for s in self.spans]
        gathered = comm.gather((offset, spans, self.dropped_spans), root=0)
        trace, error = None, None
        if comm.rank == 0:
            starts = [s[2] + off for off, rank_spans, _ in gathered for s in rank_spans]
            origin = min(starts) if starts else 0.0
            events: list[dict] = []
            for rank, (off, rank_spans, _) in enumerate(gathered):
                events += _events(rank, rank_spans, off, origin)
            trace = {"traceEvents": events, "displayTimeUnit": "ms",
                     "otherData": {"ranks": len(gathered), "clock": "time.perf_counter",
                                   "dropped_spans": sum(d for _, _, d in gathered)}}
            try:  # the whole text first (a span argument JSON cannot hold fails here), then a
                # temporary file renamed over path: never a partial trace
                text = json.dumps(trace)
                temporary = f"{path}.{os.getpid()}.tmp"
                try:
                    with open(temporary, "w") as f:
                        f.write(text)
                    os.replace(temporary, path)
                finally:
                    if os.path.exists(temporary):
                        os.remove(temporary)
            except Exception as failed:  # noqa: BLE001 - any failure is every rank's error
                error = failed
        raise_together(error, comm, kinds=(OSError, PermissionError, IsADirectoryError,
                                           NotADirectoryError))
        return trace


def _events(pid: int, spans: list[tuple], offset: float, origin: float) -> list[dict]:
    tids = {name: i for i, name in enumerate(THREADS)}
    events: list[dict] = []
    for name, category, start, end, args in spans:
        tid = tids.setdefault(category, len(tids))
        event = {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid,
                 "ts": round((start + offset - origin) * 1e6, 3),
                 "dur": round((end - start) * 1e6, 3)}
        if args:
            event["args"] = dict(args)
        events.append(event)
    events.sort(key=lambda e: (e["ts"], -e["dur"]))  # parents before their children
    used = {e["tid"] for e in events}
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"rank {pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
             "args": {"sort_index": pid}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
             for name, tid in tids.items() if tid in used]
    return meta + events


def _clock_offset(comm, rounds: int = 8) -> float:
    """Seconds to add to this rank's ``perf_counter`` to get rank 0's (collective over the
    MPICommunication ``comm``): 0 on rank 0's host, else estimated from the shortest of
    ``rounds`` round trips with rank 0."""
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    remote = [r for r, h in enumerate(hosts) if h != hosts[0]]
    if not remote:
        return 0.0
    handle, tag = comm.handle, 7301
    offset = 0.0
    for r in remote:  # every rank knows the same hosts: the messages always pair up
        if comm.rank == 0:
            best = None
            for _ in range(rounds):
                sent = time.perf_counter()
                handle.send(sent, dest=r, tag=tag)
                theirs = handle.recv(source=r, tag=tag)
                back = time.perf_counter()
                if best is None or back - sent < best[0]:
                    best = (back - sent, (sent + back) / 2 - theirs)
            handle.send(best[1], dest=r, tag=tag)
        elif comm.rank == r:
            for _ in range(rounds):
                handle.recv(source=0, tag=tag)
                handle.send(time.perf_counter(), dest=0, tag=tag)
            offset = handle.recv(source=0, tag=tag)
    return offset
