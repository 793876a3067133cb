"""heatlike.optim.ZeroRedundancyOptimizer: under DataParallel it trains the model of the unsharded
torch optimizer bit for bit (schedulers, parameter groups, GradScaler, closures) at every size,
each rank holding only its shard's state; state dicts and checkpoints move between it and plain
torch optimizers at any world size; bad input raises on every rank."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _helpers import raises_on_every_rank
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer, ZeroRedundancyOptimizer
from heatlike.optim.zero import partition
from heatlike.utils import checkpoint

pytestmark = pytest.mark.mpi

COMM = hl.MPI_WORLD


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 1, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _groups(net: nn.Module) -> list[dict]:
    """Two groups: the convolution and batch norm at a tenth of the rate, the rest."""
    return [{"params": list(net[0].parameters()) + list(net[1].parameters()), "lr": 0.001},
            {"params": list(net[4].parameters()) + list(net[6].parameters())}]


def _train(opt_of, steps: int = 5, scaler: bool = False, closure: bool = False,
           start: int = 0, net=None, opt=None, sched=None):
    net = _net() if net is None else net
    opt = opt_of(net) if opt is None else opt
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if sched is None else sched
    model = DataParallel(net, COMM)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    for step in range(start, start + steps):
        x, y = _batch(step, COMM.rank)

        def loss_fn(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            (grad_scaler.scale(loss) if scaler else loss).backward()
            return loss
        if closure:
            opt.step(loss_fn)
        else:
            loss_fn()
            if scaler:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
        sched.step()
    model.close()
    return net, opt, sched


def _same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", ["adam", "sgd-momentum"])
@pytest.mark.parametrize("how", ["step", "closure", "grad-scaler"])
def test_the_model_of_the_unsharded_optimizer_bit_for_bit(kind, how):
    cls, kwargs = (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}) if kind == "adam" \
        else (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    options = {"closure": how == "closure", "scaler": how == "grad-scaler"}
    plain, _, _ = _train(lambda net: cls(_groups(net), **kwargs), **options)
    sharded, opt, _ = _train(lambda net: ZeroRedundancyOptimizer(_groups(net), cls, **kwargs),
                             **options)
    _same(sharded, plain)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * 0.25)  # the scheduler's, seen
    if kind == "adam":
        assert opt.param_groups[1]["betas"] == (0.9, 0.999)  # the local optimizer's defaults


def test_each_rank_holds_its_shard_only():
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
    _train(None, steps=1, net=net, opt=opt)
    index = {id(p): i for i, p in enumerate(net.parameters())}
    mine = sorted(index[id(p)] for p in opt.owned)
    assert {index[id(p)] for p in opt.state} == set(mine)
    everyone = COMM.allgather(mine)
    assert sorted(i for shard in everyone for i in shard) == list(range(len(index)))
    sizes = [sum(p.numel() for p in net.parameters() if index[id(p)] in shard)
             for shard in everyone]
    largest = max(p.numel() for p in net.parameters())
    assert max(sizes) - min(sizes) <= largest  # the greedy rule's bound
    assert all(opt.owner(p) == r for r, shard in enumerate(everyone) for p in net.parameters()
               if index[id(p)] in shard)


def test_partition_is_torch_s_greedy_rule():
    assert partition([10, 30, 20, 5], 2) == [1, 0, 1, 0]  # 30, 20, 10, then a tie: rank 0
    assert partition([4, 4, 4], 4) == [0, 1, 2]  # a rank may own nothing
    totals = [0, 0]
    assert partition([8], 2, totals) == [0] and partition([8, 1], 2, totals) == [1, 0]


def test_state_dicts_are_the_plain_optimizer_s():
    plain, plain_opt, _ = _train(lambda net: torch.optim.Adam(_groups(net), lr=0.01))
    _, opt, _ = _train(lambda net: ZeroRedundancyOptimizer(_groups(net), torch.optim.Adam,
                                                           lr=0.01))
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    root = COMM.size - 1
    opt.consolidate_state_dict(to=root)
    if COMM.rank == root:
        got, expected = opt.state_dict(), plain_opt.state_dict()
        assert got["param_groups"] == expected["param_groups"]
        assert got["state"].keys() == expected["state"].keys()
        for i, state in expected["state"].items():
            for k, v in state.items():
                assert torch.equal(got["state"][i][k], v), (i, k)
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
    opt.consolidate_state_dict(to=None)
    assert opt.state_dict()["state"].keys() == plain_opt.state_dict()["state"].keys()


def test_a_plain_state_dict_loads_and_training_continues_as_the_plain_optimizer():
    """A plain Adam's state (any world size saved it) into the sharded optimizer and back."""
    plain, plain_opt, plain_sched = _train(lambda net: torch.optim.Adam(_groups(net), lr=0.01))
    net = _net()
    net.load_state_dict(plain.state_dict())
    opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.Adam, lr=0.01)
    opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))  # torch shares loaded tensors
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    sched.load_state_dict(plain_sched.state_dict())
    _train(None, steps=3, start=5, net=net, opt=opt, sched=sched)
    _train(None, steps=3, start=5, net=plain, opt=plain_opt, sched=plain_sched)
    _same(net, plain)
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def test_a_checkpoint_resumes_bitwise_and_loads_into_a_plain_optimizer(tmp_path):
    path = Path(COMM.handle.bcast(str(tmp_path / "zero.ckpt"), root=0))
    make = lambda net: ZeroRedundancyOptimizer(_groups(net), torch.optim.Adam, lr=0.01)  # noqa
    whole, _, _ = _train(make, steps=6)
    net, opt, sched = _train(make, steps=3)
    checkpoint.save(path, net, opt, scheduler=sched)
    _train(None, steps=2, start=3, net=net, opt=opt, sched=sched)  # moves away from the save
    checkpoint.load(path, net, opt, scheduler=sched)
    _train(None, steps=3, start=3, net=net, opt=opt, sched=sched)
    _same(net, whole)
    plain_net = _net()
    plain_opt = torch.optim.Adam(_groups(plain_net), lr=0.01)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain_opt, 2, 0.5)
    checkpoint.load(path, plain_net, plain_opt, scheduler=plain_sched)
    _train(None, steps=3, start=3, net=plain_net, opt=plain_opt, sched=plain_sched)
    _same(plain_net, whole)


def test_a_group_added_later_is_sharded_too():
    net, more = _net(), nn.Linear(3, 3)
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    opt.add_param_group({"params": more.parameters(), "lr": 0.01})
    everyone = COMM.allgather(sorted(id(p) == id(more.weight) for p in opt.owned))
    assert sum(True in shard for shard in everyone) == 1
    x = torch.randn(2, 3)
    more(x).sum().backward()
    for p in more.parameters():
        COMM.Allreduce(hl.IN_PLACE, p.grad)
    before = more.weight.detach().clone()
    opt.step()
    torch.testing.assert_close(more.weight, before - 0.01 * more.weight.grad)
    weights = torch.stack(COMM.allgather(more.weight.detach()))
    assert (weights == weights[0]).all()


def test_bad_input_raises_on_every_rank():
    params = list(_net().parameters())
    last = COMM.rank == COMM.size - 1
    raises_on_every_rank(COMM, TypeError, lambda: ZeroRedundancyOptimizer(
        params, "Adam" if last else torch.optim.Adam, lr=0.1), "optimizer_class")
    raises_on_every_rank(COMM, TypeError, lambda: ZeroRedundancyOptimizer(
        params, hl.optim.CentralizedSGD if last else torch.optim.SGD, lr=0.1), "local torch")
    raises_on_every_rank(COMM, ValueError, lambda: ZeroRedundancyOptimizer(
        params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1), "overlap_with_ddp")
    raises_on_every_rank(COMM, ValueError, lambda: ZeroRedundancyOptimizer(
        params, torch.optim.SGD, lr=-1.0 if last else 0.1), "learning rate")
    raises_on_every_rank(COMM, ValueError, lambda: ZeroRedundancyOptimizer(
        (params[:-1] if last else params) if COMM.size > 1 else [], torch.optim.SGD, lr=0.1),
        "empty parameter list" if COMM.size == 1 else "differs between ranks")
    # torch's own RuntimeError for a keyword combination, on one rank (the others waited)
    raises_on_every_rank(COMM, RuntimeError, lambda: ZeroRedundancyOptimizer(
        params, torch.optim.Adam, lr=0.1, **({"fused": True, "foreach": True} if last else {})),
        "cannot be `True` together")
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="synchronizes itself"):
        DataParallelOptimizer(zero)
    with pytest.raises(ValueError, match="root must be a rank"):
        zero.consolidate_state_dict(to=COMM.size)


def test_an_error_in_one_rank_s_local_step_raises_on_every_rank():
    """The owner of a parameter alone steps it: its error (here a hook of its local optimizer)
    must not leave the other ranks waiting for its shard."""
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    _train(None, steps=1, net=net, opt=opt)
    if COMM.rank == COMM.size - 1:
        def refuse(*_):
            raise RuntimeError("this rank's optimizer refuses")
        handle = opt.optim.register_step_pre_hook(refuse)
    raises_on_every_rank(COMM, RuntimeError, opt.step,
                         "refuses" if COMM.size == 1 else f"on rank {COMM.size - 1}")
    if COMM.rank == COMM.size - 1:
        handle.remove()
    opt.step()  # in step again


def test_schedulers_that_cycle_momentum_see_the_local_defaults():
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
    assert opt.defaults["betas"] == (0.9, 0.999)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    plain_net = _net()
    plain = torch.optim.Adam(plain_net.parameters(), lr=0.01)
    plain_sched = torch.optim.lr_scheduler.OneCycleLR(plain, max_lr=0.1, total_steps=10)
    _train(None, steps=3, net=net, opt=opt, sched=sched)
    _train(None, steps=3, net=plain_net, opt=plain, sched=plain_sched)
    _same(net, plain_net)
    assert opt.param_groups[0]["betas"] == plain.param_groups[0]["betas"]


def test_a_model_converted_after_construction_is_re_planned():
    """model.double() on every rank: the shards travel as float64 (as with plain SGD); on one
    rank only: RuntimeError on every rank."""
    net, plain_net = _net(), _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(plain_net.parameters(), lr=0.1)
    net.double()
    plain_net.double()
    for model, o in ((net, opt), (plain_net, plain)):
        for step in range(2):
            x, y = _batch(step, COMM.rank)
            o.zero_grad()
            nn.functional.cross_entropy(model(x.double()), y).backward()
            for p in model.parameters():
                COMM.Allreduce(hl.IN_PLACE, p.grad)
                p.grad /= COMM.size
            o.step()
    _same(net, plain_net)
    if COMM.size > 1:
        if COMM.rank == 0:
            net.float()
        raises_on_every_rank(COMM, RuntimeError, opt.step, "differ between the ranks")


def test_state_dict_hooks_run_and_a_copy_is_refused():
    opt = ZeroRedundancyOptimizer(_net().parameters(), torch.optim.Adam, lr=0.01)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    opt.consolidate_state_dict(to=None)
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "load-pre", "load-post"]
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        copy.deepcopy(opt)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_more_bad_input_raises_on_every_rank():
    net = _net()
    params = list(net.parameters())
    last = COMM.rank == COMM.size - 1
    raises_on_every_rank(COMM, ValueError, lambda: ZeroRedundancyOptimizer(
        params, torch.optim.LBFGS if last else torch.optim.SGD, lr=0.1), "closure")
    raises_on_every_rank(COMM, ValueError, lambda: ZeroRedundancyOptimizer(
        params + params[:1] if last else params, torch.optim.SGD, lr=0.1), "twice")
    opt = ZeroRedundancyOptimizer(params[:2], torch.optim.SGD, lr=0.1)
    extra = nn.Linear(2, 2)
    raises_on_every_rank(COMM, ValueError, lambda: opt.add_param_group(
        {"params": [params[0]] if last else list(extra.parameters())}), "")
    assert len(opt.param_groups) == 1  # added nowhere
    if COMM.size > 1:
        raises_on_every_rank(COMM, ValueError, lambda: opt.consolidate_state_dict(
            to=None if last else 0), "differs between ranks")


def test_large_parameters_travel_in_place_and_small_ones_packed():
    """Parameters of 256 KiB or more are broadcast where they are, the rest packed; a
    channels_last (not contiguous) large one is packed: all equal to plain Adam's, on every
    rank."""
    torch.manual_seed(3)
    shapes = [(300, 300), (7,), (256, 300), (3, 5)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ours.append(nn.Parameter(torch.randn(64, 32, 4, 4).to(memory_format=torch.channels_last)))
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = ZeroRedundancyOptimizer(ours, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(theirs, lr=0.01)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        plain.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
