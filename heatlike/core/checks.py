"""Hang-proofing: deadlines on waits, collective-consistency checks, and the boards that tell each
rank where the others are.

``HEATLIKE_COMM_TIMEOUT=<seconds>`` (or :func:`set_timeout`)
    Every wait of a heatlike collective or request (blocking calls included), and the setup of
    heatlike's private channels, gives up after that many seconds with ``TimeoutError``, naming
    the operation and the ranks that have not arrived at it (read from the communicator's
    :class:`Board`).

``HEATLIKE_CHECK=1`` (or :func:`set_check`)
    Before every collective the ranks exchange its signature (operation, reduction op, root,
    dtype, element count where all ranks must agree) on the board's private channel and raise
    ``ValueError`` on every rank if they differ, naming the ranks and both calls.

``HEATLIKE_STALL_WARN=<seconds>`` (or :func:`set_stall_warning`)
    The stall inspector: a wait that takes longer than that logs one warning (on the waiting
    rank) naming the operation and the ranks that have not arrived and where each is, and keeps
    waiting. Useful on a job that is slow rather than stuck, or before choosing a timeout.

All must be set the same way on every rank. When off, the cost is one flag test per call.

Boards
------
A :class:`Board` is heatlike's private state for one communicator of two or more ranks, shared by
every wrapper of that communicator (:class:`Hub`). It is set up at the first collective that
needs it, by all ranks at the same point of their sequence of collectives: the first collective
while a check is on, the construction of a gradient synchronization (``heatlike.engine.liveness``)
or the start of ``python -m heatlike`` (the world's). The setup

1. duplicates the communicator with the non-blocking ``MPI_Comm_idup`` and waits for it like for
   any collective: with the deadline, the stall warning, and the world board's record of ranks
   whose program has ended; a setup that cannot complete raises instead of blocking (and is
   resumed, not repeated, by the next call);
2. only then, every rank having arrived, allocates on that *channel* a small window (shared
   memory when all ranks are on one node), duplicates the channel once more for the
   end-of-program barrier, and agrees on the board's rank in a global order (a Lamport clock).

Apart from that duplication, at a point where every rank enters a collective anyway, nothing the
board needs runs on the user's communicator, so it cannot match the user's collectives. In its
window each rank records, locally and without communication: how many collectives it has entered
on the communicator (its *position*: heatlike's collectives, the agreements of
``heatlike.core.agreement`` and training steps) and the name of the last one, how many training
steps it has begun and at which position each of the last eight began, and whether its program
has ended (normally, or with an uncaught exception). The others read it one-sidedly (a rank
busy computing or blocked in a collective need not answer; on one node the records are in shared
memory, across nodes a read is an ``MPI_Rget`` that completes once the target makes MPI progress).
A check made before issuing a collective reads every record anew (:meth:`Board.read`); the checks
a polled wait repeats use the records as last answered and never wait for an answer
(:meth:`Board.known`: records only grow, so an old one is still true), so a rank on another node
that computes outside MPI delays neither the wait's deadline nor its other checks. This gives

* the timeout's and the stall warning's "ranks [1] have not arrived (rank 1 is at #4 Allreduce)";
* **ended ranks**: a rank whose program ended before entering a collective another rank waits in
  will never enter it: polled waits (every wait on a communicator with a board) raise
  ``RuntimeError`` naming it within half a second;
* **different numbers of training steps** (:meth:`Board.verify`): two ranks whose collectives at
  the same position belong to different numbers of training steps ran different numbers of
  batches. Every rank that begins a step (:meth:`Board.mark_step`) or enters a collective
  directly (not as a phase of another heatlike operation) on a *watched* board first publishes
  its position, then reads everybody's (a step may complete those reads later, before it issues
  its first collective: :meth:`Board.mark_step`); of two ranks about to issue different
  collectives at the same position at least one sees the other and raises before issuing, so
  mismatched collectives never match each other, and the other raises from its polled wait.

On a watched board every collective runs non-blocking with a polled wait (on every rank alike:
MPI never matches a blocking collective with a non-blocking one). On a board that is neither
watched nor checked, the fast paths only count the collective (one memory increment).
``MPICommunication.Dup``, ``heatlike.nn.Join``'s channel (:func:`private_duplicate`) and the
agreements (:func:`gather_objects`) are made non-blocking and waited for the same way whenever
a deadline is set or the communicator has a board.

End of the program
------------------
When a rank's program ends (an ``atexit`` handler, or the start of ``MPI_Finalize`` if the
program calls it itself) it marks itself ended on every board and waits, polling, for a
barrier with the other ranks on each board's own exit channel (``MPI_Finalize`` waits for them
too). Meanwhile it watches their positions: a rank that has entered a collective this rank never
entered waits for it forever; when that lasts 2 s, under ``python -m heatlike`` or
``abort_on_exception`` the job is aborted with a message naming both ranks, otherwise the message
is printed. Once every rank has ended, the windows are freed in the agreed order. Nothing at exit
runs on a user's communicator.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import time
import weakref
import zlib
from collections.abc import Callable, Iterator

import numpy as np
from mpi4py import MPI

from .env import env_flag, env_float
from .log import get_logger

__all__ = ["set_timeout", "set_check", "set_stall_warning", "timeout", "stall_warning",
           "watching", "checking", "active", "Board", "Hub", "hub", "wait", "private_duplicate",
           "gather_objects", "abort_on_deadlock", "end_of_program"]


def _env_seconds(name: str) -> float | None:
    """Seconds > 0, or None for unset, blank or 0; ValueError otherwise (negative, nan...)."""
    return env_float(name, None, minimum=0.0, meaning="seconds; 0 or unset: off") or None


_state = {"timeout": _env_seconds("HEATLIKE_COMM_TIMEOUT"),
          "stall": _env_seconds("HEATLIKE_STALL_WARN"),
          "check": env_flag("HEATLIKE_CHECK", False)}
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


# ---------------------------------------------------------------------------- boards

# the slots of a rank's record in a board's window (int64 each): its position, the operation it
# entered last and that operation's position (the fast paths count without naming), whether its
# program has ended, the training steps it has begun and where the last RING_LEN of them began
SEQ, OP, OP_AT, ENDED, STEPS, RING = 0, 1, 2, 3, 4, 5
RING_LEN = 8  # positions at which the last RING_LEN training steps began
_SLOTS = RING + RING_LEN

_STEP_CODE = _code("a training step")
_AGREEMENT = "an exchange of objects between the ranks (heatlike.core.agreement)"
_code(_AGREEMENT)  # named alike in every process
_BOARDS: list[Board] = []  # established boards, in creation order
_world: list[Board | None] = [None]  # the board of MPI_COMM_WORLD, once established
_clock = [0]  # Lamport clock: the order in which every rank frees the boards
_exit = {"started": False, "done": False, "abort": False}
_HUBS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
shared_windows = True  # boards of ranks on one node in shared memory (False: RMA as across nodes)


class Hub:
    """What heatlike keeps for one MPI communicator, shared by every wrapper of it: its board
    (once set up), whether the board is *watched* (a gradient synchronization runs on the
    communicator: every collective is verified and polled), the fast paths' counter (a view of
    this rank's position in the board's window), the training-step board and the node-local
    reduction's workspaces; and the communicator's name among the ranks (``key``, the same on
    every member: ``heatlike.core.communication`` names the communicators it creates after their
    parent and a count of the parent's creations, to free dropped ones together). Nothing a hub
    holds may refer to a wrapper of its communicator: an owned wrapper's finalizer keeps the hub,
    to free what it holds with the communicator."""

    __slots__ = ("board", "watched", "count", "steps", "node", "one_node", "key", "made",
                 "__weakref__")

    def __init__(self, key: str | None = None) -> None:
        self.board: Board | None = None
        self.watched = False
        self.count = None
        self.steps = None
        self.node = None  # the node-local reduction's set-up (heatlike.core._nodereduce)
        self.one_node = None  # whether the ranks share one node (heatlike.core._nodereduce)
        self.key = key
        self.made: dict = {}  # communicators created from this one: count per group (or None)


def hub(handle: MPI.Comm) -> Hub:
    """The hub of ``handle`` (created on first use; lives as long as a wrapper refers to it)."""
    key = handle.py2f()
    found = _HUBS.get(key)
    if found is None:
        name = "w" if handle == MPI.COMM_WORLD else "s" if handle == MPI.COMM_SELF else None
        found = _HUBS[key] = Hub(name)
    return found


def forget(handle: MPI.Comm) -> None:
    """``handle`` is being freed: its hub must not be found by a later communicator that gets the
    same handle value."""
    _HUBS.pop(handle.py2f(), None)


def position(row) -> int:
    """The position of a rank: how many collectives (and training steps) it has entered."""
    return int(row[SEQ])


def operation(row) -> str:
    """The name of the last collective the rank entered, "" if not known (a fast path)."""
    return opname(int(row[OP])) if row[OP_AT] == row[SEQ] and row[SEQ] else ""


def how_ended(row, after: str = "") -> str:
    """How a rank's program ended, for messages: "ended its program" or, when it ended with an
    uncaught exception, "failed (...)"; ``after`` goes after the verb."""
    if row[ENDED] == 2:
        return f"failed{after} (its program ended with an uncaught exception: see its error)"
    return f"ended its program{after}"


def steps_at(row, s: int) -> int | None:
    """How many training steps the rank had begun at its position ``s`` (None if that is older
    than its record)."""
    n = int(row[STEPS])
    for m in range(n, max(n - RING_LEN, 0), -1):
        if row[RING + (m - 1) % RING_LEN] <= s:
            return m
    return 0 if n <= RING_LEN else None


class Board:
    """The board of one communicator (module docstring): a private channel, a window with every
    rank's record, and an exit channel. Create it with :meth:`establish` at a point all ranks
    reach in the same order of collectives."""

    def __init__(self, comm) -> None:
        self.label = repr(comm)
        self.handle: MPI.Intracomm = comm.handle
        self.hub: Hub = comm._hub
        self.rank, self.size = self.handle.Get_rank(), self.handle.Get_size()
        self.channel: MPI.Intracomm | None = None  # the private duplicate
        self.exit_channel: MPI.Intracomm | None = None
        self.window: MPI.Win | None = None
        self.local: np.ndarray | None = None     # this rank's record
        self.shared: list[np.ndarray] | None = None  # every rank's record, on one node
        self.key = 0
        self.closed = False
        # liveness.StepBoard's message for ranks that ran different numbers of steps:
        # explain_steps(board, rows, ended, s) -> str
        self.explain_steps: Callable | None = None
        self._idup = None  # (duplicate, request) while the setup waits
        # reads of other ranks' records in flight (a get stays pending, with its buffer, until
        # the target answers), and the last record each rank answered with (records only grow)
        self._gets: list[tuple[int, MPI.Request, np.ndarray]] = []
        self._known: list[np.ndarray | None] = [None] * self.size
        # reads started by a deferred mark_step after this rank's record at position
        # ``_fresh[0]``, for the read that confirms the step (:meth:`confirm_step`)
        self._fresh: tuple[int, dict[int, tuple[MPI.Request, np.ndarray]]] | None = None

    @property
    def established(self) -> bool:
        return self.window is not None

    # -- setup -------------------------------------------------------------------------------

    def establish(self, before: str) -> Board:
        """Collective (all ranks at the same point): set up the board, before the collective
        ``before``. Waits like a collective (deadline, stall warning, ranks known to have ended)
        and raises TimeoutError/RuntimeError instead of blocking forever; a later call resumes
        the same setup."""
        if self.window is not None:
            return self
        if self.closed:
            raise RuntimeError(f"{before} on {self.label}: the program has ended")
        if self._idup is None:
            self._idup = self.handle.Idup()
        channel, request = self._idup
        what = f"{before} on {self.label}"
        wait(request, lambda: what, watch=lambda: self._setup_watch(what),
             who=lambda: "; it is the first collective heatlike runs on this communicator, and "
                         "heatlike's private channel for it (duplicated by all ranks together, "
                         "without blocking) is still waiting for the ranks that have not "
                         "reached it" + self._ended_note())
        self._idup = None
        # every rank has entered the setup: the blocking collectives below complete
        node = channel.Split_type(MPI.COMM_TYPE_SHARED)
        on_one_node = node.Get_size() == self.size and shared_windows
        node.Free()
        nbytes = _SLOTS * 8
        if on_one_node:
            window = MPI.Win.Allocate_shared(nbytes, 8, comm=channel)
            self.shared = [np.frombuffer(window.Shared_query(r)[0], dtype=np.int64,
                                         count=_SLOTS) for r in range(self.size)]
        else:
            window = MPI.Win.Allocate(nbytes, 8, comm=channel)
        self.local = np.frombuffer(window.tomemory(), dtype=np.int64, count=_SLOTS)
        self.local[:] = 0
        window.Lock_all(MPI.MODE_NOCHECK)
        window.Sync()
        self.exit_channel = channel.Dup()
        # the agreed order of boards (also the barrier after which the records are zero)
        self.key = channel.allreduce(_clock[0] + 1, op=MPI.MAX)
        _clock[0] = self.key
        self.channel, self.window = channel, window
        self.hub.count = memoryview(window.tomemory()).cast("B").cast("q")
        _BOARDS.append(self)
        if MPI.Comm.Compare(self.handle, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT) and \
                _world[0] is None:
            _world[0] = self
        return self

    def _setup_watch(self, what: str) -> None:
        _raise_if_ended(self.handle, self.rank, what)

    def _ended_note(self) -> str:
        ended = _ended_members(self.handle, self.rank)
        return f" (rank(s) {ended} ended their program)" if ended else \
            " (which ones cannot be known before that channel exists)"

    # -- records -----------------------------------------------------------------------------

    def arrive(self, name: str) -> int:
        """Record entering the next collective; returns its sequence number."""
        local = self.local
        seq = int(local[SEQ]) + 1
        local[SEQ] = seq
        local[OP] = opcode(name)
        local[OP_AT] = seq
        return seq

    @property
    def seq(self) -> int:
        return int(self.local[SEQ]) if self.local is not None else 0

    def mark_step(self, defer: bool = False) -> int:
        """This rank begins a training step: the step takes a position of its own (its
        collectives may run on other communicators, e.g. an exchange's private channel); record
        it, then :meth:`verify` (before the step issues anything). Returns the step's number.

        ``defer``: only start reading the others' records; :meth:`confirm_step`, called before
        the step issues its first collective, completes the reads and verifies. Across nodes a
        read completes only when its target next makes MPI progress, and at the start of a
        backward pass every rank computes: read at once, the step waited for the other node's
        ranks to reach their next MPI call (3-10 ms per step on the virtual cluster). Reads
        started after this rank's record was written see what reads made then would."""
        local = self.local
        seq = int(local[SEQ]) + 1
        n = int(local[STEPS]) + 1
        local[RING + (n - 1) % RING_LEN] = seq  # written before the position: a reader that
        local[STEPS] = n                         # sees the position sees the step too
        local[SEQ] = seq
        local[OP] = _STEP_CODE
        local[OP_AT] = seq
        if defer:
            self._start_fresh()
        else:
            self.verify()
        return n

    def confirm_step(self) -> None:
        """The verification of a deferred :meth:`mark_step` (reads already answered cost
        nothing)."""
        self.verify()

    def _start_fresh(self) -> None:
        """Start reading every other rank's record anew (after this rank's own), for the next
        current read (:meth:`read`); nothing to start on one node."""
        if self._direct() is not None:
            return
        self._retire_fresh()
        self._fresh = (int(self.local[SEQ]),
                       {r: self._get(r) for r in range(self.size) if r != self.rank})

    def _retire_fresh(self) -> None:
        """Reads started for a current read that will not be used as one: they complete in the
        background like the others (:meth:`known`)."""
        if self._fresh is not None:
            self._gets += [(r, q, buf) for r, (q, buf) in self._fresh[1].items()]
            self._fresh = None

    def end(self, failed: bool = False) -> None:
        """This rank's program has ended (``failed``: with an uncaught exception)."""
        self.local[ENDED] = 2 if failed else 1
        self.window.Sync()

    def read(self, patience: float = 1.0) -> list[np.ndarray | None]:
        """Every rank's record, read anew, after this rank's own last record was written (None
        for a rank whose window could not be read within ``patience`` seconds, or all None once
        the board is closed). On one node the records are in shared memory; across nodes a read
        completes when the other rank makes MPI progress, so a rank busy outside MPI makes this
        wait up to ``patience``."""
        direct = self._direct()
        if direct is not None:
            return direct
        if self._fresh is not None and self._fresh[0] == int(self.local[SEQ]):
            fresh, self._fresh = self._fresh[1], None  # started after this record: current
        else:
            self._retire_fresh()
            fresh = {r: self._get(r) for r in range(self.size) if r != self.rank}
        self._harvest()
        deadline = time.monotonic() + patience
        rows: list[np.ndarray | None] = [None] * self.size
        while fresh:
            for r, (q, buf) in list(fresh.items()):
                if q.Test():
                    rows[r] = buf
                    self._learn(r, buf)
                    del fresh[r]
            if not fresh or time.monotonic() >= deadline:
                break
            time.sleep(1e-4)
        # an unanswered get stays pending: it completes when the target next makes progress
        # (at the latest when the window is freed), and then counts as that rank's known record
        self._gets += [(r, q, buf) for r, (q, buf) in fresh.items()]
        rows[self.rank] = self.local.copy()
        return rows

    def known(self) -> list[np.ndarray | None]:
        """Every rank's record as last answered, without waiting (None for a rank that has not
        answered yet): completes the reads that have been answered and starts one for each rank
        without a read in flight. Records only grow (positions, steps, the end of a program), so
        an older record is a true statement about the past; checks repeated while a rank waits
        use this, so that a rank on another node that is busy outside MPI delays nothing."""
        direct = self._direct()
        if direct is not None:
            return direct
        self._harvest()
        asked = {r for r, _, _ in self._gets}
        for r in range(self.size):
            if r != self.rank and r not in asked:
                q, buf = self._get(r)
                self._gets.append((r, q, buf))
        self._harvest()
        rows = [None if row is None else row.copy() for row in self._known]
        rows[self.rank] = self.local.copy()
        return rows

    def _direct(self) -> list[np.ndarray | None] | None:
        """The records when no get is needed: all None once the board is closed, copies of
        the shared memory on one node; None otherwise (after syncing this rank's own)."""
        if self.window is None or self.closed:
            return [None] * self.size
        self.window.Sync()
        if self.shared is not None:
            return [row.copy() for row in self.shared]
        return None

    def _get(self, r: int) -> tuple[MPI.Request, np.ndarray]:
        buf = np.zeros(_SLOTS, dtype=np.int64)
        return self.window.Rget(buf, r), buf

    def _harvest(self) -> None:
        """Complete the reads in flight that have been answered."""
        pending = []
        for r, q, buf in self._gets:
            if q.Test():
                self._learn(r, buf)
            else:
                pending.append((r, q, buf))
        self._gets = pending

    def _learn(self, r: int, row: np.ndarray) -> None:
        old = self._known[r]
        if old is None or row[SEQ] >= old[SEQ]:
            self._known[r] = row

    def where(self, patience: float = 1.0) -> list[tuple[int, str] | None]:
        """(sequence number, operation) of every rank, read from their windows (None for a rank
        whose window could not be read within ``patience`` seconds)."""
        return [None if r is None else
                (int(r[SEQ]), operation(r) or ("a collective" if r[SEQ] else opname(0)))
                for r in self.read(patience)]

    def stragglers(self, seq: int) -> str:
        """Who has not reached collective number ``seq`` yet, and where they are. A rank on
        another node answers only while it makes MPI progress: one that computes or sleeps
        outside MPI "does not answer" (waiting for it would report where it is afterwards)."""
        rows = self.read(patience=0.25)
        behind = [(r, row) for r, row in enumerate(rows) if row is None or row[SEQ] < seq]
        if not behind:
            return ("every rank has reached it: a rank may have refused its own arguments there "
                    "(its error is in its output), or the transfer waits on the interconnect")
        parts = []
        for r, row in behind:
            if row is None:
                parts.append(f"rank {r} does not answer (busy outside MPI, or unreachable)")
            else:
                ended = ", its program has ended" if row[ENDED] else ""
                op = operation(row) if row[SEQ] else opname(0)
                parts.append(f"rank {r} is at #{int(row[SEQ])}" + (f" {op}" if op else "") +
                             ended)
        return f"ranks {[r for r, _ in behind]} have not arrived ({'; '.join(parts)})"

    # -- verdicts ----------------------------------------------------------------------------

    def verify(self, what: Callable[[], str] | None = None, any_ended: bool = False,
               steps: bool = True, current: bool = True) -> None:
        """Raise RuntimeError (on this rank) when what this rank waits for, or is about to
        issue, can never complete or would match another rank's different collective: a rank
        whose program ended before this rank's position (``any_ended``: whose program ended at
        all, for operations that are not counted collectives), or, on a board with training
        steps, a rank whose collective at the same position belongs to another number of
        steps (unless ``steps`` is False).

        ``current``: read every record anew, after this rank's own (:meth:`read`): what a check
        before issuing a collective needs. False: judge the records as last answered, without
        waiting (:meth:`known`), for the checks a wait repeats while it polls."""
        if self.window is None or self.closed:
            return
        rows = self.read(patience=0.5) if current else self.known()
        mine = rows[self.rank]
        k = position(mine)
        ended = [r for r, row in enumerate(rows) if r != self.rank and row is not None and
                 row[ENDED] and (any_ended or position(row) < k)]
        first = None  # the first position at which two ranks are in different steps
        if steps and self.explain_steps is not None and any(row is not None and row[STEPS]
                                                  for row in rows):
            for r, row in enumerate(rows):
                if r == self.rank or row is None:
                    continue
                s = min(k, position(row))
                a, b = steps_at(mine, s), steps_at(row, s)
                if a is not None and b is not None and a != b and (first is None or s < first):
                    first = s
        if not ended and first is None:
            return
        if self.explain_steps is not None:
            text = self.explain_steps(self, rows, ended, first)
            if text:
                raise RuntimeError(text)
        waiting = what() if what is not None else f"collective #{k} on {self.label}"
        parts = ", ".join(f"rank {r} " + how_ended(rows[r], f" after {int(rows[r][SEQ])} "
                                                     "collective(s)") for r in ended)
        raise RuntimeError(f"{waiting} can never complete: {parts} on this communicator, "
                           f"without entering it (this rank is at collective #{k})")

    def waiting_for_me(self) -> list[tuple[int, int, str]]:
        """(rank, position, operation) of the ranks still running that have entered a
        collective past this rank's position (at the end of this rank's program: they wait for
        it forever; from the records as last answered)."""
        rows = self.known()
        k = position(rows[self.rank])
        return [(r, position(row), operation(row)) for r, row in enumerate(rows)
                if r != self.rank and row is not None and not row[ENDED] and position(row) > k]

    def check(self, signature: tuple) -> None:
        """Collective: raise ValueError on every rank unless all ranks pass equal signatures."""
        everyone = np.zeros(len(signature) * self.size, dtype=np.int64)
        request = self.channel.Iallgather([np.array(signature, dtype=np.int64), MPI.INT64_T],
                                          [everyone, MPI.INT64_T])
        wait(request, lambda: "the collective-consistency check", self, self.seq,
             watch=lambda: self.verify(lambda: "the collective-consistency check",
                                       any_ended=True, current=False))
        rows = everyone.reshape(self.size, -1)
        for r, row in enumerate(rows):
            if not np.array_equal(row, rows[0]):
                raise ValueError(f"ranks call different collectives: rank 0 calls "
                                 f"{describe(rows[0])} but rank {r} calls {describe(row)}")

    def check_pairs(self, sent: list[int] | None, expected: list[int] | None,
                    what: str) -> None:
        """Collective: raise ValueError on every rank unless the count each rank sends to rank j
        (``sent[j]``) is the count rank j expects from it (its ``expected[i]``): the counts of a
        v-form exchange that only pairs of ranks share. None: not known on this rank (skipped
        there)."""
        size = self.size
        mine = np.full(size, -1, dtype=np.int64) if sent is None else \
            np.asarray(sent, dtype=np.int64)
        got = np.empty(size, dtype=np.int64)
        request = self.channel.Ialltoall([mine, MPI.INT64_T], [got, MPI.INT64_T])
        wait(request, lambda: "the collective-consistency check", self, self.seq,
             watch=lambda: self.verify(lambda: "the collective-consistency check",
                                       any_ended=True, current=False))
        first = np.array([-1, -1, -1], dtype=np.int64)  # (sender, its count, this rank's)
        if expected is not None:
            for source in range(size):
                if got[source] >= 0 and got[source] != int(expected[source]):
                    first[:] = (source, got[source], int(expected[source]))
                    break
        everyone = np.empty(3 * size, dtype=np.int64)
        request = self.channel.Iallgather([first, MPI.INT64_T], [everyone, MPI.INT64_T])
        wait(request, lambda: "the collective-consistency check", self, self.seq,
             watch=lambda: self.verify(lambda: "the collective-consistency check",
                                       any_ended=True, current=False))
        for receiver, (source, count, wanted) in enumerate(everyone.reshape(size, 3)):
            if source >= 0:
                raise ValueError(f"{what}: rank {source} sends {count} slice(s) to rank "
                                 f"{receiver}, which expects {wanted} from it")

    def release(self, what: str) -> None:
        """Collective (where all ranks free the communicator): free the board's window and
        channels, once every rank has arrived (a barrier on the channel, waited for like a
        collective)."""
        self.hub.board = None
        self.hub.count = None
        if self.window is None:
            return
        if not self.closed:
            request = self.channel.Ibarrier()
            wait(request, lambda: f"{what} (the release of its board)", self,
                 watch=lambda: self._verify_release(what))
            self.close()
        if self in _BOARDS:
            _BOARDS.remove(self)
        if _world[0] is self:
            _world[0] = None
        if not MPI.Is_finalized():
            self.exit_channel.Free()
            self.channel.Free()

    def _verify_release(self, what: str) -> None:
        """While this rank frees the communicator: raise RuntimeError if a rank has ended, or
        has entered a collective on it that this rank never entered (it would wait forever: a
        rank that left a loop early and freed what the others still use)."""
        self.verify(lambda: what, any_ended=True, steps=False, current=False)
        waiting = self.waiting_for_me()
        if waiting:
            who = "; ".join(f"rank {r} has entered collective #{k}" + (f" ({op})" if op else "")
                            for r, k, op in waiting)
            raise RuntimeError(f"{what}: {who} there, waiting for rank {self.rank}, which "
                               f"frees the communicator after "
                               f"{position(self.known()[self.rank])} collective(s) and will "
                               "never enter it")

    def close(self) -> None:
        """Free the window (collective over the channel: at the end, once every rank ended)."""
        if self.window is not None and not self.closed:
            self.closed = True
            self.hub.count = None
            self.window.Unlock_all()  # completes the gets in flight too
            self._gets = []
            self._fresh = None
            self.window.Free()


def _ended_members(handle: MPI.Intracomm, rank: int) -> list[int]:
    """Ranks of ``handle`` (other than ``rank``) whose program has ended, as far as the world's
    board knows (empty without one)."""
    world = _world[0]
    if world is None or not world.established or world.closed or \
            MPI.Comm.Compare(world.handle, handle) in (MPI.IDENT, MPI.CONGRUENT):
        return []
    group, everyone = handle.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        members = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), everyone)
    finally:
        group.Free()
        everyone.Free()
    rows = world.known()
    return [r for r, w in enumerate(members)
            if r != rank and rows[w] is not None and rows[w][ENDED]]


def _raise_if_ended(handle: MPI.Intracomm, rank: int, what: str) -> None:
    ended = _ended_members(handle, rank)
    if ended:
        raise RuntimeError(f"{what} cannot complete: rank(s) {ended} of this communicator ended "
                           "their program without entering it")


def private_duplicate(comm, what: str) -> MPI.Intracomm:
    """Collective: a private duplicate of the heatlike communicator ``comm``'s MPI communicator,
    made without blocking (``MPI_Comm_idup``) and waited for like a collective: deadline, stall
    warning, and ranks known (from the boards) to have ended raise instead of blocking."""
    duplicate, request = comm.handle.Idup()
    board = comm._hub.board
    board = board if board is not None and board.established else None

    def watch() -> None:
        if board is not None:
            board.verify(lambda: f"{what} on {comm!r}", any_ended=True, steps=False,
                         current=False)
        else:
            _raise_if_ended(comm.handle, comm.rank, f"{what} on {comm!r}")

    wait(request, lambda: f"{what} on {comm!r}", watch=watch)
    return duplicate


def gather_objects(comm, obj: object, what: str) -> list:
    """Collective over the heatlike communicator ``comm``: every rank's ``obj`` in rank order
    (like mpi4py's pickle-based ``allgather``). While a deadline or a stall warning is set, or
    once the communicator has a board (the same on every rank), it runs as two non-blocking
    all-gathers (sizes, then bytes) waited for like any heatlike collective: the deadline, and
    ranks known to have ended raise instead of blocking; on a board it takes a position and is
    verified like a collective the program calls. Otherwise it is mpi4py's allgather. Each
    rank's ``what`` travels with its object: ranks that met here from different calls (one
    agreeing on settings, another re-planning buckets) raise RuntimeError on every rank, naming
    each rank's call. An object pickle refuses on one rank raises TypeError on every rank."""
    waiter = _object_waiter(comm, what)
    payload, _ = _pickled((what, obj), what)
    if waiter is None:
        return _same_call([pickle.loads(b) for b in comm.handle.allgather(payload)], comm)
    data = np.frombuffer(payload, dtype=np.uint8)
    sizes = np.zeros(comm.size, dtype=np.int64)
    waiter(comm.handle.Iallgather([np.array([data.size], dtype=np.int64), MPI.INT64_T],
                                  [sizes, MPI.INT64_T]))
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    everyone = np.empty(int(sizes.sum()), dtype=np.uint8)
    waiter(comm.handle.Iallgatherv([data, MPI.BYTE],
                                   [everyone, (sizes.tolist(), displs.tolist()), MPI.BYTE]))
    return _same_call([pickle.loads(everyone[d:d + n].tobytes()) for d, n in zip(displs, sizes)],
                      comm)


def gather_objects_to(comm, obj: object, what: str, root: int) -> list | None:
    """Collective over the heatlike communicator ``comm``: every rank's ``obj`` in rank order on
    ``root``, None elsewhere (like mpi4py's pickle-based ``gather``), watched and compared as
    :func:`gather_objects` is. Only ``root`` holds the others' objects: every rank shares its
    object's size, a digest of its ``what`` and whether pickle refused its object (three
    integers per rank), and the pickled bytes go to ``root`` alone. Ranks that met from
    different calls (``what`` names the root, so ranks with different roots too) raise
    RuntimeError on every rank, naming each rank's call (the labels then travel in a second
    exchange); a root that is no rank raises ValueError, an object pickle refused TypeError, on
    every rank, after that exchange."""
    payload, refused = _pickled(obj, what)
    data = np.frombuffer(payload, dtype=np.uint8)
    mine = np.array([data.size, zlib.crc32(what.encode()), refused is not None],
                    dtype=np.int64)
    table = np.zeros((comm.size, 3), dtype=np.int64)
    waiter = _object_waiter(comm, what)
    if waiter is None:
        comm.handle.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    else:
        waiter(comm.handle.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]))
    if len(set(table[:, 1].tolist())) > 1:  # the same on every rank: all raise here
        gather_objects(comm, None, what)
        raise RuntimeError(f"the ranks of {comm!r} met in different collective calls")
    check_root(root, comm.size)  # the same root on every rank (it is in the label): all raise
    if table[:, 2].any():  # the verdicts of every rank, on every rank: all raise
        bad = int(np.flatnonzero(table[:, 2])[0])
        reason = refused.error if bad == comm.rank else "see that rank's error"
        raise TypeError(f"rank {bad} could not pickle its object for {what} ({reason}): "
                        "exchange plain Python values, arrays or tensors")
    sizes = table[:, 0]
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    everyone = np.empty(int(sizes.sum()) if comm.rank == root else 0, dtype=np.uint8)
    spec = [everyone, (sizes.tolist(), displs.tolist()), MPI.BYTE] if comm.rank == root \
        else None
    if waiter is None:
        comm.handle.Gatherv([data, MPI.BYTE], spec, root=root)
    else:
        waiter(comm.handle.Igatherv([data, MPI.BYTE], spec, root=root))
    if comm.rank != root:
        return None
    return [pickle.loads(everyone[d:d + n].tobytes()) for d, n in zip(displs, sizes)]


def as_root(root: object) -> object:
    """``root`` as a Python int when it is an integer (numpy's too, as mpi4py takes them; not a
    bool), else unchanged (for :func:`check_root` to refuse): the form a call's label shows."""
    if isinstance(root, (int, np.integer)) and not isinstance(root, (bool, np.bool_)):
        return int(root)
    return root


def check_root(root: object, size: int) -> None:
    """ValueError unless ``root`` is a rank of a communicator of ``size`` ranks (an int, after
    :func:`as_root`)."""
    if type(root) is not int or not 0 <= root < size:
        raise ValueError(f"root must be a rank of the communicator (0..{size - 1}), got {root!r}")


def _object_waiter(comm, what: str) -> Callable[[MPI.Request], None] | None:
    """How an exchange of objects labelled ``what`` waits for its requests: None when it may
    use mpi4py's blocking calls (no deadline, no stall warning, no board); else it takes a
    collective position on the communicator's board (verified like a collective the program
    calls, compared in check mode) and returns a wait that honours the deadline and raises for
    ranks known to have ended."""
    board = comm._hub.board
    board = board if board is not None and board.established and not board.closed else None
    if board is None and not watching():
        return None
    label = lambda: f"{what} on {comm!r}"  # noqa: E731
    seq = 0
    if board is not None:  # a collective position like any other (module docstring)
        seq = board.arrive(_AGREEMENT)
        if comm._hub.watched:
            board.verify(label)
        if _state["check"]:  # check mode: compared with the other ranks' calls like any other
            board.check((_code(_AGREEMENT), 0, -1, -1, -1, -1))

    def watch() -> None:
        if board is None:
            _raise_if_ended(comm.handle, comm.rank, label())

    return lambda request: wait(request, label, board, seq, watch=watch)


def _same_call(gathered: list[tuple[str, object]], comm) -> list:
    """The objects of :func:`gather_objects`, once every rank is known to have called it from the
    same place (the same ``what``) with an object it could pickle."""
    calls = [what for what, _ in gathered]
    if len(set(calls)) > 1:
        shown = "; ".join(f"rank {r}: {what}" for r, what in enumerate(calls))
        raise RuntimeError(f"the {comm.size} ranks of a communicator met in different "
                           f"collective calls ({shown}): the program took a different path on "
                           "some ranks")
    _raise_unpicklable([obj for _, obj in gathered])
    return [obj for _, obj in gathered]


class Unpicklable:
    """What a rank sends in an exchange of objects in place of an object pickle refused (the
    error's text), so that every rank raises instead of that rank alone."""

    def __init__(self, what: str, error: str) -> None:
        self.what, self.error = what, error


def _pickled(obj: object, what: str) -> tuple[bytes, Unpicklable | None]:
    """``pickle.dumps(obj)``, or that of an :class:`Unpicklable` (also returned) when pickle
    refuses it. An object ``(label, x)`` keeps its label, so that a different call is still
    told apart."""
    try:
        return pickle.dumps(obj), None
    except Exception as error:  # noqa: BLE001 - pickle raises many kinds; all are reported
        bad = Unpicklable(what, f"{type(error).__name__}: {error}")
        return pickle.dumps((obj[0], bad) if isinstance(obj, tuple) and len(obj) == 2 and
                            isinstance(obj[0], str) else bad), bad


def _raise_unpicklable(objects: list) -> None:
    """TypeError on every rank when a rank could not pickle its object (the same verdict
    everywhere: every rank sees every rank's object, or its size, first)."""
    for rank, obj in enumerate(objects):
        if isinstance(obj, Unpicklable):
            raise TypeError(f"rank {rank} could not pickle its object for {obj.what} "
                            f"({obj.error}): exchange plain Python values, arrays or tensors")


def describe(signature) -> str:
    code, op, root, dtype, count, counts = (int(v) for v in signature)
    parts = [opname(code)]
    if op:
        parts.append(f"op {_OP_NAMES.get(op, 'user-defined')}")
    if root >= 0:
        parts.append(f"root {root}")
    if dtype >= 0:
        parts.append(_dtype_name(dtype))
    if count >= 0:
        parts.append(f"{count} elements")
    if counts >= 0:
        parts.append(f"counts with checksum {counts:08x}")
    return "(" + ", ".join(parts) + ")"


# ---------------------------------------------------------------------------- waiting


def wait(request, what: Callable[[], str], board: Board | None = None, seq: int = 0,
         watch: Callable[[], None] | None = None, every: float = 0.5,
         who: Callable[[], str] | None = None, status: MPI.Status | None = None) -> None:
    """Wait for an MPI (or heatlike) request (filling ``status``, if given, as ``Wait`` does),
    honouring the deadline; on expiry raise
    TimeoutError naming ``what()`` and, with a board, the ranks that have not arrived (else
    ``who()``, if given).

    The wait is polled when a deadline or a stall warning is set, when ``watch`` is given or
    when the request runs on a communicator with a board (``board``, or one found inside a
    heatlike request): then every ``every`` seconds (first after 0.1 s) the board is verified
    (:meth:`Board.verify`: ranks that ended or ran other numbers of training steps raise) and
    ``watch()`` is called, which may raise to end the wait."""
    limit, stall = _state["timeout"], _state["stall"]
    if board is None:
        board = _innermost(request, None, 0)[0]
    if limit is None and stall is None and watch is None and board is None:
        request.Wait(status)
        return
    start = time.monotonic()
    deadline = start + limit if limit is not None else None
    warn_at = start + stall if stall is not None else None
    next_watch = start + min(0.1, every)
    grace = start + 0.2 if _exit["done"] else None
    while not request.Test(status):
        drive_orphans()
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise TimeoutError(_stalled(request, what, board, seq,
                                        f"did not complete within {limit:g} s "
                                        "(HEATLIKE_COMM_TIMEOUT)", who))
        if warn_at is not None and now > warn_at:
            warn_at = None
            get_logger().warning("%s", _stalled(request, what, board, seq,
                                                f"has waited {now - start:.3g} s "
                                                "(HEATLIKE_STALL_WARN)", who))
        if grace is not None and board is not None and now > grace:
            raise RuntimeError(f"{what()} can never complete: every rank's program has ended")
        if now >= next_watch:
            inner = _innermost(request, board, seq)[0]
            if inner is not None:
                inner.verify(what, current=False)
            if watch is not None:
                watch()
            next_watch = now + every
        if now - start > 0.05:  # a long wait: stop competing for the core
            time.sleep(1e-4 if now - start < 1 else 1e-3)
        else:  # let a rank sharing this core (oversubscribed) run: it may be the one we wait for
            _yield()


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def _stalled(request, what, board, seq, how: str, who=None) -> str:
    """"<operation> <how>; ranks [..] have not arrived (rank r is at ...)"."""
    board, seq, inner = _innermost(request, board, seq)
    if board is not None and board.established and not board.closed:
        tail = f"; {board.stragglers(seq)}"
    else:
        tail = who() if who is not None else ""
    return f"{what()}{inner} {how}{tail}"


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


# ---------------------------------------------------------------------------- end of program


def abort_on_deadlock(enabled: bool = True) -> None:
    """At the end of the program, abort the job (rather than print a message) when another rank
    waits in a collective this rank will never enter (set by ``python -m heatlike`` and
    ``abort_on_exception``)."""
    _exit["abort"] = bool(enabled)


def _report_deadlock(board: Board, waiting: list[tuple[int, int, str]]) -> None:
    mine = board.seq
    who = "; ".join(f"rank {r} has entered collective #{k}" +
                    (f" ({op})" if op else "") for r, k, op in waiting)
    text = (f"heatlike: rank {board.rank} ended its program after {mine} collective(s) on "
            f"{board.label}, but {who} there and waits for rank {board.rank}, which will never "
            "enter it")
    if _exit["abort"]:
        with contextlib.suppress(Exception):  # what the program printed before, not lost
            sys.stdout.flush()
        sys.stderr.write(text + "; aborting the MPI job\n")
        sys.stderr.flush()
        time.sleep(0.3)  # the launcher stops forwarding output once it kills the job
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# Requests whose owner the garbage collector dropped while they were in flight (a model dropped
# with its gradients' exchanges still running). The collector runs at a different point on
# every rank, so the owner's finalizer cannot wait for them there: the other ranks may be
# waiting for this one in another collective. They stay referenced here, with their buffers,
# until they complete: every polled wait tests them, so does a creation of a communicator
# (``heatlike.core.communication``), and so does the end of the program. An operation refers to
# the wrappers of the communicators it runs on, so none of those is freed before it completes.
ORPHANS: list[object] = []
# Orphans that completed. Their operations still refer to the communicators they ran on, whose
# wrappers are freed when the last reference goes; dropping them here, at a point of this
# rank's own, would free those communicators there. ``heatlike.core.communication`` drops them
# at a creation of a communicator, where freeing is agreed among the ranks.
FINISHED: list[object] = []
_driving = [False]
#: objects whose exchanges in flight every polled wait advances (``drive()``, never blocking),
#: while :func:`driving` holds them: a multi-phase exchange issues its next phase only when
#: tested, so a rank blocked in another collective would hold back a rank waiting for it
DRIVEN: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def driving(owner) -> Iterator[None]:
    """Within the block, every polled wait advances ``owner``'s exchanges (``owner.drive()``)."""
    DRIVEN.add(owner)
    try:
        yield
    finally:
        DRIVEN.discard(owner)


def adopt(requests) -> None:
    """Keep the unfinished heatlike ``requests`` (whose owner is being collected) until they
    complete."""
    ORPHANS.extend(r for r in requests if not r.done)


def drive_orphans() -> None:
    """Test every orphaned request once (never blocks); forget those that completed, or failed
    (a job that is failing already reports its error elsewhere)."""
    if (not ORPHANS and not DRIVEN) or _driving[0]:
        return
    _driving[0] = True
    try:
        for owner in list(DRIVEN):
            owner.drive()
        keep = []
        for request in list(ORPHANS):
            try:
                if not request.Test():
                    keep.append(request)
                    continue
            except (RuntimeError, TimeoutError, MPI.Exception) as error:
                get_logger().debug("an exchange of a dropped model failed: %s", error)
            FINISHED.append(request)
        ORPHANS[:] = keep
    finally:
        _driving[0] = False


def end_of_program() -> None:
    """Mark this rank ended on every board, wait (polling) until every rank of each board has
    ended too, reporting ranks that wait for this one forever, then free the windows in the
    agreed order. Runs once, before MPI is finalized (module docstring)."""
    if _exit["started"] or MPI.Is_finalized():
        return
    _exit["started"] = True
    boards = [b for b in _BOARDS if b.established and not b.closed]
    try:
        give_up = time.monotonic() + 10.0  # every rank's orphans progress at its own exit
        while ORPHANS and time.monotonic() < give_up:
            drive_orphans()
            time.sleep(1e-3)
        if not boards:
            return
        failed = getattr(sys, "last_value", None) is not None  # an uncaught exception
        for board in boards:
            board.end(failed)
        barriers = [board.exit_channel.Ibarrier() for board in boards]
        since: dict[tuple, float] = {}
        reported: set[tuple] = set()
        look = time.monotonic() + 0.5
        while not MPI.Request.Testall(barriers):
            now = time.monotonic()
            if now >= look:
                look = now + 0.5
                current = {}
                for board in boards:
                    waiting = board.waiting_for_me()
                    if waiting:
                        current[(id(board), tuple(waiting))] = (board, waiting)
                since = {key: since.get(key, now) for key in current}
                for key, first in since.items():
                    if now - first >= 2.0 and key not in reported:
                        reported.add(key)
                        _report_deadlock(*current[key])
            time.sleep(2e-3)
        for board in sorted(boards, key=lambda b: b.key):
            board.close()
    finally:
        _exit["done"] = True


atexit.register(end_of_program)
# a program that calls MPI.Finalize() itself: run the same at the start of MPI_Finalize (the
# attributes of MPI_COMM_SELF are deleted first)
_keyval = MPI.Comm.Create_keyval(delete_fn=lambda *_: end_of_program())
MPI.COMM_SELF.Set_attr(_keyval, True)
