"""Hang-proofing: deadlines on waits, and collective-consistency checks (both off by default).

``HEATLIKE_COMM_TIMEOUT=<seconds>`` (or :func:`set_timeout`)
    Every wait of a heatlike collective or request (blocking calls included) gives up after that
    many seconds with ``TimeoutError``, naming the operation and the ranks that have not arrived
    at it. Who has arrived is read from an *arrival board*: an MPI window in which every rank
    records, locally and without communication, the sequence number and name of the last
    collective it entered on each communicator. A rank stuck in another collective cannot answer
    a message, but its window can still be read (passive-target ``MPI_Get``).

``HEATLIKE_CHECK=1`` (or :func:`set_check`)
    Before every collective the ranks exchange its signature (operation, reduction op, root,
    dtype, element count where all ranks must agree) on a private communicator and raise
    ``ValueError`` on every rank if they differ, naming the ranks and both calls.

``HEATLIKE_STALL_WARN=<seconds>`` (or :func:`set_stall_warning`)
    The stall inspector: a wait that takes longer than that logs one warning (on the waiting
    rank) naming the operation and the ranks that have not arrived and where each is, and keeps
    waiting. Useful on a job that is slow rather than stuck, or before choosing a timeout.

All must be set the same way on every rank. When off, the cost is one flag test per call.
"""

from __future__ import annotations

import atexit
import os
import time
import zlib

import numpy as np
from mpi4py import MPI

from .log import get_logger

__all__ = ["set_timeout", "set_check", "set_stall_warning", "timeout", "stall_warning",
           "watching", "checking", "active", "Board"]


def _env_seconds(name: str) -> float | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    return seconds if seconds > 0 else None


_state = {"timeout": _env_seconds("HEATLIKE_COMM_TIMEOUT"),
          "stall": _env_seconds("HEATLIKE_STALL_WARN"),
          "check": os.environ.get("HEATLIKE_CHECK", "").strip() not in ("", "0", "false", "no")}
active = False  # read on every call: whether any of the three is on


def _update() -> None:
    global active
    active = _state["timeout"] is not None or _state["stall"] is not None or _state["check"]


_update()


def set_timeout(seconds: float | None) -> None:
    """Deadline for every wait (None: wait forever). Set it the same way on every rank."""
    _state["timeout"] = float(seconds) if seconds else None
    _update()


def set_check(enabled: bool) -> None:
    """Verify every collective's signature across ranks first. Same on every rank."""
    _state["check"] = bool(enabled)
    _update()


def set_stall_warning(seconds: float | None) -> None:
    """Log a warning when a wait takes longer than ``seconds`` (None: never). Same on every
    rank."""
    _state["stall"] = float(seconds) if seconds else None
    _update()


def timeout() -> float | None:
    return _state["timeout"]


def stall_warning() -> float | None:
    return _state["stall"]


def watching() -> bool:
    """Whether waits must be polled (a deadline or a stall warning is set)."""
    return _state["timeout"] is not None or _state["stall"] is not None


def checking() -> bool:
    return _state["check"]


_NAMES: dict[int, str] = {}  # stable code -> name, for the messages
_BOARDS: list[Board] = []  # in creation order, freed together at exit
_OP_NAMES = {getattr(MPI, n).py2f(): n for n in
             ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR",
              "MAXLOC", "MINLOC", "REPLACE", "NO_OP")}


def _code(name: str) -> int:
    """A code for ``name`` that is the same in every process (not an order of first use)."""
    code = zlib.crc32(name.encode()) + 1
    _NAMES[code] = name
    return code


def opcode(name: str) -> int:
    return _code(name)


def dtype_code(dtype) -> int:
    return _code(str(dtype).removeprefix("torch."))


for _dtype in ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
               "uint8", "bool", "complex64", "complex128"):
    dtype_code(_dtype)


def _dtype_name(code: int) -> str:
    return _NAMES.get(code, f"dtype code {code}")


def opname(code: int) -> str:
    return "nothing yet" if code == 0 else _NAMES.get(code, f"operation code {code}")


class Board:
    """Per communicator: the sequence number and operation of the last collective each rank
    entered, in an MPI window that others read without the owner's help (one passive access
    epoch to every rank stays open for the board's life, so a read needs no lock the owner
    would have to grant)."""

    def __init__(self, handle: MPI.Intracomm) -> None:
        self.handle = handle
        self.window = MPI.Win.Allocate(16, 8, comm=handle)  # collective
        self.local = np.frombuffer(self.window.tomemory(), dtype=np.int64)
        self.local[:] = 0
        self.seq = 0
        self.check_comm = handle.Dup() if _state["check"] else None
        self.window.Lock_all(MPI.MODE_NOCHECK)
        handle.Barrier()
        _BOARDS.append(self)

    def arrive(self, name: str) -> int:
        """Record entering the next collective; returns its sequence number."""
        self.seq += 1
        self.local[0], self.local[1] = self.seq, opcode(name)
        self.window.Sync()
        return self.seq

    def where(self, patience: float = 1.0) -> list[tuple[int, str] | None]:
        """(sequence number, operation) of every rank, read from their windows (None for a rank
        whose window could not be read within ``patience`` seconds)."""
        bufs = [np.zeros(2, dtype=np.int64) for _ in range(self.handle.Get_size())]
        requests = [self.window.Rget(buf, r) for r, buf in enumerate(bufs)]
        deadline = time.monotonic() + patience
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-3)
        return [(int(b[0]), opname(int(b[1]))) if q == MPI.REQUEST_NULL else None
                for b, q in zip(bufs, requests)]

    def stragglers(self, seq: int) -> str:
        """Who has not reached collective number ``seq`` yet, and where they are."""
        behind = [(r, e) for r, e in enumerate(self.where()) if e is None or e[0] < seq]
        if not behind:
            return "every rank has entered it (it may be waiting on the interconnect)"
        parts = [f"rank {r} is at #{e[0]} {e[1]}" if e else f"rank {r} does not answer"
                 for r, e in behind]
        return f"ranks {[r for r, _ in behind]} have not arrived ({'; '.join(parts)})"

    def check(self, signature: tuple) -> None:
        """Collective: raise ValueError on every rank unless all ranks pass equal signatures."""
        request = self.check_comm.Iallgather([np.array(signature, dtype=np.int64), MPI.INT64_T],
                                             [everyone := np.zeros(len(signature) *
                                                                   self.handle.Get_size(),
                                                                   dtype=np.int64),
                                              MPI.INT64_T])
        wait(request, lambda: "the collective-consistency check")
        rows = everyone.reshape(self.handle.Get_size(), -1)
        for r, row in enumerate(rows):
            if not np.array_equal(row, rows[0]):
                raise ValueError(f"ranks call different collectives: rank 0 calls "
                                 f"{describe(rows[0])} but rank {r} calls {describe(row)}")


def describe(signature) -> str:
    code, op, root, dtype, count = (int(v) for v in signature)
    parts = [opname(code)]
    if op:
        parts.append(f"op {_OP_NAMES.get(op, 'user-defined')}")
    if root >= 0:
        parts.append(f"root {root}")
    if dtype >= 0:
        parts.append(_dtype_name(dtype))
    if count >= 0:
        parts.append(f"{count} elements")
    return "(" + ", ".join(parts) + ")"


def wait(request, what, board: Board | None = None, seq: int = 0, watch=None,
         every: float = 0.5) -> None:
    """Wait for an MPI (or heatlike) request, honouring the deadline; on expiry raise
    TimeoutError naming ``what()`` and, with a board, the ranks that have not arrived.

    ``watch`` (optional) is called every ``every`` seconds while waiting and may raise to end
    the wait (e.g. when a rank the request needs has ended)."""
    limit, stall = _state["timeout"], _state["stall"]
    if limit is None and stall is None and watch is None:
        request.Wait()
        return
    start = time.monotonic()
    deadline = start + limit if limit is not None else None
    warn_at = start + stall if stall is not None else None
    next_watch = start + every
    while not request.Test():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise TimeoutError(_stalled(request, what, board, seq,
                                        f"did not complete within {limit:g} s "
                                        "(HEATLIKE_COMM_TIMEOUT)"))
        if warn_at is not None and now > warn_at:
            warn_at = None
            get_logger().warning("%s", _stalled(request, what, board, seq,
                                                f"has waited {now - start:.3g} s "
                                                "(HEATLIKE_STALL_WARN)"))
        if watch is not None and now > next_watch:
            watch()
            next_watch = now + every
        if now - start > 0.05:  # a long wait: stop competing for the core
            time.sleep(1e-4 if now - start < 1 else 1e-3)
        else:  # let a rank sharing this core (oversubscribed) run: it may be the one we wait for
            _yield()


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def _stalled(request, what, board, seq, how: str) -> str:
    """"<operation> <how>; ranks [..] have not arrived (rank r is at ...)"."""
    board, seq, inner = _innermost(request, board, seq)
    who = f"; {board.stragglers(seq)}" if board is not None else ""
    return f"{what()}{inner} {how}{who}"


def _innermost(request, board, seq) -> tuple:
    """The board, sequence number and label of the collective an operation is waiting in (a
    heatlike request can be waiting in another heatlike request, e.g. an exchange's
    all-reduce)."""
    label = ""
    inner = getattr(request, "_req", None)
    while inner is not None and hasattr(inner, "_req"):
        if getattr(inner, "_board", None) is not None:
            board, seq, label = inner._board, inner._seq, f" (waiting in {inner._label})"
        inner = inner._req
    return board, seq, label


@atexit.register
def _free_boards() -> None:
    """At exit (before MPI is finalized): free the boards' windows once every rank has got
    here (an exit barrier of at most 2 s; ranks stuck elsewhere leave them to MPI_Finalize)."""
    if not _BOARDS or MPI.Is_finalized():
        return
    barrier = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + 2.0
    while not barrier.Test():
        if time.monotonic() > deadline:
            return  # some rank is not exiting: leave the windows to MPI_Finalize
        time.sleep(1e-3)
    for board in _BOARDS:
        board.window.Unlock_all()
        board.window.Free()
    _BOARDS.clear()
