"""Detecting ranks that ran different numbers of batches, instead of waiting for them forever.

When ranks run different numbers of training steps without :class:`heatlike.nn.Join`, the ranks
with more batches wait in a gradient exchange that the others never join, while those went on to
whatever follows the loop: an evaluation all-reduce, a checkpoint, the end of the program. A
:class:`StepBoard` turns that hang into an error, on every rank, naming the ranks with fewer
batches. It lives in the communicator's board (``heatlike.core.checks.Board``: a window in which
each rank records its position, i.e. how many heatlike collectives it has entered there, and
whether its program has ended), which it sets up collectively when the first gradient
synchronization on the communicator is built, and then *watches*:

* :meth:`StepBoard.post`: a rank beginning a gradient-synchronization cycle (a training step)
  records it as its next position on the communicator (a step takes a position of its own, as
  its exchanges may run on private channels), then reads every rank's record (a gradient
  synchronization starts the reads at its first gradient and takes the verdict,
  :meth:`StepBoard.confirm`, before its first exchange: across nodes a read waits for the
  other rank's next MPI call, and at the start of a backward pass every rank computes; the
  reads were still started after the record was written, so what follows holds). Every collective
  the program calls on the communicator (an evaluation ``comm.Allreduce``) also records its
  position and reads the others' first. Two ranks that are in different numbers of steps at the
  same position have diverged; of any two such ranks at least one sees the other before issuing
  its collective and raises, so the mismatched collectives never meet;
* :meth:`StepBoard.check` (every half second while a rank waits for an exchange, and in every
  polled wait on the communicator): the same verdict, and ranks whose program ended before this
  rank's position.

The error (``RuntimeError``) names the ranks with fewer steps, what they are doing and the
remedy (``heatlike.nn.Join``, or a loader that gives every rank the same number of batches).
Under ``python -m heatlike`` (or ``abort_on_exception``) it ends the whole job.
"""

from __future__ import annotations

import numpy as np

from ..core.checks import ENDED, SEQ, STEPS, Board, operation, position, steps_at
from ..core.communication import MPICommunication

__all__ = ["StepBoard", "board_of", "explain"]

ADVICE = ("Give every rank the same number of batches (heatlike.utils.data.DataLoader does) or "
          "wrap the training loop in `with heatlike.nn.Join([model]):`")


class StepBoard:
    """Training steps of the ranks of one communicator (module docstring)."""

    def __init__(self, comm: MPICommunication) -> None:
        # nothing here may refer to ``comm``'s wrapper: the hub that holds this board outlives
        # it (heatlike.core.checks.Hub)
        self.step = 0
        self.board: Board | None = comm._arrival_board("the setup of the gradient "
                                                       "synchronization")
        if self.board is not None:
            self.board.explain_steps = explain
            comm._hub.watched = True

    def post(self, defer: bool = False) -> int:
        """This rank begins its next cycle (a position on the communicator's board); raises
        RuntimeError if the ranks are known to have diverged. Returns the cycle number.
        ``defer``: the verdict waits for :meth:`confirm`, which the caller makes before the
        cycle's first collective (``heatlike.core.checks.Board.mark_step``)."""
        self.step += 1
        if self.board is not None:
            return self.board.mark_step(defer)
        return self.step

    def confirm(self) -> None:
        """The verdict of a deferred :meth:`post`: raises RuntimeError if the ranks have
        diverged."""
        if self.board is not None:
            self.board.confirm_step()

    def check(self) -> None:
        """Raise RuntimeError if a rank that this rank's collectives need has ended, or the
        ranks are in different training steps at the same collective (from the records as last
        answered: called repeatedly while an exchange is waited for)."""
        if self.board is not None:
            self.board.verify(current=False)


def board_of(comm: MPICommunication) -> StepBoard:
    """The communicator's step board (collective on first use: create it where every rank
    does, e.g. when a gradient synchronization is built)."""
    hub = comm._hub
    if hub.steps is None:
        hub.steps = StepBoard(comm)
    return hub.steps


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def explain(board: Board, rows: list[np.ndarray | None], ended: list[int],
            first: int | None) -> str | None:
    """The message for ranks that ran different numbers of training steps: ``first``, the first
    position at which two ranks are in different steps (what they did there is the clearest
    account, also when those ranks have ended since), else ``ended`` ranks whose program ended
    before this rank's position (named when they had begun fewer steps). None when neither
    applies (a plain "ended" error then)."""
    me = board.rank
    mine = int(rows[me][STEPS])
    if first is None:  # ranks that ran out of batches and ended (not those that failed)
        fewer = [r for r in ended if rows[r][STEPS] < mine and rows[r][ENDED] == 1]
        if not fewer:
            return None
        parts = ", ".join(f"rank {r} after {int(rows[r][STEPS])} step(s)" for r in fewer)
        return (f"rank {me} waits in training step {mine} for {parts}, which ended: the ranks "
                f"ran different numbers of batches. {ADVICE}")
    by_steps: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        if row is not None and position(row) >= first:
            n = steps_at(row, first)
            if n is not None:
                by_steps.setdefault(n, []).append(r)
    fewest = min(by_steps)
    short = by_steps[fewest]
    longer = sorted(r for n, ranks in by_steps.items() if n != fewest for r in ranks)
    steps = sorted({n for n in by_steps if n != fewest})
    doing = sorted({operation(rows[r]) if rows[r][SEQ] == first and operation(rows[r]) else
                    "another collective" for r in short})
    return (f"the ranks ran different numbers of batches: {_ranks(short)} stopped after "
            f"{fewest} training step(s) and entered {' / '.join(doing)} (collective #{first} "
            f"on {board.label}), while {_ranks(longer)} entered training step "
            f"{' / '.join(str(n) for n in steps)} there. {ADVICE}")
