"""examples/kmeans.py runs as documented under mpiexec (one launch, from the single-rank run)."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import mpiexec

from heatlike.testing.matrix import _clean_env

pytestmark = pytest.mark.system  # runs the example under mpiexec

ROOT = Path(__file__).resolve().parent.parent


def test_kmeans_example_script_runs():
    env = {**_clean_env(), "HEATLIKE_LOG_RANKS": "0"}
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "heatlike",
                           str(ROOT / "examples" / "kmeans.py"), "3000"],
                          capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3000 samples on 3 ranks" in out, out
    assert "[-4.0, 4.0, 2.0]" in out and "[4.0, 4.0, 0.0]" in out, out
