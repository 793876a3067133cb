"""Operations as generators, and the requests that drive them.

Every communication operation is written once, as a generator that

1. validates its arguments and prepares buffers (so errors are raised at the call, before anything
   is sent),
2. runs one or more MPI *phases*; in non-blocking mode each phase starts a non-blocking MPI call
   and yields its ``MPI.Request``, in blocking mode the phase calls the blocking MPI function and
   yields nothing,
3. finalizes after its last phase (copy from staging or packed buffers into the caller's memory,
   cast back from float32, ...).

The blocking methods run the generator to its end. The non-blocking methods wrap it in a
:class:`Request`; ``Wait``, ``wait``, ``Test``, ``test`` and :func:`wait_all` all advance the same
generator, so the finalization step runs whichever way completion is observed.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Iterable

from mpi4py import MPI

from . import checks as _checks

__all__ = ["Request", "wait_all", "test_all", "call", "drive"]

Operation = Generator[MPI.Request, None, None]

# how many heatlike operations are advancing their generators right now: a collective called at
# depth 0 comes from the program itself, one called deeper is a phase of another heatlike
# operation (an exchange's all-reduce), which ``heatlike.core.checks`` need not verify again
depth = 0

# True while a blocking call starts the non-blocking form of its operation to wait for it right
# away (the checked path of heatlike.core.checks): nothing can run between its phases, so an
# operation may start its later collectives lazily even on a shared communicator
settled = False


def call(comm: MPI.Comm, blocking: bool, name: str, *args) -> Operation:
    """One MPI phase: ``comm.<name>(*args)`` blocking, or its ``I<name>`` form, yielding the
    request."""
    if blocking:
        getattr(comm, name)(*args)
    else:
        yield getattr(comm, "I" + name[0].lower() + name[1:])(*args)


def drive(op: Operation) -> None:
    """Run a blocking operation to its end."""
    for _ in op:
        raise RuntimeError("internal error: a blocking operation started a non-blocking phase")


class Request:
    """Handle of a non-blocking heatlike operation.

    Completing it (``Wait``/``wait``, a successful ``Test``/``test``, or :func:`wait_all`) runs the
    operation's remaining phases and its finalization: after completion the receive buffer holds
    the result, whatever the buffer kind and whichever completion call was used.
    """

    __slots__ = ("_op", "_req", "_label", "_board", "_seq", "__weakref__")

    def __init__(self, op: Operation, label: str = "a heatlike operation", board=None,
                 seq: int = 0) -> None:
        self._label, self._board, self._seq = label, board, seq
        self._op = op
        self._req = None
        self._advance()  # validation and the first phase happen here

    def _advance(self) -> None:
        global depth
        depth += 1
        try:
            self._req = next(self._op, None)
        finally:
            depth -= 1

    @property
    def done(self) -> bool:
        """Whether the operation has completed and finalized."""
        return self._req is None

    def Wait(self, status: MPI.Status | None = None) -> None:
        """Block until the operation has completed and its result is in place (raises
        TimeoutError past ``HEATLIKE_COMM_TIMEOUT``, and RuntimeError when a rank it needs has
        ended or is in another collective: see ``heatlike.core.checks``). Operations on a
        communicator with a board are waited for by polling."""
        while self._req is not None:
            if self._board is None and not _checks.watching():
                self._req.Wait(status)  # a heatlike request inside polls if it must
            else:
                _checks.wait(self._req, lambda: self._label, self._board, self._seq,
                             status=status)
            self._advance()

    def Test(self, status: MPI.Status | None = None) -> bool:
        """Whether the operation has completed (finalizing it if so); never blocks on a phase
        that has not completed."""
        while self._req is not None:
            if not self._req.Test(status):
                return False
            self._advance()
        return True

    def Cancel(self) -> None:
        """Cancel the pending phase (meaningful for receives); still ``Wait`` afterwards."""
        if self._req is not None:
            self._req.Cancel()

    wait = Wait
    test = Test

    def __del__(self) -> None:
        if getattr(self, "_req", None) is not None:
            warnings.warn("heatlike Request dropped before completion: it is kept, with the "
                          "buffers MPI still uses, and completed by later waits or at the end "
                          "of the program. Call Wait() or wait_all().", ResourceWarning,
                          stacklevel=2)
            # freeing its temporaries now would let MPI write into memory reused by others
            adopt = getattr(_checks, "adopt", None)  # None at interpreter shutdown
            if adopt is not None:
                adopt([self])


def wait_all(requests: Iterable[Request | None]) -> None:
    """Complete every request (``None`` entries are ignored), running each one's finalization.

    Phases that are in flight at the same time are waited for together with ``MPI.Request.Waitall``.
    """
    pending = [r for r in requests if r is not None and r._req is not None]
    if _checks.watching() or any(r._board is not None for r in pending):
        for r in pending:
            r.Wait()
        return
    while pending:
        phases = [r._req for r in pending]
        if all(isinstance(q, MPI.Request) for q in phases):
            MPI.Request.Waitall(phases)
        else:  # some phases are themselves heatlike requests (composed operations)
            for q in phases:
                q.Wait()
        for r in pending:
            r._advance()
        pending = [r for r in pending if r._req is not None]


def test_all(requests: Iterable[Request | None]) -> bool:
    """Whether every request has completed (finalizing those that have)."""
    return all([r.Test() for r in requests if r is not None])
