"""The benchmark suite's user side: result records, the cost model, time to accuracy, the
tracker's Chrome trace, and the figures."""

import json
import math
import os

import pytest
import torch
from torch import nn

from heatlike import recipes
from heatlike.bench import costmodel as cm
from heatlike.bench._common import FIELDS, Record, Results, topology_label
from heatlike.bench.tta import TimeToAccuracy, measure, time_to_accuracy
from heatlike.core.topology import Topology
from heatlike.recipes import (
    ALGORITHMS,
    EpochPoint,
    Task,
    load_synthetic_split,
    make_runner,
    mlp,
)
from heatlike.utils import Tracker

# -- the cost model against the formulas, by hand ---------------------------------------------

LOCAL = cm.Link.from_us_gbps(2.0, 10.0)   # 2e-6 s, 1e-10 s/byte
CROSS = cm.Link.from_us_gbps(5.0, 1.0)    # 5e-6 s, 1e-9 s/byte
LINKS = cm.Links(LOCAL, CROSS)


def test_links_and_layout():
    assert LOCAL.alpha == pytest.approx(2e-6) and LOCAL.beta == pytest.approx(1e-10)
    assert LOCAL.bandwidth == pytest.approx(1e10)
    parsed = cm.parse_links("2:10,5:1")
    assert parsed.local == LOCAL and parsed.cross.alpha == pytest.approx(5e-6)
    assert parsed.cross.beta == pytest.approx(1e-9)
    assert cm.parse_links("3:4").cross == cm.parse_links("3:4").local
    for bad in ("", "1", "1:0", "a:b", "1:2,3:4,5:6", "-1:2"):
        with pytest.raises(ValueError):
            cm.parse_links(bad)
    lay = cm.Layout(10, 4)
    assert (lay.nodes, lay.local) == (3, 4)
    assert cm.Layout(3, 4).nodes == 1 and cm.Layout(3, 4).local == 3
    assert cm.Layout(8, 4).flat_link(LINKS) == CROSS
    assert cm.Layout(4, 4).flat_link(LINKS) == LOCAL


def test_primitives_by_hand(monkeypatch):
    monkeypatch.delenv("HEATLIKE_NODE_AWARE", raising=False)
    monkeypatch.delenv("HEATLIKE_NODE_AWARE_MIN_KB", raising=False)
    monkeypatch.delenv("HEATLIKE_NODE_AWARE_CHUNK_KB", raising=False)
    n = 8e6
    # ring all-reduce: 2 (p-1) (alpha + n/p beta)
    assert cm.ring_allreduce(n, 8, CROSS) == pytest.approx(2 * 7 * (5e-6 + 1e6 * 1e-9))
    assert cm.ring_allreduce(n, 1, CROSS) == 0.0
    # all-gather of k bytes: (p-1) (alpha + k beta)
    assert cm.allgather(1000, 16, LOCAL) == pytest.approx(15 * (2e-6 + 1000 * 1e-10))
    # reduce / bcast: reduce-scatter + gather, scatter + all-gather
    assert cm.reduce(n, 4, LOCAL) == pytest.approx(2 * 3 * (2e-6 + 2e6 * 1e-10))
    assert cm.bcast(n, 4, LOCAL) == cm.reduce(n, 4, LOCAL)
    # hierarchical on 4 nodes x 4 ranks: local reduce-scatter of n (3 steps of n/4) + the 4
    # shards all-reduced across the 4 nodes at once (a ring of n at the node's link) + local
    # all-gather of the n/4 shards; in one chunk the phases add up
    lay = cm.Layout(16, 4)
    expected = 2 * (3 * (2e-6 + 2e6 * 1e-10)) + 2 * 2 * 5e-6 + 2 * 3 / 4 * n * 1e-9
    assert cm.hierarchical_allreduce(n, lay, LINKS, chunk=n) == pytest.approx(expected)
    # in 8 chunks of 1e6 bytes (the default 1 MiB chunk): the slowest phase (across the nodes)
    # for 7 chunks, then the three phases of the last one
    inside = 3 * (2e-6 + 1e6 / 4 * 1e-10)
    across = 2 * 2 * 5e-6 + 2 * 3 / 4 * 1e6 * 1e-9
    assert cm.hierarchical_allreduce(n, lay, LINKS) == pytest.approx(
        7 * across + 2 * inside + across)
    # where the ranks take turns on the cores, every chunk pays its three phases in turn
    assert cm.hierarchical_allreduce(n, cm.Layout(16, 4, overlap=False), LINKS) == \
        pytest.approx(8 * (2 * inside + across))
    # the engine's overhead per collective: three per chunk of a node-aware sum, one for MPI's
    # all-reduce
    o = 1e-4
    costly = cm.Links(LOCAL, CROSS, overhead=o)
    assert cm.hierarchical_allreduce(n, lay, costly) == pytest.approx(
        7 * (across + o) + 2 * (inside + o) + across + o)
    assert cm.engine_allreduce(1e5, lay, costly) == pytest.approx(
        cm.library_allreduce(1e5, lay, LINKS) + o)
    # the engine's all-reduce: that from the node-aware threshold (8 MiB) on over full nodes;
    # the library's below it, on one node or partial nodes, and with HEATLIKE_NODE_AWARE=0
    big = 2 * n
    assert cm.engine_allreduce(big, lay, LINKS) == cm.hierarchical_allreduce(big, lay, LINKS)
    assert cm.engine_allreduce(n, lay, LINKS) == cm.library_allreduce(n, lay, LINKS)
    assert cm.engine_allreduce(1e5, lay, LINKS) == cm.library_allreduce(1e5, lay, LINKS)
    for other in (cm.Layout(4, 4), cm.Layout(6, 4)):
        assert cm.engine_allreduce(big, other, LINKS) == cm.library_allreduce(big, other, LINKS)
    # recursive halving + doubling: 2 ceil(log2 p) alpha + 2 (p-1)/p n beta
    assert cm.halving_allreduce(n, 8, CROSS) == pytest.approx(2 * 3 * 5e-6 + 2 * 7 / 8 * n * 1e-9)
    assert cm.halving_allreduce(n, 6, CROSS) == pytest.approx(2 * 3 * 5e-6 + 2 * 5 / 6 * n * 1e-9)
    assert cm.halving_allreduce(n, 1, CROSS) == 0.0
    # the library's all-reduce on full nodes: inside the nodes, then between them; otherwise
    # over all ranks at the flat link's pace
    assert cm.library_allreduce(n, lay, LINKS) == pytest.approx(
        cm.halving_allreduce(n, 4, LOCAL) + cm.halving_allreduce(n, 4, CROSS))
    assert cm.library_allreduce(n, cm.Layout(6, 4), LINKS) == pytest.approx(
        cm.halving_allreduce(n, 6, CROSS))
    assert cm.library_allreduce(n, cm.Layout(4, 4), LINKS) == pytest.approx(
        cm.halving_allreduce(n, 4, LOCAL))
    assert cm.neighbor_exchange(1000, 2, LOCAL) == pytest.approx(2 * (2e-6 + 1000 * 1e-10))
    monkeypatch.setenv("HEATLIKE_NODE_AWARE", "0")
    assert cm.engine_allreduce(n, lay, LINKS) == cm.library_allreduce(n, lay, LINKS)


def test_algorithm_models_by_hand(monkeypatch):
    assert set(cm.MODELS) == set(ALGORITHMS)
    net = mlp([64, 128, 64, 10])
    shapes = cm.Shapes.of(net)
    m = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert shapes.total == m == 17226
    lay = cm.Layout(8, 4)  # 2 full nodes: all-reduces inside the nodes, then between them
    ring = lambda nbytes: (2 * 2 * 2e-6 + 2 * 3 / 4 * nbytes * 1e-10  # noqa: E731
                           + 2 * 1 * 5e-6 + 2 * 1 / 2 * nbytes * 1e-9)
    gather = lambda k: 7 * (5e-6 + k * 1e-9)  # noqa: E731
    assert cm.comm_time("allreduce", shapes, lay, LINKS) == pytest.approx(ring(4 * m))
    # bf16 on 2 full nodes: node-aware, i.e. hierarchical of 2m; on one node a ring of 2m
    assert cm.comm_time("bf16", shapes, lay, LINKS) == pytest.approx(
        2 * (3 * (2e-6 + 2 * m / 4 * 1e-10)) + 2 * 1 * 5e-6 + 2 * 1 / 2 * 2 * m * 1e-9)
    assert cm.comm_time("bf16", shapes, cm.Layout(4, 4), LINKS) == pytest.approx(
        2 * 2 * 2e-6 + 2 * 3 / 4 * 2 * m * 1e-10)
    # PowerSGD rank 2: all-reduce of 4 (r sum rows + 1-D) then of 4 r sum columns
    first = 4 * (2 * (128 + 64 + 10) + (128 + 64 + 10))
    second = 4 * 2 * (64 + 128 + 64)
    assert cm.payload_bytes("powersgd-2", shapes, lay, LINKS) == first + second == 4472
    assert cm.comm_time("powersgd-2", shapes, lay, LINKS) == pytest.approx(
        ring(first) + ring(second))
    k = math.ceil(0.01 * m)
    assert cm.comm_time("topk-1%", shapes, lay, LINKS) == pytest.approx(gather(8 * k))
    assert cm.comm_time("sign", shapes, lay, LINKS) == pytest.approx(gather(math.ceil(m / 8)))
    assert cm.comm_time("decentralized", shapes, lay, LINKS) == pytest.approx(
        2 * (5e-6 + 4 * m * 1e-9))
    hier = 2 * (3 * (2e-6 + 4 * m / 4 * 1e-10)) + 2 * 1 * 5e-6 + 2 * 1 / 2 * 4 * m * 1e-9
    # under the node-aware threshold (8 MiB) the library's all-reduce, like the reducer
    assert cm.comm_time("hierarchical", shapes, lay, LINKS) == pytest.approx(ring(4 * m))
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_MIN_KB", "0")
    assert cm.comm_time("hierarchical", shapes, lay, LINKS) == pytest.approx(hier)
    monkeypatch.delenv("HEATLIKE_NODE_AWARE_MIN_KB")
    # DASO: node-local all-reduce of 4m every step; every 4 steps a bf16 all-reduce among the
    # 2 nodes (in 4 shards) and a node-local all-gather of the merged shards of 4m
    node = 2 * 2 * 2e-6 + 2 * 3 / 4 * 4 * m * 1e-10
    sync = 2 * 1 * 5e-6 + 2 * 1 / 2 * 2 * m * 1e-9
    shards = 3 * (2e-6 + 4 * m / 4 * 1e-10)  # the merged shards, all-gathered in the node
    assert cm.comm_time("daso", shapes, lay, LINKS) == pytest.approx(node + (sync + shards) / 4)
    # DistOpt partial: the engine plans 4 partitions of this MLP at 4096 elements
    assert shapes.partitions(4096) == 4
    assert cm.payload_bytes("distopt-partial", shapes, lay, LINKS) == pytest.approx(4 * m / 4)
    # predict = compute + communication, at every size
    pred = cm.predict(["allreduce"], shapes, 0.01, LINKS, ranks=(8, 64), ranks_per_node=4)
    assert pred["allreduce"][8] == pytest.approx(0.01 + ring(4 * m))
    assert pred["allreduce"][64] == pytest.approx(
        0.01 + cm.halving_allreduce(4 * m, 4, LOCAL) + cm.halving_allreduce(4 * m, 16, CROSS))
    lines = cm.prediction_table(pred)
    assert len(lines) == 2 and "allreduce" in lines[1]


def test_costmodel_cli(capsys):
    assert cm.main(["--links", "2:10,5:1", "--compute-ms", "10", "--algorithms",
                    "allreduce,daso", "--widths", "64,128,64,10"]) == 0
    out = capsys.readouterr().out
    assert "a model" in out and "4096" in out and "daso" in out


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "bf16", "powersgd-2", "topk-1%", "sign",
                                  "decentralized"])
def test_model_payload_matches_the_engine(comm, name, monkeypatch):
    """The modelled payload per rank per step equals what the engine counts (within the
    per-bucket rounding of k), in the steady state: after the compressed presets' warm-up (one
    step here)."""
    monkeypatch.setattr(recipes, "COMPRESSION_WARMUP", 1)
    if name == "decentralized" and comm.size < 3:
        pytest.skip("a ring has two neighbors from 3 ranks on")
    net = mlp([64, 128, 64, 10])
    if name == "sign":  # ReLU gives exact zeros, which cost the sign vote a second round
        net = nn.Sequential(*(nn.Tanh() if isinstance(m, nn.ReLU) else m for m in net))
    runner = make_runner(name, net, comm, lr=0.01)
    runner.start_epoch(4)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
    runner.train_step(x, y)
    runner.train_step(x, y)
    before = runner.bytes_sent()
    runner.train_step(x, y)
    runner.finish()
    measured = runner.bytes_sent() - before
    model = cm.payload_bytes(name, cm.Shapes.of(net), cm.Layout(comm.size, comm.size), LINKS)
    if all(getattr(s, "passthrough", False) for s in runner._grad_syncs() or [None]):
        model = 0  # one rank, lossless: nothing is handed to MPI at all
    assert measured == pytest.approx(model, rel=0.02, abs=64)


@pytest.mark.mpi
def test_local_step_time_waits_for_the_slowest_rank(comm):
    """The compute the model adds is a synchronous step's: it starts on every rank together and
    ends with the slowest, so one slow rank sets it for all."""
    import time

    class Slow(nn.Module):
        def __init__(self, delay: float) -> None:
            super().__init__()
            self.linear, self.delay = nn.Linear(8, 4), delay

        def forward(self, x):
            time.sleep(self.delay)
            return self.linear(x)

    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    delay = 0.03 if comm.rank == comm.size - 1 else 0.0
    seconds = cm.local_step_time(Slow(delay), x, y, 3, comm.handle)
    assert comm.handle.allgather(seconds) == [seconds] * comm.size
    assert 0.03 <= seconds < 1.0


@pytest.mark.mpi
def test_step_alone_runs_the_codec_but_sends_nothing(comm):
    """The model's local part of a job: the algorithm with every rank on its own communicator,
    all ranks at once: the codec runs (its clock advances), nothing goes to the other ranks,
    and every rank gets the slowest step's time."""
    from heatlike.bench import cluster as bc
    from heatlike.engine.exchange import CODEC_CLOCK

    before = CODEC_CLOCK.seconds
    seconds = bc._step_alone("topk-1%", bc._task("cnn"), comm.handle, steps=3)
    assert CODEC_CLOCK.seconds > before
    assert 0 < seconds < 5 and comm.handle.allgather(seconds) == [seconds] * comm.size
    # DASO alone, in its cycling phase (its second epoch of three)
    seconds = bc._step_alone("daso", bc._task("cnn"), comm.handle, steps=3)
    assert 0 < seconds < 5 and comm.handle.allgather(seconds) == [seconds] * comm.size


@pytest.mark.mpi
def test_step_alone_packs_a_lossless_sum(comm, monkeypatch):
    """A lossless sum of one rank is passed through (nothing to do), but a job of several
    ranks packs and unpacks its buckets: the step alone of blocking DataParallel runs that
    work, and one-rank jobs built after it pass through again."""
    from heatlike.bench import cluster as bc
    from heatlike.core.communication import MPI_SELF
    from heatlike.engine import GradientSync, gradsync

    exchanged = []
    original = GradientSync._exchange
    monkeypatch.setattr(GradientSync, "_exchange",
                        lambda self, bucket: exchanged.append(bucket) or original(self, bucket))
    bc._step_alone("allreduce", bc._task("cnn"), comm.handle, steps=3)
    assert exchanged and gradsync.ONE_RANK_PASSTHROUGH
    assert GradientSync(list(torch.nn.Linear(2, 2).parameters()), MPI_SELF).passthrough


@pytest.mark.mpi
def test_cores_per_rank_counts_every_rank_on_one_kernel(comm):
    """The ranks of the test matrix share this machine's kernel, also on the virtual cluster's
    nodes (own host names, one kernel): each has its cores divided by all of them."""
    from mpi4py import MPI

    from heatlike.bench._common import cores_per_rank

    mine = len(os.sched_getaffinity(0)) / comm.size
    assert cores_per_rank(comm.handle) == pytest.approx(comm.handle.allreduce(mine, op=MPI.MIN))


# -- result records ---------------------------------------------------------------------------

def test_json_records_have_all_fields(tmp_path):
    results = Results()
    results.add("comm", "allreduce 4 KiB", "heatlike time", 12.5, "us", size_bytes=4096)
    results.add("tta", "sign", "digits best accuracy", float("nan"), "fraction", task="digits")
    path = tmp_path / "out" / "results.json"
    results.write_json(str(path))
    items = json.loads(path.read_text())
    assert len(items) == 2
    for item in items:
        assert set(item) == set(FIELDS)
        assert isinstance(item["world_size"], int) and item["topology"]
    assert items[0]["params"] == {"size_bytes": 4096} and items[0]["value"] == 12.5
    assert items[1]["value"] is None  # NaN is not JSON
    back = Results.read_json(str(path))
    assert back.records[0] == results.records[0]
    assert math.isnan(back.records[1].value)
    with pytest.raises(ValueError, match="lacks"):
        Results.from_list([{"suite": "x"}])


def test_topology_label(monkeypatch):
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "2")
    assert topology_label(4) == "2 emulated nodes x 2 ranks"
    assert topology_label(3) == "2 emulated nodes of 2,1 ranks"
    monkeypatch.delenv("HEATLIKE_RANKS_PER_NODE")
    monkeypatch.setenv("HEATLIKE_NODE_IDS", "0,0,0,1")
    assert topology_label(4) == "2 emulated nodes of 3,1 ranks"


@pytest.mark.mpi
def test_link_measurement_records(comm):
    from heatlike.bench.comm import bus_bandwidth, measure_links, record_links

    assert bus_bandwidth(1000, 1e-6, 4) == pytest.approx(1000 * 2 * 3 / 4 / 1e-6)
    assert bus_bandwidth(1000, 1e-6, 1) == 0.0
    links = measure_links(quick=True)
    results = Results()
    record_links(results, links)
    topo = Topology(comm)
    try:
        has_local = max(topo.local_sizes) > 1
        has_cross = topo.num_nodes > 1
    finally:
        topo.free()
    assert (links["local"] is not None) == has_local
    assert (links["cross"] is not None) == has_cross
    for link in links.values():
        if link is not None:
            assert link.alpha > 0 and link.bandwidth > 0 and link.beta > 0
    assert len(results.records) == 2 * (has_local + has_cross)
    assert all(r.world_size == comm.size for r in results.records)


# -- time to accuracy -------------------------------------------------------------------------

def test_time_to_accuracy_from_a_curve():
    curve = [EpochPoint(1, 1.5, 0.80), EpochPoint(2, 3.0, 0.93), EpochPoint(3, 4.5, 0.96)]
    hit = time_to_accuracy(curve, 0.95)
    assert (hit.epochs, hit.seconds, hit.best, hit.reached) == (3, 4.5, 0.96, True)
    assert time_to_accuracy(curve, 0.90).epochs == 2
    miss = time_to_accuracy(curve, 0.99)
    assert not miss.reached and miss.epochs is None and miss.epochs_run == 3
    assert miss.describe().startswith("not reached")
    assert hit.describe() == "3 epochs, 4.50 s"


@pytest.mark.mpi
def _mlbench_or_skip(comm):
    from heatlike.bench import mlbench

    try:
        original = mlbench.import_mlbench()
    except ImportError as error:
        pytest.skip(str(error))
    hosts = comm.handle.allgather(__import__("socket").gethostname())
    if len(set(hosts)) > 1:  # gloo is started on loopback
        pytest.skip("the ranks run on several hosts")
    from heatlike.bench.dp import init_gloo

    init_gloo(comm.handle)
    return mlbench, original


@pytest.mark.parametrize("case", ["CentralizedSGD", "CentralizedAdam"])
def test_mlbench_side_by_side_trains_the_same_model(comm, case):
    """The benchmark drives mlbench-core's class and heatlike's port on the same model and
    batches: after a few steps the two models agree to float rounding, on every rank."""
    mlbench, original = _mlbench_or_skip(comm)
    ours = mlbench.trainer(case, "heatlike", original)
    theirs = mlbench.trainer(case, "mlbench", original)
    for _ in range(3):
        ours.step()
        theirs.step()
    for a, b in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_mlbench_suite_times_every_port(comm):
    mlbench, _ = _mlbench_or_skip(comm)
    results = Results()
    mlbench.run(results, quick=True)
    ratios = {r.case: r.value for r in results.records if r.metric == "heatlike/mlbench"}
    expected = [c for c in mlbench.CASES if comm.size > 1 or c != "DecentralizedSGD"]
    assert sorted(ratios) == sorted(expected)
    assert all(v > 0 and math.isfinite(v) for v in ratios.values())


def test_dndarray_against_heat_runs_every_case_or_says_why_not(comm, capsys):
    """With Heat importable every case is timed on both sides; without, the suite says so and
    records nothing (on every rank alike)."""
    from heatlike.bench import dndarray

    try:
        dndarray.import_heat()
        available = True
    except ImportError:
        available = False
    assert len(set(comm.handle.allgather(available))) == 1
    results = Results()
    dndarray.run_against_heat(results, quick=True)
    ratios = {r.case: r.value for r in results.records if r.metric == "heatlike/heat"}
    if not available:
        assert not results.records
        if comm.rank == 0:
            assert "skipped: Heat cannot be imported" in capsys.readouterr().out
        return
    assert set(ratios) == {"random rand", "sum(axis=0)", "mean(axis=0)", "argmax(axis=0)",
                           "a + b", "resplit(0 -> 1)", "a @ w (0,None)", "DataParallel step"}
    assert all(v > 0 and math.isfinite(v) for v in ratios.values())


def test_gpu_suite_runs_only_where_every_rank_has_a_gpu(comm, capsys):
    from heatlike.bench import gpu

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/test_cuda.py runs the suite")
    results = Results()
    gpu.run(results, quick=True)
    assert not results.records
    if comm.rank == 0:
        assert "# gpu: skipped: no CUDA device on rank(s) [0" in capsys.readouterr().out


def test_tiny_time_to_accuracy_run(comm):
    task = Task("tiny", load_synthetic_split(0, samples=240, features=16), [16, 32, 10],
                batch_size=16, lr=0.1)
    result = measure("allreduce", task, target=0.5, max_epochs=2, comm=comm)
    assert isinstance(result, TimeToAccuracy)
    assert 1 <= result.epochs_run <= 2 and len(result.curve) == result.epochs_run
    assert result.reached or result.describe().startswith("not reached")
    if result.reached:
        assert result.epochs >= 1 and result.seconds > 0
        assert result.epochs == result.epochs_run  # it stops at the target
    times = [p.seconds for p in result.curve]
    assert times == sorted(times)
    # every rank got the same verdict
    assert comm.handle.allgather((result.epochs, result.best)) == \
        [(result.epochs, result.best)] * comm.size


# -- tracker spans and the Chrome trace ---------------------------------------------------------

def _check_trace(trace: dict, size: int) -> None:
    """Valid structure, one pid per rank named "rank N", sensible nesting on every rank."""
    events = trace["traceEvents"]
    json.dumps(trace)  # serializable
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == set(range(size))
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(size)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    eps = 0.002  # microseconds: rounding of ts and dur
    for e in complete:
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert threads[(e["pid"], e["tid"])] == e["cat"]  # one tid per category
    for rank in range(size):
        mine = [e for e in complete if e["pid"] == rank]
        steps = [e for e in mine if e["cat"] == "step"]
        assert steps
        for e in mine:  # everything lies inside one of its rank's steps
            if e["cat"] != "step":
                assert any(s["ts"] - eps <= e["ts"] and
                           e["ts"] + e["dur"] <= s["ts"] + s["dur"] + eps for s in steps), e
        by_tid: dict = {}
        for e in mine:
            by_tid.setdefault(e["tid"], []).append(e)
        for row in by_tid.values():  # within a row: disjoint or nested, never crossing
            row.sort(key=lambda e: (e["ts"], -e["dur"]))
            open_ends: list = []
            for e in row:
                while open_ends and open_ends[-1] <= e["ts"] + eps:
                    open_ends.pop()
                end = e["ts"] + e["dur"]
                if open_ends:
                    assert end <= open_ends[-1] + eps, e
                open_ends.append(end)


@pytest.mark.mpi
def test_tracker_chrome_trace(comm, mpi_tmp_path):
    tracker = Tracker()
    for _ in range(3):
        tracker.batch_start()
        tracker.record_batch_init()
        tracker.record("fwd_pass")
        with tracker.span("wait", "comm wait", bucket=0):
            comm.Barrier()
        tracker.record_batch_backprop()
        tracker.add_bytes(100 * (comm.rank + 1), "AllReduce", received=50)
        tracker.record("agg")
        tracker.record("opt_step")
        tracker.batch_end()
    summary = tracker.summary()
    assert summary["steps"] == 3 and summary["bytes_per_step"] == {"AllReduce": 100 * (
        comm.rank + 1)}
    assert summary["bytes_received_per_step"] == {"AllReduce": 50}
    assert set(summary["phase_s"]) == {"init", "fwd_pass", "backprop", "agg", "opt_step"}
    assert summary["wait_s"]["comm wait"] >= 0
    with pytest.raises(ValueError):
        tracker.add_span("backwards", 2.0, 1.0)
    # a file rank 0 cannot write: its error on every rank (before: rank 0 alone raised)
    with pytest.raises(FileNotFoundError, match="rank 0" if comm.size > 1 else "missing"):
        tracker.write_chrome_trace(str(mpi_tmp_path / "missing" / "trace.json"), comm)
    # a span argument JSON cannot hold (rank 0 writes) or pickle cannot send (the last rank's):
    # every rank raises, and no partial file is left
    bad = Tracker()
    bad.add_span("odd", 1.0, 2.0, v={1, 2} if comm.rank == 0 else 1,
                 f=(lambda: 0) if comm.rank == comm.size - 1 else 1)
    kinds = (TypeError,) if comm.size > 1 else (TypeError, AttributeError, RuntimeError)
    with pytest.raises(kinds):
        bad.write_chrome_trace(str(mpi_tmp_path / "bad.json"), comm)
    if comm.size > 1:
        bad = Tracker()
        bad.add_span("odd", 1.0, 2.0, v={1, 2} if comm.rank == 0 else 1)
        with pytest.raises(TypeError, match="rank 0"):
            bad.write_chrome_trace(str(mpi_tmp_path / "bad.json"), comm)
    assert not (mpi_tmp_path / "bad.json").exists()
    path = str(mpi_tmp_path / "trace.json")
    trace = tracker.write_chrome_trace(path, comm)
    if comm.rank != 0:
        assert trace is None
        return
    with open(path) as f:
        on_disk = json.load(f)
    assert on_disk["traceEvents"] == trace["traceEvents"]
    _check_trace(on_disk, comm.size)
    steps = [e for e in on_disk["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    assert len(steps) == 3 * comm.size
    assert all(e["args"]["bytes sent AllReduce"] == 100 * (e["pid"] + 1) for e in steps)
    waits = [e for e in on_disk["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm wait"]
    assert len(waits) == 3 * comm.size and all(e["args"] == {"bucket": 0} for e in waits)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "centralized-sgd"])
def test_trace_of_training_steps(comm, mpi_tmp_path, name):
    """Training steps traced through the Runner: phases, the engine's waits, bytes per step."""
    from heatlike.bench.trace import run_trace

    path = str(mpi_tmp_path / f"{name}.json")
    results = Results()
    tracker = run_trace(path, results, name, steps=2, warmup=1)
    assert len(tracker.steps) == 2
    phases = set(tracker.summary()["phase_s"])
    assert {"init", "fwd_pass", "comp_loss", "backprop", "opt_step"} <= phases
    if name == "centralized-sgd":
        assert "agg" in phases  # CentralizedSGD reports its aggregation itself
    for step in tracker.steps:
        assert sum(step["bytes"].values()) > 0 or comm.size == 1  # one rank sends nothing
    assert results.find("trace", "step time")
    if comm.rank == 0:
        with open(path) as f:
            _check_trace(json.load(f), comm.size)


# -- figures --------------------------------------------------------------------------------

def _synthetic_results() -> Results:
    r = Results()
    algos = ["allreduce", "bf16", "topk-1%"]
    for i, name in enumerate(algos):
        r.add("algorithms", name, "digits step time", 10.0 + i, "ms")
        r.add("algorithms", name, "large step time", 100.0 + 10 * i, "ms")
        r.add("algorithms", name, "digits bytes per step", 68928 / (i + 1), "bytes")
        r.add("algorithms", name, "large bytes per step", 7.4e6 / (i + 1), "bytes")
        for task in ("digits", "synthetic"):
            for epoch in (1, 2, 3):
                suite = "algorithms" if task == "digits" else "tta"
                r.add(suite, name, f"{task} epoch accuracy", 0.8 + 0.05 * epoch - 0.01 * i,
                      "fraction", task=task, epoch=epoch)
                r.add(suite, name, f"{task} epoch time", 1.5 * epoch, "s", task=task,
                      epoch=epoch)
            reached = i < 2
            r.add("tta", name, f"{task} reached target", float(reached), "bool", task=task,
                  target=0.9)
            if reached:
                r.add("tta", name, f"{task} time to accuracy", 3.0, "s", task=task, target=0.9)
                r.add("tta", name, f"{task} epochs to accuracy", 2, "epochs", task=task,
                      target=0.9)
        for p in cm.RANKS:
            r.add("costmodel", name, "model step time", 50 + p / 10, "ms", ranks=p,
                  ranks_per_node=4)
    for size in (4096, 65536, 1 << 20):
        for variant in ("heatlike", "raw", "bf16"):
            r.add("comm", f"allreduce {size}", f"{variant} bus bandwidth", size / 1e6, "GB/s",
                  size_bytes=size)
    r.add("comm", "p2p node-local", "bandwidth", 2.5, "GB/s", link="local")
    r.add("costmodel", "links", "cross bandwidth", 1.0, "GB/s", source="given (--links)")
    return r


def test_plots_from_synthetic_results(tmp_path):
    pytest.importorskip("matplotlib")
    from heatlike.bench.plot import main, plot_results

    results = _synthetic_results()
    made = plot_results(results, str(tmp_path / "all"))
    expected = {"algorithms_step_time.png", "algorithms_bytes.png", "accuracy_vs_time.png",
                "time_to_accuracy.png", "allreduce_bus_bandwidth.png", "costmodel.png"}
    assert {os.path.basename(p) for p in made} == expected
    for p in made:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 1000
    # any subset of suites: only the figures its records allow
    comm_only = Results([rec for rec in results.records if rec.suite == "comm"])
    assert [os.path.basename(p) for p in plot_results(comm_only, str(tmp_path / "comm"))] == \
        ["allreduce_bus_bandwidth.png"]
    assert plot_results(Results(), str(tmp_path / "none")) == []
    # re-plotting from a saved JSON
    saved = tmp_path / "results.json"
    comm_only.write_json(str(saved))
    assert main([str(saved), str(tmp_path / "again")]) == 0
    assert os.listdir(tmp_path / "again") == ["allreduce_bus_bandwidth.png"]


def test_record_dataclass_order():
    """FIELDS is the JSON schema: every Record field, in order."""
    assert tuple(Record.__dataclass_fields__) == FIELDS


def test_bench_cli_rejects_bad_arguments(capsys):
    from heatlike.bench.__main__ import main

    for argv in (["comm", "--links", "1:0"], ["algorithms", "--algorithms", "nope"],
                 [], ["comm", "--trace-algorithm", "nope", "--trace", "x.json"],
                 ["dndarray", "--against", "numpy"]):
        with pytest.raises(SystemExit):
            main(argv)



# -- python -m heatlike.bench cluster ----------------------------------------------------------

def _job_row(algorithm: str, curve: list, step: float, link_mb: float) -> dict:
    return {"algorithm": algorithm, "model": "cnn", "rate": "1gbit", "nodes": "2+2",
            "step_s": step, "steps": 20, "accuracy": curve[-1][2], "curve": curve,
            "link_bytes": link_mb * 1e6, "counted": "link counters"}


def test_cluster_report_times_to_accuracy_against_blocking_data_parallel(tmp_path):
    from heatlike.bench import cluster as bc
    from heatlike.bench.plot import plot_cluster

    rows = bc._with_time_to_accuracy([
        _job_row("allreduce", [[1, 1.0, 0.80], [2, 2.0, 0.95]], 0.10, 20.0),
        _job_row("daso", [[1, 0.5, 0.90], [2, 1.0, 0.945]], 0.05, 5.0),
        _job_row("topk-1%", [[1, 0.4, 0.50], [2, 0.8, 0.90]], 0.04, 0.5)])
    # the target is DataParallel's final accuracy less one point: 0.94
    assert [r["target"] for r in rows] == [pytest.approx(0.94)] * 3
    assert [r["tta_s"] for r in rows] == [2.0, 1.0, None]
    assert [r["tta_ratio"] for r in rows] == [1.0, 0.5, None]
    table = bc._table(rows)
    assert "| 1gbit | cnn | daso | 50.0 | 0.50 | 5.0 | 0.250 | 0.9450 | 1.00 | 0.50 |" in table
    assert "| 1gbit | cnn | topk-1% | 40.0 | 0.40 | 0.5 | 0.025 | 0.9000 | never | - |" in table
    paths = plot_cluster(rows, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "cluster_time_to_accuracy.png", "cluster_step_time.png", "cluster_link_bytes.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_daso_is_modelled_by_the_median_of_its_own_schedule():
    """A DASO job records what each step did (from DASO's trace); the model is the median of
    those steps' modelled times: the local all-reduce, the scatter of a send, and for a merge
    the cross-node sum (blocking: all of it; k steps after its send: what did not fit into k
    steps of computation) plus the gather and broadcast."""
    from types import SimpleNamespace

    from heatlike.bench import cluster as bc

    # 2 epochs of 4 batches: epoch 0 blocking every batch; epoch 1 sends at 0 (merged at 1) and
    # blocks at its last batch, averaging locally in batches 0, 1 and 3 only
    trace = [(0, b, *e) for b in range(4) for e in (("local",), ("send", b % 2, 0),
                                                    ("blocking", b % 2))]
    trace += [(1, 0, "local"), (1, 0, "send", 0, 1), (1, 1, "local"), (1, 1, "merge", 0),
              (1, 3, "local"), (1, 3, "send", 1, 0), (1, 3, "blocking", 1)]
    daso = SimpleNamespace(trace=trace, last_batch=4)
    schedule = bc.daso_schedule(daso, 8, skip=1)
    assert schedule == {"local+send+merge": 4, "local+send": 1, "local+merge@1": 1, "": 1}
    shapes = cm.Shapes.of(mlp([64, 128, 64, 10]))
    lay = cm.Layout(4, 2)
    parts = cm.daso_parts(shapes, lay, LINKS)
    compute = parts["cross"] / 3
    blocking = parts["local"] + parts["send"] + parts["cross"] + parts["collect"]
    late = parts["local"] + parts["cross"] - compute + parts["collect"]
    times = sorted(cm.daso_step_times(shapes, lay, LINKS, schedule, compute))
    assert times == pytest.approx(sorted([blocking] * 4 + [parts["local"] + parts["send"],
                                                           late, 0.0]))
    assert cm.daso_step_times(shapes, lay, LINKS, {"merge@4": 1}, compute) == pytest.approx(
        [parts["collect"]])  # the sum fitted into 4 steps of computation
    # the warmup's gradient all-reduce over every rank is the bf16 codec's
    assert cm.daso_step_times(shapes, lay, LINKS, {"gradients": 2}) == pytest.approx(
        [cm.comm_time("bf16", shapes, lay, LINKS)] * 2)
    links = {"local": {"alpha": 2e-6, "beta": 1e-10},
             "cross": {"alpha": 5e-6, "beta": 1e-9, "one_flow_bandwidth": 1e9}}
    row = {**_job_row("daso", [[1, 1.0, 0.9]], 0.01, 1.0), "links": links, "layout": [4, 2],
           "shapes": [list(p.shape) for p in mlp([64, 128, 64, 10]).parameters()],
           "compute_s": compute, "codec_s": 0.0, "daso_schedule": schedule}
    modelled = bc.with_model([row])[0]["model_s"]
    assert modelled == pytest.approx(compute + times[3])  # the median of 7 steps
    cycling = bc.with_model([{k: v for k, v in row.items() if k != "daso_schedule"}])[0]
    assert cycling["model_s"] == pytest.approx(compute + cm.comm_time("daso", shapes, lay,
                                                                      LINKS))


def test_cluster_report_puts_the_cost_model_next_to_the_measured_step():
    """model = the job's compute + codec time + the modelled communication on the measured
    links; for the all-reduce of m float32 parameters on 2 nodes x 2 ranks that is the library's
    (recursive halving inside the nodes, then between them)."""
    from heatlike.bench import cluster as bc

    links = {"local": {"alpha": 1e-5, "beta": 1e-9},
             "cross": {"alpha": 1e-4, "beta": 8e-9, "one_flow_bandwidth": 6e7}}
    shapes = [[100, 50], [100]]  # 5100 parameters
    row = {**_job_row("allreduce", [[1, 1.0, 0.9]], 0.01, 1.0), "shapes": shapes,
           "links": links, "compute_s": 2e-3, "codec_s": 1e-4}
    other = {**row, "algorithm": "not-modelled"}
    bare = _job_row("allreduce", [[1, 1.0, 0.9]], 0.01, 1.0)  # no links: no model
    rows = bc.with_model([row, other, bare])
    library = (2 * 1 * 1e-5 + 2 * 1 / 2 * 4 * 5100 * 1e-9      # inside each node
               + 2 * 1 * 1e-4 + 2 * 1 / 2 * 4 * 5100 * 8e-9)  # between the nodes
    assert rows[0]["model_s"] == pytest.approx(2e-3 + 1e-4 + library)
    assert rows[0]["model_ratio"] == pytest.approx(0.01 / rows[0]["model_s"])
    assert rows[1]["model_s"] is None and rows[2]["model_s"] is None
    eight = bc.with_model([{**row, "layout": [8, 4]}])[0]  # a job's own layout when it has one
    assert eight["model_s"] == pytest.approx(2e-3 + 1e-4 + (
        2 * 2 * 1e-5 + 2 * 3 / 4 * 4 * 5100 * 1e-9 + 2 * 1 * 1e-4 + 2 * 1 / 2 * 4 * 5100 * 8e-9))
    table = bc._table(bc._with_time_to_accuracy(rows))
    assert f"| {rows[0]['model_s'] * 1e3:.1f} | {rows[0]['model_ratio']:.2f} |" in table
    lines = bc.projection(rows, ranks_per_node=4)
    assert lines[0].startswith("# cost model at 1gbit, cnn") and "4096" in lines[1]
    at_8 = float(lines[2].split()[1])  # 8 ranks on 2 nodes of 4
    expected = 2.1e-3 + (2 * 2 * 1e-5 + 2 * 3 / 4 * 4 * 5100 * 1e-9
                         + 2 * 1 * 1e-4 + 2 * 1 / 2 * 4 * 5100 * 8e-9)
    assert at_8 == pytest.approx(expected * 1e3, abs=0.05)
    # the measured overhead per collective and ranks sharing cores enter the model
    shared = bc.with_model([{**row, "links": {**links, "overhead": 5e-4}, "overlap": False}])[0]
    assert shared["model_s"] == pytest.approx(rows[0]["model_s"] + 5e-4)
    # the algorithm's step without the network, where measured, replaces compute + codec
    alone = bc.with_model([{**row, "alone_s": 3e-3}])[0]
    assert alone["model_s"] == pytest.approx(3e-3 + library)


def test_cluster_suite_refuses_unknown_names():
    from heatlike.bench import cluster as bc

    with pytest.raises(SystemExit, match="unknown algorithm"):
        bc.run(["--algorithms", "allreduce,nope"])
    with pytest.raises(SystemExit, match="unknown model"):
        bc.run(["--models", "resnet"])


def _bench_cluster(tmp_path, *args: str, launcher: list[str] = ()) -> tuple[list[dict], str]:
    import subprocess
    import sys

    from heatlike.testing.matrix import _clean_env

    out = tmp_path / "cluster.json"
    proc = subprocess.run([*launcher, sys.executable, "-m", "heatlike.bench", "cluster",
                           "--models", "cnn", "--epochs", "1", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=_clean_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.system
def test_cluster_suite_measures_the_links_of_a_virtual_cluster(tmp_path):
    """Two jobs on two nodes at 1 Gbit/s: the bytes come from the links' counters, and half
    precision on the wire halves what crosses them (the node-aware half sum)."""
    from heatlike.testing.cluster import MIN_BYTES, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"virtual cluster unavailable: {reason}")
    rows, stdout = _bench_cluster(tmp_path, "--rates", "1gbit", "--algorithms",
                                  "allreduce,bf16", "--plot", str(tmp_path / "plots"))
    assert [(r["algorithm"], r["rate"], r["nodes"]) for r in rows] == [
        ("allreduce", "1gbit", "2+2"), ("bf16", "1gbit", "2+2")]
    for r in rows:
        assert r["counted"] == "link counters" and set(r["sent"]) == {"node1", "node2"}
        assert r["link_bytes"] >= MIN_BYTES and r["steps"] > 5 and r["step_s"] > 0
        assert 0.3 < r["accuracy"] <= 1.0 and len(r["curve"]) == 1
    assert rows[1]["link_bytes"] < 0.6 * rows[0]["link_bytes"], rows
    for r in rows:  # the cost model's inputs, measured on the nodes
        cross = r["links"]["cross"]
        assert cross["rate"] == pytest.approx(125e6)  # 1 Gbit/s in bytes per second
        assert 10e6 < 1 / cross["beta"] <= 1.05 * cross["rate"], cross  # a node's link
        assert r["links"]["cross"]["alpha"] > 0 and r["links"]["local"]["beta"] > 0
        # the model is the step alone (measured apart from compute_s, so either may be the
        # larger on shared cores) plus the modelled communication
        assert r["compute_s"] > 0 and r["codec_s"] >= 0 and r["model_s"] > r["alone_s"] > 0
        assert 0 <= r["links"]["overhead"] < 0.05  # seconds per collective the engine issues
        # the nodes share this machine's kernel and cores: 4 ranks on fewer than 4 cores
        assert r["overlap"] == (len(os.sched_getaffinity(0)) >= 4)
    assert "# cost model at 1gbit, cnn" in stdout
    assert "| 1gbit | cnn | bf16 |" in stdout
    assert (tmp_path / "plots" / "cluster_time_to_accuracy.png").exists()


@pytest.mark.system
def test_cluster_suite_in_a_running_job_reports_the_engines_bytes(tmp_path):
    """Under mpiexec / srun (world size > 1) the suite trains in the running job and says that
    its bytes are the engine's payload count, not link counters; a DASO job records its
    schedule (every timed step by what it did)."""
    from test_launch import mpiexec

    rows, stdout = _bench_cluster(tmp_path, "--algorithms", "allreduce,daso",
                                  launcher=[mpiexec(), "-n", "2"])
    row, daso = rows
    assert row["counted"] == "engine payload" and row["rate"] == "as launched"
    assert row["link_bytes"] == pytest.approx(row["payload_bytes_per_step"] * row["steps"])
    assert row["link_bytes"] > 0 and "engine payload" in stdout
    assert "daso_schedule" not in row
    schedule = daso["daso_schedule"]
    assert sum(schedule.values()) == daso["steps"] - 3  # the timed steps
    # one epoch, no warmup: a send every 4 batches merged in the next, a blocking last batch
    assert schedule.get("local+send+merge") == 1 and schedule.get("local+merge@1", 0) >= 1


HELP_COMMANDS = [
    ["-m", "heatlike.bench", "--help"], ["-m", "heatlike.bench", "cluster", "--help"],
    ["-m", "heatlike.testing.cluster", "--help"], ["-m", "heatlike.testing.matrix", "--help"],
    ["-m", "heatlike.bench.plot", "--help"],
    ["scripts/conformance/run_heat_tests.py", "--help"]]


@pytest.fixture(scope="module")
def help_texts():
    """Every command's ``--help``, all started at once (each spends seconds importing torch):
    argv (joined) -> (exit status, stdout, stderr)."""
    import subprocess
    import sys
    from pathlib import Path

    from heatlike.testing.matrix import _clean_env

    root = Path(__file__).resolve().parents[1]
    procs = {" ".join(argv): subprocess.Popen([sys.executable, *argv], cwd=root,
                                              env=_clean_env(), text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for argv in HELP_COMMANDS}
    texts = {}
    for key, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        texts[key] = (proc.returncode, out, err)
    return texts


@pytest.mark.parametrize("argv", HELP_COMMANDS)
def test_every_command_line_prints_its_help(argv, help_texts):
    """``--help`` of every command the project ships prints the usage and exits 0 (a ``%`` in a
    help text once made argparse raise instead)."""
    code, out, err = help_texts[" ".join(argv)]
    assert code == 0 and "usage:" in out, out + err


def test_cluster_deep_model_is_a_residual_mlp_of_fourteen_layers():
    """``bench cluster --models deep``: 4.97M parameters in fourteen linear layers (twelve of
    them 640 x 640 in residual blocks), digits in, ten classes out; two builds of one seed are
    the same model (every job starts from the same weights)."""
    import torch

    from heatlike.bench import cluster as bc

    task = bc._task("deep")
    net, again = task.build(0), task.build(0)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 14 and sum(p.numel() for p in net.parameters()) == 4_970_890
    assert [tuple(m.weight.shape) for m in linears[1:-1]] == [(640, 640)] * 12
    x = torch.randn(3, 64)
    assert net(x).shape == (3, 10) and torch.equal(net(x), again(x))


def test_cluster_transformer_model_reads_image_rows_as_tokens():
    """``bench cluster --models transformer``: two encoder blocks (attention and LayerNorm
    included) over the eight rows of a digit, 894,922 parameters in 29 tensors; every image row
    reaches the output, and two builds of one seed are the same model."""
    import torch

    from heatlike.bench import cluster as bc

    task = bc._task("transformer")
    net, again = task.build(0), task.build(0)
    params = list(net.parameters())
    assert len(params) == 29 and sum(p.numel() for p in params) == 894_922
    assert sum(isinstance(m, torch.nn.MultiheadAttention) for m in net.modules()) == 2
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in net.modules()) == 4
    x = torch.randn(3, 64)
    out = net(x)
    assert out.shape == (3, 10) and torch.equal(out, again(x))
    changed = x.clone()
    changed[:, 56:] += 1.0  # the last row only
    assert not torch.allclose(net(changed), out)


@pytest.mark.parametrize("rates", ["nonsense", ",", "1gbit,nonsense"])
def test_bench_cluster_checks_every_rate_before_it_runs(rates):
    """A bad link rate is refused with a message before any cluster is built (before: a
    traceback, or after the first rate's whole set had run, its results lost)."""
    from heatlike.bench import cluster

    with pytest.raises(SystemExit, match="--rates"):
        cluster.run(["--rates", rates, "--algorithms", "allreduce", "--models", "cnn"])


@pytest.mark.mpi
def test_the_large_mlp_is_timed_after_the_compression_warmup(comm):
    """PowerSGD and top-k send exact averages for their first COMPRESSION_WARMUP steps: the
    algorithms suite times them after those (before: at most 6 steps, all uncompressed, so their
    bytes were the float32 all-reduce's, ratio 1.0)."""
    from heatlike.bench.algorithms import LARGE, large_step_stats

    if comm.size == 1:
        pytest.skip("one rank sends nothing to measure")
    full = 4 * sum(p.numel() for p in recipes.mlp(LARGE, seed=0).parameters())
    assert large_step_stats("powersgd-2", 1).bytes < 0.1 * full
    assert large_step_stats("topk-1%", 1).bytes < 0.05 * full


@pytest.mark.mpi
def test_the_daso_suite_runs_at_any_size(comm, capsys):
    """At one rank DataParallel sends nothing across nodes: no ratio (was a ZeroDivisionError
    that also ended `all` before the later suites)."""
    from heatlike.bench import daso

    results = Results()
    daso.run(results, quick=True)
    ratio = results.value("daso", "digits", "daso/dp cross-node bytes")
    assert ratio is not None and (math.isnan(ratio) if comm.size == 1 else ratio >= 0)
