"""Consistency checks, deadlines, replica verification, non-finite detection and agreement on
settings, each raising the same error on every rank."""

import contextlib
import logging
import math
import re
import time

import pytest
import torch
from mpi4py import MPI
from torch import nn

import heatlike as hl
from heatlike.core import checks
from heatlike.core.agreement import agree_on
from heatlike.engine import Identity, PowerSGD, ScaledSign, Sign, Threshold, TopK
from heatlike.engine.codecs import Clipped
from heatlike.nn import DataParallel, Join, verify_replicas
from heatlike.optim import CentralizedSGD, DataParallelOptimizer
from heatlike.utils.data import DataLoader

pytestmark = pytest.mark.mpi


@pytest.fixture
def checking():
    checks.set_check(True)
    yield
    checks.set_check(False)


@pytest.fixture
def deadline():
    checks.set_timeout(0.5)
    yield
    checks.set_timeout(None)


def test_check_mode_finds_mismatched_collectives_on_every_rank(comm, checking):
    if comm.size == 1:
        pytest.skip("one rank always agrees with itself")
    last = comm.size - 1
    x = torch.ones(5 if comm.rank == last else 4)
    with pytest.raises(ValueError, match=rf"rank 0 calls \(Allreduce, op SUM, float32, 4 "
                                         rf"elements\) but rank {last} calls .*5 elements"):
        comm.Allreduce(hl.IN_PLACE, x)
    y = torch.ones(3, dtype=torch.float64 if comm.rank == last else torch.float32)
    with pytest.raises(ValueError, match="float64"):
        comm.Bcast(y, root=0)
    with pytest.raises(ValueError, match="root"):
        comm.Bcast(torch.ones(2), root=0 if comm.rank != last else 1)
    with pytest.raises(ValueError, match="Barrier"):
        if comm.rank == last:
            comm.Barrier()
        else:
            comm.Allreduce(hl.IN_PLACE, torch.ones(1))
    # matching calls go through, with their results
    z = torch.full((3,), float(comm.rank))
    comm.Allreduce(hl.IN_PLACE, z)
    assert torch.equal(z, torch.full((3,), float(sum(range(comm.size)))))
    req = comm.Iallreduce(hl.IN_PLACE, z)
    req.Wait()
    assert torch.equal(z, torch.full((3,), float(sum(range(comm.size)) * comm.size)))


def _late_rank(comm, last: int, sleep: float) -> tuple[str, float]:
    """How the report names a late rank that sleeps after an Allreduce, and how long it sleeps:
    on its own node, where it is (read from shared memory). From another node its record is read
    with RMA, answered only while it makes MPI progress: it "does not answer", provided it sleeps
    past those ranks' reads (a verification at a collective's entry may wait 0.5 s for an
    answer, the report 0.25 s) and the deadline."""
    hosts = comm.handle.allgather(MPI.Get_processor_name())
    board = comm._hub.board
    if board is not None and board.shared is None and len(set(hosts)) > 1:
        sleep += 2.0  # the same on every rank: the late rank itself must sleep past the reads
    if board is None or board.shared is not None or hosts[last] == hosts[comm.rank]:
        return rf"rank {last} is at #\d+ Allreduce", sleep
    return rf"rank {last} does not answer \(busy outside MPI, or unreachable\)", sleep


def test_deadline_names_the_ranks_that_have_not_arrived(comm, deadline):
    if comm.size == 1:
        pytest.skip("needs a rank to wait for")
    last = comm.size - 1
    comm.Allreduce(hl.IN_PLACE, torch.ones(1))
    late, sleep = _late_rank(comm, last, 1.2)
    if comm.rank == last:
        time.sleep(sleep)
    request = comm.Ibarrier()
    if comm.rank != last:
        with pytest.raises(TimeoutError, match=rf"Barrier .* did not complete within 0.5 s "
                                               rf"\(HEATLIKE_COMM_TIMEOUT\); ranks \[{last}\] "
                                               rf"have not arrived \({late}\)"):
            request.Wait()
    checks.set_timeout(None)
    request.Wait()  # the barrier completes once the late rank arrives


def test_stall_warning_names_the_late_rank_and_keeps_waiting(comm, caplog):
    if comm.size == 1:
        pytest.skip("needs a rank to wait for")
    last = comm.size - 1
    checks.set_stall_warning(0.3)
    try:
        comm.Allreduce(hl.IN_PLACE, torch.ones(1))
        late, sleep = _late_rank(comm, last, 1.0)
        if comm.rank == last:
            time.sleep(sleep)
        x = torch.ones(3)
        logger = logging.getLogger("heatlike")
        logger.addHandler(caplog.handler)  # heatlike's logger does not propagate to the root
        comm.Allreduce(hl.IN_PLACE, x)  # completes: a warning is not an error
    finally:
        logger.removeHandler(caplog.handler)
        checks.set_stall_warning(None)
    assert torch.equal(x, torch.full((3,), float(comm.size)))
    if comm.rank != last:
        said = [r.getMessage() for r in caplog.records if "STALL" in r.getMessage()]
        assert len(said) == 1, said
        assert re.search(rf"Allreduce .* has waited .* s \(HEATLIKE_STALL_WARN\); ranks "
                         rf"\[{last}\] have not arrived \({late}\)",
                         said[0]), said


def test_verify_replicas(comm):
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = DataParallel(net, comm)
    verify_replicas(model)
    if comm.size == 1:
        return
    with torch.no_grad():
        if comm.rank == comm.size - 1:
            net[0].bias[1] += 1e-7
    with pytest.raises(ValueError, match=rf"ranks \[{comm.size - 1}\] have other values than "
                                         r"rank 0 in \['0.bias'\]"):
        verify_replicas(model)
    if comm.rank == comm.size - 1:
        net[1].running_mean[0] = 1.0
    with pytest.raises(ValueError, match="1.running_mean"):
        verify_replicas(net, comm)
    with pytest.raises(ValueError, match="0.bias"):
        verify_replicas(net, comm, buffers=False)


def _nonfinite_step(model, opt, comm, poison_rank):
    opt.zero_grad()
    x = torch.randn(4, 3)
    if comm.rank == poison_rank:
        x[0, 0] = float("nan")
    model(x).sum().backward()
    opt.step()


@pytest.mark.parametrize("codec", [None, TopK(k=1), Sign()], ids=["identity", "topk", "sign"])
def test_check_finite_raises_on_every_rank(comm, codec):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt, codec=codec, check_finite=True)
    _nonfinite_step(model, opt, comm, poison_rank=-1)  # a clean step
    last = comm.size - 1
    here = "were non-finite in" if comm.rank == last else "were finite"
    with pytest.raises(FloatingPointError, match=rf"non-finite averaged gradients of .*weight.*"
                                                 rf"own gradients {here}"):
        _nonfinite_step(model, opt, comm, poison_rank=last)
    with torch.no_grad():
        net[2].weight[0, 0] = float("inf")  # the same on every rank: replicas stay equal
    with pytest.raises(FloatingPointError, match=r"non-finite parameters \['2.weight'\]"):
        model(torch.randn(2, 3))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_training_goes_on_after_a_caught_non_finite_step(comm, blocking):
    """A program that catches check_finite's FloatingPointError and goes on to the next batch:
    the failed step is skipped on every rank and training continues with equal replicas
    (non-blocking mode raised again at every later forward: the failed update stayed
    pending)."""
    if comm.size == 1:
        pytest.skip("one rank averages nothing: check_finite is checked where gradients meet")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt, check_finite=True)
    raised = []
    for step in range(4):
        try:
            _nonfinite_step(model, opt, comm, poison_rank=0 if step == 1 else -1)
            if not blocking:
                model(torch.randn(1, 3))  # the pending update is applied here
        except FloatingPointError:
            raised.append(step)
    model.flush()
    assert raised == [1]
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    verify_replicas(net, comm, buffers=False)


def test_a_non_finite_step_is_refused_whole_on_every_rank_in_non_blocking_mode(comm):
    """Non-blocking, ``check_finite``: the ranks agree on the step's verdict at ``step()``
    and every rank raises there with nothing applied, as blocking mode skips the whole step.
    (Buckets were checked one by one as the next forward used them: the finite ones used before
    the failing one were stepped, and a rank that read the parameters in between, e.g. a norm
    logged on rank 0, applied them in another order or raised at another point, so replicas
    drifted apart or the ranks fell out of step.)"""
    if comm.size == 1:
        pytest.skip("one rank averages nothing: check_finite is checked where gradients meet")

    def run(blocking):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                    blocking=blocking)
        model = DataParallel(net, comm, optimizer=opt, check_finite=True,
                             bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
        step_now = [0]
        if comm.rank == 0:  # the last layer's gradient (the first bucket) overflows at step 1
            net[3].weight.register_hook(lambda g: g * float("inf") if step_now[0] == 1 else g)
        raised = []
        for step in range(5):
            step_now[0] = step
            g = torch.Generator().manual_seed(10 * step + comm.rank)
            try:
                opt.zero_grad()
                model(torch.randn(4, 3, generator=g)).sum().backward()
                opt.step()
                if comm.rank == 0 and not blocking:
                    norm = float(torch.linalg.vector_norm(net[0].weight))  # logged on rank 0
                    assert math.isfinite(norm)
            except FloatingPointError:
                raised.append(step)
        model.flush()
        verify_replicas(net, comm, buffers=False)  # (each rank's own batch statistics)
        return raised, [p.detach().clone() for p in net.parameters()]

    (raised_b, blocking), (raised_n, deferred) = run(True), run(False)
    assert raised_b == raised_n == [1]  # blocking: in backward; non-blocking: at step()
    for a, b in zip(blocking, deferred):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), "the refused step changed something"


@pytest.mark.parametrize("case", ["scaler-under-join", "synchronize-under-join",
                                  "one-rank-reads-param-groups"])
def test_the_step_s_verdict_needs_no_collective_of_its_own(comm, case):
    """check_finite's verdict is a sum every rank starts after its last bucket, met wherever a
    rank first writes a bucket back: ranks that completed the averaging early (GradScaler's
    unscale, synchronize() before clipping, param_groups read on one rank) and Join's standing-in
    ranks stay in step (a verdict collective at step() was skipped by the ones and entered by
    the others: a hang)."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
    model = DataParallel(net, comm, optimizer=opt, check_finite=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0) if case == "scaler-under-join" else None
    join = Join([model]) if case.endswith("join") else contextlib.nullcontext()
    with join:
        for s in range(1 + 2 * comm.rank if case.endswith("join") else 3):
            g = torch.Generator().manual_seed(100 * comm.rank + s)
            x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                continue
            loss.backward()
            if case == "synchronize-under-join":
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            elif comm.rank == 0:
                assert opt.param_groups[0]["lr"] == 0.1
            opt.step()
    model.flush()
    verify_replicas(net, comm)


def test_centralized_check_finite(comm):
    net = nn.Linear(3, 2)
    opt = CentralizedSGD(model=net, lr=0.1, comm=comm, check_finite=True)
    opt.zero_grad()
    x = torch.randn(2, 3)
    if comm.rank == 0:
        x[1, 2] = float("inf")
    with pytest.raises(FloatingPointError, match="weight"):
        net(x).sum().backward()
        opt.step()


def test_amp_scaler_skips_together(comm):
    """A GradScaler step is skipped on every rank when one rank's gradients overflow, also
    through a lossy codec (the non-finite marker), and the replicas stay equal."""
    for codec in (None, Sign()):
        torch.manual_seed(0)
        net = nn.Linear(3, 2)
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
        model = DataParallel(net, comm, optimizer=opt, codec=codec)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        before = [p.detach().clone() for p in net.parameters()]
        x = torch.randn(2, 3)
        if comm.rank == comm.size - 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt.torch_optimizer)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 7  # skipped and backed off, everywhere
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
        verify_replicas(net, comm)


@pytest.mark.parametrize("codec", [TopK(ratio=0.5), PowerSGD(1), ScaledSign()],
                         ids=["topk", "powersgd", "scaled-sign"])
def test_codec_memory_recovers_after_a_skipped_overflow(comm, codec):
    """After an overflow that GradScaler skips, a codec with error feedback or a warm start
    goes on with finite memory: the scale backs off once and the next steps are taken (the
    NaN residual made every later step overflow: scales 128, 64, 32, ...)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt, codec=codec)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    scales = []
    for step in range(4):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(7 * step + comm.rank))
        if step == 1 and comm.rank == comm.size - 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [2.0 ** 8, 2.0 ** 7, 2.0 ** 7, 2.0 ** 7]
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    verify_replicas(net, comm)


@pytest.mark.parametrize("stepped", ["DataParallelOptimizer", "torch optimizer"])
@pytest.mark.parametrize("make", [Sign, lambda: Threshold(0.3),
                                  lambda: Clipped(Identity(), 1.0)],
                         ids=["sign", "threshold", "clipped"])
def test_codecs_that_do_not_scale_refuse_a_grad_scaler_on_every_rank(comm, make, stepped):
    """Sign's vote counts, Threshold's fixed threshold and Clipped's fixed limit do not scale
    with the loss scale, so GradScaler's unscaling changed the update (Sign: s times too small):
    stepping the heatlike optimizer through a scaler, or the program's own torch optimizer
    (DataParallel without ``optimizer=``; before, not seen), raises ValueError on every rank,
    naming what to use instead, and updates nothing."""
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if stepped == "DataParallelOptimizer":
        opt = DataParallelOptimizer(opt, blocking=True)
        model = DataParallel(net, comm, optimizer=opt, codec=make())
    else:
        model = DataParallel(net, comm, codec=make())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    before = [p.detach().clone() for p in net.parameters()]
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    with pytest.raises(ValueError, match="does not scale with its input.*without a GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    opt.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()  # without a scaler it trains
    verify_replicas(net, comm)
    model.close()


def test_settings_must_agree(comm):
    agree_on({"a": 1, "b": "x"}, comm)
    if comm.size == 1:
        return
    last = comm.size - 1
    with pytest.raises(ValueError, match=rf"'b' .*differs between ranks \(rank 0: 'x', .*"
                                         rf"rank {last}: 'y'\)"):
        agree_on({"a": 1, "b": "y" if comm.rank == last else "x"}, comm)
    with pytest.raises(ValueError, match="'bucket_cap_mb' of DataParallel"):
        DataParallel(nn.Linear(2, 2), comm, bucket_cap_mb=1.0 if comm.rank == last else 2.0)
    with pytest.raises(ValueError, match="'batch_size' of the DataLoader"):
        DataLoader(torch.zeros(16, 2), batch_size=2 + (comm.rank == last), comm=comm)
    with pytest.raises(ValueError, match="'codec'"):
        CentralizedSGD(model=nn.Linear(2, 2), lr=0.1, comm=comm,
                       codec=TopK(k=1) if comm.rank == last else None)
