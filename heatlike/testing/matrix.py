"""Run the test suite under ``mpiexec`` at several world sizes and on an emulated multi-node layout.

    python -m heatlike.testing.matrix [--sizes 1,2,3,4] [--fake-nodes 2] [--mpiexec CMD]
                                      [--timeout S] [-- PYTEST ARGS]

At one rank every test runs; at more ranks only the tests marked ``@pytest.mark.mpi`` (pytest-mpi)
do. ``--fake-nodes K`` adds a run at the largest size with ``HEATLIKE_RANKS_PER_NODE`` set so
that the ranks form K emulated nodes.

Rank 0 prints pytest's output; the other ranks write theirs to ``.test-logs/<run>/rank<r>.log``
(the plugin copies every rank's failures into rank 0's report). When the plugin's watchdog aborts
a run because a test hung, the runner records that test as a failure and runs the rest of the
suite again without it, so one hang costs one timeout and hides nothing. The exit status is
non-zero when any run failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_MAX_HANGS_PER_RUN = 3


@dataclass
class Run:
    label: str
    size: int
    env: dict[str, str]
    pytest_args: list[str]
    status: str = "not run"
    seconds: float = 0.0
    hung: list[str] = field(default_factory=list)


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


def _run_once(run: Run, mpiexec: str, log_root: Path, timeout: float, deselect: list[str]) -> str:
    """One mpiexec launch; returns 'passed', 'failed', 'hung:<nodeid>' or 'crashed (...)'."""
    state = Path(tempfile.mkdtemp(prefix="heatlike-test-state-"))
    logs = log_root / run.label.replace(" ", "_").replace(",", "")
    logs.mkdir(parents=True, exist_ok=True)
    env = {**_clean_env(), **run.env, "HEATLIKE_TEST_STATE_DIR": str(state),
           "HEATLIKE_TEST_LOG_DIR": str(logs), "PYTHONUNBUFFERED": "1"}
    args = [*run.pytest_args, *(f"--deselect={d}" for d in deselect)]
    cmd = [*_mpiexec_cmd(mpiexec, run.size), sys.executable, "-m", "heatlike.testing.matrix",
           "--worker", "--", *args]
    print(f"\n### {run.label}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    hung = sorted({p.read_text().strip() for p in state.glob("hung-rank*.txt")} - {""})
    shutil.rmtree(state, ignore_errors=True)
    if hung:
        return "hung:" + hung[0]
    if rc is None:
        return f"crashed (no result within {timeout:.0f} s)"
    if rc == 0:
        return "passed"
    if rc == 1:
        return "failed"
    return f"crashed (exit status {rc}; see the output above and {logs})"


def run_matrix(runs: list[Run], mpiexec: str, log_root: Path, timeout: float) -> bool:
    for run in runs:
        start = time.monotonic()
        deselect: list[str] = []
        while True:
            result = _run_once(run, mpiexec, log_root, timeout, deselect)
            if not result.startswith("hung:"):
                break
            nodeid = result[len("hung:"):]
            run.hung.append(nodeid)
            deselect.append(nodeid)
            print(f"### {run.label}: {nodeid} HUNG and was aborted; running the rest without it",
                  flush=True)
            if len(run.hung) >= _MAX_HANGS_PER_RUN:
                result = "failed (too many hangs)"
                break
        run.status = "failed (hang)" if run.hung and result == "passed" else result
        run.seconds = time.monotonic() - start
    print("\n### test matrix summary")
    for run in runs:
        print(f"  {run.label:<34} {run.status:<14} {run.seconds:6.1f} s")
        for nodeid in run.hung:
            print(f"      HUNG (aborted after the per-test timeout): {nodeid}")
    return all(run.status == "passed" for run in runs)


def _worker(pytest_args: list[str]) -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    log_dir = os.environ.get("HEATLIKE_TEST_LOG_DIR")
    if rank != 0 and log_dir:
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpiexec"))
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds one mpiexec launch may take in all (default 1200)")
    p.add_argument("--log-dir", default=".test-logs")
    opts = p.parse_args(argv)
    sizes = [int(s) for s in opts.sizes.split(",") if s.strip()]
    runs = []
    for size in sizes:
        selection = ["--with-mpi"] if size == 1 else ["--only-mpi"]
        runs.append(Run(f"np={size}", size, {}, [*selection, *extra]))
    if opts.fake_nodes and sizes:
        size = max(sizes)
        per_node = -(-size // opts.fake_nodes)
        runs.append(Run(f"np={size}, {opts.fake_nodes} emulated nodes", size,
                        {"HEATLIKE_RANKS_PER_NODE": str(per_node)}, ["--only-mpi", *extra]))
    ok = run_matrix(runs, opts.mpiexec, Path(opts.log_dir), opts.timeout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
