"""``python -m heatlike.bench algorithms``: every distributed algorithm, side by side.

For each algorithm of :data:`heatlike.recipes.ALGORITHMS` (with ``--quick``: one per
communication pattern, :data:`QUICK`; ``--algorithms a,b`` chooses):

* on the digits MLP (64-128-64-10, 17K parameters): the test accuracy and the training wall time
  after every epoch (the accuracy-against-time curve, also used by the ``tta`` suite), the final
  accuracy, the median step time and the payload bytes sent per rank per step;
* on a larger synthetic MLP (784-1024-1024-10, 1.9M parameters): the bytes per rank per step and
  their ratio to the plain float32 all-reduce, the median step time, and of it the time spent
  in the codec's own computations (encoding and decoding, ``heatlike.engine.exchange.CodecClock``;
  the slowest rank's mean per step): what a compression costs apart from its communication.

"Bytes" are the payload a rank hands to collectives per step (for gossip, once per neighbor).
Targets: bf16 cast 0.5x, PowerSGD rank 2 <= 0.1x and top-k 1% <= 0.05x (values and indices) and
sign <= 0.1x on the larger MLP, each within 2 accuracy points of the all-reduce on digits.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch
from mpi4py import MPI

from ..core.communication import MPI_WORLD
from ..engine.exchange import CODEC_CLOCK
from ..recipes import (
    ALGORITHMS,
    COMPRESSION_WARMUP,
    digits_task,
    load_digits_split,
    make_runner,
    mlp,
    train_task,
)
from ..utils.launch import configure_threads
from ._common import Results, describe_environment, progress, say

LARGE = [784, 1024, 1024, 10]
LARGE_BATCH = 32

#: with --quick: one algorithm per communication pattern of the cost model
QUICK = ("allreduce", "bf16", "powersgd-2", "topk-1%", "decentralized", "daso")


def choose_algorithms(names: str | None, quick: bool) -> list[str]:
    """The algorithms to run: ``names`` (comma-separated, or "all"), else all of them, or
    :data:`QUICK` with ``quick``."""
    if names:
        chosen = list(ALGORITHMS) if names == "all" else [n.strip() for n in names.split(",")
                                                           if n.strip()]
        unknown = [n for n in chosen if n not in ALGORITHMS]
        if unknown:
            raise ValueError(f"unknown algorithms {unknown}; choose from {list(ALGORITHMS)}")
        return chosen
    return list(QUICK) if quick else list(ALGORITHMS)


class LargeStep(NamedTuple):
    step: float    # median step seconds, slowest rank
    bytes: float   # bytes per step
    codec: float   # seconds per step in the codec (encode and decode), slowest rank


def large_step_stats(name: str, steps: int) -> LargeStep:
    """Step time, bytes and codec time per step on the larger synthetic MLP."""
    comm = MPI_WORLD
    net = mlp(LARGE, seed=0)
    runner = make_runner(name, net, comm, lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(LARGE_BATCH, LARGE[0], generator=g)
    y = torch.randint(0, LARGE[-1], (LARGE_BATCH,), generator=g)
    # warm-up (allocations, bucket plans) as one epoch, so that schedules with a warm-up epoch
    # (DASO) time their steady state, long enough for the exact steps that PowerSGD and top-k
    # take before they compress (COMPRESSION_WARMUP)
    runner.start_epoch(COMPRESSION_WARMUP + 1)
    for _ in range(COMPRESSION_WARMUP + 1):
        loss = runner.train_step(x, y)
    runner.end_epoch(loss)
    runner.start_epoch(2 * max(steps, 4))  # no end-of-epoch synchronization while timed
    before = runner.bytes_sent()
    codec_before = CODEC_CLOCK.seconds
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.train_step(x, y)
        times.append(time.perf_counter() - start)
    runner.finish()
    step = comm.handle.allreduce(statistics.median(times), op=MPI.MAX)
    codec = comm.handle.allreduce((CODEC_CLOCK.seconds - codec_before) / steps, op=MPI.MAX)
    return LargeStep(step, (runner.bytes_sent() - before) / steps, codec)


def record_curve(results: Results, suite: str, task: str, name: str, curve) -> None:
    """One record per epoch for the test accuracy and the training time so far."""
    for point in curve:
        results.add(suite, name, f"{task} epoch accuracy", point.accuracy, "fraction",
                    task=task, epoch=point.epoch)
        results.add(suite, name, f"{task} epoch time", point.seconds, "s", task=task,
                    epoch=point.epoch)


def run(results: Results, quick: bool = False, algorithms: str | None = None) -> None:
    comm = MPI.COMM_WORLD
    configure_threads(comm)
    names = choose_algorithms(algorithms, quick)
    task = digits_task(data=load_digits_split(0))
    epochs, steps = (3, 2) if quick else (10, 5)
    say(f"# algorithms: digits MLP {epochs} epochs, batch {task.batch_size} per rank; synthetic "
        f"MLP {'-'.join(map(str, LARGE))}, batch {LARGE_BATCH}; {describe_environment(comm)}")
    say(f"{'algorithm':>22} {'digits acc':>10} {'digits ms':>9} {'digits B':>9} "
        f"{'large MB':>9} {'ratio':>7} {'large ms':>9} {'codec ms':>9}")
    # the float32 all-reduce's payload: every gradient once, 4 bytes an element
    baseline = 4 * sum(p.numel() for p in mlp(LARGE, seed=0).parameters())
    for name in progress(names, "algorithms"):
        digits = train_task(name, MPI_WORLD, task, epochs, curve=True)
        results.curves[("digits", name)] = {"result": digits, "epochs": epochs,
                                            "suite": "algorithms"}
        record_curve(results, "algorithms", "digits", name, digits.curve)
        digits_step = comm.allreduce(statistics.median(digits.step_times), op=MPI.MAX)
        large_step, large_bytes, codec = large_step_stats(name, steps)
        ratio = large_bytes / baseline
        for metric, value, unit in (("digits accuracy", digits.accuracy, "fraction"),
                                    ("digits step time", digits_step * 1e3, "ms"),
                                    ("digits bytes per step", digits.bytes_per_step, "bytes"),
                                    ("large bytes per step", large_bytes, "bytes"),
                                    ("large bytes ratio to float32", ratio, "ratio"),
                                    ("large step time", large_step * 1e3, "ms"),
                                    ("large codec time per step", codec * 1e3, "ms")):
            results.add("algorithms", name, metric, value, unit)
        say(f"{name:>22} {digits.accuracy:10.4f} {digits_step * 1e3:9.2f} "
            f"{digits.bytes_per_step:9.0f} {large_bytes / 1e6:9.3f} {ratio:7.3f} "
            f"{large_step * 1e3:9.2f} {codec * 1e3:9.2f}")
