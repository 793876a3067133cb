"""``python -m heatlike.bench mlbench``: each mlbench-core port against the original, side by side.

Needs mlbench-core 3.0.0 importable (``pip install --no-deps mlbench-core==3.0.0``; its package
``__init__`` imports its cloud and CLI dependencies, which the optimizers never use, so the suite
imports the optimizer modules without it). The originals communicate through torch.distributed,
started here on gloo over loopback; heatlike's ports through MPI.

Every case trains the same model on the same batches, with the same hyper-parameters, through
mlbench's class and through heatlike's port: a step is zero_grad, forward, loss, backward, step
(and, for SparsifiedSGD, mlbench's call protocol around it). The two run in interleaved rounds;
the figure is the median step time of the slowest rank and the ratio heatlike / mlbench (target:
<= 0.8 at 2 and 4 ranks).

Models: an MLP 256-1024-768-10 (1.06M parameters, batch 32 per rank) for the centralized,
PowerSGD and decentralized optimizers; a linear model with a (1, 2^20) weight (batch 4 per rank,
as in sparse-feature logistic regression, where the optimizer's work dominates the step) for the
sparsified ones, which send 1000 coordinates per step (mlbench's sparsifiers index
``p.grad[0, ...]``, so they work on single-row parameters only).

How the originals are driven, where they cannot be used as written:

* ``CentralizedSGD`` / ``CentralizedAdam`` raise TypeError in their constructor
  (``super(CentralizedSGD).__init__(...)``): built as the class intends,
  ``GenericCentralizedOptimizer.__init__`` plus the torch optimizer.
* ``DecentralizedSGD`` refuses ``rank=0`` (``if not rank``): rank 0 passes an int equal to 0
  that is true.
* ``SparsifiedSGD`` does not communicate: its loop sparsifies each parameter (a block chosen from
  numpy's generator, seeded alike on every rank so the block is shared), all-reduces the block's
  values, writes their average into ``.grad`` and calls ``step()``, as heatlike's ``step()``
  does by itself.
* ``SignSGD`` (local sign steps in mlbench, a majority vote in heatlike) and ``FP16Optimizer``
  (CUDA-only loss scaling) have no comparable original here and are not run.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from .. import optim as hl
from ..recipes import mlp
from ..utils.launch import configure_threads
from ._common import Results, describe_environment, say
from .dp import init_gloo

MLP = [256, 1024, 768, 10]
LINEAR = 1 << 20
BATCH = 32
LINEAR_BATCH = 4  # sparse-feature logistic regression: the optimizer, not the data, dominates
LR = 0.01
SPARSE_K = 1000


def import_mlbench() -> types.ModuleType:
    """``mlbench_core.optim.pytorch`` without running ``mlbench_core/__init__.py`` (which imports
    kubernetes, google-cloud and the CLI). Raises ImportError when mlbench-core is not installed."""
    if "mlbench_core.optim.pytorch" in sys.modules:
        return sys.modules["mlbench_core.optim.pytorch"]
    spec = importlib.util.find_spec("mlbench_core")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlbench-core is not installed (pip install --no-deps "
                          "mlbench-core==3.0.0)")
    base = list(spec.submodule_search_locations)[0]
    for name in ("mlbench_core", "mlbench_core.utils", "mlbench_core.utils.pytorch"):
        if name not in sys.modules:  # a package object whose __init__ is not run
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(base, *name.split(".")[1:])]
            sys.modules[name] = package
    import mlbench_core.optim.pytorch as original

    return original


class Trainer(NamedTuple):
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]  # one training step


class _TrueZero(int):
    """0 that is true: mlbench's DecentralizedSGD checks ``if not rank``."""

    def __bool__(self) -> bool:
        return True


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp(MLP)


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(LINEAR, 1, bias=False)


def _mlbench_centralized(original, model: nn.Module, local: torch.optim.Optimizer):
    opt = original.CentralizedSGD.__new__(original.CentralizedSGD)
    original.GenericCentralizedOptimizer.__init__(opt, world_size=MPI.COMM_WORLD.Get_size(),
                                                  model=model)
    opt.optimizer = local
    return opt


def _ring(rank: int, size: int) -> list[int]:
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def _build(case: str, side: str, original) -> tuple[nn.Module, object]:
    """(model, optimizer) of one case through mlbench's class (side "mlbench") or heatlike's."""
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    ours = side == "heatlike"
    if case in ("CentralizedSGD", "CentralizedAdam", "PowerSGD", "DecentralizedSGD"):
        model = _mlp()
        if case == "CentralizedSGD":
            if ours:
                return model, hl.CentralizedSGD(size, model, lr=LR, momentum=0.9)
            return model, _mlbench_centralized(
                original, model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        if case == "CentralizedAdam":
            if ours:
                return model, hl.CentralizedAdam(size, model, lr=1e-3)
            return model, _mlbench_centralized(
                original, model, torch.optim.Adam(model.parameters(), lr=1e-3))
        if case == "PowerSGD":
            cls = hl.PowerSGD if ours else original.PowerSGD
            return model, cls(model=model, lr=LR, momentum=0.9, rank=2, reuse_query=True)
        neighbors = _ring(rank, size)
        if ours:
            return model, hl.DecentralizedSGD(rank, neighbors, model, lr=LR, momentum=0.9)
        return model, original.DecentralizedSGD(_TrueZero(0) if rank == 0 else rank, neighbors,
                                                model, lr=LR, momentum=0.9)
    model = _linear()
    if case == "SparsifiedSGD":
        cls = hl.SparsifiedSGD if ours else original.SparsifiedSGD
        return model, cls(model.parameters(), lr=LR, sparse_grad_size=SPARSE_K)
    random_sparse = case == "CentralizedSparsifiedSGD random"
    cls = hl.CentralizedSparsifiedSGD if ours else original.CentralizedSparsifiedSGD
    return model, cls(model.parameters(), lr=LR, sparse_grad_size=SPARSE_K,
                      random_sparse=random_sparse)


CASES = ("CentralizedSGD", "CentralizedAdam", "PowerSGD", "DecentralizedSGD",
         "CentralizedSparsifiedSGD block", "CentralizedSparsifiedSGD random", "SparsifiedSGD")


def _mlbench_sparsified_step(opt) -> None:
    """mlbench's SparsifiedSGD protocol: sparsify, all-reduce the shared block, step."""
    import torch.distributed as dist

    opt.random_sparse = False
    size = dist.get_world_size()
    for group in opt.param_groups:
        for p in group["params"]:
            block = opt.sparsify_gradients(p, group["lr"])
            values = block[0, 1:].contiguous()
            dist.all_reduce(values)
            start = int(block[0, 0])
            p.grad.zero_()
            p.grad[0, start:start + values.numel()] = values / size
    opt.step()


def trainer(case: str, side: str, original) -> Trainer:
    model, opt = _build(case, side, original)
    rank = MPI.COMM_WORLD.Get_rank()
    g = torch.Generator().manual_seed(1 + rank)
    if isinstance(model, nn.Linear):
        x = torch.randn(LINEAR_BATCH, LINEAR, generator=g)
        y = torch.randn(LINEAR_BATCH, 1, generator=g)
        loss_fn: nn.Module = nn.MSELoss()
    else:
        x = torch.randn(BATCH, MLP[0], generator=g)
        y = torch.randint(0, MLP[-1], (BATCH,), generator=g)
        loss_fn = nn.CrossEntropyLoss()
    protocol = side == "mlbench" and case == "SparsifiedSGD"

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if protocol:
            _mlbench_sparsified_step(opt)
        else:
            opt.step()

    return Trainer(model, opt, step)


def _step_times(fn: Callable[[], None], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run(results: Results, quick: bool = False) -> None:
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    try:
        original = import_mlbench()
    except ImportError as error:
        say(f"# mlbench: skipped: {error}")
        return
    threads = configure_threads(comm)
    init_gloo(comm)
    rounds, steps, warmup = (1, 3, 1) if quick else (5, 8, 2)
    say(f"# mlbench: each port against mlbench-core 3.0.0 (gloo), batch {BATCH} per rank "
        f"({LINEAR_BATCH} for the linear model), "
        f"{threads} torch thread(s) per rank, {describe_environment(comm)}")
    say(f"{'optimizer':>32} {'mlbench ms':>11} {'heatlike ms':>12} {'ratio':>7}")
    for case in CASES:
        if case == "DecentralizedSGD" and comm.Get_size() == 1:
            say(f"{case:>32} {'(needs neighbors: 2 or more ranks)':>32}")
            continue
        # mlbench draws its blocks and coordinates from numpy's global generator
        np.random.seed(0 if case == "SparsifiedSGD" else 1 + comm.Get_rank())  # noqa: NPY002
        trainers = {side: trainer(case, side, original) for side in ("mlbench", "heatlike")}
        samples: dict[str, list[float]] = {side: [] for side in trainers}
        for t in trainers.values():
            _step_times(t.step, warmup)
        for _ in range(rounds):
            for side, t in trainers.items():
                comm.Barrier()
                samples[side] += _step_times(t.step, steps)
        med = {side: comm.allreduce(statistics.median(s), op=MPI.MAX)
               for side, s in samples.items()}
        ratio = med["heatlike"] / med["mlbench"]
        for side in trainers:
            results.add("mlbench", case, f"{side} step time", med[side] * 1e3, "ms")
        results.add("mlbench", case, "heatlike/mlbench", ratio, "ratio")
        if rank0:
            say(f"{case:>32} {med['mlbench'] * 1e3:11.2f} {med['heatlike'] * 1e3:12.2f} "
                f"{ratio:7.2f}")
