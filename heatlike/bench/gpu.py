"""``python -m heatlike.bench gpu``: heatlike's communication and DataParallel on CUDA tensors.

Skipped, with the reason, unless every rank sees a GPU (each rank takes its local rank's, as
:func:`heatlike.utils.select_device` does). The header names the GPU, the MPI library and whether
it is CUDA-aware (device buffers handed to MPI directly) or not (staged through host memory).

* **all-reduce by size** (4 KiB to 64 MiB of float32): ``MPICommunication.Allreduce`` of a CUDA
  tensor against the same all-reduce of a host tensor, and their ratio (what staging, or the
  library's device path, costs); where the library is CUDA-aware, also the CUDA tensor forced
  through host staging (``heatlike.core.cuda_aware.assumed(False)``) against the direct path;
  and the staged all-reduce in one chunk (``staging_chunk``: copy out, reduce, copy back, one
  after the other) against the pipelined one (``heatlike.core._staging``), whose ratio is what
  the pipeline gains;
* **DataParallel against DDP** on the GPU: the MLPs of the ``dp`` suite (about 100K and 5M
  parameters, batch 32 per rank), heatlike's blocking DataParallel against PyTorch DDP on gloo
  (DDP's CPU-communication backend, what runs alongside an MPI job), median step time and ratio;
  at one rank also the bare model, for the cost of the wrapper.

Medians over interleaved rounds, each timed by its slowest rank after ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..core import cuda_aware
from ..core._staging import staging_chunk
from ..core.communication import MPI_WORLD
from ..utils.launch import select_device
from ._common import Results, describe_environment, say, timed_rounds
from .dp import MODELS, _trainer, init_gloo

SIZES_KIB = (4, 64, 1024, 16 * 1024, 64 * 1024)


def _timed(variants: dict, iters: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant, rounds interleaved, slowest rank, the device
    synchronized before each clock stops."""
    return timed_rounds(variants, iters, rounds, MPI.COMM_WORLD, warmup=1,
                        finish=torch.cuda.synchronize)


def _staged_for(device_fn, one_chunk: bool = False):
    """``device_fn`` run with device buffers forced through host staging (``one_chunk``: not
    pipelined)."""
    def run() -> None:
        with cuda_aware.assumed(False):
            if one_chunk:
                with staging_chunk(2 ** 62):
                    device_fn()
            else:
                device_fn()
    return run


def allreduce_by_size(results: Results, device: torch.device, quick: bool) -> None:
    comm = MPI_WORLD
    aware = cuda_aware.cuda_aware()
    say(f"{'size':>9} {'host ms':>9} {'cuda ms':>9} {'cuda/host':>9}"
        + (f" {'staged ms':>10} {'direct/staged':>13}" if aware else "")
        + f" {'1-chunk ms':>10} {'staged/1-chunk':>14}")
    for kib in SIZES_KIB[:3] if quick else SIZES_KIB:
        n = kib * 256
        host = torch.ones(n)
        dev = torch.ones(n, device=device)
        variants = {"host": lambda t=host: comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM),
                    "cuda": lambda t=dev: comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM)}
        if aware:
            variants["staged"] = _staged_for(variants["cuda"])
        variants["one chunk"] = _staged_for(variants["cuda"], one_chunk=True)
        med = _timed(variants, 3 if quick else 10, 3 if quick else 7)
        ratio = med["cuda"] / med["host"]
        case = f"{kib} KiB"
        for name, seconds in med.items():
            results.add("gpu", case, f"allreduce {name} time", seconds * 1e3, "ms")
        results.add("gpu", case, "allreduce cuda/host", ratio, "ratio")
        line = f"{case:>9} {med['host'] * 1e3:9.3f} {med['cuda'] * 1e3:9.3f} {ratio:9.2f}"
        if aware:
            direct = med["cuda"] / med["staged"]
            results.add("gpu", case, "allreduce direct/staged", direct, "ratio")
            line += f" {med['staged'] * 1e3:10.3f} {direct:13.2f}"
        gain = med["staged" if aware else "cuda"] / med["one chunk"]
        results.add("gpu", case, "allreduce staged/one chunk", gain, "ratio")
        say(f"{line} {med['one chunk'] * 1e3:10.3f} {gain:14.2f}")


def _stepper(kind: str, widths: list[int], x: torch.Tensor, y: torch.Tensor):
    """One training step of the ``dp`` suite's ``kind`` ("heatlike" blocking, "ddp", "bare")
    of the MLP ``widths`` on ``x``'s device."""
    model, opt, _ = _trainer({"heatlike": "heatlike-blocking"}.get(kind, kind), widths,
                             x.device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step


def data_parallel_against_ddp(results: Results, device: torch.device, quick: bool) -> None:
    comm = MPI_WORLD
    init_gloo(comm.handle)
    say(f"{'model':>9} {'heatlike ms':>12} {'DDP ms':>9} {'heatlike/DDP':>12}"
        + (f" {'bare ms':>9} {'heatlike/bare':>13}" if comm.size == 1 else ""))
    for name, widths in MODELS.items():
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(32, widths[0], generator=g).to(device)
        y = torch.randint(0, widths[-1], (32,), generator=g).to(device)
        kinds = ["heatlike", "ddp"] + (["bare"] if comm.size == 1 else [])
        med = _timed({k: _stepper(k, widths, x, y) for k in kinds}, 5 if quick else 10,
                     3 if quick else 7)
        ratio = med["heatlike"] / med["ddp"]
        for kind, seconds in med.items():
            results.add("gpu", name, f"{kind} step time", seconds * 1e3, "ms")
        results.add("gpu", name, "heatlike/ddp", ratio, "ratio")
        line = f"{name:>9} {med['heatlike'] * 1e3:12.3f} {med['ddp'] * 1e3:9.3f} {ratio:12.2f}"
        if "bare" in med:
            results.add("gpu", name, "heatlike/bare", med["heatlike"] / med["bare"], "ratio")
            line += f" {med['bare'] * 1e3:9.3f} {med['heatlike'] / med['bare']:13.2f}"
        say(line)


def run(results: Results, quick: bool = False) -> None:
    comm = MPI_WORLD
    seen = comm.handle.allgather(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if min(seen) == 0:
        without = [r for r, n in enumerate(seen) if n == 0]
        say(f"# gpu: skipped: no CUDA device on rank(s) {without[:8]}")
        return
    device = select_device("cuda", comm)
    aware = cuda_aware.cuda_aware()
    say(f"# gpu: {torch.cuda.get_device_name(device)} per rank ({device} on rank 0), "
        f"{describe_environment(comm.handle)}; CUDA-aware MPI: "
        f"{'yes' if aware else 'no (device buffers staged through host memory)'}")
    allreduce_by_size(results, device, quick)
    data_parallel_against_ddp(results, device, quick)
