"""Run the test suite under ``mpiexec`` at several world sizes and on an emulated multi-node layout.

    python -m heatlike.testing.matrix [--sizes 1,2,3,4] [--fake-nodes 2] [--real-nodes 2]
                                      [--nodes-size N] [--mpiexec CMD] [--timeout S]
                                      [-- PYTEST ARGS]

At one rank every test runs; at more ranks only the tests marked ``@pytest.mark.mpi`` (pytest-mpi)
do. ``--fake-nodes K`` adds a run at the largest size (or at ``--nodes-size``) with
``HEATLIKE_RANKS_PER_NODE`` set so that the ranks form K emulated nodes. ``--uneven-nodes N``
adds a run at N ranks on two emulated nodes of different sizes (N - 1 ranks and 1) of the test
files whose code paths depend on the layout (:data:`UNEVEN_TESTS`: reductions over unequal
nodes, DASO's ranks without a partner on every node, their checkpoints). ``--real-nodes N`` runs
them instead on N nodes of a virtual cluster (``heatlike.testing.cluster``: network namespaces
joined by rate-limited links, ``--link-rate``), ranks in blocks, and checks that the links carried
the inter-node traffic; where the cluster cannot start (not root, tools missing, namespaces
refused, not MPICH's Hydra) the summary says why and the emulated run takes its place.

Rank 0 prints pytest's output; the other ranks write theirs to ``.test-logs/<run>/rank<r>.log``
(the plugin copies every rank's failures into rank 0's report).

Hangs and crashes. The plugin's watchdog aborts a launch when a test runs longer than its limit
(``--mpi-timeout``, default 100 s; tests marked ``slow`` get ``--mpi-slow-factor`` times that,
default 4; pass either after ``--``). The runner then records that test as HUNG and starts a new
launch that runs the tests after it: the tests already finished are not run again, the ones not
yet run are never dropped, however many tests hang. A launch that dies during a test (a crashed
rank, ``MPI_Abort``) is resumed the same way and the test reported as CRASHED; a launch that ends
before or after the tests (bad arguments, a collection error) is reported with its exit status.
The summary lists every run's counts and each test that failed, hung or crashed; the exit status
is non-zero when any run did not pass.

Stopping. SIGTERM, SIGINT or SIGHUP to the runner, or the death of its parent (``make``, a CI
step), ends the current ``mpiexec`` with its ranks and everything they started (SIGTERM, then
SIGKILL after a few seconds), prints the summary so far and exits with 128 + the signal number.
Under ``nohup`` (SIGHUP ignored) the runner outlives its parent.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.env import env_str
from .children import Stopped, end_tree, held_signals, start, stop_on_signals
from .cluster import MIN_BYTES, ClusterError, VirtualCluster

#: the test files the ``--uneven-nodes`` run takes: those whose code depends on the layout of
#: ranks on nodes (3 ranks as 2 + 1 took 41 s for them on 2 cores); paths from the repository's
#: root, where ``make test`` runs the matrix
UNEVEN_TESTS = ("tests/test_topology.py", "tests/test_engine_codecs.py",
                "tests/test_node_reduce.py", "tests/test_data_parallel.py", "tests/test_daso.py",
                "tests/test_mlbench_presets.py", "tests/test_resume_models.py",
                "tests/test_checkpoint.py")


@dataclass
class Run:
    """One row of the matrix: a world size, its environment and pytest arguments, and what
    happened (filled in by :func:`run_matrix`)."""

    label: str
    size: int
    env: dict[str, str]
    pytest_args: list[str]
    status: str = "not run"
    seconds: float = 0.0
    launches: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    not_run: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, test id)
    slowest_files: list[tuple[float, str]] = field(default_factory=list)  # (seconds, file)
    problem: str = ""  # why a launch ended without its tests (bad arguments, ...)
    # --real-nodes: the ranks run on the nodes of this VirtualCluster (heatlike.testing.cluster),
    # so many on each; the bytes each node sent on its link and the bytes the nodes sent each
    # other ("between the nodes"), summed over the launches
    cluster: Any = None
    placement: list[int] = field(default_factory=list)
    link_bytes: dict[str, int] = field(default_factory=dict)
    note: str = ""


@dataclass
class _Launch:
    """What one mpiexec launch left behind."""

    rc: int | None  # None: killed after --timeout
    collected: list[str] | None
    started: str  # the test that was running when the launch ended ("" if none)
    hung: str  # the test the watchdog named ("" if none)


def _mpiexec_cmd(mpiexec: str, size: int) -> list[str]:
    cmd = shlex.split(mpiexec)
    try:
        version = subprocess.run([*cmd, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    extra = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    return [*cmd, *extra, "-n", str(size)]


def _clean_env() -> dict[str, str]:
    """The environment without variables of an enclosing MPI job (a runner started under mpiexec
    must not make its children join that job)."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _launch(run: Run, mpiexec: str, state: Path, logs: Path, timeout: float) -> _Launch:
    """One mpiexec launch of the run's tests, less those listed in ``state/skip.txt``."""
    for name in ("collected.txt", "started.txt"):
        (state / name).unlink(missing_ok=True)
    for path in state.glob("hung-rank*.txt"):
        path.unlink()
    env = {**_clean_env(), **run.env, "HEATLIKE_TEST_STATE_DIR": str(state),
           "HEATLIKE_TEST_LOG_DIR": str(logs), "PYTHONUNBUFFERED": "1"}
    # on real nodes: the cluster's mpiexec and environment; it ends what the launch left on
    # every node and counts the bytes each node sent on its link
    frame = (run.cluster.job(run.placement, env=env) if run.cluster is not None
             else contextlib.nullcontext())
    with frame as job:
        prefix = job.command if job is not None else _mpiexec_cmd(mpiexec, run.size)
        env = job.env if job is not None else env
        cmd = [*prefix, sys.executable, "-m", "heatlike.testing.matrix", "--worker", "--",
               *run.pytest_args]
        print(f"\n### {run.label}: {shlex.join(cmd)}", flush=True)
        proc = None
        try:
            with held_signals():
                proc = start(cmd, env=env)
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc is not None:  # also when the runner is stopped: nothing of a launch outlives
                try:
                    end_tree(proc)
                except Stopped:  # arrived during the clean-up of a finished launch: finish it
                    end_tree(proc)
                    raise
    if job is not None:
        sent = {**job.result.sent, "between the nodes": job.result.between_nodes}
        for host, count in sent.items():
            run.link_bytes[host] = run.link_bytes.get(host, 0) + count
    collected = _lines(state / "collected.txt") if (state / "collected.txt").exists() else None
    started = "".join(_lines(state / "started.txt")[:1]).strip()
    hung = sorted({line.strip() for p in state.glob("hung-rank*.txt") for line in _lines(p)})
    return _Launch(rc, collected, started, hung[0] if hung else "")


def _finished(state: Path, seconds: dict[str, float] | None = None) -> dict[str, str]:
    """Test id -> outcome of every test finished so far in this run (and into ``seconds``,
    test id -> its duration)."""
    done = {}
    for line in _lines(state / "finished.txt"):
        parts = line.split("\t", 2)
        if len(parts) == 3:
            done[parts[2]] = parts[0]
            if seconds is not None:
                seconds[parts[2]] = float(parts[1])
    return done


def _execute(run: Run, mpiexec: str, log_root: Path, timeout: float) -> None:
    """All launches of one run: the first runs every test, each later one the tests after the
    one that hung or crashed. Fills in the run's outcome."""
    logs = log_root / run.label.replace(" ", "_").replace(",", "")
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="heatlike-test-state-"))
    skip: list[str] = []
    total: list[str] | None = None
    try:
        while True:
            run.launches += 1
            failures = state / "failures.txt"
            printed = failures.stat().st_size if failures.exists() else 0
            try:
                launch = _launch(run, mpiexec, state, logs, timeout)
            except ClusterError as e:
                run.problem = f"the virtual cluster failed: {e}"
                break
            if total is None:
                total = launch.collected
            culprit = launch.hung or launch.started
            if launch.rc in (0, 1) or (launch.rc == 5 and run.launches > 1):
                break  # pytest ran to its end (5: nothing was left to run)
            if not culprit or culprit in skip:
                run.problem = ("no result within --timeout" if launch.rc is None else
                               f"mpiexec exited with status {launch.rc} outside any test; see "
                               f"the output above and {logs}")
                break
            skip.append(culprit)
            with open(failures, "a+") as f:
                f.seek(printed)
                lost = f.read()
            if lost:
                print(f"### {run.label}: the failures of the aborted launch (pytest did not get "
                      f"to report them)\n{lost}", flush=True)
            if launch.hung:
                run.hung.append(launch.hung)
                what = "HUNG and was aborted"
            elif launch.rc is None:
                run.hung.append(f"{culprit} (the launch ran past --timeout {timeout:.0f} s)")
                what = "was running when the launch ran past --timeout"
            else:
                run.crashed.append(f"{culprit} (mpiexec exit status {launch.rc})")
                what = f"CRASHED (mpiexec exit status {launch.rc})"
            done = _finished(state)
            # the next launch runs neither the tests finished nor those that hung or crashed
            (state / "skip.txt").write_text("".join(t + "\n" for t in [*done, *skip]))
            left = [t for t in (total or []) if t not in done and t not in skip]
            print(f"### {run.label}: {culprit} {what} (finished: {len(done)}, left: "
                  f"{len(left)})", flush=True)
            if total is not None and not left:
                break
            print(f"### {run.label}: resuming after it", flush=True)
    finally:
        seconds: dict[str, float] = {}
        done = _finished(state, seconds)
        run.slowest = sorted(((s, t) for t, s in seconds.items()), reverse=True)[:5]
        per_file: dict[str, float] = {}
        for test, s in seconds.items():
            path = test.split("::")[0]
            per_file[path] = per_file.get(path, 0.0) + s
        run.slowest_files = sorted(((s, f) for f, s in per_file.items()), reverse=True)[:5]
        for outcome in done.values():
            run.counts[outcome] = run.counts.get(outcome, 0) + 1
        run.failed = [t for t, o in done.items() if o == "failed"]
        if total is not None:
            run.not_run = len([t for t in total if t not in done and t not in skip])
        shutil.rmtree(state, ignore_errors=True)
    if run.problem or run.hung or run.crashed or run.failed or run.not_run:
        run.status = "failed"
    elif total is None:
        run.status = "failed"
        run.problem = run.problem or "no tests were collected"
    else:
        run.status = "passed"
    if run.cluster is not None and run.status == "passed":
        between = run.link_bytes.get("between the nodes", 0)
        if between < MIN_BYTES:
            run.status = "failed"
            run.problem = (f"the nodes sent each other only {between} bytes: the ranks did not "
                           "talk over the network")


def _summary(runs: list[Run], stopped: Stopped | None) -> None:
    print("\n### test matrix summary" + (f" (stopped by {stopped.name})" if stopped else ""))
    for run in runs:
        counts = ", ".join(f"{n} {o}" for o, n in sorted(run.counts.items()))
        extra = [f"{len(run.hung)} hung" if run.hung else "",
                 f"{len(run.crashed)} crashed" if run.crashed else "",
                 f"{run.not_run} not run" if run.not_run else ""]
        counts = ", ".join(x for x in [counts, *extra] if x)
        launches = f"; {run.launches} launches" if run.launches > 1 else ""
        print(f"  {run.label:<34} {run.status:<11} {run.seconds:7.1f} s  {counts}{launches}")
        for nodeid in run.hung:
            print(f"      HUNG (aborted after the per-test timeout): {nodeid}")
        for nodeid in run.crashed:
            print(f"      CRASHED: {nodeid}")
        for nodeid in run.failed:
            print(f"      FAILED: {nodeid}")
        if run.problem:
            print(f"      {run.problem}")
        if run.slowest:
            print("      slowest: " + ", ".join(f"{t} {s:.0f} s" for s, t in run.slowest[:3]))
        if run.slowest_files:
            print("      slowest files: " + ", ".join(f"{f} {s:.0f} s"
                                                      for s, f in run.slowest_files))
        if run.link_bytes:
            print("      sent on the links: " + ", ".join(
                f"{host} {sent / 1e6:.1f} MB" for host, sent in run.link_bytes.items()))
        if run.note:
            print(f"      {run.note}")
    sys.stdout.flush()


def run_matrix(runs: list[Run], mpiexec: str, log_root: Path, timeout: float) -> bool:
    """Run every row of the matrix (see the module docstring); True when all passed. Raises
    :class:`~heatlike.testing.children.Stopped` after ending the children and printing the
    summary when the runner is told to stop."""
    stopped = None
    with stop_on_signals():
        try:
            for run in runs:
                if run.status == "skipped":
                    continue
                start_time = time.monotonic()
                try:
                    _execute(run, mpiexec, log_root, timeout)
                finally:
                    run.seconds = time.monotonic() - start_time
        except Stopped as stop:
            stopped = stop
            for run in runs:
                if run.launches and run.status == "not run":
                    run.status = f"stopped ({stop.name})"
        _summary(runs, stopped)
    if stopped is not None:
        raise stopped
    return all(run.status in ("passed", "skipped") for run in runs)


def _worker(pytest_args: list[str]) -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    log_dir = env_str("HEATLIKE_TEST_LOG_DIR")
    if rank != 0 and log_dir:
        # appended: a resumed run's launches share the log
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
    import pytest

    return int(pytest.main(pytest_args))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        rest = argv[1:]
        return _worker(rest[1:] if rest[:1] == ["--"] else rest)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m heatlike.testing.matrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,3,4", help="world sizes (default 1,2,3,4)")
    p.add_argument("--fake-nodes", type=int, default=2,
                   help="emulated nodes for an extra run at the largest size (0: none)")
    p.add_argument("--uneven-nodes", type=int, default=0, metavar="N",
                   help="world size of an extra run of the layout-dependent test files on two "
                        "emulated nodes of N - 1 ranks and 1 (0: none)")
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpiexec"))
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds one mpiexec launch may take in all (default 1200); the test "
                        "running then is reported as hung and the run resumes after it")
    p.add_argument("--real-nodes", type=int, default=0,
                   help="run the multi-rank tests at the largest size on this many nodes of a "
                        "virtual cluster (heatlike.testing.cluster; needs root) instead of the "
                        "emulated run, which stays the fallback when the cluster cannot start")
    p.add_argument("--nodes-size", type=int, default=0,
                   help="world size of the multi-node run (real or emulated nodes); default: "
                        "the largest of --sizes. A size not in --sizes runs only on nodes")
    p.add_argument("--link-rate", default="10gbit",
                   help="the virtual cluster's link rate (default 10gbit)")
    p.add_argument("--log-dir", default=".test-logs")
    opts = p.parse_args(argv)
    sizes = [int(s) for s in opts.sizes.split(",") if s.strip()]
    runs = []
    for size in sizes:
        selection = ["--with-mpi"] if size == 1 else ["--only-mpi"]
        runs.append(Run(f"np={size}", size, {}, [*selection, *extra]))
    real, why = None, ""
    size = opts.nodes_size or max(sizes, default=0)
    if opts.real_nodes and size:
        real, why = _real_nodes_run(opts, size, extra)
        runs.append(real or Run(f"np={size}, {opts.real_nodes} real nodes", size,
                                {}, [], status="skipped", note=f"not run: {why}"))
    if opts.fake_nodes and size and real is None:
        per_node = -(-size // opts.fake_nodes)
        runs.append(Run(f"np={size}, {opts.fake_nodes} emulated nodes", size,
                        {"HEATLIKE_RANKS_PER_NODE": str(per_node)}, ["--only-mpi", *extra],
                        note=f"instead of {opts.real_nodes} real nodes" if why else ""))
    if opts.uneven_nodes >= 3:
        n = opts.uneven_nodes
        runs.append(Run(f"np={n}, uneven nodes {n - 1}+1", n,
                        {"HEATLIKE_RANKS_PER_NODE": str(n - 1)},
                        ["--only-mpi", *UNEVEN_TESTS, *extra]))
    elif opts.uneven_nodes:
        p.error(f"--uneven-nodes {opts.uneven_nodes}: give 3 or more ranks (nodes of N - 1 "
                "and 1 ranks, the first of more than one)")
    try:
        ok = run_matrix(runs, opts.mpiexec, Path(opts.log_dir), opts.timeout)
    except Stopped as stop:
        return 128 + stop.signum
    finally:
        if real is not None:
            with held_signals():
                real.cluster.down()
    return 0 if ok else 1


def _real_nodes_run(opts: argparse.Namespace, size: int,
                    extra: list[str]) -> tuple[Run | None, str]:
    """The run of the multi-rank tests on ``opts.real_nodes`` nodes of a virtual cluster
    (created here, removed by the caller), or None and why the cluster cannot be used."""
    per_node = -(-size // opts.real_nodes)
    try:
        if opts.real_nodes < 2 or size < opts.real_nodes:
            raise ValueError(f"--real-nodes {opts.real_nodes}: give 2 or more nodes, at most "
                             f"the multi-node run's size ({size})")
        # a name of its own: other runners and the cluster tests may have clusters up
        cluster = VirtualCluster([per_node] * opts.real_nodes, opts.link_rate,
                                 name=f"hlm{os.getpid() % 100000}", mpiexec=opts.mpiexec)
        placement = cluster.placement(n=size)
        with held_signals():
            cluster.up(temporary=True)
        try:
            cluster.command(placement)  # is opts.mpiexec MPICH's Hydra?
        except ClusterError:
            with held_signals():
                cluster.down()
            raise
    except (ClusterError, ValueError) as e:
        why = str(e)
        print(f"### {opts.real_nodes} real nodes: {why}", flush=True)
        return None, why
    layout = "+".join(str(k) for k in placement)
    return Run(f"np={size}, {opts.real_nodes} real nodes", size, {}, ["--only-mpi", *extra],
               cluster=cluster, placement=placement,
               note=f"virtual cluster {cluster.name}: ranks {layout}, links at "
                    f"{cluster.rate}"), ""


if __name__ == "__main__":
    sys.exit(main())
