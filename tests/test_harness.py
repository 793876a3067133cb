"""The test harness itself: a failure on one rank fails the test on every rank; a hung or crashed
test is killed, named, and the run goes on after it (each test runs once, however many hang);
slow tests get a longer watchdog; stopping the runner leaves no process behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from test_launch import mpiexec

from heatlike.testing.children import Stopped, stop_on_signals
from heatlike.testing.matrix import _clean_env

SUITE = textwrap.dedent("""
    import pytest
    from mpi4py import MPI

    @pytest.mark.mpi
    def test_fails_on_rank_one_only():
        assert MPI.COMM_WORLD.rank != 1, "rank one disagrees"

    @pytest.mark.mpi
    def test_hangs_in_a_collective():
        if MPI.COMM_WORLD.rank == 0:
            MPI.COMM_WORLD.Barrier()  # rank 1 never joins

    @pytest.mark.mpi
    def test_after_the_hang():
        MPI.COMM_WORLD.Barrier()
""")


def _matrix(tmp_path: Path, size: int, *pytest_args: str) -> list[str]:
    return [sys.executable, "-m", "heatlike.testing.matrix", "--sizes", str(size),
            "--fake-nodes", "0", "--mpiexec", mpiexec(), "--log-dir", str(tmp_path / "logs"),
            "--", str(tmp_path), "-p", "heatlike.testing.plugin", "-p", "no:cacheprovider",
            *pytest_args]


@pytest.mark.system
@pytest.mark.slow  # two launches at two ranks
def test_harness_propagates_failures_and_survives_hangs(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    cmd = _matrix(tmp_path, 2, "--mpi-timeout", "5", "-rA")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=_clean_env())
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # rank 1's assertion is reported by rank 0's pytest, i.e. the test failed on every rank
    assert "failed on rank 1 of 2" in out and "rank one disagrees" in out, out
    # the hang is killed within the per-test timeout, named, and reported in the summary
    assert "TIMEOUT: test_suite.py::test_hangs_in_a_collective" in out, out
    assert "HUNG (aborted after the per-test timeout): test_suite.py::test_hangs_in_a_collective" \
        in out, out
    assert "FAILED: test_suite.py::test_fails_on_rank_one_only" in out, out
    # the suite went on after it, without running the first test again
    assert "PASSED test_suite.py::test_after_the_hang" in out, out
    assert "2 launches" in out, out  # the first, and one after the hang
    assert elapsed < 180, elapsed  # the hang cost its 5 s, not the default 100


# every test appends its name to ran.txt: the run must resume after each hang or crash, not
# start over, and must not give up after a few hangs (the runner of before started over after a
# hang, gave up at the third, and stopped at a crash)
RESUMING = textwrap.dedent("""
    import os
    import time

    import pytest

    def _ran(name):
        with open(os.path.join(os.path.dirname(__file__), "ran.txt"), "a") as f:
            f.write(name + "\\n")

    def test_a():
        _ran("a")

    def test_hang_1():
        _ran("hang_1"); time.sleep(120)

    def test_b():
        _ran("b")

    def test_crash():
        _ran("crash"); os._exit(3)

    def test_hang_2():
        _ran("hang_2"); time.sleep(120)

    def test_c():
        _ran("c"); assert 1 == 2, "c fails on purpose"

    def test_hang_3():
        _ran("hang_3"); time.sleep(120)

    @pytest.mark.slow
    def test_slow_but_within_its_limit():
        _ran("slow"); time.sleep(3)

    def test_last():
        _ran("last")
""")


@pytest.mark.system
@pytest.mark.slow  # five launches of mpiexec
def test_runner_resumes_after_each_hang_and_runs_every_test_once(tmp_path):
    (tmp_path / "test_resuming.py").write_text(RESUMING)
    cmd = _matrix(tmp_path, 1, "--mpi-timeout", "2", "--mpi-slow-factor", "3")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=tmp_path,
                          env=_clean_env())
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    ran = (tmp_path / "ran.txt").read_text().split()
    assert ran == ["a", "hang_1", "b", "crash", "hang_2", "c", "hang_3", "slow", "last"], out
    summary = out[out.index("### test matrix summary"):]
    for name in ("hang_1", "hang_2", "hang_3"):
        assert ("HUNG (aborted after the per-test timeout): "
                f"test_resuming.py::test_{name}") in summary, out
    assert "CRASHED: test_resuming.py::test_crash (mpiexec exit status 3)" in summary, out
    assert "FAILED: test_resuming.py::test_c" in summary, out
    assert "4 passed" in summary and "1 failed" in summary and "3 hung" in summary, out
    assert "5 launches" in summary, out
    # the failure's traceback is shown although pytest's own report never came (aborted launch)
    assert "c fails on purpose" in out, out
    assert elapsed < 240, elapsed


SLEEPER = textwrap.dedent("""
    import os
    import subprocess
    import sys
    import time

    def test_sleeps_and_starts_a_process():
        here = os.path.dirname(__file__)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", here])
        open(os.path.join(here, "running"), "w").close()
        time.sleep(300)
""")


def _processes_with(token: str) -> list[str]:
    """Command lines of the processes (not zombies) that mention ``token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if token in cmdline and state != "Z" and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.mark.system
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "parent killed"])
def test_stopping_the_runner_leaves_no_process_behind(tmp_path, how):
    """The runner's mpiexec, its ranks and what they started go when the runner is stopped by a
    signal, or when the runner's parent dies (SIGKILL, no chance to clean up)."""
    token = f"hl-stop-{uuid.uuid4().hex[:12]}"
    suite = tmp_path / token
    suite.mkdir()
    (suite / "test_sleeper.py").write_text(SLEEPER)
    cmd = _matrix(suite, 2, "--with-mpi", "--mpi-timeout", "600")
    if how == "parent killed":  # a parent (make, a CI step) that dies without a word
        cmd = [sys.executable, "-c", "import subprocess, sys, time; "
               "subprocess.Popen(sys.argv[1:]); time.sleep(600)", *cmd]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_clean_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (suite / "running").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        assert len(_processes_with(token)) >= 5  # runner, mpiexec, two ranks, their children
        start = time.monotonic()
        proc.send_signal(signal.SIGKILL if how == "parent killed" else getattr(signal, how))
        out, _ = proc.communicate(timeout=60)
        left = _processes_with(token)
        while left and time.monotonic() - start < 20:
            time.sleep(0.2)
            left = _processes_with(token)
        assert not left, f"left behind {time.monotonic() - start:.1f} s after {how}:\n" + \
            "\n".join(left) + "\n" + out
        if how != "parent killed":
            assert proc.returncode == 128 + getattr(signal, how), out
            assert f"### test matrix summary (stopped by {how})" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_stop_signals_raise_once_and_handlers_come_back(signum):
    """Each stop signal becomes one Stopped in the launcher; a second one during the clean-up
    is ignored; the previous handler is back afterwards."""
    before = signal.getsignal(signum)
    if before == signal.SIG_IGN:
        pytest.skip(f"{signal.Signals(signum).name} is ignored here (nohup)")
    with pytest.raises(Stopped) as caught, stop_on_signals():
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here
        finally:
            os.kill(os.getpid(), signum)  # during the clean-up: ignored
            time.sleep(0.1)
    assert caught.value.signum == signum
    assert signal.getsignal(signum) is before


def test_the_uneven_nodes_run_needs_three_ranks_and_names_existing_files(capsys):
    """``--uneven-nodes N`` runs nodes of N - 1 ranks and 1: fewer than 3 ranks is a usage error
    (nothing launched); every file it takes exists, so that a renamed one cannot drop out."""
    from heatlike.testing.matrix import UNEVEN_TESTS, main

    root = Path(__file__).resolve().parent.parent
    assert all((root / name).is_file() for name in UNEVEN_TESTS), UNEVEN_TESTS
    with pytest.raises(SystemExit) as stopped:
        main(["--sizes", "", "--fake-nodes", "0", "--uneven-nodes", "2"])
    assert stopped.value.code == 2
    assert "--uneven-nodes 2: give 3 or more ranks" in capsys.readouterr().err
