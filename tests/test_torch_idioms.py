"""Torch idioms with DataParallel + DataParallelOptimizer, in both modes: LR schedulers, GradScaler
(with and without unscale_ + clipping), clip_grad_norm_, optimizer hooks and state dicts give the
model a single process gets with the combined batch, or raise a clear error, on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer

STEPS, LR = 5, 0.1


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 1, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))


def _schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _reference(comm, clip: float | None = None) -> nn.Module:
    """One process, the ranks' batches concatenated."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    sched = _schedule(opt)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*[_data(step, r) for r in range(comm.size)])
        nn.functional.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        sched.step()
    return net


def _train(comm, blocking: bool, *, scaler: bool = False, clip: float | None = None,
           synchronize: bool = False, unscale: bool = False) -> nn.Module:
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    sched = _schedule(opt)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step, comm.rank)
        loss = nn.functional.cross_entropy(model(x), y)
        (grad_scaler.scale(loss) if scaler else loss).backward()
        if unscale:
            grad_scaler.unscale_(opt)
        if synchronize:
            opt.synchronize()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        if scaler:
            grad_scaler.step(opt)
            grad_scaler.update()
        else:
            opt.step()
        sched.step()
    model.flush()
    return net


def _assert_close(net, ref, what: str) -> None:
    for (name, a), b in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), \
            f"{what}: {name} off by {(a - b).abs().max().item():.3g}"


MODES = [pytest.param(True, id="blocking"), pytest.param(False, id="non-blocking")]


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_a_wrapper_is_a_torch_optimizer_that_lr_schedulers_drive(comm, blocking):
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=blocking)
    DataParallel(net, comm, optimizer=opt)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.torch_optimizer.param_groups
    assert opt.defaults is opt.torch_optimizer.defaults
    _assert_close(_train(comm, blocking), _reference(comm), "StepLR")


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_grad_scaler_gives_the_unscaled_model(comm, blocking):
    _assert_close(_train(comm, blocking, scaler=True), _reference(comm), "GradScaler")


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_grad_scaler_unscale_then_clip_clips_the_average(comm, blocking):
    _assert_close(_train(comm, blocking, scaler=True, unscale=True, clip=0.5),
                  _reference(comm, clip=0.5), "GradScaler + unscale_ + clip_grad_norm_")


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_clip_after_synchronize_clips_the_average(comm, blocking):
    _assert_close(_train(comm, blocking, synchronize=True, clip=0.5),
                  _reference(comm, clip=0.5), "synchronize + clip_grad_norm_")


@pytest.mark.mpi
def test_blocking_clip_between_backward_and_step_is_ddp_s(comm):
    _assert_close(_train(comm, True, clip=0.5), _reference(comm, clip=0.5), "clip_grad_norm_")


@pytest.mark.mpi
def test_non_blocking_clip_of_gradients_in_flight_raises_on_every_rank(comm):
    if comm.size == 1:  # nothing is ever in flight at one rank: clipping just works
        _assert_close(_train(comm, False, clip=0.5), _reference(comm, clip=0.5), "clip")
        return
    with pytest.raises(RuntimeError, match="synchronize"):
        _train(comm, False, clip=0.5)


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_a_replaced_or_scaled_gradient_in_flight_is_never_silently_dropped(comm, blocking):
    """Changing .grad by hand between backward and step: used as DDP would (blocking) or an
    error (non-blocking), in both the copied (first step) and bucket-view (later) cases."""
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    for step in range(3):
        opt.zero_grad(set_to_none=step != 1)
        x, y = _data(step, comm.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        before = net[3].bias.detach().clone()
        net[3].bias.grad = torch.ones_like(net[3].bias)
        if blocking or comm.size == 1:
            opt.step()
            assert torch.allclose(net[3].bias, before - LR)
        else:
            with pytest.raises(RuntimeError, match="3.bias"):
                opt.step()
            opt.synchronize()
            net[3].bias.grad = torch.ones_like(net[3].bias)
            opt.step()
            assert torch.allclose(net[3].bias, before - LR)


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_grad_scaler_skips_the_step_on_every_rank_when_one_rank_overflows(comm, blocking):
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _data(0, comm.rank)
    if comm.rank == comm.size - 1:
        x[0, 0, 0, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    model.flush()
    assert scaler.get_scale() == 512.0
    for a, b in zip(net.parameters(), before):
        assert torch.equal(a, b)


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_hooks_and_state_dict_in_torch_format(comm, blocking):
    net = _net()
    opt = DataParallelOptimizer(torch.optim.Adam(net.parameters(), lr=1e-2), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    for step in range(2):
        opt.zero_grad()
        x, y = _data(step, comm.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert calls == [1, 1]
    state = opt.state_dict()  # applies the pending update first
    assert set(state) >= {"state", "param_groups"}
    plain = torch.optim.Adam(_net().parameters(), lr=1e-2)
    plain.load_state_dict(state)
    assert plain.state_dict()["state"][0]["step"].item() == 2
    with pytest.raises(RuntimeError, match="before wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(TypeError, match="plain torch optimizer"):
        DataParallelOptimizer(opt)


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_every_lr_scheduler_changes_the_rate_the_update_uses(comm, blocking):
    """Each scheduler's rate sequence reaches the parameters: a plain SGD replica (no momentum)
    stepped with the rates the scheduler set equals the data-parallel model."""
    makers = [lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
              lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
              lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=STEPS),
              lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5)]
    for make in makers:
        net = _net()
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=blocking)
        model = DataParallel(net, comm, optimizer=opt)
        sched = make(opt)
        ref = _net()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        ref_sched = make(ref_opt)
        for step in range(STEPS):
            opt.zero_grad()
            ref_opt.zero_grad()
            x, y = _data(step, comm.rank)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            xs, ys = zip(*[_data(step, r) for r in range(comm.size)])
            nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
            ref_opt.step()
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(1.0)
                ref_sched.step(1.0)
            else:
                sched.step()
                ref_sched.step()
        model.flush()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        _assert_close(net, ref, type(sched).__name__)


def test_the_wrapper_raises_without_a_model():
    opt = DataParallelOptimizer(torch.optim.SGD(_net().parameters(), lr=LR))
    with pytest.raises(RuntimeError, match="not attached"):
        opt.step()
    assert hl.MPI_WORLD is not None


@pytest.mark.mpi
def test_daso_and_distopt_are_torch_optimizers_that_lr_schedulers_drive(comm):
    from heatlike.nn import DataParallelMultiGPU
    from heatlike.optim import DASO, DistOpt

    net = _net()
    daso = DASO(torch.optim.SGD(net.parameters(), lr=LR), total_epochs=4, comm=comm,
                warmup_epochs=1, cooldown_epochs=1)
    model = DataParallelMultiGPU(net, daso)
    daso.last_batch = 4
    dist = DistOpt(torch.optim.SGD(_net().parameters(), lr=LR), comm)
    for opt in (daso, dist):
        assert isinstance(opt, torch.optim.Optimizer)
        sched = _schedule(opt)
        for step in range(2):
            opt.zero_grad()
            x, y = _data(step, comm.rank)
            if opt is daso:
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        assert opt.param_groups[0]["lr"] == LR / 2
        state = opt.state_dict()
        assert {"state", "param_groups", "engine"} <= set(state)
        opt.param_groups[0]["lr"] = 1.0
        opt.load_state_dict(state)
        assert opt.param_groups[0]["lr"] == LR / 2


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["blocking", "non-blocking", "daso"])
def test_copies_of_a_wrapped_module_are_plain_modules(comm, wrapper):
    """copy.deepcopy (an EMA copy), torch.optim.swa_utils.AveragedModel and torch.save of the
    module a wrapper holds give plain modules with the module's current weights, whose forward
    passes leave the wrapper alone (a non-blocking update still pending stays pending: flush()
    first to copy it too), on every rank."""
    import copy
    import io

    from heatlike.nn import DataParallelMultiGPU
    from heatlike.optim import DASO

    net = _net()
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    if wrapper == "daso":
        opt = DASO(sgd, total_epochs=3, comm=comm, warmup_epochs=1, cooldown_epochs=1)
        model = DataParallelMultiGPU(net, opt)
        opt.last_batch = 4
    else:
        opt = DataParallelOptimizer(sgd, blocking=wrapper == "blocking")
        model = DataParallel(net, comm, optimizer=opt)
    averaged = torch.optim.swa_utils.AveragedModel(net)
    for step in range(2):
        opt.zero_grad()
        x, y = _data(step, comm.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        averaged.update_parameters(net)
    pending = wrapper == "non-blocking" and comm.size > 1
    assert bool(getattr(model.grad_sync, "pending", list)()) == pending
    weights = [p.detach().clone() for p in net.parameters()]
    ema = copy.deepcopy(net)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (ema, loaded):
        assert all(torch.equal(a, b) for a, b in zip(copied.parameters(), weights))
    x, _ = _data(9, comm.rank)
    with torch.no_grad():
        outputs = [m(x) for m in (ema, loaded, averaged)]
    assert bool(getattr(model.grad_sync, "pending", list)()) == pending  # untouched by copies
    assert torch.equal(outputs[0], outputs[1])
    assert all(out.shape == (4, 3) and bool(torch.isfinite(out).all()) for out in outputs)
    if pending:  # the update in flight lands in the wrapped module, not in the copies
        model.flush()
        assert not all(torch.equal(a, b) for a, b in zip(net.parameters(), weights))
