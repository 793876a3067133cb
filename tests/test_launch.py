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


@pytest.mark.system
@pytest.mark.parametrize("how", ["python -m heatlike", "decorator", "import heatlike"])
def test_exception_on_one_rank_aborts_job(tmp_path, how):
    """Under the launcher, with the decorator, and with nothing but ``import heatlike`` in a
    plain ``mpiexec`` job (the default handler)."""
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


@pytest.mark.system
def test_the_default_handler_keeps_a_programs_own_hook_and_can_be_turned_off(tmp_path):
    """``import heatlike`` installs its abort on uncaught exceptions only in a job of several
    ranks, never over a hook the program installed, and not with
    ``HEATLIKE_ABORT_ON_EXCEPTION=0``."""
    script = tmp_path / "hooks.py"
    script.write_text(textwrap.dedent("""
        import sys
        own = len(sys.argv) > 1
        if own:
            sys.excepthook = lambda *exc: None
        before = sys.excepthook
        import heatlike
        from heatlike.utils import launch
        which = ("heatlike" if sys.excepthook is launch._excepthook else
                 "same" if sys.excepthook is before else "other")
        sys.stdout.write(f"hook {heatlike.MPI_WORLD.size} {own} {which}" + chr(10))
        sys.stdout.flush()  # one write per line: the launcher interleaves the ranks' writes
    """))
    runs = {(3, False, "1"): "heatlike", (3, True, "1"): "same", (3, False, "0"): "same",
            (1, False, "1"): "same"}
    for (ranks, own, flag), expected in runs.items():
        proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(script),
                               *(["own"] if own else [])], capture_output=True, text=True,
                              timeout=60, env={**_clean_env(),
                                               "HEATLIKE_ABORT_ON_EXCEPTION": flag})
        lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("hook"))
        assert proc.returncode == 0 and lines == [f"hook {ranks} {own} {expected}"] * ranks, \
            (ranks, own, flag, proc.stdout + proc.stderr)


@pytest.mark.system
@pytest.mark.parametrize("how", ["import heatlike", "python -m heatlike"])
def test_an_exception_a_program_reports_after_handling_it_aborts_nothing(tmp_path, how):
    """An embedded console reports a typo's exception through sys.excepthook: printed, and the
    job goes on (only an uncaught exception, at the bottom of the stack, aborts)."""
    script = tmp_path / "console.py"
    script.write_text(textwrap.dedent("""
        import code
        import sys
        import heatlike
        if heatlike.MPI_WORLD.rank == 0:
            code.InteractiveConsole().push("1/0")
        heatlike.MPI_WORLD.Barrier()
        sys.stdout.write(f"survived-{heatlike.MPI_WORLD.rank}\\n")  # one write per line
        sys.stdout.flush()
    """))
    launch = ["-m", "heatlike"] if how.startswith("python") else []
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, *launch, str(script)],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ZeroDivisionError" in proc.stderr, out
    assert "survived-0" in proc.stdout and "survived-1" in proc.stdout, out
    assert "aborting" not in out, out


@pytest.mark.system
def test_the_launcher_runs_a_script_as_python_does(tmp_path):
    """``python -m heatlike sub/job.py`` as ``python sub/job.py``: the script's sibling modules
    import, ``__file__`` is absolute (before: the import failed, ``__file__`` was relative)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 42\n")
    (tmp_path / "sub" / "job.py").write_text(textwrap.dedent("""
        import os, sys
        import helper
        print("value", helper.VALUE, "absolute", os.path.isabs(__file__), "args", sys.argv[1:])
    """))
    (tmp_path / "link.py").symlink_to(tmp_path / "sub" / "job.py")  # imports from sub/ too
    for cmd in ([sys.executable, "sub/job.py", "a"],
                [sys.executable, "-m", "heatlike", "sub/job.py", "a"],
                [sys.executable, "link.py", "a"],
                [sys.executable, "-m", "heatlike", "link.py", "a"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env=_clean_env())
        assert proc.returncode == 0, proc.stderr
        assert "value 42 absolute True args ['a']" in proc.stdout, proc.stdout


@pytest.mark.system
def test_a_process_the_launcher_counts_as_one_of_several_but_mpi_runs_alone_is_refused():
    """A launcher said N > 1 ranks (PMI_SIZE, as Hydra sets it; OMPI_COMM_WORLD_SIZE, as Open
    MPI's mpirun does; SLURM_STEP_NUM_TASKS in an srun step, as with --mpi=none) and MPI started
    a singleton (mpi4py loaded another library than the launcher's): ``import heatlike`` raises,
    naming the library, instead of N independent one-rank trainings writing the same files. A
    size of 1, HEATLIKE_LAUNCH_CHECK=0 and a batch script's shell (SLURM_NTASKS without a step)
    pass."""
    probe = [sys.executable, "-c", "import heatlike; print('size', heatlike.MPI_WORLD.size)"]
    step = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "3"}  # srun's task, without a PMI plugin
    for name, extra in (("PMI_SIZE", {}), ("OMPI_COMM_WORLD_SIZE", {}),
                        ("SLURM_STEP_NUM_TASKS", step)):
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=120,
                              env={**_clean_env(), **extra, name: "3"})
        assert proc.returncode != 0, proc.stdout
        assert f"started as one of 3 ranks ({name}=3) but MPI_COMM_WORLD has 1 rank" \
            in proc.stderr, proc.stderr
        assert "mpi4py loaded an MPI library (MPI" in proc.stderr, proc.stderr
    batch_shell = {"SLURM_NTASKS": "3", "SLURM_NPROCS": "3", "SLURM_PROCID": "0"}
    for extra in ({"PMI_SIZE": "1"}, {"PMI_SIZE": "3", "HEATLIKE_LAUNCH_CHECK": "0"},
                  batch_shell, {**batch_shell, "SLURM_STEP_NUM_TASKS": "3"}):
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=120,
                              env={**_clean_env(), **extra})
        assert proc.returncode == 0 and "size 1" in proc.stdout, (extra, proc.stderr)
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=120,
                          env={**_clean_env(), "HEATLIKE_LAUNCH_CHECK": "maybe"})
    assert proc.returncode != 0, proc.stdout
    assert "HEATLIKE_LAUNCH_CHECK='maybe' is not valid" in proc.stderr, proc.stderr


@pytest.mark.system
def test_an_aborting_rank_keeps_what_it_printed(tmp_path):
    """The failing rank's printed lines reach the output before the job is aborted, with
    Python's output buffered (before: lost with the process)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        print(f"rank {comm.rank} printed this first")
        if comm.rank == 1:
            raise RuntimeError("boom on purpose")
        comm.Barrier()
    """))
    env = {k: v for k, v in _clean_env().items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "heatlike", str(script)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0
    assert "rank 1 printed this first" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_threads_share_the_cores_a_rank_may_run_on(monkeypatch, bound):
    """Unbound ranks (each allowed on all of the node's 4 * local_size cores) split them; ranks
    bound to 4 cores of their own keep all 4. Either way each rank gets 4 threads; the old rule
    gave bound ranks 4 // local_size."""
    import os

    import torch
    from mpi4py import MPI

    from heatlike.utils import configure_threads

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    cores = set(range(4 * local, 4 * local + 4)) if bound else set(range(4 * local_size))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: cores, raising=False)
    before = torch.get_num_threads()
    try:
        threads = configure_threads(comm)
    finally:
        torch.set_num_threads(before)
    assert threads == 4  # 4 * local_size cores shared by local_size ranks, or 4 of its own


def _fake_gpus(monkeypatch, count: int) -> list:
    """torch.cuda as seen by a rank with ``count`` GPUs; returns the devices made current."""
    import torch

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


@pytest.mark.mpi
def test_select_device_on_cpus_and_its_errors(comm):
    import torch

    from heatlike.utils import select_device

    assert select_device("cpu", comm) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert select_device("auto", comm) == torch.device("cpu")
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[0.*see no CUDA device"):
            select_device("cuda", comm)
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        select_device("gpu", comm)


@pytest.mark.mpi
@pytest.mark.parametrize("gpus", [1, 2])
def test_select_device_gives_each_rank_its_local_ranks_gpu(comm, monkeypatch, gpus):
    """Every rank sees ``gpus`` GPUs: rank r of its node gets GPU r % gpus, made current;
    "auto" picks the same."""
    from mpi4py import MPI

    from heatlike.utils import select_device

    node = comm.handle.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_rank()
    node.Free()
    current = _fake_gpus(monkeypatch, gpus)
    for choice in ("cuda", "auto"):
        device = select_device(choice, comm)
        assert (device.type, device.index) == ("cuda", local % gpus)
    assert current == [device, device]


@pytest.mark.mpi(min_size=2)
def test_select_device_never_mixes_cpus_and_gpus(comm, monkeypatch):
    """Only rank 0 has a GPU: "auto" trains on the CPU everywhere, "cuda" fails everywhere,
    naming the ranks without one."""
    import torch

    from heatlike.utils import select_device

    _fake_gpus(monkeypatch, 1 if comm.rank == 0 else 0)
    assert select_device("auto", comm) == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"on rank 0: .*rank\(s\) \[1"):
        select_device("cuda", comm)


@pytest.mark.mpi(min_size=2)
def test_select_device_refuses_different_choices_on_different_ranks(comm, monkeypatch):
    """One rank asks for the CPU, the others for GPUs they have: every rank raises (none is
    left waiting in the node split the GPU ranks would enter)."""
    from heatlike.utils import select_device

    _fake_gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="different devices"):
        select_device("cpu" if comm.rank == 0 else "cuda", comm)
