"""The test harness itself: a failure on one rank fails the test on every rank, and a hung
collective is killed, named, and the rest of the suite still runs."""

import subprocess
import sys
import textwrap
import time

from test_launch import mpiexec

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


def test_harness_propagates_failures_and_survives_hangs(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    cmd = [sys.executable, "-m", "heatlike.testing.matrix", "--sizes", "2", "--fake-nodes", "0",
           "--mpiexec", mpiexec(), "--log-dir", str(tmp_path / "logs"), "--",
           str(tmp_path), "-p", "heatlike.testing.plugin", "--mpi-timeout", "5",
           "-p", "no:cacheprovider", "-rA"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
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
    # the suite went on without it
    assert "PASSED test_suite.py::test_after_the_hang" in out, out
    assert elapsed < 120, elapsed
