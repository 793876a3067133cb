"""Detecting ranks that ran out of batches, instead of waiting for them forever.

When ranks run different numbers of training steps without :class:`heatlike.nn.Join`, the rank
that finishes first leaves the loop and eventually ends, while the others wait in a gradient
exchange it will never join. A :class:`StepBoard` turns that hang into an error:

* every rank counts the gradient-synchronization cycles it has begun on the communicator
  (:meth:`StepBoard.post`, no communication);
* when its program ends (an ``atexit`` handler that runs before MPI is finalized) a rank sends
  its count to every other rank on a private duplicate of the communicator (8 bytes each);
* a rank waiting for an exchange checks for such notices every half second
  (:meth:`StepBoard.check`, one ``Iprobe``); if a rank that has ended had begun fewer cycles,
  the exchange can never complete and ``check`` raises ``RuntimeError`` naming that rank, its
  count and this rank's. Under ``python -m heatlike`` (or ``abort_on_exception``) the error ends
  the whole job.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref

import numpy as np
from mpi4py import MPI

from ..core.communication import MPICommunication

__all__ = ["StepBoard", "board_of"]

_TAG = 7301
_BOARDS: weakref.WeakSet = weakref.WeakSet()


class StepBoard:
    """Cycle counts and end-of-program notices of the ranks of one communicator."""

    def __init__(self, comm: MPICommunication) -> None:
        self.comm = comm
        self.channel = comm.handle.Dup()  # collective
        self.step = 0
        self.ended: dict[int, int] = {}
        _BOARDS.add(self)

    def post(self) -> int:
        """This rank begins its next cycle; returns the cycle number."""
        self.step += 1
        return self.step

    def check(self) -> None:
        """Raise RuntimeError if a rank that the current cycle needs has ended."""
        status = MPI.Status()
        buf = np.zeros(1, dtype=np.int64)
        while self.channel.Iprobe(MPI.ANY_SOURCE, _TAG, status):
            source = status.Get_source()
            self.channel.Recv(buf, source, _TAG)
            self.ended[source] = int(buf[0])
        gone = sorted((r, s) for r, s in self.ended.items() if s < self.step)
        if gone:
            parts = ", ".join(f"rank {r} after {s} step(s)" for r, s in gone)
            raise RuntimeError(
                f"rank {self.comm.rank} waits in training step {self.step} for {parts}, which "
                "ended: the ranks ran different numbers of batches. Give every rank the same "
                "number of batches (heatlike.utils.data.DataLoader does) or wrap the training "
                "loop in `with heatlike.nn.Join([model]):`")

    def end(self) -> None:
        """Tell every other rank how many cycles this rank ran (at the end of the program)."""
        mine = np.array([self.step], dtype=np.int64)
        requests = [self.channel.Isend(mine, r, _TAG) for r in range(self.comm.size)
                    if r != self.comm.rank]
        deadline = time.monotonic() + 1.0
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-4)
        for request in requests:
            if request != MPI.REQUEST_NULL:
                request.Free()


def board_of(comm: MPICommunication) -> StepBoard:
    """The communicator's board (collective on first use: create it where every rank does)."""
    board = comm.__dict__.get("_step_board")
    if board is None:
        board = StepBoard(comm)
        comm.__dict__["_step_board"] = board
    return board


@atexit.register
def _announce_end() -> None:
    """Registered after mpi4py's own handler, so it runs before MPI is finalized."""
    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    for board in list(_BOARDS):
        if board.comm.size > 1:
            with contextlib.suppress(MPI.Exception):  # the peers are gone already: no one to tell
                board.end()
