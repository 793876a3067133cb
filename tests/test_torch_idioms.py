"""Torch idioms with DataParallel + DataParallelOptimizer, in both modes: LR schedulers, GradScaler
(with and without unscale_ + clipping), clip_grad_norm_, optimizer hooks and state dicts give the
model a single process gets with the combined batch, or raise a clear error, on every rank."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings

import pytest
import torch
from _helpers import DynamoLog
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel
from heatlike.nn.deferred import drop_guard
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


def _step_both(comm, step: int, model, opt, ref, ref_opt, zero=None) -> None:
    """One training step of the data-parallel model (``zero``: how its gradients are reset,
    default ``opt.zero_grad``) and of the one-process reference on the ranks' batches
    concatenated."""
    (zero or opt.zero_grad)()
    ref_opt.zero_grad()
    x, y = _data(step, comm.rank)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    xs, ys = zip(*[_data(step, r) for r in range(comm.size)])
    nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_opt.step()


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
            _step_both(comm, step, model, opt, ref, ref_opt)
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(1.0)
                ref_sched.step(1.0)
            else:
                sched.step()
                ref_sched.step()
        model.flush()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        _assert_close(net, ref, type(sched).__name__)


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_a_scheduler_built_on_the_torch_optimizer_before_wrapping(comm, blocking):
    """StepLR on the torch optimizer, then the wrapper: the rates reach the updates, and torch
    does not warn that ``lr_scheduler.step()`` came before ``optimizer.step()`` (non-blocking,
    the torch step runs at the next forward; it used to)."""
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(inner, 1, 0.5)
    opt = DataParallelOptimizer(inner, blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            _step_both(comm, step, model, opt, ref, ref_opt)
            sched.step()
            ref_sched.step()
        model.flush()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], \
        [str(w.message) for w in caught]
    assert inner.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    _assert_close(net, ref, "StepLR on the torch optimizer")


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
    module a wrapper holds give plain modules with the module's current weights (reading them
    applies a pending non-blocking update first), whose forward passes leave the wrapper alone
    (an update pending meanwhile stays pending), on every rank."""
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

    def train(step):
        opt.zero_grad()
        x, y = _data(step, comm.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    pending = wrapper == "non-blocking" and comm.size > 1
    for step in range(2):
        train(step)
        assert bool(getattr(model.grad_sync, "pending", list)()) == pending
        averaged.update_parameters(net)
        assert not getattr(model.grad_sync, "pending", list)()  # the update was applied
    train(2)
    weights = [p.detach().clone() for p in net.parameters()]
    ema = copy.deepcopy(net)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (ema, loaded):
        assert all(torch.equal(a, b) for a, b in zip(copied.parameters(), weights))
    train(3)
    x, _ = _data(9, comm.rank)
    with torch.no_grad():
        outputs = [m(x) for m in (ema, loaded, averaged)]
    assert bool(getattr(model.grad_sync, "pending", list)()) == pending  # untouched by copies
    assert torch.equal(outputs[0], outputs[1])
    assert all(out.shape == (4, 3) and bool(torch.isfinite(out).all()) for out in outputs)
    getattr(model, "flush", lambda: None)()  # the last update lands in the module, not the copies
    assert not all(torch.equal(a, b) for a, b in zip(net.parameters(), weights))


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["blocking", "non-blocking", "daso", "distopt"])
def test_a_parameter_frozen_when_wrapped_and_unfrozen_later_raises_on_every_rank(comm, wrapper):
    """Fine-tuning's "freeze, wrap, unfreeze": a parameter that did not require gradients at
    construction is not synchronized, so its update would use each rank's own gradient (the
    replicas drifted apart in blocking mode; non-blocking never moved it). The next step raises
    on every rank, saying what to do."""
    from heatlike.nn import DataParallelMultiGPU
    from heatlike.optim import DASO, DistOpt

    net = _net()
    net[0].weight.requires_grad_(False)
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    if wrapper == "daso":
        opt = DASO(sgd, total_epochs=3, comm=comm, warmup_epochs=1, cooldown_epochs=1)
        model = DataParallelMultiGPU(net, opt)
        opt.last_batch = 4
    elif wrapper == "distopt":
        opt, model = DistOpt(sgd, comm), net
    else:
        opt = DataParallelOptimizer(sgd, blocking=wrapper == "blocking")
        model = DataParallel(net, comm, optimizer=opt)

    def step(i):
        opt.zero_grad()
        x, y = _data(i, comm.rank)
        loss = nn.functional.cross_entropy(model(x), y)
        if wrapper == "distopt":
            opt.backward_and_update(loss)
        else:
            loss.backward()
            opt.step()

    step(0)
    net[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"did not require gradients when .* was built.*"
                                           r"requires gradients now"):
        step(1)


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_a_tensor_learning_rate_changed_by_a_scheduler_applies_to_its_own_step(comm, blocking):
    """``lr=torch.tensor(...)``: schedulers change the tensor in place. A deferred update uses
    the rate of the step() that scheduled it, as the blocking one does (it used the next
    step's rate: 0.036 off after 5 steps)."""
    net, ref = _net(), _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=torch.tensor(LR),
                                                momentum=0.9), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=torch.tensor(LR), momentum=0.9)
    scheds = [_schedule(opt), _schedule(ref_opt)]
    for step in range(STEPS):
        _step_both(comm, step, model, opt, ref, ref_opt)
        for sched in scheds:
            sched.step()
    model.flush()
    _assert_close(net, ref, "tensor lr")


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
@pytest.mark.parametrize("into", ["module", "wrapper"])
def test_loading_weights_after_step_gives_the_loaded_weights(comm, blocking, into):
    """Roll back to a saved state with torch's own calls (``load_state_dict`` of the module or
    of the wrapper, then of the optimizer) while a non-blocking update is pending: the loaded
    values are what the model holds, as after a blocking step (the pending update landed on
    top of them; through the wrapper it raised a misleading "during a backward pass")."""
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    target = model if into == "wrapper" else net

    def step(i):
        opt.zero_grad()
        x, y = _data(i, comm.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step(0)
    saved = copy.deepcopy(target.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    step(1)
    target.load_state_dict(saved)
    opt.load_state_dict(saved_opt)
    for name, value in target.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, saved[name]), name
    step(2)  # and training goes on from there
    model.flush()
    assert all(torch.isfinite(p).all() for p in net.parameters())


@pytest.mark.mpi
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("target", ["wrapper", "module"])
def test_zero_grad_of_the_module_while_an_update_is_pending(comm, set_to_none, target):
    """Non-blocking: the wrapper's ``zero_grad`` (DDP users' ``model.zero_grad()``) resets the
    gradients once the pending update is applied; the wrapped module's own ``zero_grad`` reads
    the gradients, which applies the pending update first. Both give the one-process model
    (before: the module's raised at the next forward, and earlier still, accumulated gradients
    or replicas that drifted apart)."""
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=False)
    model = DataParallel(net, comm, optimizer=opt)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    zero = functools.partial(model.zero_grad if target == "wrapper" else net.zero_grad,
                             set_to_none=set_to_none)
    for step in range(STEPS):
        _step_both(comm, step, model, opt, ref, ref_opt, zero=zero)
    model.flush()
    _assert_close(net, ref, f"{target}.zero_grad(set_to_none={set_to_none})")


def _backward_of_a_deferred_model(comm):
    """A non-blocking DataParallel model, its optimizer and its net after one backward pass
    (skips at one rank, where nothing is deferred)."""
    if comm.size == 1:
        pytest.skip("one rank updates at once: nothing is deferred")
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=False)
    model = DataParallel(net, comm, optimizer=opt)
    x, y = _data(0, comm.rank)
    nn.functional.cross_entropy(model(x), y).backward()
    return net, opt, model


@pytest.mark.mpi
def test_a_gradient_changed_behind_the_guard_raises_on_every_rank(comm):
    """A ``.grad`` tensor kept from before ``step()`` and zeroed after it is not a read of a
    parameter: the average in flight into it is lost, and the next forward raises on every
    rank, naming what to call instead."""
    net, opt, model = _backward_of_a_deferred_model(comm)
    grads = [p.grad for p in net.parameters()]
    opt.step()
    for g in grads:
        g.zero_()
    with pytest.raises(RuntimeError, match="were reset or changed after step.*kept from before"):
        model(_data(1, comm.rank)[0])


def _l2(net: nn.Module) -> torch.Tensor:
    return sum((p * p).sum() for p in net.parameters())


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
def test_parameters_read_between_step_and_forward_are_the_updated_ones(comm, blocking):
    """Code between ``step()`` and the next forward that reads the parameters sees them
    updated, as after a blocking step: a regularizer computed before ``model(x)`` (Python
    evaluates ``reg(net) + loss(model(x))`` left to right), an exponential moving average
    updated right after ``step()`` (``torch.optim.swa_utils.AveragedModel``) and a gradient
    norm logged after ``step()``. Non-blocking, they saw the weights (and gradients) from before
    the step: a silently different model (2.5e-3 off after 5 steps)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net, ref = _net(), _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.8)) for m in (net, ref)]
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = _data(step, comm.rank)
        (1e-2 * _l2(net) + nn.functional.cross_entropy(model(x), y)).backward()
        opt.step()
        xs, ys = zip(*[_data(step, r) for r in range(comm.size)])
        (1e-2 * _l2(ref) + nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys))
         ).backward()
        ref_opt.step()
        for ema, m in zip(emas, (net, ref)):
            ema.update_parameters(m)
        norms = [torch.linalg.vector_norm(p.grad) for p in (net[-1].weight, ref[-1].weight)]
        assert torch.allclose(*norms, rtol=1e-5), f"step {step}: logged gradient norm"
    _assert_close(net, ref, "regularizer before the forward pass")
    _assert_close(emas[0].module, emas[1].module, "EMA updated after step()")


class _Passing(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Skippable(nn.Module):
    """Raises in its forward pass for a batch of another size (a loop that skips bad batches)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(36, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x.flatten(1)).relu()
        if x.shape[0] != 4:
            raise ValueError("bad batch")
        return self.b(h)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["mode-around-step", "compiled-read", "forward-raised"])
def test_reads_stay_guarded_through_modes_compiled_code_and_failed_forwards(comm, case):
    """Reads between ``step()`` and the next forward see the updated weights (as blocking mode)
    also when ``step()`` runs inside a torch function mode the program leaves afterwards (its
    ``__exit__`` took the guard off the stack and left the program's mode on it), when the
    read is compiled code (torch.compile failed on the guard), and after a forward pass that
    raised (the updates it had not applied were left unguarded)."""
    def run(blocking):
        net = _Skippable()
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                    blocking=blocking)
        model = DataParallel(net, comm, optimizer=opt, bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
        square = (torch.compile(lambda t: (t * t).sum(), backend="aot_eager")
                  if case == "compiled-read" else None)
        reads = []
        for step in range(4):
            x, y = _data(step, comm.rank)
            opt.zero_grad()
            if case == "forward-raised" and step == 2:
                with pytest.raises(ValueError, match="bad batch"):
                    model(x[:3])
            if square is not None:
                reads.append(torch.stack([square(p).detach() for p in net.parameters()]))
            else:
                reads.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
            with _Passing() if case == "mode-around-step" else contextlib.nullcontext():
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        model.flush()
        left = [torch._C._get_function_stack_at(i)
                for i in range(torch._C._len_torch_function_stack())]
        # (other tests' optimizers with updates still pending keep their guards)
        assert not [m for m in left if isinstance(m, _Passing) or m is opt._guard], left
        return reads

    blocking, deferred = run(True), run(False)
    for step, (a, b) in enumerate(zip(blocking, deferred)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{case}: read at step {step}"


@pytest.mark.mpi
def test_a_compiled_read_builds_no_guard_on_the_pending_parameters(comm):
    """A read compiled while updates are pending looks them up as plain Python: dynamo guards on
    none of the read guard's entries. Traced, every entry got a guard, and the garbage collector
    emptying a dropped optimizer's guard between dynamo's trace and its building of those guards
    failed the compilation inside dynamo (``InternalTorchDynamoError: KeyError``, seen in a
    4-rank run)."""
    if comm.size == 1:
        pytest.skip("one rank updates at once: nothing is deferred")
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=False)
    model = DataParallel(net, comm, optimizer=opt, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    x, y = _data(0, comm.rank)
    nn.functional.cross_entropy(model(x), y).backward()
    square = torch.compile(lambda t: (t * t).sum(), backend="aot_eager")
    probe = torch.compile(lambda probed: probed + 1, backend="aot_eager")
    with DynamoLog("guards") as guards:
        probe(torch.ones(2))  # guards the log must show (nothing pending yet: it works)
        opt.step()
        assert opt._guard is not None and opt._guard.owner, "the test needs updates pending"
        compiled = [square(p).detach() for p in net.parameters()]
    model.flush()
    assert [g for g in guards if "probed" in g], "the guards log does not show the probe's"
    assert not [g for g in guards if ".owner[" in g], [g for g in guards if "owner" in g]
    torch.testing.assert_close(torch.stack(compiled),
                               torch.stack([(p * p).sum().detach() for p in net.parameters()]))


@pytest.mark.mpi
def test_an_inert_read_guard_costs_compiled_code_no_graph_break(comm):
    """A read guard whose optimizer was dropped with updates pending stays on the stack until
    the next forward or ``step()`` takes it off; compiled code run meanwhile traces as if it were
    not there (a live guard checks each call in a graph break)."""
    from torch._dynamo.utils import counters

    net, opt, model = _backward_of_a_deferred_model(comm)
    opt.step()
    guard = opt._guard
    del opt, model, net  # (the module's hooks hold the wrapper)
    gc.collect()
    assert not guard.owner and guard in [torch._C._get_function_stack_at(i)
                                         for i in range(torch._C._len_torch_function_stack())]
    square = torch.compile(lambda t: (t * t).sum(), backend="aot_eager")
    before = sum(counters["graph_break"].values())
    assert square(torch.ones(3)).item() == 3.0
    assert sum(counters["graph_break"].values()) == before
    drop_guard(guard)


@pytest.mark.mpi
def test_the_guard_keeps_a_default_device_at_the_bottom_and_leaves_with_flush(comm):
    """``torch.set_default_device`` keeps its context at the bottom of the mode stack, where
    torch checks for it (the guard went under it: setting the device again raised
    AssertionError and lost the context); a guard made inert inside its own call is taken off by
    ``flush()`` (it stayed until the next forward, at about 2 us per torch call)."""
    if comm.size == 1:
        pytest.skip("one rank updates at once: nothing is deferred")
    torch.set_default_device("cpu")
    try:
        net = _net()
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=False)
        model = DataParallel(net, comm, optimizer=opt)
        for step in range(2):
            x, y = _data(step, comm.rank)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            torch.set_default_device("cpu")  # set again between step() and the forward
            float(torch.linalg.vector_norm(net[0].weight))  # a read applies the update
        model.flush()
        left = [type(torch._C._get_function_stack_at(i)).__name__
                for i in range(torch._C._len_torch_function_stack())]
        assert left == ["DeviceContext"], left
    finally:
        torch.set_default_device(None)


@pytest.mark.mpi
def test_a_loop_that_reads_parameters_only_in_the_forward_keeps_the_overlap(comm):
    """The guard against early reads lets through what does not read a parameter's values:
    the next batch, metadata (shapes, devices), ``zero_grad`` and LR schedulers between
    ``step()`` and the next forward leave the update pending for the forward pass."""
    if comm.size == 1:
        pytest.skip("one rank updates at once: nothing is deferred")
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=False)
    model = DataParallel(net, comm, optimizer=opt)
    sched = _schedule(opt)
    for step in range(3):
        opt.zero_grad()
        x, y = _data(step, comm.rank)
        x = torch.cat([x, x]).float()[: len(x)]
        shapes = [(p.shape, p.dtype, p.device, p.requires_grad, p.numel()) for p in
                  net.parameters()]
        assert opt.update_next == (step > 0) and shapes
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        assert opt.update_next
    model.flush()
    assert not opt.update_next


class _Checkpointed(nn.Module):
    """A layer before a reentrant activation checkpoint (``layout="pre"``), the whole model
    inside one (``"all"``) or a checkpoint between layers (``"mid"``)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.pre = nn.Linear(36, 36)
        self.body = nn.Sequential(nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = x.flatten(1).requires_grad_()
        if self.layout == "pre":
            return checkpoint(lambda t: self.head(self.body(t)), self.pre(x), use_reentrant=True)
        if self.layout == "all":
            return checkpoint(lambda t: self.head(self.body(self.pre(t))), x, use_reentrant=True)
        return self.head(checkpoint(self.body, self.pre(x), use_reentrant=True))


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
@pytest.mark.parametrize("layout", ["pre", "all", "mid"])
def test_reentrant_activation_checkpointing_syncs_once_per_backward(comm, blocking, layout):
    """``checkpoint(..., use_reentrant=True)`` runs a backward pass inside the backward pass:
    its end is not the end of the cycle. The one-process model, one exchange per bucket per
    step (before: a "second gradient" error in non-blocking mode, two cycles in blocking
    mode)."""
    net, ref = _Checkpointed(layout), _Checkpointed(layout)
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        _step_both(comm, step, model, opt, ref, ref_opt)
    model.flush()
    _assert_close(net, ref, f"reentrant checkpoint, {layout}")
    if comm.size > 1:
        assert model.grad_sync.state_dict()["exchanges"] == [STEPS] * len(model.grad_sync.buckets)


@pytest.mark.mpi(min_size=2)
def test_a_block_reentrantly_checkpointed_twice_names_the_cause(comm):
    """A shared block run through two reentrant checkpoints (ALBERT-like): each block's backward
    is a pass of its own, so the shared parameters report twice in one cycle (DDP refuses it
    too). The error names the parameter and the way out, on every rank (it said to call step()
    between backward passes)."""
    from torch.utils.checkpoint import checkpoint

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.shared, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.inp(x)
            for _ in range(2):
                h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
            return self.out(h)

    model = DataParallel(Shared(), comm)
    loss = model(torch.randn(4, 6)).sum()
    with pytest.raises(RuntimeError, match=r"'shared\.(weight|bias)' received a second gradient.*"
                                           r"use_reentrant=False"):
        loss.backward()


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["DataParallel", "DataParallelMultiGPU"])
def test_converting_the_module_after_wrapping_is_a_clear_error(comm, wrapper):
    """``model.double()`` after wrapping: the buckets were planned for float32 gradients. The
    next training forward raises on every rank, saying what to do (before: torch's "attempting
    to assign a gradient with dtype 'float'" deep inside the backward pass)."""
    from heatlike.nn import DataParallelMultiGPU
    from heatlike.optim import DASO

    net = _net()
    if wrapper == "DataParallel":
        model = DataParallel(net, comm, optimizer=DataParallelOptimizer(
            torch.optim.SGD(net.parameters(), lr=LR)))
    else:
        daso = DASO(torch.optim.SGD(net.parameters(), lr=LR), total_epochs=3, comm=comm,
                    warmup_epochs=1, cooldown_epochs=1)
        model = DataParallelMultiGPU(net, daso)
    model.double()
    x, _ = _data(0, comm.rank)
    if comm.size == 1:  # nothing is averaged: the converted model trains
        model(x.double()).sum().backward()
        assert all(p.grad.dtype == torch.float64 for p in net.parameters())
        return
    with pytest.raises(RuntimeError, match=rf"converted after {wrapper} was built .*"
                                           r"torch.float64 on cpu now"):
        model(x.double())
    with torch.no_grad():  # evaluation still runs
        assert model(x.double()).dtype == torch.float64


@pytest.mark.mpi(min_size=2)
def test_converting_one_layer_after_wrapping_names_it(comm):
    """One layer converted after wrapping (not its bucket's first parameter, which the forward
    checks): the write-back of the averages names the parameter and what to do, on every rank
    (before: torch's "attempting to assign a gradient with dtype 'float'")."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype))).float())

    net = Mixed()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=LR), blocking=True)
    model = DataParallel(net, comm, optimizer=opt)
    net.fc1.double()
    with pytest.raises(RuntimeError, match=r"'fc1\.(weight|bias)' was converted after its "
                                           r"gradient bucket was planned .*torch.float64"):
        model(torch.randn(4, 6)).sum().backward()


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", MODES)
@pytest.mark.parametrize("codec", ["topk", "powersgd"])
def test_grad_scaler_with_an_error_feedback_codec_trains_the_unscaled_model(comm, blocking,
                                                                             codec):
    """DataParallel with a codec that keeps residuals (top-k, PowerSGD) under a GradScaler whose
    scale doubles at every step: the residuals follow the scale, so the model is the one trained
    without a scaler (it was 1.5e-2 off: residuals of one scale added to gradients of another)."""
    from heatlike.engine import PowerSGD, TopK

    def run(scaler):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                    blocking=blocking)
        model = DataParallel(net, comm, optimizer=opt,
                             codec=TopK(ratio=0.1) if codec == "topk" else PowerSGD(rank=1))
        for step in range(6):
            g = torch.Generator().manual_seed(10 * step + comm.rank)
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        model.flush()
        return [p.detach().clone() for p in net.parameters()]

    plain = run(None)
    scaled = run(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1))
    for a, b in zip(scaled, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
