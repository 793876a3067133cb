"""``--trace PATH``: a Chrome trace of a few training steps (open it in ``chrome://tracing`` or
https://ui.perfetto.dev).

Trains the larger synthetic MLP of the algorithms suite (784-1024-1024-10, batch 32 per rank,
about 7.5 MB of float32 gradients in two buckets) with one algorithm of
:data:`heatlike.recipes.ALGORITHMS` (``--trace-algorithm``, default ``allreduce``:
DataParallel with blocking updates) for a few warm-up steps and then ``steps`` steps reported to a
:class:`heatlike.utils.Tracker`: per rank the step, its phases (init = zero_grad, fwd_pass,
comp_loss, backprop, and agg / opt_step), every wait for a gradient bucket's exchange ("comm
wait", inside backprop for blocking DataParallel, inside the next forward for the non-blocking
mode) and the bytes sent per communicator (in the step's ``args``). The median of each phase
(slowest rank) goes into the results.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..core.communication import MPI_WORLD
from ..recipes import make_runner, mlp
from ..utils.tracker import Tracker
from ._common import Results, say
from .algorithms import LARGE, LARGE_BATCH

__all__ = ["run_trace"]


def run_trace(path: str, results: Results | None = None, algorithm: str = "allreduce",
              steps: int = 5, warmup: int = 2) -> Tracker:
    """Collective: trace ``steps`` training steps of ``algorithm`` and write the Chrome trace to
    ``path`` on rank 0; returns this rank's tracker."""
    comm = MPI_WORLD
    runner = make_runner(algorithm, mlp(LARGE, seed=0), comm, lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(LARGE_BATCH, LARGE[0], generator=g)
    y = torch.randint(0, LARGE[-1], (LARGE_BATCH,), generator=g)
    tracker = Tracker()
    runner.start_epoch(1)
    runner.end_epoch(runner.train_step(x, y))  # an epoch of one batch: past any warm-up epoch
    runner.start_epoch(2 * (warmup + steps))
    for i in range(warmup + steps):
        runner.train_step(x, y, tracker if i >= warmup else None)
    runner.finish()
    tracker.write_chrome_trace(path, comm)
    summary = tracker.summary()
    rows = {f"{phase} time": value for phase, value in summary.get("phase_s", {}).items()}
    rows.update({f"{category} time": value
                 for category, value in summary.get("wait_s", {}).items()})
    rows["step time"] = summary.get("step_s", 0.0)
    handle = comm.handle
    slowest = {k: handle.allreduce(v, op=MPI.MAX) for k, v in sorted(rows.items())}
    sent = summary.get("bytes_per_step", {})
    say(f"# trace: {steps} steps of {algorithm} on MLP {'-'.join(map(str, LARGE))}, batch "
        f"{LARGE_BATCH} per rank -> {path}")
    say("  " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in slowest.items()))
    say("  bytes sent per step (rank 0): " + ", ".join(f"{k} {v:.0f}" for k, v in sent.items()))
    if results is not None:
        for metric, value in slowest.items():
            results.add("trace", algorithm, metric, value * 1e3, "ms", steps=steps)
        for label, value in sent.items():
            results.add("trace", algorithm, f"bytes sent per step {label}", value, "bytes",
                        steps=steps)
    return tracker
