"""``python -m heatlike.bench algorithms``: every distributed algorithm, side by side.

For each algorithm of :data:`heatlike.bench.workloads.ALGORITHMS`:

* on the digits MLP (64-128-64-10, 17K parameters): the test accuracy after training, the
  median step time and the payload bytes sent per rank per step;
* on a larger synthetic MLP (784-1024-1024-10, 1.9M parameters): the bytes per rank per step and
  their ratio to the plain float32 all-reduce, and the median step time.

"Bytes" are the payload a rank hands to collectives per step (for gossip, once per neighbor).
Targets: bf16 cast 0.5x, PowerSGD rank 2 <= 0.1x and top-k 1% <= 0.05x (values and indices) and
sign <= 0.1x on the larger MLP, each within 2 accuracy points of the all-reduce on digits.
"""

from __future__ import annotations

import statistics
import time

import torch
from mpi4py import MPI

from ..core.communication import MPI_WORLD
from ..utils.launch import configure_threads
from ._common import Results, describe_environment
from .workloads import ALGORITHMS, load_digits_split, make_runner, mlp, train_digits

LARGE = [784, 1024, 1024, 10]


def _large_step_stats(name: str, steps: int) -> tuple[float, float]:
    """(median step seconds, bytes per step) on the larger synthetic MLP."""
    comm = MPI_WORLD
    net = mlp(LARGE, seed=0)
    runner = make_runner(name, net, comm, lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(32, LARGE[0], generator=g)
    y = torch.randint(0, LARGE[-1], (32,), generator=g)
    runner.train_step(x, y)  # warm-up (allocations, bucket plans)
    before = runner.bytes_sent()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.train_step(x, y)
        times.append(time.perf_counter() - start)
    runner.finish()
    step = comm.handle.allreduce(statistics.median(times), op=MPI.MAX)
    return step, (runner.bytes_sent() - before) / steps


def run(results: Results, quick: bool = False) -> None:
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    configure_threads(comm)
    data = load_digits_split(0)
    epochs, steps = (4, 2) if quick else (10, 5)
    if rank0:
        print(f"# algorithms: digits MLP {epochs} epochs, batch 16 per rank; synthetic MLP "
              f"{'-'.join(map(str, LARGE))}, batch 32; {describe_environment(comm)}")
        print(f"{'algorithm':>22} {'digits acc':>10} {'digits ms':>9} {'digits B':>9} "
              f"{'large MB':>9} {'ratio':>7} {'large ms':>9}")
    baseline = None
    for name in ALGORITHMS:
        digits = train_digits(name, MPI_WORLD, epochs=epochs, data=data)
        digits_step = comm.allreduce(statistics.median(digits.step_times), op=MPI.MAX)
        large_step, large_bytes = _large_step_stats(name, steps)
        if baseline is None:
            baseline = large_bytes
        ratio = large_bytes / baseline
        for metric, value, unit in (("digits accuracy", digits.accuracy, "fraction"),
                                    ("digits step time", digits_step * 1e3, "ms"),
                                    ("digits bytes per step", digits.bytes_per_step, "bytes"),
                                    ("large bytes per step", large_bytes, "bytes"),
                                    ("large bytes ratio to allreduce", ratio, "ratio"),
                                    ("large step time", large_step * 1e3, "ms")):
            results.add("algorithms", name, metric, value, unit)
        if rank0:
            print(f"{name:>22} {digits.accuracy:10.4f} {digits_step * 1e3:9.2f} "
                  f"{digits.bytes_per_step:9.0f} {large_bytes / 1e6:9.3f} {ratio:7.3f} "
                  f"{large_step * 1e3:9.2f}", flush=True)
