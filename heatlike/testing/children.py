"""Child processes that never outlive their launcher.

A launcher (the matrix runner) starts ``mpiexec``, which starts proxies and ranks, which may
start processes of their own (a test that runs an example under a nested ``mpiexec``). When the
launcher is told to stop (SIGTERM, SIGINT, SIGHUP) or its own parent dies, all of them must go:

* :func:`start` runs the command in a session of its own (a terminal's Ctrl-C or a signal to
  the launcher's process group does not reach it directly) and, on Linux, asks the kernel to send
  the child SIGTERM when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``); ``mpiexec``
  answers SIGTERM by ending its ranks. Call it inside :func:`held_signals` and keep the result
  where a ``finally`` block that ends it can see it: a stop signal is then never handled between
  the child's creation and that assignment.
* :func:`end_tree` ends a child and everything below it: it records the process tree (every
  descendant with its process group, from ``/proc``), sends SIGTERM to the child and to every
  process group led by one of them, waits ``grace`` seconds, then sends SIGKILL to whatever of
  the recorded processes still runs (and to their groups). Processes are identified by pid and
  start time, so a recycled pid is never signalled.
* :func:`stop_on_signals` turns the first SIGTERM, SIGINT or SIGHUP into a :class:`Stopped`
  exception in the launcher (so ``finally`` blocks end the children; later signals are ignored
  so that the clean-up is not interrupted) and asks for SIGTERM when the launcher's parent dies.
  A launcher started under ``nohup`` (SIGHUP ignored) is left to outlive its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

__all__ = ["Stopped", "start", "held_signals", "end_tree", "tree", "stop_on_signals",
           "set_parent_death_signal", "parent_death_signal"]

_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP")
                     if hasattr(signal, name))


class Stopped(BaseException):
    """The launcher received a stop signal (``signum``); raised from the signal handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; 0 cancels). Returns False where that is not available. The
    request holds across ``exec`` and is cleared in children. Strictly it is the parent *thread*
    that created this process whose end sends the signal: start launchers from a thread that
    outlives them (the main thread)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
        return False


def parent_death_signal() -> int:
    """The signal this process receives when its parent dies (0: none, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.c_int(0)
        if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) != 0:
            return 0
        return value.value
    except (OSError, AttributeError):  # pragma: no cover
        return 0


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Hold SIGTERM, SIGINT and SIGHUP within the block; they are handled when it ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _child_setup(signum: int) -> None:
    # runs in the child between fork and exec: the launcher may hold its stop signals around
    # the fork (held_signals), the command must get them unblocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    set_parent_death_signal(signum)


def start(cmd: Sequence[str], *, env: dict[str, str] | None = None,
          death_signal: int = signal.SIGTERM, **popen) -> subprocess.Popen:
    """``subprocess.Popen(cmd)`` in a new session that receives ``death_signal`` when this
    process dies (see the module docstring)."""
    return subprocess.Popen(list(cmd), env=env, start_new_session=True,
                            preexec_fn=lambda: _child_setup(death_signal), **popen)


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) "
    # fields[0] is the state: a zombie has exited already
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _all_stats() -> dict[int, tuple[int, int, int]]:
    stats = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(int(name))
                if st is not None:
                    stats[int(name)] = st
    return stats


def tree(pid: int) -> dict[int, tuple[int, int]]:
    """``pid`` and its living descendants: pid -> (process group, start time). Empty where
    /proc is not available or ``pid`` is gone."""
    stats = _all_stats()
    if pid not in stats:
        return {}
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in found or p not in stats:
            continue
        found[p] = (stats[p][1], stats[p][2])
        todo.extend(children.get(p, ()))
    return found


def _alive(recorded: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """The recorded processes that still run (same pid and start time)."""
    alive = {}
    for p, (pgid, started) in recorded.items():
        st = _stat(p)
        if st is not None and st[2] == started:
            alive[p] = (pgid, started)
    return alive


def _signal_all(recorded: dict[int, tuple[int, int]], signum: int) -> None:
    own = os.getpgrp()
    # a group is signalled only when its leader is one of ours: ranks that started a session
    # of their own (Hydra does so) take the processes they started with them
    for pgid in {g for p, (g, _) in recorded.items() if g == p and g != own}:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signum)
    for p in recorded:
        with contextlib.suppress(OSError):
            os.kill(p, signum)


def end_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End ``proc`` and every process below it: SIGTERM, ``grace`` seconds, then SIGKILL (see
    the module docstring). Reaps ``proc``. Safe to call when it has exited already."""
    recorded = tree(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGTERM)
    _signal_all(recorded, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _alive(recorded):
            break
        recorded.update(tree(proc.pid))  # late children of a process still shutting down
        time.sleep(0.1)
    survivors = _alive(recorded)
    if proc.poll() is None:
        survivors.update(tree(proc.pid))
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
    _signal_all(survivors, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


_stopping = {"signum": 0}


def _raise_stopped(signum: int, _frame) -> None:
    if _stopping["signum"]:
        return  # stopping already: let the clean-up finish
    _stopping["signum"] = signum
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGTERM, SIGINT or SIGHUP raises :class:`Stopped` (later ones
    are ignored), and the death of this process's parent sends it SIGTERM (unless SIGHUP was
    ignored when the block was entered, as under ``nohup``). The previous handlers are restored
    on exit. Outside the main thread (where Python cannot handle signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stopping["signum"] = 0
    detached = hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    signums = [s for s in STOP_SIGNALS if not (detached and s == getattr(signal, "SIGHUP", None))]
    previous = {s: signal.signal(s, _raise_stopped) for s in signums}
    death_signal = parent_death_signal()
    try:
        parent = os.getppid()
        if not detached and set_parent_death_signal(signal.SIGTERM) and os.getppid() != parent:
            raise Stopped(signal.SIGTERM)  # the parent died before the request was in place
        yield
    finally:
        if not detached:
            set_parent_death_signal(death_signal)
        for s, handler in previous.items():
            signal.signal(s, handler)
