"""The SLURM batch scripts of scripts/slurm/: they parse, shellcheck finds nothing in them, they
call srun as documented inside an allocation (an emulated one, with a stand-in srun), and their
payloads run outside SLURM with ``mpiexec -n 2`` in place of srun and short settings.

The scripts read the launcher from ``LAUNCH``, the virtual environment from ``VENV``, the examples
from ``EXAMPLES`` and the short-run knobs (``EPOCHS``, ``QUICK``, ...) from the environment, and
write their outputs into the directory they run in (here ``tmp_path``).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launch import mpiexec

from heatlike.testing.matrix import _clean_env

pytestmark = pytest.mark.system  # runs the batch scripts

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted([*SLURM.glob("*.sbatch"), *SLURM.glob("*.sh")])
_IDS = {"ids": lambda p: p.name}


def _shellcheck() -> str:
    local = Path(sys.executable).parent / "shellcheck"
    found = str(local) if local.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.skip("no shellcheck")
    return found


def _env(**settings: str) -> dict[str, str]:
    """A local stand-in for a job's environment: no variables of an enclosing MPI or SLURM job,
    this interpreter's environment as VENV, srun replaced by mpiexec at 2 ranks."""
    env = {k: v for k, v in _clean_env().items() if not k.startswith(("SLURM_", "SRUN_"))}
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").exists():
        env["VENV"] = sys.prefix
    else:  # no virtual environment to activate: the scripts use the python on PATH
        env["VENV"] = ""
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"LAUNCH": f"{mpiexec()} -n 2", "EXAMPLES": str(ROOT / "examples"),
                "PYTHONUNBUFFERED": "1", "HEATLIKE_LOG_RANKS": "0"})
    env.update(settings)
    return env


def _run(script: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    proc = subprocess.run(["bash", str(SLURM / script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _accuracy(out: str) -> float:
    return float(out.split("test accuracy: ")[-1].split()[0])


def test_the_deliverables_exist():
    names = {p.name for p in SCRIPTS}
    assert {"cpu.sbatch", "gpu.sbatch", "daso.sbatch", "requeue.sbatch",
            "bench_sweep.sbatch"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, **_IDS)
def test_batch_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, **_IDS)
def test_shellcheck_finds_nothing(script):
    proc = subprocess.run([_shellcheck(), "--norc", "--severity=style", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, **_IDS)
def test_scripts_follow_the_conventions(script):
    """A header saying how to submit, strict mode, the knobs every script shares."""
    text = script.read_text()
    header = text.split("\nset -euo pipefail\n")[0]
    assert text.startswith("#!/bin/bash\n"), script.name
    assert "set -euo pipefail" in text, script.name
    assert "sbatch " in header and f"scripts/slurm/{script.name}" in header, script.name
    for option in ("--job-name", "--nodes", "--ntasks-per-node", "--time", "--output"):
        assert re.search(rf"^#SBATCH {option}=", header, re.M), (script.name, option)
    assert "module load" in text, script.name
    assert "OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}" in text, script.name
    assert "${SLURM_SUBMIT_DIR:-$PWD}" in text, script.name


SRUN_STUB = '''#!{python}
import json, os, sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "omp": os.environ.get("OMP_NUM_THREADS"),
                        "cwd": os.getcwd()}}) + "\\n")
for flag, value in zip(args, args[1:]):
    if flag == "--json":
        with open(value, "w") as f:
            f.write("[]")
'''

# script, settings, expected srun command lines (with {sub}: the submit directory)
LAUNCH = "srun --cpus-per-task=8 --kill-on-bad-exit=1"
DRY_RUNS = {
    "cpu.sbatch": ({}, [f"{LAUNCH} python -m heatlike {{sub}}/examples/digits.py --epochs 30 "
                        "--batch-size 16"]),
    "daso.sbatch": ({"VERBOSE": "1"},
                    [f"{LAUNCH} python -m heatlike {{sub}}/examples/daso_digits.py --epochs 16 "
                     "--warmup 2 --cooldown 2 --batch-size 16 --verbose"]),
    "requeue.sbatch": ({}, [f"{LAUNCH} python -m heatlike {{sub}}/examples/resume.py --algorithm "
                            "allreduce --epochs 100 --batch-size 16 --checkpoint "
                            "checkpoints/resume-99.ckpt --save-every 50"]),
    "gpu.sbatch": ({"SCRIPT": "train.py", "ARGS": "--lr 0.1"},
                   [f"{LAUNCH} --gpu-bind=closest python -c ...",
                    f"{LAUNCH} --gpu-bind=closest python -m heatlike train.py --lr 0.1"]),
    "bench_sweep.sbatch": ({}, [
        f"srun --nodes={n} --ntasks={4 * n} --ntasks-per-node=4 --cpus-per-task=8 "
        f"--kill-on-bad-exit=1 python -m heatlike.bench comm --json "
        f"bench-results/comm-{n}nodes-4ppn-99.json" for n in (1, 2, 4, 6)]),
    "bench_comm.sbatch": ({"SWEEP": str(SLURM / "bench_sweep.sbatch"), "QUICK": "1"}, [
        "srun --nodes=6 --ntasks=24 --ntasks-per-node=4 --cpus-per-task=8 --kill-on-bad-exit=1 "
        "python -m heatlike.bench comm --quick --json bench-results/comm-6nodes-4ppn-99.json"]),
}


def _srun_stub(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(directory with a recording srun stub, the file it records calls in, a submit dir)."""
    stub_dir, calls = tmp_path / "bin", tmp_path / "srun.calls"
    stub_dir.mkdir()
    (stub_dir / "srun").write_text(SRUN_STUB.format(python=sys.executable, calls=str(calls)))
    (stub_dir / "srun").chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir()
    return stub_dir, calls, submit


@pytest.mark.parametrize("script", sorted(DRY_RUNS))
def test_default_srun_commands_in_an_allocation(tmp_path, script):
    """Inside an (emulated) allocation of 6 nodes x 4 tasks x 8 cores with no LAUNCH set, each
    script runs in the submit directory and calls srun as documented (srun is a stub here)."""
    settings, expected = DRY_RUNS[script]
    stub_dir, calls, submit = _srun_stub(tmp_path)
    env = _env(SLURM_JOB_ID="99", SLURM_SUBMIT_DIR=str(submit), SLURM_JOB_NUM_NODES="6",
               SLURM_NNODES="6", SLURM_NTASKS_PER_NODE="4", SLURM_CPUS_PER_TASK="8",
               **settings)
    del env["LAUNCH"], env["EXAMPLES"]
    env["PATH"] = f"{stub_dir}{os.pathsep}{env['PATH']}"
    out = _run(script, tmp_path, env, timeout=60)
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    got = []
    for record in records:
        argv = record["argv"]
        if "-c" in argv:  # the GPU check's program text
            argv = [*argv[:argv.index("-c") + 1], "..."]
        got.append(" ".join(["srun", *argv]))
        assert record["omp"] == "8" and record["cwd"] == str(submit), (record, out)
    assert got == [line.format(sub=submit) for line in expected], out


def test_gpu_script_trains_the_digits_example_on_gpus_by_default(tmp_path):
    """Without SCRIPT the GPU job trains examples/digits.py with --device cuda after the check;
    SCRIPT= (empty) runs the check only."""
    stub_dir, calls, submit = _srun_stub(tmp_path)
    for settings, expected in (({}, 2), ({"SCRIPT": ""}, 1)):
        calls.unlink(missing_ok=True)
        env = _env(SLURM_JOB_ID="99", SLURM_SUBMIT_DIR=str(submit), SLURM_CPUS_PER_TASK="8",
                   **settings)
        del env["LAUNCH"]
        env["PATH"] = f"{stub_dir}{os.pathsep}{env['PATH']}"
        out = _run("gpu.sbatch", tmp_path, env, timeout=60)
        argvs = [json.loads(line)["argv"] for line in calls.read_text().splitlines()]
        assert len(argvs) == expected, out
        if expected == 2:
            assert argvs[1][-4:] == ["heatlike", f"{submit}/examples/digits.py", "--device",
                                     "cuda"], (argvs, out)


def test_gpu_script_binds_one_gpu_per_rank():
    text = (SLURM / "gpu.sbatch").read_text()
    assert re.search(r"^#SBATCH --ntasks-per-node=(\d+)\n#SBATCH --gpus-per-node=\1", text, re.M)
    for variable in ("OMPI_MCA_opal_cuda_support=true", "UCX_TLS=", "MPIR_CVAR_ENABLE_GPU=1",
                     "MPICH_GPU_SUPPORT_ENABLED=1", "HEATLIKE_CUDA_AWARE_MPI=",
                     "--gpu-bind=closest", "CUDA_VISIBLE_DEVICES=", "${SLURM_LOCALID:-"):
        assert variable in text, variable


def test_gpu_script_check_runs_with_per_rank_devices(tmp_path):
    """GPU_BIND=localid shows each rank only its own device; the check then reports the ranks
    without a GPU (here: all of them, unless this machine has two GPUs)."""
    import torch

    if torch.cuda.device_count() == 1:
        pytest.skip("one GPU: the second rank would see none")
    proc = subprocess.run(["bash", str(SLURM / "gpu.sbatch")], cwd=tmp_path,
                          env=_env(GPU_BIND="localid"), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert "rank 0: host" in out and "CUDA_VISIBLE_DEVICES=0" in out, out
    assert "rank 1: host" in out and "CUDA_VISIBLE_DEVICES=1" in out, out
    if torch.cuda.device_count() >= 2:
        assert proc.returncode == 0 and "GPU check ok" in out, out
    else:
        assert proc.returncode != 0, out
        assert "GPU check failed: no CUDA device visible on ranks [0, 1]" in out, out


def test_cpu_script_trains_with_the_chosen_algorithm(tmp_path):
    out = _run("cpu.sbatch", tmp_path,
               _env(EPOCHS="2", ALGORITHM="powersgd-2", EXTRA_ARGS="--lr 0.05"))
    assert "algorithm powersgd-2" in out and "powersgd-2: PowerSGD" in out, out
    assert _accuracy(out) >= 0.8, out


def test_daso_script_trains_across_emulated_nodes(tmp_path):
    env = _env(EPOCHS="2", WARMUP="1", COOLDOWN="0", HEATLIKE_RANKS_PER_NODE="1")
    out = _run("daso.sbatch", tmp_path, env)
    assert "2 ranks on 2 node(s) of [1, 1] ranks" in out, out
    assert "epoch  2/2" in out, out
    assert _accuracy(out) >= 0.85, out


def _requeue_with_usr1_at_checkpoint(cwd: Path, env: dict[str, str],
                                     checkpoint: Path) -> tuple[int, str]:
    """Run requeue.sbatch; SIGUSR1 to it (SLURM's --signal=B:USR1) as soon as ``checkpoint``
    exists; its exit status and output. Fails if it ended before its first checkpoint."""
    proc = subprocess.Popen(["bash", str(SLURM / "requeue.sbatch")], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        signalled = checkpoint.exists() and proc.poll() is None
        if signalled:
            proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert signalled, "no signal: the run ended before its first checkpoint:\n" + out
    return proc.returncode, out


def test_requeue_script_requeues_on_usr1_and_the_next_run_resumes(tmp_path):
    """SIGUSR1 to the batch shell (SLURM's --signal=B:USR1) once a checkpoint exists: the trap
    passes it on to the step, whose ranks save after an agreed step and exit with status 75; the
    script calls `scontrol requeue <job id>` (a stub here); the same command run again (the
    requeued job) resumes from the step saved on the signal, not from the last periodic save,
    and finishes."""
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    stub = stub_dir / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    stub.chmod(0o755)
    env = _env(EPOCHS="4", SAVE_EVERY="5", SLURM_JOB_ID="4242")
    env["PATH"] = f"{stub_dir}{os.pathsep}{env['PATH']}"
    checkpoint = tmp_path / "checkpoints" / "resume-4242.ckpt"

    returncode, out = _requeue_with_usr1_at_checkpoint(tmp_path, env, checkpoint)
    assert returncode == 0, out
    assert calls.read_text() == "requeue 4242\n", out
    assert "job 4242: requeued" in out and "starting afresh" in out, out
    assert "final parameters sha256" not in out, "the step was not stopped:\n" + out
    saved = re.search(r"SIGUSR1: saved after step (\d+) in \S+; run again", out)
    assert saved and int(saved.group(1)) >= 5, out

    out = _run("requeue.sbatch", tmp_path, env)
    assert "resuming from checkpoints/resume-4242.ckpt" in out, out
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    assert resumed and resumed.group(1) == saved.group(1), out
    assert "epoch 4/4 done" in out and "final parameters sha256" in out, out
    assert calls.read_text() == "requeue 4242\n", "requeued again without a signal"


# srun --kill-on-bad-exit as the batch script sees it when it terminated a rank still exiting
# after another had left with 75: the step's status is that rank's signal
KILL_ON_BAD_EXIT = """#!/bin/bash
"$@" &
pid=$!
trap 'kill -USR1 $pid' USR1
while true; do
    if wait $pid; then status=0; else status=$?; fi
    kill -0 $pid 2>/dev/null || break
done
if [ $status = 75 ]; then exit 143; fi
exit $status
"""

# a step whose ranks end on the signal before saving (killed; the checkpoint on disk is older)
DIES_ON_SIGNAL = """#!/bin/bash
while [ $# -gt 0 ]; do
    if [ "$1" = --checkpoint ]; then echo periodic > "$2.tmp" && mv "$2.tmp" "$2"; fi
    shift
done
trap 'exit 143' USR1
while true; do sleep 0.05; done
"""


def _launcher(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def _scontrol_stub(directory: Path) -> tuple[Path, Path]:
    """A stand-in ``scontrol`` that records its arguments: its directory (for PATH), the record."""
    stub_dir = directory / "bin"
    stub_dir.mkdir()
    calls = directory / "scontrol.calls"
    _launcher(stub_dir, "scontrol", f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    return stub_dir, calls


def test_requeue_script_requeues_when_srun_terminated_a_rank_after_the_save(tmp_path):
    """srun --kill-on-bad-exit terminates the ranks still exiting once the first has left with
    75, and the step's status is then their signal's (143): the checkpoint saved after the signal
    decides, and the job is requeued."""
    stub_dir, calls = _scontrol_stub(tmp_path)
    wrapper = _launcher(tmp_path, "srun-kill-on-bad-exit", KILL_ON_BAD_EXIT)
    env = _env(EPOCHS="4", SAVE_EVERY="5", SLURM_JOB_ID="4244",
               LAUNCH=f"{wrapper} {mpiexec()} -n 2")
    env["PATH"] = f"{stub_dir}{os.pathsep}{env['PATH']}"
    checkpoint = tmp_path / "checkpoints" / "resume-4244.ckpt"
    returncode, out = _requeue_with_usr1_at_checkpoint(tmp_path, env, checkpoint)
    assert returncode == 0, out
    assert re.search(r"SIGUSR1: saved after step \d+ in \S+; run again", out), out
    assert "ended with status 143 after saving" in out and "job 4244: requeued" in out, out
    assert calls.read_text() == "requeue 4244\n", out


def test_requeue_script_does_not_requeue_a_step_that_ended_before_saving(tmp_path):
    """A step that ends on the signal without a save after it (its ranks killed) is not requeued:
    the script ends with the step's status and says so."""
    stub_dir, calls = _scontrol_stub(tmp_path)
    launcher = _launcher(tmp_path, "dies-on-signal", DIES_ON_SIGNAL)
    env = _env(SLURM_JOB_ID="4245", LAUNCH=str(launcher))
    env["PATH"] = f"{stub_dir}{os.pathsep}{env['PATH']}"
    checkpoint = tmp_path / "checkpoints" / "resume-4245.ckpt"
    returncode, out = _requeue_with_usr1_at_checkpoint(tmp_path, env, checkpoint)
    assert returncode == 143, out
    assert "the training step ended with status 143 after the signal" in out, out
    assert "requeued" not in out and not calls.exists(), out


def test_requeue_script_trains_on_after_max_restarts(tmp_path):
    """A SIGUSR1 after MAX_RESTARTS requeues is declined and the step trains to its end: the
    trap returns 0, so that set -e does not end the script with the interrupted wait's
    status (138) while the step still runs."""
    env = _env(EPOCHS="4", SAVE_EVERY="5", SLURM_JOB_ID="4243", SLURM_RESTART_COUNT="1",
               MAX_RESTARTS="1")
    checkpoint = tmp_path / "checkpoints" / "resume-4243.ckpt"
    returncode, out = _requeue_with_usr1_at_checkpoint(tmp_path, env, checkpoint)
    assert returncode == 0, out
    assert "not requeueing: MAX_RESTARTS=1 reached" in out, out
    assert "epoch 4/4 done" in out and "final parameters sha256" in out, out


def test_bench_sweep_writes_one_json_per_node_count(tmp_path):
    env = _env(LAUNCH=mpiexec(), NODE_COUNTS="1 2", TASKS_PER_NODE="1", QUICK="1")
    out = _run("bench_sweep.sbatch", tmp_path, env, timeout=180)
    for nodes in (1, 2):
        path = tmp_path / "bench-results" / f"comm-{nodes}nodes-1ppn-local.json"
        assert path.is_file(), out
        records = json.loads(path.read_text())
        assert "comm" in {r["suite"] for r in records}, records
        assert {r["world_size"] for r in records} == {nodes}, records
    assert re.search(r"allreduce 16 MiB +heatlike time +us +\S+ +\S+", out), out
    assert "1 node(s)" in out and "2 node(s)" in out, out
