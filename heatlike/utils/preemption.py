"""Stop a distributed training loop at a step every rank agrees on when a signal arrives, so that
it can save a checkpoint and exit before the scheduler ends it.

A batch system announces the end of a job with a signal (SLURM: ``--signal=USR1@120`` sends
SIGUSR1 to the tasks 120 s before the time limit, or ``B:USR1`` to the batch shell, which passes
it on; at the limit SIGTERM, then SIGKILL after ``KillWait``, 30 s by default). The signal does
not reach every rank at the same moment (or at all: a batch shell may signal one launcher
only), while saving a checkpoint is a collective that every rank must enter after the same step.
:class:`StopOnSignal` makes that agreement:

* its handlers only record the signal (they never interrupt a collective);
* ``stop()`` (call it once per step, at the same place on every rank) is a collective: an
  ``Allreduce(MAX)`` of every rank's recorded signal number (one integer) on a communicator of
  its own. The answer is therefore the same on every rank, at the first call after the signal
  arrived on some rank. Nothing is left in flight between calls, so a rank may leave the loop
  by an exception without an unfinished operation (an ``Iallreduce`` started for the next call
  and never completed crashed Open MPI at exit); the ranks wait for each other at every step
  anyway, in the gradient exchange;
* a signal received again (SLURM's SIGTERM after a SIGTERM, a second Ctrl-C of ``SIGINT`` when
  it is watched) is passed on at once to the handler that was there before, as is every later
  one of that number: the process ends as it would have without this class (a default action
  inside ``checkpoint.save`` first lets the save remove its temporary file). Handlers are never
  replaced from inside a handler, so the ones in place before are restored when the block ends.

Typical use (``examples/resume.py``)::

    with StopOnSignal(comm) as stop:
        for x, y in loader:
            train_step(x, y)
            if stop():
                checkpoint.save(path, model, optimizer, loader=loader)
                sys.exit(StopOnSignal.EXIT_STATUS)   # 75: run again to continue

The exit status 75 (``EX_TEMPFAIL``: a temporary failure, to be retried) tells a batch script to
requeue the job (``scripts/slurm/requeue.sbatch``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType

import numpy as np
from mpi4py import MPI

from ..core.agreement import raise_together
from ..core.communication import IN_PLACE, MPICommunication, sanitize_comm
from ._signals import end_process

__all__ = ["StopOnSignal"]

DEFAULT_SIGNALS = ("SIGUSR1", "SIGTERM")


def _signal_number(sig: object) -> int:
    """``signal.SIGUSR1``, ``"SIGUSR1"``, ``"USR1"`` or 10 as a signal number."""
    if isinstance(sig, signal.Signals):
        return int(sig)
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        number = getattr(signal, name, None)
        if not isinstance(number, signal.Signals):
            raise ValueError(f"unknown signal {sig!r}")
        return int(number)
    if isinstance(sig, (int, np.integer)) and not isinstance(sig, bool):
        valid = {int(s) for s in signal.valid_signals()}
        if int(sig) not in valid:
            raise ValueError(f"{int(sig)} is not a valid signal number")
        return int(sig)
    raise TypeError(f"a signal is a name, a number or a signal.Signals, got {type(sig).__name__}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class StopOnSignal:
    """Collective: watch ``signals`` (default SIGUSR1 and SIGTERM) on every rank of ``comm``
    (default the world) and agree, at every call, whether any rank has received one (module
    docstring). Must be built on every rank, in the main thread; SIGKILL and SIGSTOP cannot be
    watched. Use it as a context manager or call :meth:`close` (collective) when done: the
    previous handlers are restored.

    Attributes: ``signal`` the name of the agreed signal (the highest signal number any rank
    received) once :meth:`__call__` has returned True, else None; ``calls`` the number of calls
    so far."""

    EXIT_STATUS = 75

    def __init__(self, comm: MPICommunication | None = None,
                 signals: Iterable[object] = DEFAULT_SIGNALS) -> None:
        self.comm = sanitize_comm(comm)
        error, numbers = None, []
        try:
            if isinstance(signals, (str, int, signal.Signals)):
                signals = [signals]
            numbers = sorted({_signal_number(s) for s in signals})
            if not numbers:
                raise ValueError("no signal to watch")
            fixed = [n for n in numbers if n in (int(signal.SIGKILL), int(signal.SIGSTOP))]
            if fixed:
                raise ValueError(f"{_signal_name(fixed[0])} cannot be caught")
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("StopOnSignal must be built in the main thread (Python runs "
                                   "signal handlers there only)")
        except (TypeError, ValueError, RuntimeError) as e:
            error = e
        raise_together(error, self.comm)
        names = self.comm.allgather(numbers)
        if any(n != numbers for n in names):
            raise ValueError(f"the ranks watch different signals: "
                             f"{[[_signal_name(x) for x in n] for n in names][:8]}")
        self.signals = tuple(numbers)
        self.signal: str | None = None
        self.calls = 0
        self._received = 0  # the highest signal number this rank received (0: none)
        self._seen: set[int] = set()  # every signal number this rank received
        self._private = self.comm.Dup()
        # its collectives counted on a board of its own (one memory increment per call): a rank
        # that leaves the loop early and closes this raises there, naming the ranks waiting in
        # stop(), instead of leaving them waiting forever
        self._private._arrival_board("StopOnSignal")
        self._signals = np.zeros(1, dtype=np.int32)
        self._previous = {n: signal.signal(n, self._record) for n in numbers}
        self._closed = False

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum in self._seen:  # insisted on: to the previous handler now
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            elif previous is not signal.SIG_IGN:  # the default action (or one set outside Python)
                end_process(signum)
            return
        self._seen.add(signum)
        self._received = max(self._received, signum)

    @property
    def received(self) -> str | None:
        """The signal this rank has received (not yet agreed), or None."""
        return _signal_name(self._received) if self._received else None

    def __call__(self) -> bool:
        """Collective: True on every rank once any rank has received a watched signal (before
        this call). Then ``signal`` names it."""
        if self._closed:
            raise RuntimeError("this StopOnSignal was closed")
        self.calls += 1
        self._signals[0] = self._received
        self._private.Allreduce(IN_PLACE, self._signals, MPI.MAX)
        if self._signals[0]:
            self.signal = _signal_name(int(self._signals[0]))
            return True
        return False

    def close(self) -> None:
        """Collective: free the communicator and restore the handlers in place before
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._private.Free()
        finally:
            self._restore()

    def _restore(self) -> None:
        for number, previous in self._previous.items():
            # None: a handler installed outside Python, which cannot be put back from here
            signal.signal(number, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def __enter__(self) -> StopOnSignal:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or (exc_type is SystemExit and self.signal is not None):
            self.close()  # every rank leaves here: the end of the loop, an agreed stop
        else:  # another rank may not reach close(): no collective, only the handlers
            self._closed = True
            self._restore()

    def __repr__(self) -> str:
        names = ", ".join(_signal_name(n) for n in self.signals)
        return f"StopOnSignal({names}; received={self.received}, agreed={self.signal})"
