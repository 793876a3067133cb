"""``python -m heatlike.bench daso``: DASO against blocking DataParallel on emulated nodes.

Trains the digits MLP (heatlike.recipes), widened to two hidden layers of 512 (about 300K
parameters, so that bandwidth matters), with DASO (warmup 1, cooldown 1) and with blocking
DataParallel, same data order and initial weights, and prints per epoch the bytes each rank sent
over cross-node links (mean over ranks) and the wall time, then the final test accuracies.
Bytes over cross-node links: DASO's cross-node all-reduces and its warmup's gradient
all-reduces (which span the nodes); every byte of the data-parallel all-reduce, likewise. Run
at 4 ranks: without a multi-node launch the suite emulates two nodes (HEATLIKE_RANKS_PER_NODE,
set only while the suite runs). 12 epochs (3 with
``--quick``, a smoke run: warmup, one cycling epoch, cooldown). Target: DASO sends <= 25% of
DataParallel's cross-node bytes over >= 10 epochs with accuracy within 1 point.

``--slow-link LATENCY_US:BANDWIDTH_MBPS`` adds a simulated slower link (heatlike.engine.links) to
the cross-node traffic of both (DataParallel's all-reduces count as cross-node), to show the
wall-time effect; the output says when it is on. Measured links are ``python -m heatlike.bench
cluster``'s (a virtual cluster, interface counters); the simulation remains for machines where
that cannot run (no root) and for a per-message latency, which the cluster's rate-limited links
do not add.
"""

from __future__ import annotations

import os
import time

import torch
from mpi4py import MPI
from torch import nn

from ..core.communication import MPI_WORLD
from ..core.env import env_str
from ..engine.links import SimulatedLink, SlowLinkAllReduce
from ..nn import DataParallel, DataParallelMultiGPU
from ..optim import DASO, DataParallelOptimizer
from ..recipes import evaluate, load_digits_split, mlp
from ..utils.data import DataLoader, Dataset
from ..utils.launch import configure_threads
from ._common import Results, describe_environment, say


def parse_link(spec: str | None) -> SimulatedLink | None:
    """``"200:100"`` -> 200 us latency, 100 MB/s."""
    if not spec:
        return None
    try:
        latency_us, mbps = (float(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"--slow-link takes LATENCY_US:BANDWIDTH_MBPS, got {spec!r}") from None
    return SimulatedLink(latency_us * 1e-6, mbps * 1e6)


def _run(kind: str, epochs: int, link: SimulatedLink | None, data) -> tuple:
    """Train with ``kind`` ('daso' or 'dp'); returns (bytes per epoch, seconds per epoch,
    accuracy)."""
    comm = MPI_WORLD
    x_train, y_train, x_test, y_test = data
    net = mlp([64, 512, 512, 10], 0)
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if kind == "daso":
        opt = DASO(sgd, total_epochs=epochs, comm=comm, warmup_epochs=1, cooldown_epochs=1)
        opt.link = link
        model = DataParallelMultiGPU(net, opt)
        if link is not None and model.global_sync is not None:  # the warmup's all-reduces
            model.global_sync.set_reducer(SlowLinkAllReduce(link, comm))
        sent = lambda: opt.bytes_cross + opt.bytes_warmup  # noqa: E731
    else:
        opt = DataParallelOptimizer(sgd, blocking=True)
        reducer = SlowLinkAllReduce(link, comm) if link is not None else None
        model = DataParallel(net, comm, optimizer=opt)
        if reducer is not None:
            model.grad_sync.set_reducer(reducer)
        sent = lambda: model.grad_sync.bytes_sent  # noqa: E731
    loader = DataLoader(Dataset(x_train, y_train), batch_size=16, seed=0)
    if kind == "daso":
        opt.last_batch = len(loader)
    loss_fn = nn.CrossEntropyLoss()
    per_epoch_bytes, per_epoch_time = [], []
    for _ in range(epochs):
        model.train()
        before = sent()
        comm.Barrier()
        start = time.perf_counter()
        total = 0.0
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
        elapsed = comm.handle.allreduce(time.perf_counter() - start, op=MPI.MAX)
        per_epoch_time.append(elapsed)
        per_epoch_bytes.append(comm.handle.allreduce(sent() - before, op=MPI.SUM) / comm.size)
        if kind == "daso":
            opt.epoch_loss_logic(total / len(loader))
    model.eval()
    return per_epoch_bytes, per_epoch_time, evaluate(model, x_test, y_test, comm)


def run(results: Results, quick: bool = False, slow_link: str | None = None) -> None:
    """Run the suite; nodes are emulated only while it runs (the environment is restored)."""
    emulate = env_str("HEATLIKE_RANKS_PER_NODE") is None and env_str("HEATLIKE_NODE_IDS") is None
    if emulate:
        os.environ["HEATLIKE_RANKS_PER_NODE"] = str(max(1, -(-MPI.COMM_WORLD.Get_size() // 2)))
    try:
        _suite(results, quick, slow_link)
    finally:
        if emulate:
            del os.environ["HEATLIKE_RANKS_PER_NODE"]


def _suite(results: Results, quick: bool, slow_link: str | None) -> None:
    comm = MPI.COMM_WORLD
    configure_threads(comm)
    link = parse_link(slow_link)
    epochs = 3 if quick else 12
    data = load_digits_split(0)
    daso = _run("daso", epochs, link, data)
    dp = _run("dp", epochs, link, data)
    case = "digits" + (" slow link" if link else "")
    say(f"# daso: digits MLP 64-512-512-10, {epochs} epochs, batch 16 per rank, "
        f"{describe_environment(comm)}")
    say(f"# simulated cross-node link: {link}" if link else
        "# simulated cross-node link: off (cross-node traffic at shared-memory speed)")
    say(f"{'epoch':>5} {'DASO KB':>9} {'DP KB':>9} {'DASO s':>8} {'DP s':>8}")
    for e in range(epochs):
        say(f"{e + 1:5d} {daso[0][e] / 1e3:9.1f} {dp[0][e] / 1e3:9.1f} "
            f"{daso[1][e]:8.3f} {dp[1][e]:8.3f}")
        for k, v in (("daso", daso), ("dp", dp)):
            results.add("daso", case, f"{k} epoch cross-node bytes per rank", v[0][e], "bytes",
                        epoch=e + 1)
            results.add("daso", case, f"{k} epoch time", v[1][e], "s", epoch=e + 1)
    total = {k: (sum(v[0]), sum(v[1]), v[2]) for k, v in (("daso", daso), ("dp", dp))}
    # one rank sends nothing across nodes: no ratio
    ratio = total["daso"][0] / total["dp"][0] if total["dp"][0] else float("nan")
    for k in ("daso", "dp"):
        results.add("daso", case, f"{k} cross-node bytes per rank", total[k][0], "bytes")
        results.add("daso", case, f"{k} wall time", total[k][1], "s")
        results.add("daso", case, f"{k} accuracy", total[k][2], "fraction")
    results.add("daso", case, "daso/dp cross-node bytes", ratio, "ratio")
    say(f"total: DASO {total['daso'][0] / 1e6:.2f} MB, DP {total['dp'][0] / 1e6:.2f} MB "
        f"per rank (ratio {ratio:.3f}); wall DASO {total['daso'][1]:.2f} s, DP "
        f"{total['dp'][1]:.2f} s; test accuracy DASO {total['daso'][2]:.4f}, DP "
        f"{total['dp'][2]:.4f}")
