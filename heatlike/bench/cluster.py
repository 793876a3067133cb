"""``python -m heatlike.bench cluster``: the algorithms on two nodes whose traffic crosses real,
rate-limited links.

Run as one process, as root, *not* under ``mpiexec``: the suite brings up a virtual cluster of two
nodes with two ranks each (:mod:`heatlike.testing.cluster`; docs/multinode.md) and, for every link
rate (``--rates``, default 1 and 10 Gbit/s), model and algorithm, launches one 4-rank job that
trains on scikit-learn's digits for ``--epochs`` epochs (6; 2 with ``--quick``), batch 32 per rank,
learning rate 0.05 (the residual MLP: 0.02, :data:`DEEP_LR`; SGD with momentum 0.9 and the rate
scaled per algorithm as :data:`heatlike.recipes.ALGORITHMS` says),
the same initial weights and data order in every job. The models: ``mlp``, 64-2048-2048-10 (4.35M
parameters, where the links dominate) and ``cnn``, two 3x3 convolutions and two linear layers
(151K parameters, where computation does); on request (``--models deep``) ``deep``, a residual
MLP of fourteen linear layers (64-640, twelve residual 640-640 blocks, 640-10: 4.97M parameters
in 1.6 MB matrices whose gradients arrive over the whole backward pass; with small buckets,
``HEATLIKE_BUCKET_CAP_MB=2``, it shows what overlapping communication with backward can win);
``--models transformer``: two transformer encoder blocks over a digit's eight rows as tokens
(895K parameters in 29 tensors: attention, LayerNorm; compute-bound on these cores).

Per job it reports

* **step**: the median time of a training step, slowest rank;
* **link MB**: the bytes both nodes sent each other during the job, read from their interfaces'
  counters (not estimated), and the part of it per step; a job whose nodes exchanged fewer than
  16 KiB is an error (its transport did not use the links, so its times say nothing);
* **accuracy**: the test accuracy after the last epoch;
* **time to accuracy**: the training time (evaluations excluded) until the test accuracy first
  reached blocking DataParallel's final accuracy less one point, and its ratio to blocking
  DataParallel's own time to it ("never" when not reached within the epochs).

* **model**: the cost model's step time (:mod:`heatlike.bench.costmodel`) fitted to these nodes:
  the job's step without the network (the same algorithm with every rank on its own
  communicator, all ranks at once, every step starting together and ending with the slowest:
  compute, codec and the engine's own work) plus the modelled communication on the links
  measured before the jobs of each rate (``--job links``, :func:`measure_cluster_links`:
  alpha and beta inside a node; between the nodes alpha, and beta of a node's link with all
  its ranks sending the sums' chunks at once; the engine's overhead per collective), and
  ``step / model``. Where the ranks share the cores
  (:func:`heatlike.bench._common.cores_per_rank` below 1, as on this machine) the model does
  not overlap the phases of a pipelined sum. For DASO, whose steps differ (blocking, send,
  merge, local only), the modelled communication is the median over the steps its schedule
  ran (recorded from DASO's trace: :func:`daso_schedule`,
  :func:`heatlike.bench.costmodel.daso_step_times`). The same inputs give the projection to
  8 ... 4096 ranks printed after the table (DASO: its cycling phase).

Figures (``--plot DIR``): ``cluster_time_to_accuracy.png``, ``cluster_step_time.png`` and
``cluster_link_bytes.png``: per algorithm one bar per link rate, one panel per model.

The bytes include MPICH's start-up (about 35 KB) and the evaluations' all-reduces (a few KB).
Everything runs on this machine's cores: computation is as slow as 4 ranks on them make it,
only the links are a cluster's. Under ``srun`` or ``mpiexec`` on a real cluster (world size > 1)
the suite trains the same jobs in the running job instead and reports the payload bytes the
engine counted, since it cannot read the links' counters there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["ALGORITHMS", "MODELS", "run", "run_job"]

#: the algorithms compared (keys of heatlike.recipes.ALGORITHMS)
ALGORITHMS = ["allreduce", "allreduce-nonblocking", "bf16", "hierarchical", "daso", "powersgd-2",
              "topk-1%", "decentralized"]
QUICK_ALGORITHMS = ["allreduce", "bf16", "hierarchical", "daso", "powersgd-2"]
MODELS = ["mlp", "cnn"]
#: every model a job can train (``deep`` only when asked for)
ALL_MODELS = [*MODELS, "deep", "transformer"]
RANKS_PER_NODE = (2, 2)
BATCH_SIZE = 32
#: the residual MLP's learning rate: at the other models' 0.05 (momentum 0.9) its fourteen
#: layers without normalization diverge to chance accuracy after 5-7 epochs, in one process
#: with the combined batch too; at 0.02 it reaches 0.96 in 12 epochs with either seed tried
DEEP_LR = 0.02


def _cnn(seed: int = 0):
    """Two 3x3 convolutions (32 and 64 channels) and two linear layers on the 8x8 digits (151K
    parameters); the input is the flat 64-vector of :func:`heatlike.recipes.load_digits_split`."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))


def _deep(seed: int = 0):
    """The residual MLP of ``--models deep`` (module docstring): block i computes
    ``x + relu(W_i x + b_i)``, which trains where fourteen plain ReLU layers would not."""
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.linear(x))

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 640), nn.ReLU(), *[Residual(640) for _ in range(12)],
                         nn.Linear(640, 10))


def _transformer(seed: int = 0):
    """The digits as 8 tokens (image rows) of 8 pixels: a linear embedding to width 192 plus a
    learned position embedding, two post-norm ``nn.TransformerEncoderLayer`` blocks (4 heads,
    feed-forward 768, no dropout), the tokens' mean and a linear classifier (895K parameters in
    29 tensors, LayerNorms and attention included)."""
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self, width: int = 192) -> None:
            super().__init__()
            self.embed = nn.Linear(8, width)
            self.position = nn.Parameter(torch.zeros(8, width))
            layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=4 * width, dropout=0.0,
                                               batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = self.embed(x.view(-1, 8, 8)) + self.position
            return self.head(self.blocks(tokens).mean(dim=1))

    torch.manual_seed(seed)
    return Encoder()


def _task(model: str):
    from ..recipes import Task, load_digits_split

    data = load_digits_split(0)
    if model == "mlp":
        return Task("digits-mlp-4.35M", data, [64, 2048, 2048, 10], batch_size=BATCH_SIZE)
    if model == "deep":
        return Task("digits-residual-mlp-4.97M", data, [64, 10], batch_size=BATCH_SIZE,
                    lr=DEEP_LR, model=_deep)
    if model == "transformer":
        return Task("digits-transformer-895K", data, [64, 10], batch_size=BATCH_SIZE,
                    model=_transformer)
    return Task("digits-cnn", data, [64, 10], batch_size=BATCH_SIZE, model=_cnn)


def run_job(algorithm: str, model: str, epochs: int) -> dict:
    """Collective over MPI_COMM_WORLD: train ``model`` with ``algorithm`` (module docstring);
    returns (on every rank) the median step time of the slowest rank, the accuracy after every
    epoch with the training time so far, and the payload bytes per step this engine counted."""
    from mpi4py import MPI

    from ..core.communication import MPICommunication
    from ..core.topology import get_topology
    from ..engine.exchange import CODEC_CLOCK
    from ..recipes import train_task
    from ..utils import configure_threads
    from ._common import cores_per_rank

    configure_threads()
    comm = MPICommunication(MPI.COMM_WORLD)
    task = _task(model)
    codec_before = CODEC_CLOCK.seconds
    daso = []
    result = train_task(algorithm, comm, task, epochs=epochs, seed=0, curve=True,
                        on_runner=lambda runner: _trace_daso(runner, daso))
    codec = (CODEC_CLOCK.seconds - codec_before) / max(1, len(result.step_times))
    skip = min(3, len(result.step_times) - 1)
    steps = result.step_times[skip:]  # the first build buckets
    step = comm.handle.allreduce(statistics.median(steps), op=MPI.MAX)
    net = task.build(0)
    parameters = sum(p.numel() for p in net.parameters())
    topo = get_topology(comm)
    return {"algorithm": algorithm, "model": model, "parameters": parameters,
            "shapes": [list(p.shape) for p in net.parameters()],
            "layout": [comm.size, max(topo.local_sizes)],
            "overlap": cores_per_rank(comm.handle) >= 1,
            "steps": len(result.step_times), "step_s": step, "accuracy": result.accuracy,
            "payload_bytes_per_step": comm.handle.allreduce(result.bytes_per_step),
            "codec_s": comm.handle.allreduce(codec, op=MPI.MAX),
            "compute_s": _compute_time(net, task.batch_size, comm.handle),
            "alone_s": _step_alone(algorithm, task, comm.handle),
            "curve": [[p.epoch, p.seconds, p.accuracy] for p in result.curve],
            **({"daso_schedule": daso_schedule(daso[0], len(result.step_times), skip)}
               if daso else {})}


def _trace_daso(runner, keep: list) -> None:
    """Record the schedule of a DASO run (its ``trace``), for the cost model."""
    from ..optim import DASO

    if isinstance(runner.optimizer, DASO):
        runner.optimizer.trace = []
        keep.append(runner.optimizer)


def daso_schedule(daso, steps: int, skip: int = 0) -> dict[str, int]:
    """Steps ``skip .. steps - 1`` of a DASO run by what they did, from its ``trace``, keyed as
    :func:`heatlike.bench.costmodel.daso_step_times` reads them: ``"gradients"``,
    ``"local"``, ``"send"``,
    ``"merge"`` (blocking) or ``"merge@k"`` (sent k steps before), joined by ``+``."""
    did: dict[tuple[int, int], list[str]] = {}
    in_flight: dict[int, int] = {}  # group -> batches between its send and its merge
    for epoch, batch, event, *rest in daso.trace:
        tokens = did.setdefault((epoch, batch), [])
        if event == "send":
            group, btw = rest
            tokens.append("send")
            if btw:
                in_flight[group] = btw
        elif event == "blocking":
            tokens.append("merge")
        elif event == "merge":
            tokens.append(f"merge@{in_flight.pop(rest[0])}")
        else:
            tokens.insert(0, event)  # "local" first
    counts: dict[str, int] = {}
    for step in range(skip, steps):
        key = "+".join(did.get(divmod(step, daso.last_batch), []))
        counts[key] = counts.get(key, 0) + 1
    return counts


def _step_alone(algorithm: str, task, comm, steps: int = 12) -> float:
    """Collective over the mpi4py communicator ``comm``: the job's own training step without
    the network: ``algorithm`` with every rank alone (its communicator ``MPI_COMM_SELF``, where
    the engine still packs, encodes, decodes and unpacks the buckets, but sends nothing: a
    lossless sum is not passed through, as it is for a one-rank job), all
    ranks at once (:func:`heatlike.bench.costmodel.synchronous_step_time`), in the second of
    three epochs (DASO's cycling phase), after the compressing presets' exact warm-up steps in
    the first: the computation, the codec and the engine's own work (DASO's copies of the
    parameters, say) on cores the ranks share."""
    import torch
    from mpi4py import MPI

    from ..core.communication import MPICommunication
    from ..engine import gradsync
    from ..recipes import COMPRESSION_WARMUP, make_runner
    from .costmodel import synchronous_step_time

    gradsync.ONE_RANK_PASSTHROUGH = False  # the packing and hooks a job of several ranks runs
    try:
        runner = make_runner(algorithm, task.build(0), MPICommunication(MPI.COMM_SELF), task.lr,
                             3)
    finally:
        gradsync.ONE_RANK_PASSTHROUGH = True
    g = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(task.batch_size, 64, generator=g)
    y = torch.randint(0, 10, (task.batch_size,), generator=g)
    warmup = COMPRESSION_WARMUP + 2
    runner.start_epoch(warmup)
    for _ in range(warmup):
        runner.train_step(x, y)
    runner.end_epoch(1.0)
    runner.start_epoch(steps)
    seconds = synchronous_step_time(lambda: runner.train_step(x, y), steps, comm)
    runner.finish()
    runner.close()
    return seconds


def _compute_time(net, batch: int, comm, steps: int = 12) -> float:
    """:func:`heatlike.bench.costmodel.local_step_time` of ``net`` on ``batch`` random
    digits-shaped samples."""
    import torch

    from .costmodel import local_step_time

    g = torch.Generator().manual_seed(comm.Get_rank())
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return local_step_time(net, x, y, steps, comm)


def measure_cluster_links(rate_bytes_per_s: float | None = None) -> dict:
    """Collective: the cost model's links on these nodes. Node-local: alpha and beta of the ring
    ``Sendrecv`` inside a node (:func:`heatlike.bench.comm.measure_links`). Cross-node: alpha
    of that ``Sendrecv`` between the nodes' first ranks, and beta of a node's link as the sums
    load it: every rank exchanges messages of the node-aware sum's chunk
    (:func:`~heatlike.engine.reducers.node_aware_chunk_bytes`) with its counterpart on the other
    node(s) at once, and the node's egress carries its ranks' bytes together
    (``beta = time / (ranks per node x bytes)``; on a token-bucket link two 16 MiB flows at once
    overrun its queue and get about 70% of the rate that 1 MiB chunks get). And the engine's
    overhead per collective: the time of the engine's all-reduce of 4 KiB over all ranks (one
    collective, issued and tested as a gradient bucket's is) less the library all-reduce the
    model gives it. Recorded beside them: the link's configured rate (``rate_bytes_per_s``,
    where known) and one 16 MiB flow's bandwidth."""
    from mpi4py import MPI

    from ..core.communication import MPI_WORLD
    from ..core.topology import Topology
    from ..engine.reducers import node_aware_chunk_bytes
    from .comm import _ring_shift_time, measure_links

    found = measure_links(quick=False)
    local, cross = found.get("local"), found.get("cross")
    out = {}
    if local is not None:
        out["local"] = {"alpha": local.alpha, "beta": local.beta}
    if cross is None:
        return out
    topo = Topology(MPI_WORLD)
    chunk = node_aware_chunk_bytes()
    try:
        concurrent = _ring_shift_time(topo.cross_comm.handle, chunk, 8, 5, MPI.COMM_WORLD)
        per_node = max(topo.local_sizes)
    finally:
        topo.free()
    out["cross"] = {"alpha": cross.alpha, "beta": concurrent / (per_node * chunk),
                    "one_flow_bandwidth": cross.bandwidth, "rate": rate_bytes_per_s}
    out["overhead"] = _engine_overhead(_links_of({"links": out}))
    return out


def _engine_overhead(links) -> float:
    """Collective: seconds the engine's all-reduce of 4 KiB over all ranks (an exchange of one
    bucket) takes beyond the library all-reduce the cost model gives it on ``links`` (the
    median of 30, slowest rank; at least 0)."""
    import torch
    from mpi4py import MPI

    from ..core.communication import MPI_WORLD
    from ..core.topology import get_topology
    from ..engine.codecs import Identity
    from ..engine.exchange import Context, Lane
    from ..engine.reducers import AllReduce
    from ._common import timed_rounds
    from .costmodel import Layout, library_allreduce

    values = torch.ones(1024)
    lane = Lane(Identity(), AllReduce(MPI_WORLD))
    ctx = Context(key="overhead", shapes=[values.shape], size=MPI_WORLD.size,
                  rank=MPI_WORLD.rank)
    seconds = timed_rounds({"engine": lambda: lane.start(values, ctx).wait()}, 1, 30,
                           MPI.COMM_WORLD)["engine"]
    lane.close()
    layout = Layout(MPI_WORLD.size, max(get_topology(MPI_WORLD).local_sizes))
    return max(0.0, seconds - library_allreduce(values.numel() * 4, layout, links))


# ---------------------------------------------------------------------------- the driver


def run(argv: list[str] | None = None) -> int:
    """``python -m heatlike.bench cluster [options]`` (module docstring); returns the exit
    status."""
    opts = _parser().parse_args(argv)
    if opts.job:
        return job_main(opts.job[0], opts.job[1], int(opts.job[2]), opts.out)
    algorithms = _choose(opts.algorithms, QUICK_ALGORITHMS if opts.quick else ALGORITHMS)
    models = _choose(opts.models, MODELS, what="model")
    rates = _rates(opts.rates)
    epochs = opts.epochs or (2 if opts.quick else 6)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        rows = _in_this_job(algorithms, models, epochs)
    else:
        rows = _on_a_virtual_cluster(algorithms, models, rates, epochs, opts)
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    rows = with_model(_with_time_to_accuracy(rows))
    print(_table(rows), flush=True)
    print("\n".join(projection(rows)), flush=True)
    if opts.json:
        _write_json(rows, opts.json)
        print(f"# wrote {opts.json}", flush=True)
    if opts.plot:
        from .plot import plot_cluster

        for path in plot_cluster(rows, opts.plot):
            print(f"# wrote {path}", flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m heatlike.bench cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="2 epochs, 5 algorithms (one per pattern)")
    p.add_argument("--rates", default="1gbit,10gbit",
                   help="link rates, comma-separated (default 1gbit,10gbit)")
    p.add_argument("--algorithms", metavar="A,B,...",
                   help="algorithms (default: " + ",".join(ALGORITHMS).replace("%", "%%") + ")")
    p.add_argument("--models", metavar="M,...",
                   help="mlp, cnn, deep, transformer (default: mlp,cnn)")
    p.add_argument("--epochs", type=int, default=0, help="epochs per job (default 6)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds one job may take (default 1200)")
    p.add_argument("--mpiexec", help="MPICH's Hydra mpiexec to launch with (default: the one "
                                     "next to this Python, else PATH's)")
    p.add_argument("--json", metavar="PATH", help="write one JSON object per job")
    p.add_argument("--plot", metavar="DIR", help="write the figures to DIR")
    p.add_argument("--job", nargs=3, metavar=("ALGORITHM", "MODEL", "EPOCHS"),
                   help=argparse.SUPPRESS)  # one job, launched by the driver on the nodes
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def _rates(spec: str) -> list[str]:
    """The link rates of ``--rates``, each checked before anything runs (a bad one after hours
    of measurements would lose them)."""
    from ..testing.cluster import parse_rate

    rates = [r.strip() for r in spec.split(",") if r.strip()]
    if not rates:
        raise SystemExit(f"bench cluster: --rates {spec!r} names no link rate (e.g. 1gbit,10gbit)")
    for rate in rates:
        try:
            parse_rate(rate)
        except ValueError as bad:
            raise SystemExit(f"bench cluster: --rates: {bad}") from None
    return rates


def _choose(spec: str | None, default: list[str], what: str = "algorithm") -> list[str]:
    from ..recipes import ALGORITHMS as KNOWN

    if not spec:
        return list(default)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = KNOWN if what == "algorithm" else ALL_MODELS
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"bench cluster: unknown {what}(s) {unknown}; choose from "
                         f"{sorted(known)}")
    return names


def _on_a_virtual_cluster(algorithms, models, rates, epochs, opts) -> list[dict]:
    from ..testing.cluster import ClusterError, VirtualCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench cluster: the virtual cluster cannot start here: {reason}")
    rows = []
    cluster = VirtualCluster(list(RANKS_PER_NODE), rates[0], name=f"hlb{os.getpid() % 100000}",
                             mpiexec=opts.mpiexec)
    try:
        cluster.up(temporary=True)
        with tempfile.TemporaryDirectory(prefix="heatlike-bench-cluster-") as tmp:
            for rate in rates:
                cluster.set_rate(rate)
                links = _launch_links(cluster, rate, Path(tmp) / f"{rate}-links.json",
                                      opts.timeout)
                for model in models:
                    for algorithm in algorithms:
                        out = Path(tmp) / f"{rate}-{model}-{algorithm}.json"
                        rows.append(_launch(cluster, algorithm, model, epochs, rate, out,
                                            opts.timeout))
                        r = rows[-1]
                        r["links"] = links
                        print(f"# {rate} {model} {algorithm}: step {r['step_s'] * 1e3:.1f} ms, "
                              f"{r['link_bytes'] / 1e6:.1f} MB between the nodes, accuracy "
                              f"{r['accuracy']:.4f}", flush=True)
    except ClusterError as error:
        raise SystemExit(f"bench cluster: {error}") from error
    finally:
        cluster.down()
    return rows


def _launch_links(cluster, rate: str, out: Path, timeout: float) -> dict:
    from ..testing.cluster import parse_rate

    return _launch(cluster, "links", str(parse_rate(rate)), 0, rate, out, timeout)


def _launch(cluster, algorithm: str, model: str, epochs: int, rate: str, out: Path,
            timeout: float) -> dict:
    cmd = [sys.executable, "-m", "heatlike.bench", "cluster", "--job", algorithm, model,
           str(epochs), "--out", str(out)]
    log = out.with_suffix(".log")
    with open(log, "w") as output:  # a file, not a pipe: nobody reads while the job runs
        result = cluster.run(cmd, list(RANKS_PER_NODE), timeout=timeout, require_traffic=True,
                             stdout=output, stderr=subprocess.STDOUT)
    if result.returncode != 0 or not out.exists():
        status = "ran past --timeout" if result.returncode is None else \
            f"exit status {result.returncode}"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"bench cluster: the job {algorithm} / {model} at {rate} failed "
                         f"({status}):\n{result.report()}\n{tail}")
    row = json.loads(out.read_text())
    if algorithm == "links":
        return row
    row.update(rate=rate, nodes="+".join(map(str, RANKS_PER_NODE)), seconds=result.seconds,
               link_bytes=result.between_nodes, sent=result.sent, counted="link counters")
    return row


def _in_this_job(algorithms, models, epochs) -> list[dict]:
    """Under srun / mpiexec on a real cluster: the same jobs in the running job."""
    from mpi4py import MPI

    from ._common import detect_layout, topology_label

    detect_layout(MPI.COMM_WORLD)
    links = measure_cluster_links(None)
    rows = []
    for model in models:
        for algorithm in algorithms:
            row = run_job(algorithm, model, epochs)
            row.update(rate="as launched", nodes=topology_label(), counted="engine payload",
                       link_bytes=row["payload_bytes_per_step"] * row["steps"], links=links)
            rows.append(row)
    return rows


def job_main(algorithm: str, model: str, epochs: int, out: str) -> int:
    """The job the driver launches on the nodes: rank 0 writes :func:`run_job`'s result (or,
    for the algorithm ``links`` and a rate in bytes per second as its model,
    :func:`measure_cluster_links`')."""
    from mpi4py import MPI

    if algorithm == "links":
        row = measure_cluster_links(float(model) or None)
    else:
        row = run_job(algorithm, model, epochs)
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(out).write_text(json.dumps(row))
    return 0


# ---------------------------------------------------------------------------- the report


def time_to(curve: list, target: float) -> float | None:
    """Training seconds until the accuracy first reached ``target`` (None: never)."""
    return next((seconds for _, seconds, accuracy in curve if accuracy >= target), None)


def _with_time_to_accuracy(rows: list[dict]) -> list[dict]:
    """Add each row's time to blocking DataParallel's final accuracy less one point (same rate
    and model) and its ratio to DataParallel's own time to it."""
    for row in rows:
        base = next((r for r in rows if r["algorithm"] == "allreduce" and
                     r["rate"] == row["rate"] and r["model"] == row["model"]), None)
        row["target"] = row["tta_s"] = row["tta_ratio"] = None
        if base is None:
            continue
        row["target"] = base["accuracy"] - 0.01
        row["tta_s"] = time_to(row["curve"], row["target"])
        reference = time_to(base["curve"], row["target"])
        if row["tta_s"] is not None and reference:
            row["tta_ratio"] = row["tta_s"] / reference
    return rows


def with_model(rows: list[dict]) -> list[dict]:
    """Add the cost model's step time (:mod:`heatlike.bench.costmodel`) to every row that has
    links: the job's measured compute and codec time per step plus the modelled communication
    on the measured links, at the job's layout (``layout``: ranks, ranks per node; the
    cluster's 2 x 2 for rows without one); and the ratio measured / model."""
    from .costmodel import Layout, Shapes, comm_time, daso_step_times

    for row in rows:
        row["model_s"] = row["model_ratio"] = None
        if not _modelled(row):
            continue
        layout = Layout(*row.get("layout", (sum(RANKS_PER_NODE), max(RANKS_PER_NODE))),
                        overlap=row.get("overlap", True))
        shapes, links = Shapes.of(row["shapes"]), _links_of(row)
        if row.get("daso_schedule"):  # the median step of the run's own schedule
            comm = statistics.median(daso_step_times(shapes, layout, links,
                                                     row["daso_schedule"], row["compute_s"]))
        else:
            comm = comm_time(row["algorithm"], shapes, layout, links)
        row["model_s"] = _local_part(row) + comm
        row["model_ratio"] = row["step_s"] / row["model_s"]
    return rows


def projection(rows: list[dict], ranks_per_node: int = 4) -> list[str]:
    """Lines: the predicted step time (ms) of every algorithm at 8 to 4096 ranks, per model and
    link rate, from the links and compute times measured here."""
    from .costmodel import RANKS, Layout, Shapes, comm_time

    lines = []
    for (rate, model) in dict.fromkeys((r["rate"], r["model"]) for r in rows):
        group = [r for r in rows if (r["rate"], r["model"]) == (rate, model) and _modelled(r)]
        if not group:
            continue
        chosen = _links_of(group[0])
        lines.append(f"# cost model at {rate}, {model}, {ranks_per_node} ranks per node: "
                     "predicted step ms")
        lines.append(f"{'algorithm':>22} " + " ".join(f"{p:>7d}" for p in RANKS))
        for r in group:
            shapes, base = Shapes.of(r["shapes"]), _local_part(r)
            steps = [base + comm_time(r["algorithm"], shapes,
                                      Layout(p, ranks_per_node, r.get("overlap", True)), chosen)
                     for p in RANKS]
            lines.append(f"{r['algorithm']:>22} " + " ".join(f"{t * 1e3:7.1f}" for t in steps))
    return lines


def _local_part(row: dict) -> float:
    """What the model adds to the communication: the algorithm's step alone (``alone_s``:
    compute, codec and the engine's own work, measured together), else the compute and the
    codec time measured apart."""
    alone = row.get("alone_s")
    return alone if alone is not None else row["compute_s"] + row["codec_s"]


def _modelled(row: dict) -> bool:
    from .costmodel import MODELS as MODELLED

    return "cross" in (row.get("links") or {}) and row["algorithm"] in MODELLED \
        and "compute_s" in row


def _links_of(row: dict):
    """The cost model's :class:`~heatlike.bench.costmodel.Links` from a row's measured links."""
    from .costmodel import Link, Links

    links = row["links"]
    local = links.get("local", links["cross"])
    return Links(Link(local["alpha"], local["beta"]),
                 Link(links["cross"]["alpha"], links["cross"]["beta"]),
                 links.get("overhead", 0.0))


def _table(rows: list[dict]) -> str:
    lines = ["| rate | model | algorithm | step ms | step / DP | link MB | MB / step | "
             "accuracy | time to DP's accuracy (s) | / DP | model ms | step / model |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = next((r for r in rows if r["algorithm"] == "allreduce" and
                     r["rate"] == row["rate"] and r["model"] == row["model"]), None)
        ratio = f"{row['step_s'] / base['step_s']:.2f}" if base else "-"
        tta = "never" if row.get("target") is not None and row["tta_s"] is None else \
            (f"{row['tta_s']:.2f}" if row.get("tta_s") is not None else "-")
        tta_ratio = f"{row['tta_ratio']:.2f}" if row.get("tta_ratio") is not None else "-"
        model = f"{row['model_s'] * 1e3:.1f}" if row.get("model_s") else "-"
        fit = f"{row['model_ratio']:.2f}" if row.get("model_ratio") else "-"
        lines.append(f"| {row['rate']} | {row['model']} | {row['algorithm']} | "
                     f"{row['step_s'] * 1e3:.1f} | {ratio} | {row['link_bytes'] / 1e6:.1f} | "
                     f"{row['link_bytes'] / 1e6 / max(1, row['steps']):.3f} | "
                     f"{row['accuracy']:.4f} | {tta} | {tta_ratio} | {model} | {fit} |")
    counted = {row["counted"] for row in rows}
    lines.append(f"\nbytes: {', '.join(sorted(counted))}; {rows[0]['nodes'] if rows else ''} "
                 f"ranks per node; {time.strftime('%Y-%m-%d %H:%M')}")
    return "\n".join(lines)


def _write_json(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
