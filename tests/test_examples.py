"""Examples and job scripts run as documented."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import mpiexec

from heatlike.testing.matrix import _clean_env

ROOT = Path(__file__).resolve().parent.parent


def test_communication_tour_runs_on_emulated_nodes():
    env = {**_clean_env(), "HEATLIKE_RANKS_PER_NODE": "2", "HEATLIKE_LOG_RANKS": "0"}
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "heatlike",
                           str(ROOT / "examples" / "communication_tour.py")],
                          capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "sum of arange(4) + rank over 3 ranks: [3.0, 6.0, 9.0, 12.0]" in out, out
    assert "bf16 256 + 2 x 1.0 = 258.0" in out, out
    assert "2 node(s) of sizes [2, 1]; cross-node groups: [[0, 2], [1]]" in out, out


@pytest.mark.parametrize("mode", ["--non-blocking", "--blocking"])
def test_digits_example_learns(mode):
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "heatlike",
                           str(ROOT / "examples" / "digits.py"), "--epochs", "8", mode],
                          capture_output=True, text=True, timeout=180, env=_clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracy = float(out.split("test accuracy: ")[-1].split()[0])
    assert accuracy >= 0.9, out
    assert "epoch  8/8" in out, out
