"""Signals that arrive while a collective write runs (``heatlike.utils.checkpoint.save``).

Inside :func:`unwinding`, SIGTERM, SIGINT and SIGHUP unwind the block (its ``finally`` clauses
run: a temporary file is removed) before taking their usual effect:

* a signal left at its default action raises :class:`Signalled`; when it leaves the block the
  handlers in place before are restored and the signal is raised again, so the process ends as
  it would have;
* a program's own handler (or Python's KeyboardInterrupt for SIGINT) is called, and an ignored
  signal stays ignored.

Inside ``guard.held()`` a program's handler is not called at once but when the block ends: a
message of the write's protocol (a size, then the bytes) is then never cut in two by an
exception the handler raises (SystemExit from ``sys.exit`` in a handler), which would leave the
peer waiting for the rest. Default actions and Python's KeyboardInterrupt are not held back:
they end the process at once (an uncaught KeyboardInterrupt aborts the job under
``python -m heatlike``), and the launcher then ends the job.

:func:`end_process` is how another handler (``StopOnSignal`` given a signal twice) takes a
signal's default action: inside :func:`unwinding` it unwinds first, elsewhere it ends the
process at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Signalled", "SIGNALS", "unwinding", "end_process"]

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP")
                if hasattr(signal, name))


class Signalled(BaseException):
    """A signal whose default action ends the process arrived during an unwinding block."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Guard:
    """The handlers of one :func:`unwinding` block."""

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.holding = 0
        self.pending: list[tuple[int, FrameType | None]] = []

    def handler(self, signum: int, frame: FrameType | None) -> None:
        before = self.previous.get(signum, signal.SIG_DFL)
        if self.holding and callable(before) and before is not signal.default_int_handler:
            self.pending.append((signum, frame))
            return
        self.dispatch(signum, frame)

    def dispatch(self, signum: int, frame: FrameType | None) -> None:
        before = self.previous.get(signum, signal.SIG_DFL)
        if before is signal.SIG_IGN:
            return
        if callable(before):
            before(signum, frame)
            return
        raise Signalled(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Program handlers of signals arriving in the block run when it ends (module
        docstring)."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
        if not self.holding:
            while self.pending:
                self.dispatch(*self.pending.pop(0))


_active: list[_Guard] = []  # the unwinding blocks entered and not left, innermost last


@contextlib.contextmanager
def unwinding() -> Iterator[_Guard]:
    """The block unwinds on SIGTERM, SIGINT and SIGHUP (module docstring); yields the guard
    whose ``held()`` holds program handlers back. Handlers are only set in the main thread
    (Python runs them there only); elsewhere the block runs as it is."""
    guard = _Guard()
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            before = signal.getsignal(sig)
            if before is None:  # set outside Python: leave it alone
                continue
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, guard.handler)
                guard.previous[sig] = before
    _active.append(guard)

    def restore() -> None:
        for sig, before in guard.previous.items():
            signal.signal(sig, before)
        guard.previous.clear()
        if guard in _active:
            _active.remove(guard)

    try:
        yield guard
    except Signalled as e:
        restore()
        signal.raise_signal(e.signum)  # default action: the process ends here
        raise  # only if the signal is blocked
    finally:
        restore()
        pending, guard.pending = guard.pending, []
        for signum, _ in pending:  # held back and not yet delivered: to the handlers now
            signal.raise_signal(signum)


def end_process(signum: int) -> None:
    """Take ``signum``'s default action (end the process): inside :func:`unwinding` once the
    block has unwound, elsewhere now."""
    if _active:
        raise Signalled(signum)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
