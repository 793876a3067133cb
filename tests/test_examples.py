"""Examples and job scripts run as documented; every example answers ``--help``; benchmark
progress bars stay out of output that is not a terminal."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI
from test_launch import mpiexec

from heatlike.testing.matrix import _clean_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.system
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


@pytest.mark.system
@pytest.mark.slow  # 8 epochs under mpiexec
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
    assert "epochs, on cpu" in out or "epochs, on cuda" in out, out  # --device auto


@pytest.mark.system
@pytest.mark.slow  # two jobs of 3 epochs under mpiexec
def test_cnn_example_learns_and_sharding_the_state_changes_nothing_but_memory():
    """SyncBatchNorm (the default) with Adam, then the same with its state sharded (--zero):
    the same losses and accuracy to every printed digit, half the state per rank."""
    outs = []
    for extra in ([], ["--zero"]):
        proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "heatlike",
                               str(ROOT / "examples" / "cnn_digits.py"), "--epochs", "3",
                               *extra], capture_output=True, text=True, timeout=180,
                              env=_clean_env())
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "synchronized batch norm" in out, out
        outs.append(out)
    epochs = [[line.split("INFO: ")[1] for line in out.splitlines() if "epoch " in line]
              for out in outs]
    assert len(epochs[0]) == 3 and epochs[0] == epochs[1], outs
    assert float(outs[0].split("test accuracy: ")[-1].split()[0]) >= 0.9, outs[0]
    state = [ast.literal_eval(out.split("optimizer state per rank (MiB): ")[1].split("\n")[0])
             for out in outs]
    assert max(state[1]) < 0.75 * max(state[0]), state


@pytest.mark.system
def test_uneven_example_trains_the_single_process_model():
    """Shards of three sizes under Join: every epoch the ranks run different numbers of batches,
    and the model is the single process's with the combined batches (its own check)."""
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "heatlike",
                           str(ROOT / "examples" / "uneven.py"), "--epochs", "3", "--check"],
                          capture_output=True, text=True, timeout=180, env=_clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "batches per rank [15, 30, 45]" in out, out
    difference = float(out.split("with the combined batches: ")[1].split()[0])
    assert difference < 1e-4, out
    assert float(out.split("test accuracy: ")[-1].split()[0]) >= 0.85, out


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
TRAINING = ("digits.py", "daso_digits.py", "resume.py", "cnn_digits.py",
            "uneven.py")  # each takes --device


@pytest.mark.system
@pytest.mark.slow  # five interpreters importing torch
def test_every_example_explains_itself_with_help():
    """``python examples/X.py --help`` (no mpiexec) prints usage and the example's whole
    description, exits 0, and runs nothing; for every example (all at once: each imports torch)."""
    assert len(EXAMPLES) >= 5, EXAMPLES
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / name), "--help"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=_clean_env())
             for name in EXAMPLES}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out = f"{name}:\n{stdout}{stderr}"
        assert proc.returncode == 0, out
        assert stdout.startswith(f"usage: {name}"), out
        assert "Traceback" not in out and "[rank 0" not in out, out  # nothing ran or logged
        # the description is the module docstring, complete (not cut after its first line)
        doc = ast.get_docstring(ast.parse((ROOT / "examples" / name).read_text()))
        assert " ".join(doc.split()) in " ".join(stdout.split()), out
        if name in TRAINING:
            assert "--device {auto,cpu,cuda}" in stdout, out


@pytest.mark.mpi
def test_bench_progress_bars_only_on_a_terminal(monkeypatch, capsys):
    """Progress bars of ``python -m heatlike.bench`` stay out of output that is not a terminal
    (a file, a pipe, mpiexec's forwarding), where they would tangle with the tables;
    ``--progress`` asks for them anyway. Every rank runs the suite, rank 0 alone prints (before:
    at 2 ranks rank 1 failed its assertion and rank 0 waited for it in the second run)."""
    from heatlike.bench import __main__ as bench
    from heatlike.bench import _common as bench_common

    def suite(results, quick=False):
        for _ in bench_common.progress(range(3), "fake suite"):
            bench_common.say("| a table row |")

    monkeypatch.setitem(bench.SUITES, "comm", suite)
    monkeypatch.setattr(bench_common, "_PROGRESS", None)
    rows = 3 if MPI.COMM_WORLD.rank == 0 else 0  # tables and bars are rank 0's
    assert bench.main(["comm"]) == 0
    plain = capsys.readouterr()
    assert bench.main(["comm", "--progress"]) == 0  # collective: every rank, before asserting
    bars = capsys.readouterr()
    assert plain.out.count("| a table row |") == rows, plain
    assert "fake suite" not in plain.err and "\r" not in plain.err + plain.out, plain
    assert bars.out.count("| a table row |") == rows, bars
    assert ("fake suite" in bars.err) == (rows > 0), bars


def _imported_names(path: Path) -> list[str]:
    """Every ``module`` and ``module.name`` an example imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_examples_use_only_the_public_api():
    """An example is a user's code: it imports heatlike's public modules and names only (no
    benchmark internals, testing aids or underscore names)."""
    for name in EXAMPLES:
        for imported in _imported_names(ROOT / "examples" / name):
            if imported.split(".")[0] != "heatlike":
                continue
            parts = imported.split(".")
            assert not any(p.startswith("_") for p in parts), (name, imported)
            assert parts[1:2] not in (["bench"], ["testing"]), (name, imported)
