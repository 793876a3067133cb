"""``python -m heatlike.bench gpu``: heatlike's communication and DataParallel on CUDA tensors.

Skipped, with the reason, unless every rank sees a GPU (each rank takes its local rank's, as
:func:`heatlike.utils.select_device` does). The header names the GPU, the MPI library and whether
it is CUDA-aware (device buffers handed to MPI directly) or not (staged through host memory).

* **all-reduce by size** (4 KiB to 64 MiB of float32): ``MPICommunication.Allreduce`` of a CUDA
  tensor (the default path: direct where the library is CUDA-aware, else the node-local sum
  through the peers' device memory where every rank is on one node, else staged) against the
  same all-reduce of a host tensor; the CUDA tensor staged through host memory
  (``heatlike.core.cuda_aware.assumed(False)``, the node-local sum off), pipelined
  (``heatlike.core._staging``) and in one chunk (``staging_chunk``: copy out, reduce, copy
  back, one after the other); and their ratios;
* **DataParallel against DDP** on the GPU: the MLPs of the ``dp`` suite (about 100K and 5M
  parameters, batch 32 per rank), heatlike's blocking DataParallel (its default path, and
  staged) against PyTorch DDP on gloo (DDP's CPU-communication backend, what runs alongside an
  MPI job), and the bare model (at several ranks it shares the GPU with the others' bare
  models: the floor any wrapper's step stands on), median step times and ratios.

Medians over interleaved rounds, each timed by its slowest rank after ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import contextlib

import torch
from mpi4py import MPI

from ..core import _nodereduce, cuda_aware
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


def _staged(fn, one_chunk: bool = False):
    """``fn`` run with device buffers staged through host memory: not handed to MPI directly,
    not summed through the peers' memory (``one_chunk``: not pipelined either)."""
    def run() -> None:
        with cuda_aware.assumed(False), _nodereduce.enabled(False):
            if one_chunk:
                with staging_chunk(2 ** 62):
                    fn()
            else:
                fn()
    return run


def allreduce_by_size(results: Results, device: torch.device, quick: bool) -> None:
    comm = MPI_WORLD
    say(f"{'size':>9} {'host ms':>9} {'cuda ms':>9} {'cuda/host':>9} {'staged ms':>10} "
        f"{'staged/host':>11} {'cuda/staged':>11} {'1-chunk ms':>10} {'staged/1-chunk':>14}")
    for kib in SIZES_KIB[:3] if quick else SIZES_KIB:
        n = kib * 256
        host = torch.ones(n)
        dev = torch.ones(n, device=device)
        variants = {"host": lambda t=host: comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM),
                    "cuda": lambda t=dev: comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM)}
        variants["staged"] = _staged(variants["cuda"])
        variants["one chunk"] = _staged(variants["cuda"], one_chunk=True)
        med = _timed(variants, 3 if quick else 10, 3 if quick else 7)
        case = f"{kib} KiB"
        for name, seconds in med.items():
            results.add("gpu", case, f"allreduce {name} time", seconds * 1e3, "ms")
        ratios = {"cuda/host": med["cuda"] / med["host"],
                  "staged/host": med["staged"] / med["host"],
                  "cuda/staged": med["cuda"] / med["staged"],
                  "staged/one chunk": med["staged"] / med["one chunk"]}
        for name, ratio in ratios.items():
            results.add("gpu", case, f"allreduce {name}", ratio, "ratio")
        say(f"{case:>9} {med['host'] * 1e3:9.3f} {med['cuda'] * 1e3:9.3f} "
            f"{ratios['cuda/host']:9.2f} {med['staged'] * 1e3:10.3f} "
            f"{ratios['staged/host']:11.2f} {ratios['cuda/staged']:11.2f} "
            f"{med['one chunk'] * 1e3:10.3f} {ratios['staged/one chunk']:14.2f}")


def _stepper(kind: str, widths: list[int], x: torch.Tensor, y: torch.Tensor):
    """One training step of the ``dp`` suite's ``kind`` ("heatlike" blocking, "staged": the
    same with device buffers staged through host memory, "ddp", "bare") of the MLP ``widths``
    on ``x``'s device."""
    scope = _nodereduce.enabled(False) if kind == "staged" else contextlib.nullcontext()
    with scope:
        model, opt, _ = _trainer({"heatlike": "heatlike-blocking",
                                  "staged": "heatlike-blocking"}.get(kind, kind), widths,
                                 x.device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step if kind != "staged" else _staged(step)


def data_parallel_against_ddp(results: Results, device: torch.device, quick: bool) -> None:
    comm = MPI_WORLD
    init_gloo(comm.handle)
    say(f"{'model':>9} {'heatlike ms':>12} {'staged ms':>10} {'DDP ms':>9} {'heatlike/DDP':>12} "
        f"{'staged/DDP':>10} {'bare ms':>9} {'heatlike/bare':>13}")
    for name, widths in MODELS.items():
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(32, widths[0], generator=g).to(device)
        y = torch.randint(0, widths[-1], (32,), generator=g).to(device)
        kinds = ["heatlike", "staged", "ddp", "bare"]
        med = _timed({k: _stepper(k, widths, x, y) for k in kinds}, 5 if quick else 30,
                     3 if quick else 9)
        for kind, seconds in med.items():
            results.add("gpu", name, f"{kind} step time", seconds * 1e3, "ms")
        ratio, staged = med["heatlike"] / med["ddp"], med["staged"] / med["ddp"]
        results.add("gpu", name, "heatlike/ddp", ratio, "ratio")
        results.add("gpu", name, "staged/ddp", staged, "ratio")
        results.add("gpu", name, "heatlike/bare", med["heatlike"] / med["bare"], "ratio")
        say(f"{name:>9} {med['heatlike'] * 1e3:12.3f} {med['staged'] * 1e3:10.3f} "
            f"{med['ddp'] * 1e3:9.3f} {ratio:12.2f} {staged:10.2f} {med['bare'] * 1e3:9.3f} "
            f"{med['heatlike'] / med['bare']:13.2f}")


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
    node = comm._hub.node
    if not aware and comm.size > 1:
        say("# node-local sums through the peers' device memory: "
            f"{'yes' if node is not None and node.usable else 'no (staged)'}")
    data_parallel_against_ddp(results, device, quick)
