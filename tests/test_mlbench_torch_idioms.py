"""Torch idioms with every mlbench-core preset: each is a ``torch.optim.Optimizer`` that LR
schedulers, ``torch.amp.GradScaler``, ``add_param_group`` and state dicts work with. Every rank
compares its model with a single process computed here from all ranks' batches (a conv +
BatchNorm model: the reference runs each rank's batch through it separately, as the ranks do)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from heatlike import optim
from heatlike.engine import ScaledSign, TopK

pytestmark = pytest.mark.mpi
STEPS, LR, B = 4, 0.05, 3
TOL = dict(rtol=1e-5, atol=1e-6)


def _net() -> nn.Module:
    torch.manual_seed(0)
    # no bias before BatchNorm: its gradient is zero up to rounding, which Adam would amplify
    return nn.Sequential(nn.Conv2d(1, 3, 3, bias=False), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(48, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, 1, 6, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


def _loss(net, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.cross_entropy(net(x), y)


def _others(comm) -> list[int]:
    return [r for r in range(comm.size) if r != comm.rank]


def _generic(net, comm):
    opt = optim.GenericCentralizedOptimizer(model=net, comm=comm)
    opt.optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    return opt


def _sgd(momentum=0.9, weight_decay=0.0):
    return lambda ps: torch.optim.SGD(ps, lr=LR, momentum=momentum, weight_decay=weight_decay)


# name: (build the preset, reference kind, build the reference torch optimizer, step kwargs, tol)
PRESETS = {
    "CentralizedSGD": (lambda net, comm: optim.CentralizedSGD(
        model=net, lr=LR, momentum=0.9, weight_decay=1e-3, comm=comm), "torch",
        _sgd(0.9, 1e-3), {}, TOL),
    "CentralizedSGD-weights": (lambda net, comm: optim.CentralizedSGD(
        model=net, lr=LR, momentum=0.9, agg_grad=False, comm=comm), "torch", _sgd(), {}, TOL),
    "CentralizedAdam": (lambda net, comm: optim.CentralizedAdam(model=net, lr=0.01, comm=comm),
                        "torch", lambda ps: torch.optim.Adam(ps, lr=0.01), {}, TOL),
    "Generic": (_generic, "torch", _sgd(), {}, TOL),
    "Custom": (lambda net, comm: optim.CustomCentralizedOptimizer(
        net, None, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), average_world=True,
        comm=comm), "torch", _sgd(), {}, TOL),
    "Custom-denom": (lambda net, comm: optim.CustomCentralizedOptimizer(
        net, None, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), average_custom=True,
        divide_before=True, comm=comm), "torch", _sgd(), "denom", TOL),
    "PowerSGD": (lambda net, comm: optim.PowerSGD(model=net, lr=LR, momentum=0.9, rank=64,
                                                  comm=comm), "torch", _sgd(), {},
                 dict(rtol=1e-4, atol=2e-5)),
    "DecentralizedSGD": (lambda net, comm: optim.DecentralizedSGD(
        neighbors=_others(comm), model=net, lr=LR, momentum=0.9, comm=comm), "torch", _sgd(),
        {}, TOL),
    "SparsifiedSGD": (lambda net, comm: optim.SparsifiedSGD(
        net.parameters(), lr=LR, sparse_grad_size=10**6, comm=comm), "torch", _sgd(0.0), {},
        TOL),
    "CentralizedSparsifiedSGD": (lambda net, comm: optim.CentralizedSparsifiedSGD(
        net.parameters(), lr=LR, sparse_grad_size=10**6, comm=comm), "torch", _sgd(0.0), {},
        TOL),
    "SignSGD": (lambda net, comm: optim.SignSGD(net.parameters(), lr=LR / 10, momentum=0.9,
                                                comm=comm), "sign",
                lambda ps: torch.optim.SGD(ps, lr=LR / 10, momentum=0.9), {}, TOL),
}

# presets whose engine keeps state between steps (memories, warm starts, momentum of votes)
LOSSY = {
    "PowerSGD-1": lambda net, comm: optim.PowerSGD(model=net, lr=LR, momentum=0.9, rank=1,
                                                   reuse_query=True, comm=comm),
    "SparsifiedSGD-5": lambda net, comm: optim.SparsifiedSGD(net.parameters(), lr=LR,
                                                             sparse_grad_size=5, comm=comm),
    "CentralizedSparsifiedSGD-5": lambda net, comm: optim.CentralizedSparsifiedSGD(
        net.parameters(), lr=LR, sparse_grad_size=5, random_sparse=True, comm=comm),
    # weights through lossy codecs: residuals and the reference weights (gossip: public copies)
    "CentralizedSGD-weights-topk": lambda net, comm: optim.CentralizedSGD(
        model=net, lr=LR, momentum=0.9, agg_grad=False, codec=TopK(k=5), comm=comm),
    "DecentralizedSGD-bf16": lambda net, comm: optim.DecentralizedSGD(
        model=net, lr=LR, momentum=0.9, codec="bf16", comm=comm),
}

SCHEDULERS = {
    "StepLR": lambda o, m: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o, m: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)),
    "OneCycleLR": lambda o, m: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.1, total_steps=STEPS, cycle_momentum=m),
    "ReduceLROnPlateau": lambda o, m: torch.optim.lr_scheduler.ReduceLROnPlateau(
        o, patience=0, factor=0.5),
    "CosineAnnealingLR": lambda o, m: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3),
}


def _cycles_momentum(opt) -> bool:
    return opt.defaults.get("momentum", 0) > 0 or "betas" in opt.defaults


def _sched_step(sched) -> None:
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched.step(1.0)  # never improves: the rate halves from the second step on
    else:
        sched.step()


def _kwargs(name, comm) -> dict:
    extra = PRESETS[name][3] if name in PRESETS else {}
    return {"denom": comm.size} if extra == "denom" else dict(extra)


def _train(comm, name, steps=STEPS, schedule=None, scaler=None, inf_at=None, make=None,
           start=None, new_scales=None):
    """The preset trained on this rank's batches; returns (net, opt, params before each step).
    ``new_scales``: the scale the scaler is given after each step (instead of its own update
    rule)."""
    net = _net()
    if comm.rank:  # the preset starts every rank from rank 0's weights
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * comm.rank)
    opt = (make or PRESETS[name][0])(net, comm)
    if start is not None:  # resume
        net.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    sched = schedule(opt, _cycles_momentum(opt)) if schedule else None
    before = []
    first = 0 if start is None else start[2]
    for step in range(first, steps):
        opt.zero_grad()
        loss = _loss(net, step, comm.rank)
        if step == inf_at and comm.rank == comm.size - 1:  # an overflow on one rank only
            loss = loss + net[0].weight[0, 0, 0, 0] * float("inf")
        before.append([p.detach().clone() for p in net.parameters()])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt, **_kwargs(name, comm))
            scaler.update(None if new_scales is None else new_scales[step])
        else:
            loss.backward()
            opt.step(**_kwargs(name, comm))
        if sched is not None:
            _sched_step(sched)
    return net, opt, before


def _rank_grads(net, step: int, size: int) -> list[list[torch.Tensor]]:
    """Every rank's gradients at ``step``, computed in this process."""
    out = []
    for r in range(size):
        net.zero_grad()
        _loss(net, step, r).backward()
        out.append([p.grad.clone() for p in net.parameters()])
    return out


def _reference(comm, name, steps=STEPS, schedule=None, skip=None) -> nn.Module:
    """One process: the average of the ranks' gradients through the torch optimizer, or the
    majority vote of their signs (SignSGD); no update at step ``skip``."""
    _, kind, make_ref, _, _ = PRESETS[name]
    net = _net()
    # SignSGD: a torch optimizer over a stand-in carries the scheduled hyperparameters
    ref = make_ref(list(net.parameters()) if kind == "torch" else [nn.Parameter(torch.zeros(1))])
    sched = schedule(ref, _cycles_momentum(ref)) if schedule else None
    buffers = [{} for _ in range(comm.size)]  # SignSGD: every rank's momentum buffers
    for step in range(steps):
        grads = _rank_grads(net, step, comm.size)
        if step != skip:
            group = ref.param_groups[0]
            if kind == "torch":
                for i, p in enumerate(net.parameters()):
                    p.grad = torch.stack([g[i] for g in grads]).mean(0)
                ref.step()
            else:
                votes = [torch.zeros_like(p) for p in net.parameters()]
                for r, rank_grads in enumerate(grads):
                    for i, g in enumerate(rank_grads):
                        buf = buffers[r].get(i)
                        if buf is None:
                            buf = buffers[r][i] = g.clone()
                        else:
                            buf.mul_(group["momentum"]).add_(g)
                        votes[i] += torch.sign(buf)
                with torch.no_grad():
                    for p, v in zip(net.parameters(), votes):
                        p.sub_(group["lr"] * torch.sign(v))
                ref.step()  # nothing to update: keeps the scheduler's bookkeeping
        if sched is not None:
            _sched_step(sched)
    return net


def _assert_close(net, ref, tol, what) -> None:
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **tol,
                                   msg=lambda m, n=n: f"{what} {n}: {m}")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_torch_optimizer(comm, name):
    """isinstance, param_groups / state / defaults are the local optimizer's objects, step hooks
    run once per step."""
    net = _net()
    opt = PRESETS[name][0](net, comm)
    assert isinstance(opt, torch.optim.Optimizer)
    local = getattr(opt, "optimizer", None) or opt
    assert opt.param_groups is local.param_groups and opt.defaults is local.defaults
    assert opt.state is local.state and "lr" in opt.defaults
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    _loss(net, 0, comm.rank).backward()
    opt.step(**_kwargs(name, comm))
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("schedule", sorted(SCHEDULERS))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_lr_schedulers(comm, name, schedule):
    """Every torch LR scheduler drives the preset as it drives the reference optimizer."""
    net, _, _ = _train(comm, name, schedule=SCHEDULERS[schedule])
    _assert_close(net, _reference(comm, name, schedule=SCHEDULERS[schedule]), PRESETS[name][4],
                  f"{name} with {schedule}")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_grad_scaler_gives_the_same_model(comm, name):
    """scaler.scale(loss).backward(); scaler.step(opt); scaler.update() at a scale that does not
    overflow: the model of the run without a scaler (power-of-two scales are exact)."""
    plain, _, _ = _train(comm, name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    scaled, _, _ = _train(comm, name, scaler=scaler)
    _assert_close(scaled, plain, dict(rtol=1e-6, atol=1e-7), f"{name} with GradScaler")
    _assert_close(scaled, _reference(comm, name), PRESETS[name][4], f"{name} with GradScaler")


# gradient-mode presets whose codec keeps error-feedback residuals of the scaled gradients
SCALED_MEMORY = {
    "PowerSGD-1": LOSSY["PowerSGD-1"],
    "CentralizedSGD-topk": lambda net, comm: optim.CentralizedSGD(
        model=net, lr=LR, momentum=0.9, codec=TopK(k=5), comm=comm),
    "CentralizedAdam-scaled-sign": lambda net, comm: optim.CentralizedAdam(
        model=net, lr=0.01, codec=ScaledSign(), comm=comm),
}


@pytest.mark.parametrize("name", sorted(SCALED_MEMORY))
def test_grad_scaler_rescales_error_feedback_memory(comm, name):
    """The residuals of gradients exchanged at loss scale s enter the next exchange, at scale
    s', multiplied by s' / s: the model of the run without a scaler while the scale doubles at
    every step, jumps up and down, and across a checkpoint taken with the scaler's state (the
    memory saved at the scale of the resumed run's first gradients)."""
    make = SCALED_MEMORY[name]
    tol = dict(rtol=1e-6, atol=1e-7)
    plain, _, _ = _train(comm, None, make=make)
    for new_scales in (None, [2.0 ** k for k in (13, 9, 12, 8)]):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        scaled, _, _ = _train(comm, None, make=make, scaler=scaler, new_scales=new_scales)
        _assert_close(scaled, plain, tol, f"{name} with the scale changing ({new_scales})")
    whole, _, _ = _train(comm, None, steps=6, make=make)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    half, opt, _ = _train(comm, None, steps=3, make=make, scaler=scaler)
    saved = (copy.deepcopy(half.state_dict()), copy.deepcopy(opt.state_dict()), 3)
    again = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1)
    again.load_state_dict(scaler.state_dict())
    resumed, _, _ = _train(comm, None, steps=6, make=make, start=saved, scaler=again)
    _assert_close(resumed, whole, tol, f"{name} resumed with its scaler")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_grad_scaler_skips_on_every_rank(comm, name):
    """An overflow in the last rank's backward at step 1: every rank skips that step (its
    weights do not move), later steps go on as if step 1 had no update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    net, _, before = _train(comm, name, scaler=scaler, inf_at=1)
    after_skip = before[2]
    for b, a in zip(before[1], after_skip):
        assert torch.equal(a, b), "a rank stepped although some rank's gradients overflowed"
    _assert_close(net, _reference(comm, name, skip=1), PRESETS[name][4], f"{name} after a skip")


@pytest.mark.parametrize("name", sorted(PRESETS) + sorted(LOSSY))
def test_state_dict_round_trip_resumes_exactly(comm, name):
    """state_dict() is torch's format with the engine inside; loading it into a fresh optimizer
    (and model) continues exactly as the uninterrupted run."""
    make = LOSSY.get(name) or PRESETS[name][0]
    kwargs_name = name if name in PRESETS else None
    whole, _, _ = _train(comm, kwargs_name, steps=6, make=make)
    half, opt, _ = _train(comm, kwargs_name, steps=3, make=make)
    state = opt.state_dict()
    assert {"state", "param_groups", "engine"} <= set(state)
    saved = (copy.deepcopy(half.state_dict()), copy.deepcopy(state), 3)
    resumed, _, _ = _train(comm, kwargs_name, steps=6, make=make, start=saved)
    for (n, a), b in zip(resumed.named_parameters(), whole.parameters()):
        assert torch.equal(a, b), f"{name}: {n} differs after resuming"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_add_param_group_refuses_unsynchronized_parameters(comm, name):
    """A parameter the engine was not built with would be trained with each rank's own
    gradient: ValueError on every rank, nothing added."""
    net = _net()
    opt = PRESETS[name][0](net, comm)
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="synchroniz"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == groups


def test_add_param_group_with_synchronized_parameters(comm):
    """CustomCentralizedOptimizer over the head only, the body added later: both trained on the
    average, as one process with two groups."""
    net = _net()
    head, body = list(net[4].parameters()), list(net[0].parameters()) + list(net[1].parameters())
    opt = optim.CustomCentralizedOptimizer(net, None, torch.optim.SGD(head, lr=LR),
                                           average_world=True, comm=comm)
    ref_net = _net()
    ref = torch.optim.SGD(list(ref_net[4].parameters()), lr=LR)
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": body, "lr": LR / 2})
            ref.add_param_group({"params": list(ref_net[0].parameters()) +
                                 list(ref_net[1].parameters()), "lr": LR / 2})
        opt.zero_grad()
        _loss(net, step, comm.rank).backward()
        opt.step()
        grads = _rank_grads(ref_net, step, comm.size)
        for i, p in enumerate(ref_net.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        ref.step()
    _assert_close(net, ref_net, TOL, "groups added later")


def test_unfrozen_parameter_is_not_trained_silently(comm):
    """A parameter frozen when the optimizer was built is not synchronized: once it gets a
    gradient, step() raises instead of training it with this rank's gradient."""
    net = _net()
    net[4].bias.requires_grad_(False)
    opt = optim.CentralizedSGD(model=net, lr=LR, comm=comm)
    net[4].bias.requires_grad_(True)
    _loss(net, 0, comm.rank).backward()
    with pytest.raises(RuntimeError, match="did not require gradients"):
        opt.step()


def test_local_optimizer_must_be_synchronized(comm):
    """CustomCentralizedOptimizer with an optimizer over a parameter outside the model."""
    net = _net()
    stray = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not among them"):
        optim.CustomCentralizedOptimizer(
            net, None, torch.optim.SGD(list(net.parameters()) + [stray], lr=LR),
            average_world=True, comm=comm)
    with pytest.raises(TypeError, match="plain torch"):
        optim.CustomCentralizedOptimizer(net, None, optim.CentralizedSGD(model=_net(), lr=LR,
                                                                         comm=comm), comm=comm)


# -- FP16Optimizer -------------------------------------------------------------------------------

def _half_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).half()


def _train_fp16(comm, scaler=None, inf_at=None, schedule=False, steps=STEPS, start=None):
    model = _half_net()
    fp = optim.FP16Optimizer(model, average_world=True, init_scale=2.0 ** 8,
                             scale_window=10**6, comm=comm)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=LR, momentum=0.9))
    if start is not None:
        model.load_state_dict(start[0])
        fp.load_state_dict(start[1])
    sched = torch.optim.lr_scheduler.StepLR(fp, step_size=1, gamma=0.5) if schedule else None
    skipped = []
    for step in range(0 if start is None else start[2], steps):
        g = torch.Generator().manual_seed(50 * step + comm.rank)
        x, y = torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)
        fp.zero_grad()
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        if step == inf_at and comm.rank == comm.size - 1:
            loss = loss * float("inf")
        before = fp.fp32_params.detach().clone()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(fp)
            scaler.update()
        else:
            fp.backward_loss(loss)
            fp.step()
        if torch.equal(before, fp.fp32_params.detach()):
            skipped.append(step)
        if sched is not None:
            sched.step()
    return model, fp, skipped


def test_fp16_optimizer_with_grad_scaler(comm):
    """GradScaler in place of FP16Optimizer's own loss scaling: the same model at the same
    scale; an overflow on one rank skips the step on every rank and halves every rank's
    scale."""
    own, _, _ = _train_fp16(comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10**6)
    scaled, fp, _ = _train_fp16(comm, scaler=scaler)
    assert isinstance(fp, torch.optim.Optimizer) and fp.param_groups is fp.optimizer.param_groups
    for a, b in zip(own.parameters(), scaled.parameters()):
        assert torch.equal(a, b)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10**6)
    _, _, skipped = _train_fp16(comm, scaler=scaler, inf_at=1)
    assert skipped == [1]
    scales = comm.handle.allgather(scaler.get_scale())
    assert scales == [2.0 ** 7] * comm.size
    _, fp, skipped = _train_fp16(comm, inf_at=1)
    assert skipped == [1] and fp.loss_scale == 2.0 ** 7


def test_fp16_optimizer_scheduler_and_state(comm):
    """An LR scheduler on the FP16Optimizer sets the inner optimizer's rate; state_dict round
    trip (master weights, loss scale, inner state) resumes exactly."""
    _, fp, _ = _train_fp16(comm, schedule=True)
    assert fp.optimizer.param_groups[0]["lr"] == LR * 0.5 ** STEPS
    whole, _, _ = _train_fp16(comm, steps=6)
    half, fp, _ = _train_fp16(comm, steps=3)
    saved = (copy.deepcopy(half.state_dict()), copy.deepcopy(fp.state_dict()), 3)
    assert {"state", "param_groups", "engine"} <= set(saved[1])
    resumed, _, _ = _train_fp16(comm, steps=6, start=saved)
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="synchroniz"):
        fp.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_fp16_optimizer_refuses_parameters_frozen_after_it_was_built(comm):
    """The master weights are laid out over the parameters that required gradients at
    construction; a layer frozen later made the copies read and write other layers' places
    (mlbench-core's do the same: the next layer took the frozen one's weights)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).half()
    fp = optim.FP16Optimizer(model, average_world=True, init_scale=1.0, comm=comm)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
    x = torch.randn(2, 4).half()
    fp.zero_grad()
    fp.backward_loss(model(x).float().pow(2).mean())
    fp.step()
    model[0].requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    fp.zero_grad()
    fp.backward_loss(model(x).float().pow(2).mean())
    with pytest.raises(RuntimeError, match="frozen or unfrozen after FP16Optimizer was built"):
        fp.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_sign_sgd_takes_sparse_gradients_with_weight_decay(comm):
    """(before: torch's add(sparse, dense) error on the ranks holding such a gradient, while
    the others entered the vote)."""
    from _helpers import SparseEmbedding

    results = []
    for sparse in (True, False):
        net = SparseEmbedding(20, 6, 3)
        if not sparse:
            net.table.sparse = False
        opt = optim.SignSGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01,
                            comm=comm)
        for step in range(3):
            x, y = _batch(step, comm.rank)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x.reshape(len(x), -1)[:, :4]), y).backward()
            opt.step()
        results.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.allclose(a, b) for a, b in zip(*results))
