"""Never leave a job hanging after an uncaught exception.

When one rank of an MPI job dies from an exception while the others wait in a collective, the
job hangs until the batch system kills it. With :func:`install_abort_handler` (or
``python -m heatlike script.py``, or the :func:`abort_on_exception` decorator / context manager)
an uncaught exception on any rank prints the rank and the traceback to stderr and calls
``MPI_Abort`` on ``COMM_WORLD``, which ends every rank of the job. ``import heatlike`` installs
the main thread's part of it in jobs of several ranks (:func:`install_default_abort_handler`).
The full handlers also make a rank
whose program ends while another rank waits for it in a collective abort the job, naming both
(see ``heatlike.core.checks``, "End of the program").
"""

from __future__ import annotations

import contextlib
import os
import runpy
import socket
import sys
import threading
import time
import traceback
from types import TracebackType

from mpi4py import MPI

from ..core import checks as _checks

__all__ = ["install_abort_handler", "install_default_abort_handler", "abort_on_exception",
           "abort_job", "run_script", "configure_threads", "select_device", "DEVICE_CHOICES"]


def abort_job(exc: BaseException | None = None, errorcode: int = 1) -> None:
    """Print this rank's traceback (of ``exc``, if given) with its rank and abort the whole job."""
    comm = MPI.COMM_WORLD
    header = (f"heatlike: uncaught exception on rank {comm.Get_rank()} of {comm.Get_size()} "
              f"(host {socket.gethostname()}, pid {os.getpid()}); aborting the MPI job\n")
    text = "".join(traceback.format_exception(exc)) if exc is not None else ""
    try:
        with contextlib.suppress(Exception):  # what the program printed before, not lost
            sys.stdout.flush()
        sys.stderr.write(header + text)
        sys.stderr.flush()
        # the launcher forwards output asynchronously and stops forwarding once it kills the
        # job: give it a moment to pass this message on
        time.sleep(0.3)
    finally:
        comm.Abort(errorcode)


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    if tb is not None and tb.tb_frame.f_back is not None:
        # not the end of the program: code reporting an exception it handled (an embedded
        # console, pdb's interact) through sys.excepthook; the outermost frame of an uncaught
        # exception's traceback is the bottom of the stack
        sys.__excepthook__(exc_type, exc, tb)
        return
    abort_job(exc.with_traceback(tb))


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    abort_job(args.exc_value)


def install_abort_handler() -> None:
    """Abort the whole MPI job on an uncaught exception in any thread of this process (only when
    more than one rank runs; a single process exits normally). Also, when this rank's program
    ends while another rank waits for it in a collective it will never enter, abort the job
    naming both (``heatlike.core.checks``) instead of leaving that rank waiting."""
    if MPI.COMM_WORLD.Get_size() > 1:
        sys.excepthook = _excepthook
        threading.excepthook = _thread_excepthook
        _checks.abort_on_deadlock(True)


def install_default_abort_handler() -> bool:
    """Run at ``import heatlike``: in a job of more than one rank, an uncaught exception in the
    main thread aborts the job with the rank and the traceback (as under ``python -m
    heatlike``) instead of ending this rank alone while the others wait for it in a collective
    forever. Left out, and False returned: one rank; an interactive interpreter (``python -i``,
    ``PYTHONINSPECT``, where an error at the prompt is no end of the program); a
    ``sys.excepthook`` someone else installed (IPython, a framework's reporter: theirs is kept);
    ``HEATLIKE_ABORT_ON_EXCEPTION=0``. An exception that code reports through
    ``sys.excepthook`` after handling it (an embedded console) is printed, not aborted on.
    Threads and the end of a program that another rank waits for are covered only by
    :func:`install_abort_handler`."""
    from ..core.env import env_flag

    enabled = env_flag("HEATLIKE_ABORT_ON_EXCEPTION", True)  # a bad value raises, everywhere
    if not enabled or MPI.COMM_WORLD.Get_size() < 2 or sys.flags.interactive or \
            sys.flags.inspect or hasattr(sys, "ps1") or sys.excepthook is not sys.__excepthook__:
        return False
    sys.excepthook = _excepthook
    return True


class abort_on_exception(contextlib.ContextDecorator):
    """``with abort_on_exception():`` / ``@abort_on_exception()``: an exception leaving the block
    aborts the job (with more than one rank) instead of leaving other ranks waiting."""

    def __enter__(self) -> abort_on_exception:
        if MPI.COMM_WORLD.Get_size() > 1:
            _checks.abort_on_deadlock(True)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and exc_type is not SystemExit and MPI.COMM_WORLD.Get_size() > 1:
            abort_job(exc)
        return False


def run_script(path: str, argv: list[str]) -> None:
    """Run a Python script as ``__main__`` with the abort handler installed.

    Before the script runs (a point every rank reaches first, before any collective of the
    script), the world communicator's board is set up (``heatlike.core.checks``): from then on
    each rank counts the heatlike collectives it enters on ``heatlike.MPI_WORLD`` in a window the
    others can read, so that a rank whose script ends (``sys.exit``, the end of the file) while
    another waits for it in a collective aborts the job with both ranks named."""
    install_abort_handler()
    from ..core.communication import MPI_WORLD

    MPI_WORLD._arrival_board("the start of the program (python -m heatlike)")
    # as ``python script.py``: the folder of the script (of the file a link points to) first on
    # the import path (its sibling modules import), ``__file__`` absolute
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    runpy.run_path(os.path.abspath(path), run_name="__main__")


def configure_threads(comm: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """Give each rank its share of its cores for torch's intra-op threads (collective over
    ``comm``): ``max(1, cpus // k)``, where ``cpus`` is the number of cores this rank may run on
    and ``k`` the number of ranks on this node whose cores overlap them (itself included). Ranks
    left unbound by the launcher share the node's cores; ranks bound to their own cores (``srun
    --cpus-per-task``, ``mpiexec --bind-to``) keep them. Several ranks each using every core
    oversubscribe the machine and slow everything down. Returns the count."""
    import torch

    if hasattr(os, "sched_getaffinity"):
        mine = frozenset(os.sched_getaffinity(0))
    else:
        mine = frozenset(range(os.cpu_count() or 1))
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        everyone = node.allgather(mine)
    finally:
        node.Free()
    sharing = sum(1 for other in everyone if other & mine)
    threads = max(1, len(mine) // max(sharing, 1))
    torch.set_num_threads(threads)
    return threads


DEVICE_CHOICES = ("auto", "cpu", "cuda")


def select_device(choice: str = "auto", comm=None):
    """The torch device this rank computes on (collective over ``comm``, default the world).

    * ``"cpu"``;
    * ``"cuda"``: the GPU of this rank's local rank on its node, modulo the GPUs the rank sees
      (one GPU per rank where the launcher gives each its own, e.g. ``srun --gpus-per-task=1`` or
      ``CUDA_VISIBLE_DEVICES``; the node's GPUs shared round-robin otherwise), made the current
      CUDA device;
    * ``"auto"``: ``"cuda"`` when every rank sees a GPU, else ``"cpu"`` (never a mix).

    Another choice, or different choices on different ranks, raise ValueError, ``"cuda"`` where
    some rank sees no GPU RuntimeError naming those ranks, on every rank."""
    import torch

    from ..core.agreement import raise_together
    from ..core.communication import sanitize_comm

    comm = sanitize_comm(comm)
    error = None
    if choice not in DEVICE_CHOICES:
        error = ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    answers = comm.allgather((gpus, choice))
    everyone = [n for n, _ in answers]
    if error is None and len({c for _, c in answers}) > 1:  # every rank takes the same path
        error = ValueError(f"the ranks chose different devices: "
                           f"{[c for _, c in answers][:8]}")
    if error is None and choice == "cuda" and min(everyone) == 0:
        without = [r for r, n in enumerate(everyone) if n == 0]
        error = RuntimeError(f"device 'cuda': rank(s) {without[:8]} see no CUDA device")
    raise_together(error, comm)
    if choice == "cpu" or min(everyone) == 0:
        return torch.device("cpu")
    node = comm.handle.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = node.Get_rank()
    finally:
        node.Free()
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    return device

