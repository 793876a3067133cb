"""Faults end the job with a clear message instead of hanging: separate MPI jobs, each with a
fault injected into a data-parallel training loop on one rank. Every job must end within 30 s
and leave no process behind."""

import subprocess
import sys
import textwrap
import time
import uuid

from test_launch import mpiexec

from heatlike.testing.matrix import _clean_env

TRAIN = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import heatlike as hl
    from heatlike.nn import DataParallel
    from heatlike.optim import DataParallelOptimizer

    fault, token = sys.argv[1], sys.argv[2]
    comm = hl.MPI_WORLD
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
    model = DataParallel(net, comm, optimizer=opt)
    steps = 6 - (fault == "uneven" and comm.rank == 1)
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).square().mean()
        if step == 3 and comm.rank == 1:
            if fault == "raise":
                raise ValueError("injected failure in the middle of a step")
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "late":
                time.sleep(60)
        loss.backward()
        opt.step()
    model.flush()
    print(f"rank {comm.rank} finished", flush=True)
""")


def _run(tmp_path, fault: str, ranks: int = 2, env: dict | None = None):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    token = uuid.uuid4().hex
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "heatlike", str(script), fault,
           token]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90,
                          env={**_clean_env(), **(env or {})})
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout
    return proc, proc.stdout + proc.stderr, elapsed, left


def test_a_rank_raising_mid_step_aborts_the_job(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "raise")
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "uncaught exception on rank 1 of 2" in out, out
    assert "ValueError: injected failure in the middle of a step" in out, out
    assert not left, f"processes left behind: {left}"


def test_a_killed_rank_ends_the_job(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "sigkill")
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "finished" not in out, out
    assert not left, f"processes left behind: {left}"


def test_uneven_batches_without_join_end_with_an_error(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "uneven")
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "the ranks ran different numbers of batches" in out, out
    assert "rank 1 after 5 step(s)" in out and "heatlike.nn.Join" in out, out
    assert not left, f"processes left behind: {left}"


def test_comm_timeout_names_the_late_rank(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "late", env={"HEATLIKE_COMM_TIMEOUT": "3"})
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "TimeoutError" in out and "did not complete within 3 s" in out, out
    assert "ranks [1] have not arrived" in out, out
    assert not left, f"processes left behind: {left}"


def test_a_correct_job_finishes_in_check_mode(tmp_path):
    """The control: without a fault the same job ends normally, also with every check on."""
    proc, out, _, left = _run(tmp_path, "none", env={"HEATLIKE_CHECK": "1",
                                                     "HEATLIKE_COMM_TIMEOUT": "30"})
    assert proc.returncode == 0, out
    assert out.count("finished") == 2 and "WARN" not in out and not left, out
