"""Resume in a new process (examples/resume.py under mpiexec): a run stopped after k steps and
started again ends with the same parameters, bit for bit, as a run never stopped; so does a run
whose rank was killed between two checkpoints; a checkpoint loads at another world size; a save
interrupted by a signal leaves no temporary file."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_launch import mpiexec

import heatlike as hl
from heatlike.testing.matrix import _clean_env

pytestmark = pytest.mark.system  # every test starts MPI jobs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "resume.py"


def _job(ranks: int, *args, env=None, check=True) -> str:
    proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, "-m", "heatlike",
                           str(EXAMPLE), *map(str, args)], capture_output=True, text=True,
                          timeout=180, env={**_clean_env(), "HEATLIKE_LOG_RANKS": "0",
                                            **(env or {})})
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, out
    return out


def _digest(out: str) -> str:
    found = re.findall(r"final parameters sha256: (\w+)", out)
    assert found, out
    return found[-1]


_STRAIGHT: dict[tuple, str] = {}


def _straight(tmp_path: Path, ranks: int, name: str, epochs: int, env=None) -> str:
    """The digest of an uninterrupted run (run once per configuration in this module)."""
    key = (ranks, name, epochs, tuple(sorted((env or {}).items())))
    if key not in _STRAIGHT:
        _STRAIGHT[key] = _digest(_job(ranks, "--algorithm", name, "--epochs", epochs,
                                      "--checkpoint", tmp_path / "straight.ckpt", env=env))
    return _STRAIGHT[key]


# (algorithm, ranks, epochs, stop after, environment): DASO on two emulated nodes stops right
# after a global synchronization was sent and before it is merged. The engines with state of
# their own (PowerSGD, top-k, DistOpt's sparse mode, ...) resume bit for bit in-process in
# test_checkpoint.py and test_resume_models.py; here a new process resumes the example (and
# top-k's state is reset when the checkpoint loads at another world size, below).
CASES = [("allreduce", 2, 2, 50, {}),
         ("daso", 2, 3, 54, {"HEATLIKE_RANKS_PER_NODE": "1"})]


@pytest.mark.slow  # three training runs under mpiexec
@pytest.mark.parametrize("name,ranks,epochs,stop,env", CASES, ids=[c[0] for c in CASES])
def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path, name, ranks, epochs, stop, env):
    common = ["--algorithm", name, "--epochs", epochs]
    path = tmp_path / "b.ckpt"
    first = _job(ranks, *common, "--checkpoint", path, "--stop-after", stop, env=env)
    assert f"stopped after step {stop}" in first
    second = _job(ranks, *common, "--checkpoint", path, env=env)
    assert f"resumed from {path} at step {stop}" in second
    assert _digest(second) == _straight(tmp_path, ranks, name, epochs, env)


@pytest.mark.slow  # three training runs under mpiexec
def test_a_kill_between_checkpoints_resumes_from_the_last_complete_one(tmp_path):
    path = tmp_path / "c.ckpt"
    common = ["--algorithm", "allreduce", "--epochs", 2, "--checkpoint", path]
    killed = _job(2, *common, "--save-every", 20, "--kill-at", 50, check=False)
    assert "final parameters" not in killed
    resumed = _job(2, *common, "--save-every", 20)
    assert f"resumed from {path} at step 40" in resumed
    assert _digest(resumed) == _straight(tmp_path, 2, "allreduce", 2)


@pytest.mark.slow  # two training runs under mpiexec
def test_a_checkpoint_loads_at_another_world_size(tmp_path):
    path = tmp_path / "e.ckpt"
    common = ["--algorithm", "topk-1%", "--epochs", 2, "--checkpoint", path]
    _job(2, *common, "--stop-after", 30)
    out = _job(3, *common)
    assert "saved at 2 ranks, loaded at 3" in out and "reset: optimizer.engine" in out, out
    accuracy = float(re.findall(r"test accuracy: ([\d.]+)", out)[-1])
    assert accuracy > 0.85, out


SAVER = """
import os, sys, time
from pathlib import Path
import torch
import heatlike as hl
from heatlike.utils import checkpoint

comm = hl.MPI_WORLD
path = Path(sys.argv[1])
net = torch.nn.Linear(256, 256)
checkpoint.save(path, net, comm=comm, step=1)


def slowly(real):
    def call(*args, **kwargs):
        time.sleep(120)  # a slow disk, a slow rank: the temporary file exists meanwhile
        return real(*args, **kwargs)
    return call


if comm.size == 1:
    checkpoint.os.fsync = slowly(os.fsync)
elif comm.rank == comm.size - 1:
    checkpoint._send_bytes = slowly(checkpoint._send_bytes)
if comm.rank == 0:
    (path.parent / "pid").write_text(str(os.getpid()))
checkpoint.save(path, net, comm=comm, step=2)
print("saved twice", flush=True)
"""


@pytest.mark.parametrize("ranks,signum", [(1, signal.SIGTERM), (2, signal.SIGTERM),
                                          (2, signal.SIGINT)], ids=["1-TERM", "2-TERM", "2-INT"])
def test_a_save_interrupted_by_a_signal_leaves_no_temporary_file(tmp_path, ranks, signum):
    """SIGTERM/SIGINT to rank 0 while it writes a checkpoint (waiting for a slow disk at one
    rank, for the last rank's part at two): the job ends at once, the temporary file is gone and
    the previous checkpoint is intact."""
    from heatlike.utils import checkpoint

    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    path = tmp_path / "run.ckpt"
    proc = subprocess.Popen([mpiexec(), "-n", str(ranks), sys.executable, "-m", "heatlike",
                             str(script), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**_clean_env(), "HEATLIKE_LOG_RANKS": "0"})
    try:
        deadline = time.monotonic() + 150
        while not ((tmp_path / "pid").exists() and
                   any(p.name.endswith(".tmp") for p in tmp_path.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        time.sleep(0.5)  # well inside the slow part
        os.kill(int((tmp_path / "pid").read_text()), signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0 and "saved twice" not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pid", "run.ckpt", "saver.py"], out
    state = checkpoint.load(path, torch.nn.Linear(256, 256), comm=hl.MPI_SELF, rng=False)
    assert state["step"] == 1


SIGNALLED_SAVER = """
import os, signal, sys
from pathlib import Path
import torch
import heatlike as hl
from heatlike.utils import StopOnSignal, checkpoint

comm = hl.MPI_WORLD
path, mode = Path(sys.argv[1]), sys.argv[2]
net = torch.nn.Linear(64, 64)
checkpoint.save(path, net, comm=comm, step=1)
real = checkpoint._dumps


def dumps_and_signal(value):  # rank 0 is signalled while it writes
    os.kill(os.getpid(), signal.SIGTERM)
    return real(value)


if mode == "exit":  # the program's own handler exits
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
    if comm.rank == 0:
        checkpoint._dumps = dumps_and_signal
    checkpoint.save(path, net, comm=comm, step=2)
else:  # "twice": StopOnSignal took the first SIGTERM; the second one ends the process
    with StopOnSignal(comm) as stop:
        if comm.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop()
        if comm.rank == 0:
            checkpoint._dumps = dumps_and_signal
        checkpoint.save(path, net, comm=comm, step=2)
print("saved twice", flush=True)
"""


@pytest.mark.parametrize("ranks,mode", [(1, "twice"), (2, "twice"), (2, "exit")])
def test_a_signal_handled_during_a_save_ends_the_job_without_a_temporary_file(tmp_path, ranks,
                                                                              mode):
    """A second SIGTERM after StopOnSignal took the first (its default action) while rank 0
    writes: the save still removes its temporary file (StopOnSignal replaced the save's
    handler and killed the process at once). A program handler calling sys.exit on rank 0
    while it writes: the other ranks are not left waiting for it (they waited forever: the
    exit skipped the receipt of their parts)."""
    from heatlike.utils import checkpoint

    script = tmp_path / "saver.py"
    script.write_text(SIGNALLED_SAVER)
    path = tmp_path / "run.ckpt"
    proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, "-m", "heatlike",
                           str(script), str(path), mode], capture_output=True, text=True,
                          timeout=120, env={**_clean_env(), "HEATLIKE_LOG_RANKS": "0"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "saved twice" not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt", "saver.py"], out
    state = checkpoint.load(path, torch.nn.Linear(64, 64), comm=hl.MPI_SELF, rng=False)
    assert state["step"] == 1
