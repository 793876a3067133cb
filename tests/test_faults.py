"""Faults end the job with a clear message instead of hanging: separate MPI jobs, each with a
fault injected on one rank (into a data-parallel training loop, or around a plain collective).
Every job must end within a bounded time and leave no process behind; the tests measure the
time from the fault to the end of the job."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
from test_launch import mpiexec

from heatlike.core import checks
from heatlike.testing.matrix import _clean_env

pytestmark = pytest.mark.system  # every test starts an MPI job

TRAIN = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import heatlike as hl
    from heatlike.nn import DataParallel
    from heatlike.optim import DataParallelOptimizer

    fault, token = sys.argv[1], sys.argv[2]
    comm = hl.MPI_WORLD
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
    model = DataParallel(net, comm, optimizer=opt)
    steps = 6 - (fault == "uneven" and comm.rank == 1)
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).square().mean()
        if step == 3 and comm.rank == 1:
            if fault == "raise":
                raise ValueError("injected failure in the middle of a step")
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "late":
                time.sleep(60)
        loss.backward()
        opt.step()
    model.flush()
    print(f"rank {comm.rank} finished", flush=True)
""")


def _job(tmp_path, text: str, case: str, ranks: int, env: dict | None, launcher: bool,
         limit: float = 90):
    """Run ``text`` as an MPI job of ``ranks`` ranks (under ``python -m heatlike`` or plain);
    a job still running after ``limit`` seconds is killed with its whole process group and
    reported as hung. Returns (returncode or None, output, elapsed seconds, processes left).
    A plain job runs without the abort of ``import heatlike`` (unless ``env`` sets
    ``HEATLIKE_ABORT_ON_EXCEPTION``): what it tests is heatlike's checks on their own, which
    must also hold where a program installs its own ``sys.excepthook``."""
    script = tmp_path / "job.py"
    script.write_text(text)
    token = uuid.uuid4().hex
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, *(["-m", "heatlike"] if launcher else []),
           str(script), case, token]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_clean_env(), **({} if launcher else
                                                     {"HEATLIKE_ABORT_ON_EXCEPTION": "0"}),
                                 **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout
    for pid in left.split():  # do not leave them to the next test either
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    return code, out, elapsed, left


def _run(tmp_path, fault: str, ranks: int = 2, env: dict | None = None):
    code, out, elapsed, left = _job(tmp_path, TRAIN, fault, ranks, env, launcher=True)
    assert code is not None, f"the job hung:\n{out}"
    return subprocess.CompletedProcess([], code), out, elapsed, left


def test_a_rank_raising_mid_step_aborts_the_job(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "raise")
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "uncaught exception on rank 1 of 2" in out, out
    assert "ValueError: injected failure in the middle of a step" in out, out
    assert not left, f"processes left behind: {left}"


def test_a_killed_rank_ends_the_job(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "sigkill")
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "finished" not in out, out
    assert not left, f"processes left behind: {left}"


def test_uneven_batches_without_join_end_with_an_error(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "uneven")
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "the ranks ran different numbers of batches" in out, out
    assert "rank 1 after 5 step(s)" in out and "heatlike.nn.Join" in out, out
    assert not left, f"processes left behind: {left}"


def test_comm_timeout_names_the_late_rank(tmp_path):
    proc, out, elapsed, left = _run(tmp_path, "late", env={"HEATLIKE_COMM_TIMEOUT": "3"})
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "TimeoutError" in out and "did not complete within 3 s" in out, out
    assert "ranks [1] have not arrived" in out, out
    assert not left, f"processes left behind: {left}"


def test_a_correct_job_finishes_in_check_mode(tmp_path):
    """The control: without a fault the same job ends normally, also with every check on."""
    proc, out, _, left = _run(tmp_path, "none", env={"HEATLIKE_CHECK": "1",
                                                     "HEATLIKE_COMM_TIMEOUT": "30"})
    assert proc.returncode == 0, out
    assert out.count("finished") == 2 and "WARN" not in out and not left, out


# -- faults around collectives: a peer dead before the first one, a peer that exits early, uneven
# batches followed by an evaluation all-reduce. Each rank prints what it got; "FAULT <time>" marks
# the moment the fault happens, to measure the time from it to the end of the job.

JOBS = textwrap.dedent("""
    import sys, time
    import torch
    import heatlike as hl
    from heatlike.nn import DataParallel, Join
    from heatlike.optim import DataParallelOptimizer

    case, token = sys.argv[1], sys.argv[2]
    comm = hl.MPI_WORLD
    if case.endswith("-rma"):  # boards read with MPI_Rget, as across nodes
        hl.core.checks.shared_windows = False
        case = case[:-len("-rma")]

    def say(*words):
        line(" ".join([f"rank {comm.rank}:", *map(str, words)]))

    def line(text):  # one write per line: the ranks' lines must not interleave
        sys.stdout.write(text + "\\n")
        sys.stdout.flush()

    def fault():
        line(f"FAULT {time.time()}")

    def training(blocking=True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=blocking)
        return DataParallel(net, comm, optimizer=opt), opt

    def step(model, opt):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()

    try:
        if case == "dead-before-first-collective":
            x = hl.zeros((8, 4), split=0)
            if comm.rank == 1:
                fault()
                raise ValueError("rank 1 fails before any collective")
            say("sum", x.sum(0).larray.tolist())
        elif case == "exit-after-allreduce":
            v = torch.ones(4)
            comm.Allreduce(hl.IN_PLACE, v)
            if comm.rank == 1:
                fault()
                sys.exit(0)
            v = torch.full((4,), 5.0)
            comm.Allreduce(hl.IN_PLACE, v)
            say("result", v.tolist())
        elif case == "leave-stop-loop-early":  # the last rank breaks before stop()
            from heatlike.utils import StopOnSignal
            model, opt = training()
            with StopOnSignal(comm) as stop:
                for i in range(6):
                    step(model, opt)
                    if i == 3 and comm.rank == comm.size - 1:
                        fault()
                        break
                    if stop():
                        break
            say("left the loop at", i)
        elif case == "exit-during-training":
            model, opt = training()
            step(model, opt)
            if comm.rank == 1:
                fault()
                sys.exit(0)
            step(model, opt)
            say("trained a step alone")
        elif case == "raise-during-training":
            model, opt = training()
            step(model, opt)
            if comm.rank == 1:
                fault()
                raise ValueError("rank 1 fails between two steps")
            step(model, opt)
            say("trained a step alone")
        elif case == "join-after-exit":
            model, opt = training()
            if comm.rank == 1:
                fault()
                sys.exit(0)
            with Join([model]):
                step(model, opt)
            say("joined alone")
        elif case == "late-at-nonzero":  # an operation exchanging Python objects
            x = hl.array(torch.arange(8), split=0)
            x.sum()
            if comm.rank == 1:
                fault()
                time.sleep(12)
            say("nonzero", hl.nonzero(x).gshape)
        elif case == "late-at-gather":  # a gather of Python objects (checkpoint metadata)
            comm.allgather(comm.rank)
            if comm.rank == 1:
                fault()
                time.sleep(12)
            say("gathered", comm.gather(comm.rank, root=0))
        elif case == "mask-against-sum":  # different operations, check mode
            x = hl.array(torch.arange(8.0), split=0)
            x.sum()
            fault()
            say("got", x.sum().item() if comm.rank == 1 else x[x > 2].gshape)
        elif case == "distopt-threshold-differs":  # a new fusion plan on rank 0 only
            from heatlike.optim import DistOpt
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                                      torch.nn.Linear(10, 3))
            dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm)
            x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
            dist.backward_and_update(torch.nn.functional.cross_entropy(net(x), y), threshold=20)
            if comm.rank == 0:
                time.sleep(2)  # the other rank enters its reused plan first
            fault()
            dist.backward_and_update(torch.nn.functional.cross_entropy(net(x), y),
                                     threshold=30 if comm.rank == 0 else 20)
            say("stepped")
        elif case.startswith("uneven-eval"):  # uneven-eval-{blocking,deferred}[-join]
            model, opt = training(blocking="blocking" in case)
            steps = 6 - (comm.rank == 1)
            with Join([model], enable=case.endswith("join")):
                for i in range(steps):
                    step(model, opt)
            if comm.rank == 1 and not case.endswith("join"):
                fault()
            model.eval()
            accuracy = torch.tensor([0.5])
            comm.Allreduce(hl.IN_PLACE, accuracy)
            say("accuracy", accuracy.item())
    except Exception as e:
        line(f"ERROR {comm.rank} {time.time()}")
        say(f"raised {type(e).__name__}: {e}")
        raise
""")


def _fault_job(tmp_path, case: str, ranks: int = 2, env: dict | None = None,
               launcher: bool = False):
    code, out, elapsed, left = _job(tmp_path, JOBS, case, ranks, env, launcher, limit=60)
    assert code is not None, f"the job hung (killed after {elapsed:.0f} s):\n{out}"
    assert not left, f"processes left behind: {left}\n{out}"
    faults = [float(t) for t in re.findall(r"FAULT ([0-9.]+)$", out, re.M)]
    if not faults:
        print(f"{case} at {ranks} ranks: ended after {elapsed:.1f} s")
        return code, out, None
    to_end = time.time() - 0.5 - min(faults)
    errors = {int(r): float(t) - min(faults)
              for r, t in re.findall(r"ERROR (\d+) ([0-9.]+)$", out, re.M)}
    raised = ", ".join(f"rank {r} raised after {t:.2f} s" for r, t in sorted(errors.items()))
    print(f"{case} at {ranks} ranks: {raised or 'no rank raised'}; the job ended "
          f"{to_end:.1f} s after the fault")
    return code, out, to_end


# The job's lines are single writes, but the launcher interleaves the ranks' output streams in
# chunks, so another rank's traceback may have left a partial line before one of them: the
# patterns below match anywhere in a line, not only at its start.


def _raised(out: str, rank: int) -> str:
    found = re.findall(rf"rank {rank}: raised (.*)$", out, re.M)
    assert found, f"rank {rank} raised nothing:\n{out}"
    return found[0]


def test_timeout_covers_the_setup_before_a_communicators_first_collective(tmp_path):
    """A peer dead before the first collective: the setup of heatlike's private channel (done
    at that collective) honours HEATLIKE_COMM_TIMEOUT, also without the launcher."""
    code, out, to_end = _fault_job(tmp_path, "dead-before-first-collective",
                                   env={"HEATLIKE_COMM_TIMEOUT": "3"})
    assert code != 0 and to_end < 30, out
    error = _raised(out, 0)
    assert error.startswith("TimeoutError: Allreduce on MPICommunication(rank=0, size=2) did "
                            "not complete within 3 s (HEATLIKE_COMM_TIMEOUT)"), out
    assert "first collective heatlike runs on this communicator" in error, out
    assert "rank 0: sum" not in out, out


def _rank_0_timed_out(tmp_path, case: str, operation: str) -> str:
    """Run ``case`` (rank 1 12 s late) with HEATLIKE_COMM_TIMEOUT=3: rank 0 raised TimeoutError
    in ``operation`` 3 s after the fault (not 12); returns rank 0's error."""
    code, out, _ = _fault_job(tmp_path, case, env={"HEATLIKE_COMM_TIMEOUT": "3"})
    fault = float(re.findall(r"FAULT ([0-9.]+)$", out, re.M)[0])
    raised = float(re.findall(r"ERROR 0 ([0-9.]+)$", out, re.M)[0])
    assert code != 0 and 2.5 < raised - fault < 8, out
    error = _raised(out, 0)
    assert error.startswith(f"TimeoutError: {operation} on MPICommunication(rank=0, size=2) "
                            "did not complete within 3 s"), out
    return error


def test_timeout_covers_operations_that_exchange_python_objects(tmp_path):
    """nonzero, boolean masks, is_split and the like exchange counts as Python objects: their
    waits honour HEATLIKE_COMM_TIMEOUT too (before: rank 0 waited the full 20 s)."""
    error = _rank_0_timed_out(tmp_path, "late-at-nonzero", "allgather")
    assert "ranks [1] have not arrived" in error, error


def test_timeout_covers_the_gather_of_python_objects(tmp_path):
    """comm.gather (checkpoint.save gathers its metadata with it) honours HEATLIKE_COMM_TIMEOUT
    (before: mpi4py's raw gather, which waited for ever)."""
    _rank_0_timed_out(tmp_path, "late-at-gather", "gather(root=0)")


def test_check_mode_compares_object_exchanges_with_other_collectives(tmp_path):
    """HEATLIKE_CHECK: one rank indexing with a mask (an exchange of objects) while another sums
    raises ValueError on both (before: both waited forever)."""
    code, out, to_end = _fault_job(tmp_path, "mask-against-sum", env={"HEATLIKE_CHECK": "1"})
    assert code != 0 and to_end < 15, out
    for rank in (0, 1):
        assert _raised(out, rank).startswith("ValueError: ranks call different collectives"), out


def test_a_fusion_threshold_new_on_one_rank_raises_everywhere(tmp_path):
    """DistOpt: rank 0 builds a new fusion plan (another threshold) while rank 1 reuses its
    own, whose second cycle re-plans its buckets: both raise, plainly launched (before: rank 1
    waited forever in an unchecked broadcast)."""
    code, out, to_end = _fault_job(tmp_path, "distopt-threshold-differs")
    assert code != 0 and to_end < 20, out
    for rank in (0, 1):
        _raised(out, rank)
    assert "stepped" not in out, out


@pytest.mark.parametrize("rma", [False, True], ids=["shm", "rma"])
@pytest.mark.parametrize("launcher", [False, True], ids=["plain", "launcher"])
def test_a_rank_that_exits_early_is_named_not_matched(tmp_path, launcher, rma):
    """Rank 1 exits after a first all-reduce. Its exit must not complete rank 0's next
    all-reduce (no wrong data) nor leave it waiting: with HEATLIKE_COMM_TIMEOUT (plain mpiexec)
    rank 0 raises at once naming rank 1; under python -m heatlike without a timeout, rank 1's
    end of program sees rank 0 waiting for it and aborts the job naming both."""
    if rma and launcher:
        pytest.skip("the launcher's case reads the same boards")
    env = {} if launcher else {"HEATLIKE_COMM_TIMEOUT": "30"}
    case = "exit-after-allreduce" + ("-rma" if rma else "")
    code, out, to_end = _fault_job(tmp_path, case, env=env, launcher=launcher)
    assert code != 0 and to_end < 15, out
    assert "rank 0: result" not in out, f"rank 0's all-reduce completed without rank 1:\n{out}"
    if launcher:
        assert "rank 1 ended its program after 1 collective(s)" in out, out
        assert "rank 0 has entered collective #2" in out and "aborting the MPI job" in out, out
    else:
        error = _raised(out, 0)
        assert error.startswith("RuntimeError: Allreduce on MPICommunication(rank=0, size=2) "
                                "can never complete: rank 1 ended its program after 1 "
                                "collective(s)"), out


@pytest.mark.parametrize("launcher", [False, True], ids=["plain", "launcher"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_leaving_the_stop_on_signal_loop_early_is_named(tmp_path, launcher, ranks):
    """The last rank breaks out of the StopOnSignal loop before ``stop()``, the others enter
    its all-reduce: leaving the block frees StopOnSignal's communicator, and that release
    raises, naming the ranks waiting in the all-reduce it will never enter; the uncaught
    error ends the job (``import heatlike``'s abort, on by default; before, every rank waited
    forever, also under the launcher)."""
    code, out, to_end = _fault_job(tmp_path, "leave-stop-loop-early", ranks=ranks,
                                   launcher=launcher,
                                   env=None if launcher else {"HEATLIKE_ABORT_ON_EXCEPTION": "1"})
    assert code != 0 and to_end < 20, out
    assert "left the loop at" not in out, out
    last = ranks - 1
    assert f"rank {last - 1} has entered collective #4" in out, out
    assert f"waiting for rank {last}, which frees the communicator after 3 collective(s)" in out, \
        out


def test_an_uncaught_exception_on_one_rank_aborts_a_plain_job(tmp_path):
    """``import heatlike`` alone (plain mpiexec, no launcher, no timeout): rank 1 fails before
    the first collective, which rank 0 waits in; the job ends at once with rank 1 and its
    traceback named, instead of rank 0 waiting forever."""
    code, out, to_end = _fault_job(tmp_path, "dead-before-first-collective",
                                   env={"HEATLIKE_ABORT_ON_EXCEPTION": "1"})
    assert code != 0 and to_end < 10, out
    assert "heatlike: uncaught exception on rank 1 of 2" in out, out
    assert "ValueError: rank 1 fails before any collective" in out, out
    assert "rank 0: sum" not in out, out


def test_a_rank_that_exits_during_training_is_named(tmp_path):
    """A communicator with a gradient synchronization is watched: without a timeout and without
    the launcher, rank 0's next step raises naming rank 1, which ended."""
    code, out, to_end = _fault_job(tmp_path, "exit-during-training")
    assert code != 0 and to_end < 15, out
    error = _raised(out, 0)
    assert "rank 1 ended its program" in error or "for rank 1 after 1 step(s), which ended" \
        in error, out
    assert "trained a step alone" not in out, out


def test_a_rank_that_fails_during_training_is_named_without_the_launcher(tmp_path):
    """Without the launcher, a rank that fails with an exception ends its program: the others
    raise at once, naming it as failed (not as a rank with fewer batches)."""
    code, out, to_end = _fault_job(tmp_path, "raise-during-training")
    assert code != 0 and to_end < 15, out
    error = _raised(out, 0)
    assert re.search(r"can never complete: rank 1 failed after \d+ collective\(s\) \(its "
                     r"program ended with an uncaught exception: see its error\)", error), out
    assert "different numbers of batches" not in error and "trained a step alone" not in out


def test_join_after_a_rank_exited_raises(tmp_path):
    """Join's collectives of its own (the agreement on its joinables, its private channel, made
    without blocking) are waited for like collectives: a rank that ended is named."""
    code, out, to_end = _fault_job(tmp_path, "join-after-exit")
    assert code != 0 and to_end < 15, out
    assert re.match(r"RuntimeError: .* on MPICommunication\(rank=0, size=2\) can never "
                    r"complete: rank 1 ended its program", _raised(out, 0)), out


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mode", ["blocking", "deferred", "deferred-rma"])
def test_uneven_batches_then_an_evaluation_allreduce(tmp_path, mode, ranks):
    """Rank 1 has one batch fewer, no Join; after the loop every rank all-reduces its accuracy.
    Without a timeout and without the launcher every rank raises, naming rank 1 and Join (rma:
    with the boards read through MPI_Rget, as between nodes)."""
    if ranks == 2 and mode != "blocking":
        pytest.skip("one size is enough for the deferred modes")
    code, out, to_end = _fault_job(tmp_path, f"uneven-eval-{mode}", ranks=ranks)
    assert code != 0 and to_end is not None and to_end < 15, out
    for rank in range(ranks):
        error = _raised(out, rank)
        assert error.startswith("RuntimeError: the ranks ran different numbers of batches: "
                                "rank 1 stopped after 5 training step(s)"), out
        assert "heatlike.nn.Join" in error, out
    assert not re.search(r"rank \d: accuracy", out, re.M), out


def test_uneven_batches_with_join_then_an_evaluation_allreduce(tmp_path):
    """The control: with Join the same job ends normally."""
    code, out, _ = _fault_job(tmp_path, "uneven-eval-deferred-join", ranks=3)
    assert code == 0, out
    assert out.count("accuracy 1.5") == 3 and "raised" not in out, out


def test_step_positions_and_counts():
    """The arithmetic of the step board: a rank's position and how many steps it had begun at
    an earlier position, from its record (RING_LEN most recent step positions)."""
    row = np.zeros(checks.RING + checks.RING_LEN, dtype=np.int64)
    assert checks.position(row) == 0 and checks.steps_at(row, 0) == 0
    for n, at in enumerate([2, 4, 5, 9], start=1):  # step n took position `at`
        row[checks.RING + (n - 1) % checks.RING_LEN] = at
        row[checks.STEPS] = n
        row[checks.SEQ] = at
    row[checks.SEQ] = 11
    assert checks.position(row) == 11
    assert [checks.steps_at(row, s) for s in (1, 2, 3, 4, 5, 8, 9, 11)] == [0, 1, 1, 2, 3, 3, 4, 4]
    for n in range(5, 13):  # more steps than the record keeps: old positions are unknown
        row[checks.RING + (n - 1) % checks.RING_LEN] = 10 + n
        row[checks.STEPS] = n
    assert checks.steps_at(row, 30) == 12 and checks.steps_at(row, 15) == 5
    assert checks.steps_at(row, 3) is None
