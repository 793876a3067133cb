"""``python -m heatlike.bench dp``: heatlike DataParallel against PyTorch DDP.

Trains the same MLP (about 5M parameters, and about 100K) on synthetic data for a fixed number of
steps with heatlike DataParallel (blocking and non-blocking, SGD with momentum) and with
``torch.nn.parallel.DistributedDataParallel`` on the gloo backend, the CPU choice of DDP users.
A step is zero_grad, forward, loss, backward, step. Variants run in interleaved rounds; the figure
is the median step time (slowest rank) and the ratio heatlike/DDP. Targets: ratio <= 0.8 for both
models at 2 and 4 ranks, non-blocking no slower than blocking. torch gets
``cpus / ranks-per-node`` threads per rank for every variant alike.

A second table times a small conv net with batch norms (:func:`conv_bn`, 16x16 inputs) under
blocking DataParallel with per-rank ``BatchNorm2d`` and with :class:`heatlike.nn.SyncBatchNorm`
(one all-gather per norm forward, one all-reduce backward), next to DDP with ``BatchNorm2d``
(torch's own SyncBatchNorm has no CPU kernels): what synchronized statistics cost per step.

A third table trains the 5M MLP with Adam under DataParallel, once with torch's Adam and once
with :class:`heatlike.optim.ZeroRedundancyOptimizer` over Adam: step time and the optimizer
state each rank holds (the largest over the ranks; ZeRO keeps no exchange buffer).
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
from mpi4py import MPI
from torch import nn

from ..core.communication import MPI_WORLD
from ..nn import DataParallel
from ..optim import DataParallelOptimizer
from ..recipes import mlp
from ..utils.launch import configure_threads
from ._common import Results, describe_environment

MODELS = {"mlp-5M": [1024, 2048, 1024, 512, 10], "mlp-100K": [256, 256, 128, 10]}
BATCH = 32


def init_gloo(comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Start torch.distributed (gloo, loopback) on the ranks of this MPI job, once."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())


def _trainer(variant: str, widths: list[int], device: torch.device | None = None):
    """(model, optimizer, finish) for one variant ("heatlike-blocking", "heatlike-nonblocking",
    "ddp" or "bare", the unwrapped model), on ``device``; finish() completes pending updates."""
    net = mlp(widths) if device is None else mlp(widths).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if variant == "bare":
        return net, opt, lambda: None
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net), opt, lambda: None
    dp_opt = DataParallelOptimizer(opt, blocking=variant == "heatlike-blocking")
    model = DataParallel(net, MPI_WORLD, optimizer=dp_opt)
    return model, dp_opt, model.flush


def conv_bn(channels: int = 16, blocks: int = 3) -> nn.Sequential:
    """``blocks`` times (3x3 convolution, BatchNorm2d, ReLU) on 1-channel 16x16 inputs, then a
    linear layer to 10 classes."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(blocks):
        layers += [nn.Conv2d(1 if i == 0 else channels, channels, 3, padding=1),
                   nn.BatchNorm2d(channels), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * 16 * 16, 10))


def _norm_trainer(variant: str):
    net = conv_bn()
    if variant == "syncbn":
        from ..nn import SyncBatchNorm

        net = SyncBatchNorm.convert_sync_batchnorm(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net), opt
    dp_opt = DataParallelOptimizer(opt, blocking=True)
    return DataParallel(net, MPI_WORLD, optimizer=dp_opt), dp_opt


def run_batchnorm(results: Results, quick: bool = False) -> None:
    """The second table (module docstring)."""
    comm = MPI.COMM_WORLD
    variants = ["batchnorm", "syncbn", "ddp"]
    trainers = {v: _norm_trainer(v) for v in variants}
    g = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(BATCH, 1, 16, 16, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    med = _median_steps(trainers, x, y, quick)
    for v in variants:
        results.add("dp", "conv-bn", f"{v} step time", med[v] * 1e3, "ms")
    results.add("dp", "conv-bn", "syncbn/batchnorm", med["syncbn"] / med["batchnorm"], "ratio")
    if comm.Get_rank() == 0:
        print(f"{'conv-bn':>9} {'BatchNorm ms':>12} {'SyncBN ms':>10} {'DDP+BN ms':>10} "
              f"{'SyncBN/BN':>9}")
        print(f"{'':>9} {med['batchnorm'] * 1e3:12.2f} {med['syncbn'] * 1e3:10.2f} "
              f"{med['ddp'] * 1e3:10.2f} {med['syncbn'] / med['batchnorm']:9.2f}", flush=True)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def run_sharded_state(results: Results, quick: bool = False) -> None:
    """The third table (module docstring)."""
    from ..optim import ZeroRedundancyOptimizer

    comm = MPI.COMM_WORLD
    widths = MODELS["mlp-5M"]
    trainers = {}
    for v in ("adam", "zero"):
        net = mlp(widths)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3) if v == "adam" else \
            ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
        trainers[v] = (DataParallel(net, MPI_WORLD), opt)
    g = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(BATCH, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (BATCH,), generator=g)
    med = _median_steps(trainers, x, y, quick)
    state = {v: comm.allreduce(_state_bytes(opt), op=MPI.MAX) / 2**20
             for v, (_, opt) in trainers.items()}
    for v in trainers:
        results.add("dp", "mlp-5M adam", f"{v} step time", med[v] * 1e3, "ms")
        results.add("dp", "mlp-5M adam", f"{v} optimizer state per rank", state[v], "MiB")
    if comm.Get_rank() == 0:
        print(f"{'adam 5M':>9} {'Adam ms':>9} {'ZeRO ms':>9} {'Adam MiB':>9} {'ZeRO MiB':>9}")
        print(f"{'':>9} {med['adam'] * 1e3:9.2f} {med['zero'] * 1e3:9.2f} "
              f"{state['adam']:9.1f} {state['zero']:9.1f}", flush=True)


def _median_steps(trainers: dict, x: torch.Tensor, y: torch.Tensor,
                  quick: bool) -> dict[str, float]:
    """Each variant's median step time (slowest rank), the variants run in interleaved rounds
    after a warm-up. ``trainers``: variant -> (model, optimizer[, finish]); ``finish()`` completes
    pending updates after each run of steps."""
    comm = MPI.COMM_WORLD
    rounds, steps, warmup = (1, 3, 1) if quick else (4, 10, 3)
    samples: dict[str, list[float]] = {v: [] for v in trainers}
    for model, opt, *finish in trainers.values():  # first steps allocate, rebuild buckets
        _step_times(model, opt, x, y, warmup)
        for f in finish:
            f()
    for _ in range(rounds):
        for v, (model, opt, *finish) in trainers.items():
            comm.Barrier()
            samples[v] += _step_times(model, opt, x, y, steps)
            for f in finish:
                f()
    return {v: comm.allreduce(statistics.median(s), op=MPI.MAX) for v, s in samples.items()}


def _step_times(model, opt, x, y, steps: int) -> list[float]:
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def run(results: Results, quick: bool = False) -> None:
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    threads = configure_threads(comm)
    init_gloo(comm)
    variants = ["heatlike-blocking", "heatlike-nonblocking", "ddp"]
    if rank0:
        print(f"# dp: MLP training steps, batch {BATCH} per rank, {threads} torch thread(s) per "
              f"rank, {describe_environment(comm)}")
        print(f"{'model':>9} {'params':>9} {'blocking ms':>12} {'non-block ms':>12} "
              f"{'DDP ms':>9} {'block/DDP':>9} {'nonbl/DDP':>9}")
    for name, widths in MODELS.items():
        trainers = {v: _trainer(v, widths) for v in variants}
        params = sum(p.numel() for p in trainers["ddp"][0].parameters())
        g = torch.Generator().manual_seed(comm.Get_rank())
        x = torch.randn(BATCH, widths[0], generator=g)
        y = torch.randint(0, widths[-1], (BATCH,), generator=g)
        med = _median_steps(trainers, x, y, quick)
        for v in variants:
            results.add("dp", name, f"{v} step time", med[v] * 1e3, "ms")
        results.add("dp", name, "heatlike-blocking/ddp", med["heatlike-blocking"] / med["ddp"],
                    "ratio")
        results.add("dp", name, "heatlike-nonblocking/ddp",
                    med["heatlike-nonblocking"] / med["ddp"], "ratio")
        if rank0:
            print(f"{name:>9} {params:9d} {med['heatlike-blocking'] * 1e3:12.2f} "
                  f"{med['heatlike-nonblocking'] * 1e3:12.2f} {med['ddp'] * 1e3:9.2f} "
                  f"{med['heatlike-blocking'] / med['ddp']:9.2f} "
                  f"{med['heatlike-nonblocking'] / med['ddp']:9.2f}", flush=True)
    run_batchnorm(results, quick)
    run_sharded_state(results, quick)
