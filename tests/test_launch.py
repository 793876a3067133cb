"""An uncaught exception on one rank aborts the whole job, with the rank and the traceback."""

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from heatlike.testing.matrix import _clean_env


def mpiexec() -> str:
    local = Path(sys.executable).with_name("mpiexec")
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec")
    return found


SCRIPT = textwrap.dedent("""
    from mpi4py import MPI
    import heatlike
    {decorate}
    def main():
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            raise RuntimeError("boom on purpose")
        comm.Barrier()  # the other ranks would wait here forever
    main()
""")


@pytest.mark.parametrize("how", ["python -m heatlike", "decorator"])
def test_exception_on_one_rank_aborts_job(tmp_path, how):
    decorate = "@heatlike.utils.abort_on_exception()" if how == "decorator" else ""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(decorate=decorate))
    cmd = [mpiexec(), "-n", "3", sys.executable]
    cmd += ["-m", "heatlike", str(script)] if how.startswith("python") else [str(script)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_clean_env())
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < 30, f"abort took {elapsed:.1f} s"
    assert "uncaught exception on rank 1 of 3" in out, out
    assert "RuntimeError: boom on purpose" in out and "Traceback" in out, out
