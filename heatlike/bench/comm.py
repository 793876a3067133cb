"""``python -m heatlike.bench comm``: the cost of MPICommunication over raw mpi4py, and half-type
all-reduce against float32.

For fp32 all-reduces of 4 KiB, 1 MiB and 16 MiB it times MPICommunication on torch tensors and on
numpy arrays, each against raw mpi4py on the *same memory* (``[array, MPI.FLOAT]`` specs, mpi4py's
fastest form; for tensors through ``tensor.numpy()`` views). Same memory matters: numpy advises
transparent huge pages for large arrays and torch does not, which alone changes a 16 MiB
all-reduce by about 20% on shared memory. It also times bfloat16 and float16 tensors holding the
same number of elements (half the bytes). Targets: wrapper/raw <= 1.05 at >= 1 MiB and <= 1.3 at
4 KiB; bf16 no slower than fp32 at 16 MiB.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..core.communication import MPI_WORLD
from ._common import Results, describe_environment, timed_rounds

SIZES = [("4 KiB", 4 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20)]


def _plan(nbytes: int, quick: bool) -> tuple[int, int]:
    """(iterations per timed block, rounds) for a message size."""
    if nbytes <= 64 << 10:
        return (100, 7) if quick else (300, 15)
    if nbytes <= 2 << 20:
        return (10, 5) if quick else (30, 11)
    return (2, 5) if quick else (4, 9)


def _variants(n: int) -> dict:
    """The all-reduces compared, each on its own buffers of n elements."""
    comm, w = MPI.COMM_WORLD, MPI_WORLD
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    t, u = torch.ones(n), torch.empty(n)
    tn, un = t.numpy(), u.numpy()
    h, hh = torch.ones(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    f, ff = torch.ones(n, dtype=torch.float16), torch.empty(n, dtype=torch.float16)
    return {
        "raw": lambda: comm.Allreduce([tn, MPI.FLOAT], [un, MPI.FLOAT], MPI.SUM),
        "heatlike": lambda: w.Allreduce(t, u, MPI.SUM),
        "raw-numpy": lambda: comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT], MPI.SUM),
        "heatlike-numpy": lambda: w.Allreduce(a, b, MPI.SUM),
        "bf16": lambda: w.Allreduce(h, hh, MPI.SUM),
        "fp16": lambda: w.Allreduce(f, ff, MPI.SUM),
    }


def run(results: Results, quick: bool = False) -> None:
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    if rank0:
        print(f"# comm: fp32 all-reduce, {describe_environment(comm)}")
        print("#        ---- torch tensors ----  ---- numpy arrays -----  -- same n, half types -")
        print(f"{'size':>7} {'mpi4py':>7} {'heatlike':>8} {'ratio':>6} {'mpi4py':>7} "
              f"{'heatlike':>8} {'ratio':>6} {'bf16':>7} {'/fp32':>5} {'fp16':>7} {'/fp32':>5}"
              "   (times in us)")
    for label, nbytes in SIZES:
        iters, rounds = _plan(nbytes, quick)
        med = timed_rounds(_variants(nbytes // 4), iters, rounds, comm)
        ratio = med["heatlike"] / med["raw"]
        for name, value in med.items():
            results.add("comm", f"allreduce {label}", f"{name} time", value * 1e6, "us")
        results.add("comm", f"allreduce {label}", "heatlike/mpi4py", ratio, "ratio")
        results.add("comm", f"allreduce {label}", "numpy heatlike/mpi4py",
                    med["heatlike-numpy"] / med["raw-numpy"], "ratio")
        results.add("comm", f"allreduce {label}", "bf16/fp32", med["bf16"] / med["heatlike"],
                    "ratio")
        results.add("comm", f"allreduce {label}", "fp16/fp32", med["fp16"] / med["heatlike"],
                    "ratio")
        if rank0:
            us = {k: v * 1e6 for k, v in med.items()}
            print(f"{label:>7} {us['raw']:7.1f} {us['heatlike']:8.1f} {ratio:6.2f} "
                  f"{us['raw-numpy']:7.1f} {us['heatlike-numpy']:8.1f} "
                  f"{med['heatlike-numpy'] / med['raw-numpy']:6.2f} "
                  f"{us['bf16']:7.1f} {med['bf16'] / med['heatlike']:5.2f} "
                  f"{us['fp16']:7.1f} {med['fp16'] / med['heatlike']:5.2f}", flush=True)
