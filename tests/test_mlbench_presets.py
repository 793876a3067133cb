"""The mlbench-core ports: linear presets equal one process with the combined batch; compressed
ones do what their math says; every mlbench bug listed in ANCHORS is fixed."""

import copy
import math

import pytest
import torch
from torch import nn

import heatlike as hl
from heatlike import aggregation as agg
from heatlike import optim
from heatlike.engine import Cast

pytestmark = pytest.mark.mpi
B = 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _net(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12, bias=bias), nn.Tanh(), nn.Linear(12, 3, bias=bias))


def _data(step, n):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_everywhere(comm, model):
    mine = _flat(model)
    everyone = torch.empty(comm.size * mine.numel(), dtype=mine.dtype)
    comm.Allgather(mine, everyone)
    assert all(torch.equal(o, mine) for o in everyone.view(comm.size, -1))


def _compare(comm, make_dist, make_ref, steps=3, tol=TOL, loss_scale=1.0, step_kwargs=None):
    """Train a distributed preset and its single-process reference on the same data."""
    P, r = comm.size, comm.rank
    ref_net = _net()
    net = _net(seed=100 + r)  # the preset makes the replicas equal
    if r == 0:
        net.load_state_dict(ref_net.state_dict())
    dist = make_dist(net)
    ref = make_ref(ref_net)
    mine = slice(r * B, (r + 1) * B)
    for step in range(steps):
        x, y = _data(step, P * B)
        ref.zero_grad()
        (loss_scale * nn.functional.cross_entropy(ref_net(x), y)).backward()
        ref.step()
        dist.zero_grad()
        nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
        dist.step(**(step_kwargs or {}))
        torch.testing.assert_close(_flat(net), _flat(ref_net), **tol, msg=f"step {step}")
    _same_everywhere(comm, net)
    return dist


@pytest.mark.parametrize("by_layer", [False, True], ids=["by-model", "by-layer"])
@pytest.mark.parametrize("agg_grad", [True, False], ids=["gradients", "weights"])
def test_centralized_sgd(comm, by_layer, agg_grad):
    _compare(comm,
             lambda m: optim.CentralizedSGD(model=m, lr=0.1, momentum=0.9, weight_decay=0.01,
                                            by_layer=by_layer, agg_grad=agg_grad, comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01))


def test_centralized_adam(comm):
    _compare(comm, lambda m: optim.CentralizedAdam(model=m, lr=0.01, comm=comm),
             lambda m: torch.optim.Adam(m.parameters(), lr=0.01))


def test_custom_centralized_clipping_and_averaging(comm):
    """Clipping applies to the aggregated gradient; custom denominators scale it."""
    P = comm.size
    _compare(comm,
             lambda m: optim.CustomCentralizedOptimizer(
                 m, None, torch.optim.SGD(m.parameters(), lr=0.3), grad_clip=0.05,
                 average_world=True, comm=comm),
             lambda m: _ClipSGD(m, 0.3, 0.05))
    _compare(comm,
             lambda m: optim.CustomCentralizedOptimizer(
                 m, None, torch.optim.SGD(m.parameters(), lr=0.1), average_custom=True,
                 divide_before=True, comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
             loss_scale=P / (2 * P), step_kwargs={"denom": 2 * P})
    _compare(comm,  # plain sum: P times the average
             lambda m: optim.CustomCentralizedOptimizer(
                 m, None, torch.optim.SGD(m.parameters(), lr=0.05), comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.05), loss_scale=P)


class _ClipSGD:
    def __init__(self, model, lr, clip):
        self.model, self.clip = model, clip
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()


def test_bf16_cast_codec_within_tolerance(comm):
    _compare(comm, lambda m: optim.CentralizedSGD(model=m, lr=0.1, comm=comm,
                                                  codec=Cast(torch.bfloat16)),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.1), tol=dict(rtol=2e-2, atol=2e-3))


def test_powersgd_full_rank_equals_exact_averaging(comm):
    _compare(comm, lambda m: optim.PowerSGD(model=m, lr=0.1, momentum=0.9, rank=64, comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
             tol=dict(rtol=1e-4, atol=1e-5))


def test_powersgd_low_rank_error_feedback(comm):
    """Rank 1: applied gradients differ from the true ones, but the residual keeps the
    difference; no global RNG reseeding; compression happens at world size 1 too."""
    net = _net(bias=False)  # a model without 1-D tensors (mlbench's PowerAggregation crashed)
    opt = optim.PowerSGD(model=net, lr=0.0, rank=1, comm=comm)
    rng = torch.get_rng_state()
    x, y = _data(0, B)
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    true = [p.grad.clone() for p in net.parameters()]  # before averaging: local gradients
    assert not any(torch.equal(t, torch.zeros_like(t)) for t in true)
    opt.step()
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG was touched"
    residual = opt.sync.codec.state_for(0)["residual"]
    assert residual.abs().sum() > 0  # rank-1 approximation of 12x6 and 3x12 matrices


def test_sparsified_sgd_memory_and_estimate(comm):
    """SparsifiedSGD: user initialization kept, any shape, lr applied; sent + memory = lr*g;
    the estimated weights follow Stich et al.'s weights."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.full((3, 4, 2), 3.0)), nn.Parameter(torch.full((5,), -1.0))]
    opt = optim.SparsifiedSGD(params, lr=0.5, sparse_grad_size=4, comm=comm)
    assert all(bool((p == v).all()) for p, v in zip(params, (3.0, -1.0)))
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(comm.rank + i))
             for i, p in enumerate(params)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    before = [p.detach().clone() for p in params]
    opt.step()
    for b, (p, g) in enumerate(zip(params, grads)):
        bucket = next(k.index for k in opt.sync.buckets if k.params[0] is p)
        memory = opt.sync.codec.state_for(bucket)["residual"]
        sent = 0.5 * g.reshape(-1) - memory
        assert int((sent != 0).sum()) == min(4, p.numel())
        total = sent.clone()
        comm.Allreduce(hl.IN_PLACE, total)
        expected = before[b].reshape(-1) - total / comm.size
        torch.testing.assert_close(p.detach().reshape(-1), expected)
    est = opt.get_estimated_weights()
    torch.testing.assert_close(est[0], params[0].detach())  # rho_0 = 1
    opt.update_estimated_weights(1, 4)
    tau = 24 / 4
    rho = 6 * (1 + tau) ** 2 / (2 * (6 * tau ** 2 + 1 + 6 * tau + 2))
    expected = (1 - rho) * params[0].detach() + rho * params[0].detach()
    torch.testing.assert_close(opt.get_estimated_weights()[0], expected)


def test_centralized_sparsified_sgd_sends_k_per_tensor(comm):
    net = _net()
    opt = optim.CentralizedSparsifiedSGD(net.parameters(), lr=0.1, sparse_grad_size=5,
                                         random_sparse=True, comm=comm)
    x, y = _data(comm.rank, B)
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    per_tensor = [min(5, p.numel()) for p in net.parameters()]
    # (index, value) pairs and one float32 non-finite marker per tensor
    assert opt.sync.bytes_sent == sum(k * 8 + 4 for k in per_tensor)
    _same_everywhere(comm, net)


def test_sign_sgd_majority_vote(comm):
    net = _net()
    opt = optim.SignSGD(net.parameters(), lr=0.01, comm=comm)
    before = _flat(net)
    x, y = _data(comm.rank, B)
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    mine = torch.cat([torch.where(p.grad >= 0, 1.0, -1.0).reshape(-1) for p in net.parameters()])
    votes = mine.clone()
    comm.Allreduce(hl.IN_PLACE, votes)
    opt.step()
    torch.testing.assert_close(_flat(net), before - 0.01 * torch.sign(votes))
    # one bit per value and one float32 non-finite marker per tensor
    assert opt.sync.bytes_sent == sum(math.ceil(p.numel() / 8) + 4 for p in net.parameters())


def test_decentralized_sgd_gossip(comm):
    """lr 0, different models: gossip keeps the average and shrinks the consensus distance;
    rank 0 is a rank like any other."""
    net = _net(seed=comm.rank)
    neighbors = sorted({(comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size} - {comm.rank})
    opt = optim.DecentralizedSGD(rank=comm.rank, neighbors=neighbors, model=net, lr=0.0,
                                 comm=comm, sync_initial=False)
    mean = _flat(net).double()
    comm.Allreduce(hl.IN_PLACE, mean)
    d0 = optim.consensus_distance(net, comm)
    for _ in range(4):
        opt.zero_grad()
        opt.step()
    mean_after = _flat(net).double()
    comm.Allreduce(hl.IN_PLACE, mean_after)
    torch.testing.assert_close(mean_after, mean, rtol=1e-6, atol=1e-6)
    d4 = optim.consensus_distance(net, comm)
    if comm.size > 1:
        assert d4 < 0.5 * d0
    else:
        assert d0 == d4 == 0.0


def test_fp16_optimizer_skips_together(comm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).half()
    fp = optim.FP16Optimizer(model, average_world=True, init_scale=256, scale_window=2,
                             comm=comm)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
    for step in range(4):
        x, y = _data(step, B)
        fp.zero_grad()
        fp.backward_loss(nn.functional.cross_entropy(model(x.half()).float(), y))
        if step == 1 and comm.rank == comm.size - 1:
            model[0].weight.grad[0, 0] = float("inf")
        before = fp.fp32_params.detach().clone()
        updated = fp.step()
        if step == 1:
            assert not updated and torch.equal(fp.fp32_params, before)
            assert fp.loss_scale == 128
        else:
            assert updated and not torch.equal(fp.fp32_params, before)
    assert fp.loss_scale == 256  # two clean steps after the backoff: grown again
    _same_everywhere(comm, model)
    with pytest.raises(ValueError, match="fp32_params"):
        fp.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_aggregation_api(comm):
    P = comm.size
    reference = _net()
    model = copy.deepcopy(reference)
    x, y = _data(comm.rank, B)
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    everyone = []
    for g in grads:
        all_g = torch.empty(P * g.numel())
        comm.Allgather(g.reshape(-1).contiguous(), all_g)
        everyone.append(all_g.view(P, *g.shape))
    a = agg.AllReduceAggregation(comm=comm)
    for by_layer in (False, True):
        for op, ref in (("avg", lambda e: e.mean(0)), ("sum", lambda e: e.sum(0)),
                        ("max", lambda e: e.amax(0)), ("custom_avg", lambda e: e.sum(0) / 3)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            a.agg_grad(by_layer)(model, op, denom=3 if op == "custom_avg" else None)
            for p, e in zip(model.parameters(), everyone):
                torch.testing.assert_close(p.grad, ref(e), msg=f"{op} by_layer={by_layer}")
    # None gradients (mlbench's pack_tensors crashed): stay None where no rank had one
    for p in model.parameters():
        p.grad = None
    model[2].weight.grad = torch.ones_like(model[2].weight) if comm.rank == 0 else None
    agg.AllReduceAggregationHVD(comm=comm).agg_grad()(model, "avg")
    assert model[0].weight.grad is None and model[2].bias.grad is None
    torch.testing.assert_close(model[2].weight.grad, torch.full_like(model[2].weight, 1 / P))
    # weights: average; gossip keeps the average
    w = _net(seed=comm.rank)
    mean = _flat(w)
    comm.Allreduce(hl.IN_PLACE, mean)
    agg.DecentralizedAggregation(comm.rank, None, comm=comm).agg_model()(w)
    after = _flat(w)
    comm.Allreduce(hl.IN_PLACE, after)
    torch.testing.assert_close(after, mean, rtol=1e-5, atol=1e-5)
    a.agg_model(by_layer=True)(w, "avg")
    _same_everywhere(comm, w)
    t = torch.full((5,), float(comm.rank))
    assert torch.equal(a._agg(t, "max"), torch.full((5,), float(P - 1)))
    with pytest.raises(ValueError, match="op"):
        a._agg(t, "median")


def test_power_and_sparsified_aggregation(comm):
    model = _net(bias=False)
    x, y = _data(comm.rank, B)
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    exact = [g.clone() for g in grads]
    for g in exact:
        comm.Allreduce(hl.IN_PLACE, g)
        g /= comm.size
    agg.PowerAggregation(model, rank=64, comm=comm).agg_grad()(model, "avg")
    for p, e in zip(model.parameters(), exact):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    s = agg.SparsifiedAggregation(model, k=3, comm=comm)
    s.agg_grad(by_layer=True)(model, "avg")
    assert s.codec.name == "topk-3"


def test_bad_input(comm):
    net = _net()
    with pytest.raises(TypeError, match="lr is required"):
        optim.CentralizedSGD(model=net, comm=comm)
    with pytest.raises(ValueError, match="world_size"):
        optim.CentralizedSGD(world_size=comm.size + 1, model=net, lr=0.1, comm=comm)
    with pytest.raises(TypeError, match="model"):
        optim.CentralizedSGD(model="net", lr=0.1, comm=comm)
    with pytest.raises(TypeError, match="optimizer"):
        optim.CustomCentralizedOptimizer(net, None, "sgd", comm=comm)
    with pytest.raises(ValueError, match="one of"):
        optim.CustomCentralizedOptimizer(net, None, torch.optim.SGD(net.parameters(), lr=1),
                                         average_world=True, average_custom=True, comm=comm)
    with pytest.raises(ValueError, match="rank"):
        optim.PowerSGD(model=net, lr=0.1, rank=0, comm=comm)
    with pytest.raises(ValueError, match="sparse_grad_size"):
        optim.SparsifiedSGD(net.parameters(), lr=0.1, sparse_grad_size=0, comm=comm)
    with pytest.raises(ValueError, match="rank="):
        optim.DecentralizedSGD(rank=comm.rank + 1, model=net, lr=0.1, comm=comm)
    c = optim.CustomCentralizedOptimizer(net, None, torch.optim.SGD(net.parameters(), lr=1),
                                         average_custom=True, comm=comm)
    with pytest.raises(ValueError, match="denom"):
        c.step()


_DIGITS = {}


@pytest.mark.mpi(min_size=4)
@pytest.mark.mpi_timeout(150)
@pytest.mark.parametrize("name", sorted(__import__("heatlike.bench.workloads",
                                                   fromlist=["ALGORITHMS"]).ALGORITHMS))
def test_every_algorithm_learns_digits(comm, name):
    """At 4 ranks every algorithm reaches >= 0.93 test accuracy on the digits in 8 epochs."""
    from heatlike.bench.workloads import load_digits_split, train_digits

    if comm.size != 4:
        pytest.skip("the accuracy check runs at 4 ranks")
    data = _DIGITS.setdefault("data", load_digits_split(0))
    result = train_digits(name, comm, epochs=8, data=data)
    assert result.accuracy >= 0.93, f"{name}: {result.accuracy:.4f}"
