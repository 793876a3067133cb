"""Refuse a job whose processes each run alone: the launcher started N ranks, MPI sees one.

``mpiexec -n 4 python train.py`` tells every process the job's size through the environment of
the launcher's process manager. When mpi4py loads a *different* MPI library than the launcher's
(a system Open MPI beside the MPICH wheel, a module loaded for the launcher but not for mpi4py),
or when ``srun`` starts the tasks without a PMI plugin the library speaks (``--mpi=none``),
``MPI_Init`` finds no process manager it knows and starts a singleton: four independent one-rank
jobs, each training alone on its own batch and writing the same checkpoint files. mpi4py at most
warns. heatlike raises at import, on every process, before anything is trained or written.
"""

from __future__ import annotations

import os

from mpi4py import MPI

from .env import env_flag

__all__ = ["LAUNCHER_SIZE_VARIABLES", "launcher_size", "check_world_size"]

#: environment variables through which launchers give each process the job's size, in the order
#: they are trusted: PMI-1/PMI-2 (MPICH's Hydra, Intel MPI, ``srun --mpi=pmi2``), Open MPI's
#: ``mpirun`` / ``prterun``, and the task count of a SLURM job step (set by ``srun`` in every
#: task, with ``SLURM_STEP_ID``; not in the batch script's or ``salloc``'s shell, where
#: ``SLURM_NTASKS`` is the allocation's and a one-process run is legitimate; under Hydra it
#: counts the proxies, which is why ``PMI_SIZE`` comes first)
LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def launcher_size() -> tuple[str, int] | None:
    """The first of :data:`LAUNCHER_SIZE_VARIABLES` set to an integer, and its value
    (``SLURM_STEP_NUM_TASKS`` only inside a job step, i.e. with ``SLURM_STEP_ID`` set)."""
    for name in LAUNCHER_SIZE_VARIABLES:
        if name.startswith("SLURM_STEP") and "SLURM_STEP_ID" not in os.environ:
            continue
        try:
            return name, int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def check_world_size(world: MPI.Comm) -> None:
    """``RuntimeError`` when the launcher started this process as one of N > 1 ranks but
    ``world`` has one rank (``HEATLIKE_LAUNCH_CHECK=0`` skips the check)."""
    enabled = env_flag("HEATLIKE_LAUNCH_CHECK", True)  # a bad value raises here, always
    launched = launcher_size()
    if not enabled or launched is None or launched[1] <= 1 or world.Get_size() != 1:
        return
    name, size = launched
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    raise RuntimeError(
        f"this process was started as one of {size} ranks ({name}={size}) but MPI_COMM_WORLD "
        f"has 1 rank: mpi4py loaded an MPI library ({library}) other than the one of the "
        f"launcher that started the job, or srun started the tasks without a PMI plugin that "
        f"library speaks, so every process would run alone. Start the job with the "
        f"mpiexec/mpirun of that library or with srun --mpi=pmi2 (or pmix), or point mpi4py at "
        f"the launcher's library (MPI4PY_LIBMPI=/path/to/libmpi.so); see 'Which MPI' in "
        f"docs/communication.md. HEATLIKE_LAUNCH_CHECK=0 skips this check (independent "
        f"one-rank runs on purpose).")
