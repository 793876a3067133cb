"""StopOnSignal: a signal on any rank stops every rank after the same call; handlers restored;
a repeated signal reaches the handler that was there before; bad input raises on every rank."""

import os
import signal
import threading

import pytest
import torch
from _dndarray_helpers import COMM, raises_everywhere

from heatlike.utils import StopOnSignal

pytestmark = pytest.mark.mpi


def _loop(stop: StopOnSignal, signal_at: dict[int, int], sig=signal.SIGUSR1,
          most: int = 50) -> int:
    """Call ``stop()`` once per step; rank r signals itself before step ``signal_at[r]``."""
    for step in range(1, most + 1):
        if signal_at.get(COMM.rank) == step:
            os.kill(os.getpid(), sig)
        if stop():
            return step
    return 0


def test_every_rank_stops_after_the_same_call():
    last = COMM.size - 1
    with StopOnSignal(COMM) as stop:
        assert signal.getsignal(signal.SIGUSR1) == stop._record
        stopped = _loop(stop, {last: 4})
    # the signal is recorded before call 4 and agreed by it
    assert stopped == 4 and stop.calls == 4
    assert stop.signal == "SIGUSR1"
    assert stop.received == ("SIGUSR1" if COMM.rank == last else None)
    assert COMM.allgather(stopped) == [4] * COMM.size
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_signals_on_several_ranks_agree_on_the_highest():
    kinds = {r: signal.SIGTERM if r % 2 else signal.SIGUSR1 for r in range(COMM.size)}
    with StopOnSignal(COMM, signals=["USR1", "SIGTERM"]) as stop:
        step = 0
        while True:
            step += 1
            if step == 2:
                os.kill(os.getpid(), kinds[COMM.rank])
            if stop():
                break
    assert step == 2  # every rank signals before call 2: agreed by it
    assert stop.signal == ("SIGTERM" if COMM.size > 1 else "SIGUSR1")


@pytest.fixture
def program_handler():
    """A handler of the program's own on SIGUSR1 (``seen`` lists its calls), put back after."""
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    mine.seen = seen
    before = signal.signal(signal.SIGUSR1, mine)
    yield mine
    signal.signal(signal.SIGUSR1, before)


def test_no_signal_runs_to_the_end_and_restores_a_program_handler(program_handler):
    stop = StopOnSignal(COMM, signals=signal.SIGUSR1)
    assert _loop(stop, {}, most=10) == 0 and stop.signal is None
    stop.close()
    stop.close()  # idempotent
    assert signal.getsignal(signal.SIGUSR1) is program_handler
    with pytest.raises(RuntimeError, match="closed"):
        stop()
    assert program_handler.seen == []


def test_a_repeated_signal_goes_to_the_previous_handler(program_handler):
    with StopOnSignal(COMM) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert program_handler.seen == [] and stop.received == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGUSR1)  # insisted on: the program's handler now
        assert program_handler.seen == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)  # and every later one
        assert program_handler.seen == [signal.SIGUSR1] * 2
        assert _loop(stop, {}) == 1 and stop.signal == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is program_handler


def test_a_repeat_after_a_higher_signal_is_still_a_repeat(program_handler):
    """USR1, TERM, USR1: the second USR1 reaches the program's handler (only the highest
    signal number was kept, so it went unnoticed)."""
    with StopOnSignal(COMM, signals=["USR1", "USR2"]) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert program_handler.seen == [signal.SIGUSR1] and stop.received == "SIGUSR2"
        assert _loop(stop, {}) == 1 and stop.signal == "SIGUSR2"
    assert signal.getsignal(signal.SIGUSR1) is program_handler


def test_a_repeat_during_a_save_reaches_the_handler_and_the_handlers_are_restored(tmp_path):
    """SIGTERM, then SIGTERM again while ``checkpoint.save`` writes: the program's handler gets
    the second one, the save completes, and the program's handler is back after the block (the
    save's own handlers put StopOnSignal's back over the one it had restored)."""
    from heatlike.utils import checkpoint

    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    real = checkpoint._dumps

    def dumps_and_signal(value):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(value)

    path = tmp_path / "run.ckpt" if COMM.rank == 0 else None
    path = COMM.bcast(path)
    try:
        with StopOnSignal(COMM) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop() and stop.signal == "SIGTERM"
            checkpoint._dumps = dumps_and_signal
            try:
                checkpoint.save(path, torch.nn.Linear(2, 2), comm=COMM, step=1)
            finally:
                checkpoint._dumps = real
            assert seen and set(seen) == {signal.SIGTERM}
        assert signal.getsignal(signal.SIGTERM) is not None
        assert signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"
        assert checkpoint.load(path, torch.nn.Linear(2, 2), comm=COMM)["step"] == 1
    finally:
        signal.signal(signal.SIGTERM, before)


def test_an_exception_restores_the_handlers_without_a_collective():
    with pytest.raises(KeyError):
        with StopOnSignal(COMM) as stop:
            stop()
            raise KeyError("raised on every rank here; on one rank, close() would wait")
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_bad_input_raises_on_every_rank():
    raises_everywhere(ValueError, lambda: StopOnSignal(COMM, signals="SIGNOPE"), "unknown")
    raises_everywhere(ValueError, lambda: StopOnSignal(COMM, signals=[]), "no signal")
    raises_everywhere(ValueError, lambda: StopOnSignal(COMM, signals="KILL"), "cannot be caught")
    raises_everywhere(TypeError, lambda: StopOnSignal(COMM, signals=[1.5]), "name, a number")
    raises_everywhere(ValueError, lambda: StopOnSignal(COMM, signals=10_000), "valid signal")
    if COMM.size > 1:
        mine = "USR1" if COMM.rank else "USR2"
        raises_everywhere(ValueError, lambda: StopOnSignal(COMM, signals=mine), "different")
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL

    errors = []

    def build():
        try:
            StopOnSignal(COMM)
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    assert errors and "main thread" in errors[0]
