"""pytest plugin for tests that run under ``mpiexec`` (enabled with ``-p heatlike.testing.plugin``).

* **One verdict per test on every rank.** After each phase (setup, call, teardown) of a test the
  ranks exchange their outcomes on a private duplicate of ``COMM_WORLD``. If the test failed on
  any rank it fails on every rank, and the report shows each failing rank's traceback; a test
  skipped on some ranks but not on others fails too (a rank-dependent skip would desynchronize
  collectives).
* **No silent hang.** A watchdog thread aborts the whole job (``MPI_Abort``) when a test runs
  longer than ``--mpi-timeout`` seconds (default ``HEATLIKE_TEST_TIMEOUT`` or 100), after
  printing the test's name, the rank and every thread's stack, and recording the test id in
  ``$HEATLIKE_TEST_STATE_DIR`` so the matrix runner can report it and go on without it.
* **Same collection everywhere.** The ranks compare their collected test ids before running any.
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

_state: dict = {"comm": None, "deadline": None, "nodeid": None, "timeout": 100.0}
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
        default=float(os.environ.get("HEATLIKE_TEST_TIMEOUT", "100")),
        help="seconds a single test may run before the whole MPI job is aborted (default 100)")


def _world() -> MPI.Intracomm:
    return MPI.COMM_WORLD


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi_timeout(seconds): per-test watchdog timeout")
    _state["timeout"] = config.getoption("--mpi-timeout")
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
            f"\n[heatlike.testing] TIMEOUT: {nodeid} ran longer than {_state['timeout']:.0f} s "
            f"on rank {rank} of {size} (a stuck collective?); aborting all ranks.\n")
        _report.flush()
        faulthandler.dump_traceback(file=_report, all_threads=True)
        _report.flush()
        state_dir = os.environ.get("HEATLIKE_TEST_STATE_DIR")
        if state_dir:
            # best effort: the runner still reports the hang without the test's name
            with contextlib.suppress(OSError), open(
                    os.path.join(state_dir, f"hung-rank{rank}.txt"), "w") as f:
                f.write(nodeid or "")
        _world().Abort(124)
        os._exit(124)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    timeout = _state["timeout"]
    marker = item.get_closest_marker("mpi_timeout")
    if marker is not None and marker.args:
        timeout = float(marker.args[0])
    with _lock:
        _state["nodeid"] = item.nodeid
        _state["deadline"] = time.monotonic() + timeout if timeout > 0 else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str, location) -> None:
    with _lock:
        _state["deadline"] = None


def pytest_collection_finish(session: pytest.Session) -> None:
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
