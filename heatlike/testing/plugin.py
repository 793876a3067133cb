"""pytest plugin for tests that run under ``mpiexec`` (enabled with ``-p heatlike.testing.plugin``).

* **One verdict per test on every rank.** After each phase (setup, call, teardown) of a test the
  ranks exchange their outcomes on a private duplicate of ``COMM_WORLD``. If the test failed on
  any rank it fails on every rank, and the report shows each failing rank's traceback; a test
  skipped on some ranks but not on others fails too (a rank-dependent skip would desynchronize
  collectives).
* **No silent hang.** A watchdog thread aborts the whole job (``MPI_Abort``) when a test runs
  longer than its limit, after printing the test's name, the rank and every thread's stack, and
  recording the test id in ``$HEATLIKE_TEST_STATE_DIR`` so the matrix runner can report it and
  go on after it. The limit is ``--mpi-timeout`` seconds (default ``HEATLIKE_TEST_TIMEOUT`` or
  100); a test marked ``@pytest.mark.slow`` gets ``--mpi-slow-factor`` times that (default
  ``HEATLIKE_TEST_SLOW_FACTOR`` or 4), and ``@pytest.mark.mpi_timeout(S)`` sets S seconds.
* **Same collection everywhere.** The ranks compare their collected test ids before running any.
* **Resumable runs.** With ``$HEATLIKE_TEST_STATE_DIR`` set, rank 0 writes there the ids of
  the tests collected (``collected.txt``), the test now running (``started.txt``, emptied when
  it finishes) and one line ``outcome<TAB>seconds<TAB>id`` per finished test (``finished.txt``,
  appended) with the traceback of each failure (``failures.txt``), and every rank deselects
  the ids listed in ``skip.txt``. The matrix runner uses them to start a new launch after the
  test that hung or crashed, without running again the tests already finished.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import sys
import threading
import time

import pytest
from mpi4py import MPI

from ..core.env import env_float, env_str

_state: dict = {"comm": None, "deadline": None, "nodeid": None, "timeout": 100.0,
                "limit": 100.0, "slow_factor": 4.0, "outcome": None, "started": 0.0}
_lock = threading.Lock()
# pytest's output capture redirects fd 2 while tests run; the watchdog reports on a duplicate of
# the original stderr, taken when the plugin is imported (before capturing starts)
try:
    _report = os.fdopen(os.dup(2), "w", buffering=1)
except OSError:  # pragma: no cover - no stderr at all
    _report = sys.__stderr__


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mpi-timeout", type=float,
        default=env_float("HEATLIKE_TEST_TIMEOUT", 100.0, minimum=1.0, meaning="seconds"),
        help="seconds a single test may run before the whole MPI job is aborted (default 100)")
    parser.addoption(
        "--mpi-slow-factor", type=float,
        default=env_float("HEATLIKE_TEST_SLOW_FACTOR", 4.0, minimum=1.0),
        help="tests marked slow may run this many times --mpi-timeout (default 4)")


def _state_file(name: str) -> str | None:
    """A file of the runner's state directory, written by rank 0 only (None: not recorded)."""
    state_dir = env_str("HEATLIKE_TEST_STATE_DIR")
    if not state_dir or _world().Get_rank() != 0:
        return None
    return os.path.join(state_dir, name)


def _record(name: str, text: str, mode: str = "w") -> None:
    path = _state_file(name)
    if path is not None:
        with contextlib.suppress(OSError), open(path, mode) as f:
            f.write(text)


def _world() -> MPI.Intracomm:
    return MPI.COMM_WORLD


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi_timeout(seconds): per-test watchdog timeout")
    config.addinivalue_line("markers", "slow: a long test; its watchdog timeout is "
                            "--mpi-slow-factor times --mpi-timeout")
    config.addinivalue_line("markers", "system: starts its own MPI jobs, programs, virtual "
                            "cluster or SLURM (selected with -m system, e.g. make test-system)")
    _state["timeout"] = config.getoption("--mpi-timeout")
    _state["slow_factor"] = config.getoption("--mpi-slow-factor")
    if _state["comm"] is None:
        _state["comm"] = _world().Dup()
        threading.Thread(target=_watchdog, name="heatlike-test-watchdog", daemon=True).start()


def pytest_unconfigure(config: pytest.Config) -> None:
    comm = _state["comm"]
    if comm is not None and not MPI.Is_finalized():
        with _lock:
            _state["deadline"] = None
        comm.Free()
        _state["comm"] = None
    if _report is not sys.__stderr__ and not _report.closed:
        _report.close()


def _watchdog() -> None:
    while True:
        time.sleep(0.5)
        with _lock:
            deadline, nodeid = _state["deadline"], _state["nodeid"]
        if deadline is None or time.monotonic() < deadline:
            continue
        rank, size = _world().Get_rank(), _world().Get_size()
        _report.write(
            f"\n[heatlike.testing] TIMEOUT: {nodeid} ran longer than {_state['limit']:.0f} s "
            f"on rank {rank} of {size} (a stuck collective?); aborting all ranks.\n")
        _report.flush()
        faulthandler.dump_traceback(file=_report, all_threads=True)
        _report.flush()
        state_dir = env_str("HEATLIKE_TEST_STATE_DIR")
        if state_dir:
            # best effort: the runner still reports the hang without the test's name
            with contextlib.suppress(OSError), open(
                    os.path.join(state_dir, f"hung-rank{rank}.txt"), "w") as f:
                f.write(nodeid or "")
        # mpiexec forwards a rank's output through pipes and drops what is still in them once
        # an abort has killed the job: give the message time to reach it
        time.sleep(1.0)
        _world().Abort(124)
        os._exit(124)


def timeout_for(item: pytest.Item) -> float:
    """The watchdog's limit for ``item`` in seconds (0: none): ``mpi_timeout(S)`` if marked,
    else ``--mpi-timeout``, times ``--mpi-slow-factor`` for a test marked ``slow``."""
    marker = item.get_closest_marker("mpi_timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    timeout = _state["timeout"]
    if item.get_closest_marker("slow") is not None:
        timeout *= _state["slow_factor"]
    return timeout


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    timeout = timeout_for(item)
    _state["outcome"], _state["started"] = "passed", time.monotonic()
    _record("started.txt", item.nodeid + "\n")
    with _lock:
        _state["nodeid"] = item.nodeid
        _state["limit"] = timeout
        _state["deadline"] = time.monotonic() + timeout if timeout > 0 else None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # the verdict of every phase is the same on every rank (pytest_runtest_makereport)
    if report.failed:
        _state["outcome"] = "failed"
        # pytest prints the tracebacks at the end of the session, which a launch aborted by a
        # later hang never reaches: the runner prints them from here then
        _record("failures.txt", f"{'_' * 20} {report.nodeid} ({report.when}) {'_' * 20}\n"
                f"{_text(report)}\n", "a")
    elif report.skipped and _state["outcome"] != "failed":
        _state["outcome"] = "skipped"


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str, location) -> None:
    with _lock:
        _state["deadline"] = None
    seconds = time.monotonic() - _state["started"]
    _record("finished.txt", f"{_state['outcome']}\t{seconds:.2f}\t{nodeid}\n", "a")
    _record("started.txt", "")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    state_dir = env_str("HEATLIKE_TEST_STATE_DIR")
    if not state_dir:
        return
    try:
        with open(os.path.join(state_dir, "skip.txt")) as f:
            skip = {line.rstrip("\n") for line in f if line.strip()}
    except OSError:
        return
    kept = [i for i in items if i.nodeid not in skip]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in skip])
        items[:] = kept


def pytest_collection_finish(session: pytest.Session) -> None:
    _record("collected.txt", "".join(i.nodeid + "\n" for i in session.items))
    comm = _state["comm"]
    if comm is None or comm.Get_size() == 1:
        return
    digest = hashlib.sha1("\n".join(i.nodeid for i in session.items).encode()).hexdigest()
    digests = comm.allgather((digest, len(session.items)))
    if len(set(digests)) != 1:
        _report.write(f"[heatlike.testing] ranks collected different tests: {digests}; "
                      "aborting\n")
        _report.flush()
        _world().Abort(4)


def _text(report: pytest.TestReport) -> str:
    try:
        return report.longreprtext
    except Exception:  # pragma: no cover - defensive: a report without text
        return str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    comm = _state["comm"]
    if comm is None or comm.Get_size() == 1:
        return
    report = outcome.get_result()
    xfail = hasattr(report, "wasxfail")
    mine = (report.outcome, _text(report) if report.failed else "", xfail)
    everyone = comm.allgather(mine)
    failed = [(r, text) for r, (o, text, _) in enumerate(everyone) if o == "failed"]
    outcomes = {o for o, _, _ in everyone}
    if failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(
            f"{'=' * 20} {report.when} failed on rank {r} of {comm.Get_size()} {'=' * 20}\n"
            f"{text}" for r, text in failed)
    elif len(outcomes) > 1 and not any(x for _, _, x in everyone):
        by = {o: [r for r, (oo, _, _) in enumerate(everyone) if oo == o] for o in outcomes}
        report.outcome = "failed"
        report.longrepr = (f"{report.when}: ranks disagree on the outcome {by}; a test must "
                           "skip or pass on all ranks alike")
