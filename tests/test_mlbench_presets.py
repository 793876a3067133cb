"""The mlbench-core ports: linear presets equal one process with the combined batch; compressed
ones do what their math says; every mlbench bug listed in ANCHORS is fixed."""

import copy
import gc
import math

import pytest
import torch
from _helpers import SparseEmbedding
from torch import nn

import heatlike as hl
from heatlike import aggregation as agg
from heatlike import optim
from heatlike.engine import Cast, RandomK, Sign, Threshold, TopK
from heatlike.engine.codecs import Clipped

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


@pytest.mark.parametrize("reducer", ["flat", "hierarchical"])
def test_large_gradients_are_summed_in_place_by_both_all_reduces(comm, monkeypatch, reducer):
    """CentralizedSGD's large gradients get buckets of their own and are summed where backward
    left them (``.grad`` is still the tensor backward made), with the flat all-reduce and with
    ``Hierarchical``'s three phases alike (on emulated or real nodes in the matrix), so its
    buckets complete during the backward pass as DataParallel's do; the model equals one
    process with the combined batch."""
    from heatlike.core.topology import get_topology
    from heatlike.engine import gradsync
    from heatlike.engine.reducers import AllReduce, Hierarchical

    monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES", 64)  # the 12x6 and 3x12 weights
    made = {}

    def make(m):
        red = (Hierarchical(comm, topology=get_topology(comm)) if reducer == "hierarchical"
               else AllReduce(comm))
        opt = optim.CentralizedSGD(model=m, lr=0.1, momentum=0.9, comm=comm, reducer=red)
        m[0].weight.register_post_accumulate_grad_hook(
            lambda p: made.__setitem__("w", p.grad.data_ptr()))
        return opt

    opt = _compare(comm, make, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    several = comm.size > 1
    assert sum(opt.sync._solo) == (2 if several else 0)
    if several:
        assert opt.model[0].weight.grad.data_ptr() == made["w"]
    opt.close()


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


def test_powersgd_warmup_steps_average_exactly_then_compress(comm):
    """warmup_steps=2: the first two steps are the single-process step on the combined batch
    (an exact average, no residual), the third is compressed (rank 1 of 12 x 6 and 3 x 12
    matrices: no longer that step, and a residual is kept)."""
    dist = _compare(comm, lambda m: optim.PowerSGD(model=m, lr=0.1, momentum=0.9, rank=1,
                                                   comm=comm, warmup_steps=2),
                    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=2)
    assert repr(dist.sync.codec) == "warmup-2-powersgd-1"
    assert not any(dist.sync.codec.states.values()), "state kept before compressing"
    net = dist.model
    x, y = _data(2, comm.size * B)
    mine = slice(comm.rank * B, (comm.rank + 1) * B)
    dist.zero_grad()
    nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
    dist.step()
    assert dist.sync.codec.state_for(0)["residual"].abs().sum() > 0
    _same_everywhere(comm, net)
    with pytest.raises(ValueError, match="warmup_steps"):
        optim.PowerSGD(model=_net(), lr=0.1, comm=comm, warmup_steps=-1)
    with pytest.raises(ValueError, match="not both"):
        optim.PowerSGD(model=_net(), lr=0.1, comm=comm, warmup_steps=2,
                       codec=hl.engine.TopK(k=2))


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


def _memory(opt, p):
    """A sparsified preset's memory of parameter ``p`` (its codec's residual of that tensor)."""
    bucket = opt.sync.buckets[opt.sync.buckets_of([p])[0]]
    i = next(j for j, q in enumerate(bucket.params) if q is p)
    return opt.sync.codec.state_for(bucket.index)[i]["residual"]


def test_sparsified_sgd_memory(comm):
    """SparsifiedSGD: user initialization kept, any shape, lr applied; sent + memory = lr*g."""
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
        memory = _memory(opt, p)
        sent = 0.5 * g.reshape(-1) - memory
        assert int((sent != 0).sum()) == min(4, p.numel())
        total = sent.clone()
        comm.Allreduce(hl.IN_PLACE, total)
        expected = before[b].reshape(-1) - total / comm.size
        torch.testing.assert_close(p.detach().reshape(-1), expected)


def _rho(t, tau):
    return 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau ** 2 + t + 6 * tau * t + 2 * t ** 2))


def test_sparsified_sgd_estimated_weights_follow_the_loop(comm):
    """mlbench's protocol: step() leaves the estimated weights alone; the loop's
    update_estimated_weights(t, k) after each step gives Stich et al.'s weighted average
    (computed here in float64 from the iterates)."""
    net = _net()
    opt = optim.SparsifiedSGD(net.parameters(), lr=0.2, sparse_grad_size=7, comm=comm)
    est = [p.detach().double().clone() for p in net.parameters()]
    for t in range(4):
        x, y = _data(t, B)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        held = [e.clone() for e in opt.get_estimated_weights()]
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(held, opt.get_estimated_weights()))
        opt.update_estimated_weights(t, 7)
        for e, p in zip(est, net.parameters()):
            rho = _rho(t, p.numel() / min(7, p.numel()))
            e.mul_(1 - rho).add_(p.detach().double(), alpha=rho)
    for e, got in zip(est, opt.get_estimated_weights()):
        torch.testing.assert_close(got.double(), e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("random_sparse", [False, True], ids=["block", "random"])
def test_sparsified_sgd_sparsify_gradients_protocol(comm, random_sparse):
    """The documented sparsify_gradients(param, lr): the loop gathers every rank's coordinates,
    writes their average into .grad and calls step(), which applies it without communicating;
    the model is the one step() alone gives (the same coordinates)."""
    k, lr = 5, 0.3
    auto, manual = _net(), _net()
    a = optim.SparsifiedSGD(auto.parameters(), lr=lr, sparse_grad_size=k, comm=comm,
                            random_sparse=random_sparse)
    m = optim.SparsifiedSGD(manual.parameters(), lr=lr, sparse_grad_size=k, comm=comm,
                            random_sparse=random_sparse)
    for t in range(3):
        x, y = _data(10 * t + comm.rank, B)
        for net, opt in ((auto, a), (manual, m)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        a.step()
        for p in manual.parameters():
            sparse = m.sparsify_gradients(p, lr)
            kp = min(k, p.numel())
            assert sparse.shape == ((2, kp) if random_sparse else (1, kp + 1))
            everyone = torch.empty(comm.size * sparse.numel(), dtype=sparse.dtype)
            comm.Allgather(sparse.reshape(-1).contiguous(), everyone)
            update = torch.zeros(p.numel(), dtype=torch.float64)
            for s in everyone.view(comm.size, *sparse.shape):
                if random_sparse:
                    update.index_add_(0, s[0].long(), s[1])
                else:
                    start = int(s[0, 0])
                    update[start:start + kp] += s[0, 1:]
            p.grad = (update / comm.size).to(p.dtype).view(p.shape)
        m.step()
        for pa, pm in zip(auto.parameters(), manual.parameters()):
            torch.testing.assert_close(pm, pa, rtol=1e-6, atol=1e-7)
    _same_everywhere(comm, manual)


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


@pytest.mark.parametrize("random_sparse", [False, True], ids=["blocks", "coordinates"])
def test_sparsified_updates_touch_only_their_coordinates(comm, random_sparse):
    """A sparsified step applies exactly -(sum of every rank's sent coordinates) / P, through
    the combined update's support only (each rank's own choice of coordinates: a block or
    indices, which may coincide between ranks); the other coordinates stay bitwise equal."""
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(4000))
    opt = optim.CentralizedSparsifiedSGD([w], lr=0.5, sparse_grad_size=10,
                                         random_sparse=random_sparse, comm=comm)
    g = torch.randn(4000, generator=torch.Generator().manual_seed(comm.rank))
    before = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    assert opt.sync.support_of(w) is not None, "the update's support is not used"
    memory = _memory(opt, w)
    sent = 0.5 * g - memory
    total = sent.clone()
    comm.Allreduce(hl.IN_PLACE, total)
    torch.testing.assert_close(w.detach(), before - total / comm.size)
    untouched = total == 0
    assert torch.equal(w.detach()[untouched], before[untouched])
    assert torch.equal(w.grad, g)  # the user's gradient is given back


def test_sign_sgd_majority_vote(comm):
    net = _net()
    opt = optim.SignSGD(net.parameters(), lr=0.01, comm=comm)
    before = _flat(net)
    x, y = _data(comm.rank, B)
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    mine = torch.cat([torch.sign(p.grad).reshape(-1) for p in net.parameters()])
    votes = mine.clone()
    comm.Allreduce(hl.IN_PLACE, votes)
    opt.step()
    torch.testing.assert_close(_flat(net), before - 0.01 * torch.sign(votes))
    # dense gradients without exact zeros: one bit per value and one float32 marker per bucket,
    # the tensors sharing one bucket (one collective per step, not one per tensor)
    assert len(opt.sync.buckets) == 1
    assert opt.sync.bytes_sent == math.ceil(sum(p.numel() for p in net.parameters()) / 8) + 4


def test_sign_sgd_zero_and_missing_gradients_cast_no_vote(comm):
    """sign(0) = 0 and a rank without a gradient for a parameter does not vote on it (mlbench's
    SignSGD counted both as +1: at 3 ranks a coordinate where only rank 0 has gradient -1 moved
    the wrong way, and zero-gradient coordinates drifted by -lr every step)."""
    P, r, lr = comm.size, comm.rank, 0.1
    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (4, 3, 2))
    opt = optim.SignSGD([a, b, c], lr=lr, comm=comm)

    def grad_a(rank):  # coord 0: only rank 0 has an opinion; 1: nobody; 2: alternating; 3: all
        return torch.tensor([-1.0 if rank == 0 else 0.0, 0.0, 1.0 if rank % 2 == 0 else -1.0,
                             2.0])

    a.grad = grad_a(r)
    b.grad = torch.tensor([1.0, -1.0, 0.0]) if r == 0 else None  # only rank 0 has one
    opt.step()
    votes = sum(torch.sign(grad_a(q)) for q in range(P))
    torch.testing.assert_close(a.detach(), -lr * torch.sign(votes))
    assert a[0].item() == pytest.approx(lr) and a[1].item() == 0.0
    torch.testing.assert_close(b.detach(), torch.tensor([-lr, lr, 0.0]))
    assert torch.equal(c.detach(), torch.zeros(2)) and c.grad is None
    assert torch.equal(a.grad, grad_a(r))  # the caller's gradients are left as they were
    _same_everywhere(comm, nn.ParameterList([a, b, c]))


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


def test_aggregation_arguments_are_checked_on_every_rank(comm):
    """min/max of what PowerSGD or top-k send is not the elementwise min/max (it was silently
    wrong); an invalid denom on one rank, or different ops or denoms on different ranks, raise
    ValueError on every rank before anything is sent (one rank raised, the others matched its
    next call and then hung)."""
    model = nn.Linear(3, 4, bias=False)
    for make in (lambda: agg.PowerAggregation(rank=3, comm=comm),
                 lambda: agg.SparsifiedAggregation(k=2, comm=comm)):
        for op in ("max", "min"):
            model.weight.grad = torch.randn(4, 3)
            with pytest.raises(ValueError, match=f"op='{op}' takes the elementwise"):
                make().agg_grad()(model, op)
    a = agg.AllReduceAggregation(comm=comm)
    last = comm.rank == comm.size - 1
    t = torch.ones(5)
    with pytest.raises(ValueError, match="needs a positive denom"):
        a._agg(t, agg.AVG_CUSTOM, denom=0.0 if last else 2.0)
    if comm.size > 1:
        with pytest.raises(ValueError, match="different arguments"):
            a._agg(t, agg.AVG_CUSTOM, denom=3.0 if last else 2.0)
        with pytest.raises(ValueError, match="different arguments"):
            a.agg_grad()(model, "max" if last else "avg")
    assert torch.equal(t, torch.ones(5))
    assert torch.equal(a._agg(t, "sum"), torch.full((5,), float(comm.size)))  # still in step


def test_each_new_model_gets_a_plan_of_its_own_on_every_rank(comm):
    """An aggregation keeps a plan per model. A model built where a freed one was (Python
    reuses the address, so the id, on some ranks) is aggregated with its own parameters on every
    rank (its gradients were left alone where the freed model's plan was reused, and ranks
    that built a plan waited in a collective the others skipped)."""
    aggregate = agg.AllReduceAggregation(comm=comm).agg_grad()
    for trial in range(12):
        model = nn.Linear(3, 2, bias=False)
        model.weight.grad = torch.full((2, 3), float(comm.rank + trial))
        aggregate(model, "avg")
        expected = sum(r + trial for r in range(comm.size)) / comm.size
        assert torch.equal(model.weight.grad, torch.full((2, 3), float(expected))), trial
        del model
        gc.collect(0)  # the next model often lands at the freed one's address


def test_one_tensor_aggregation_keeps_memory_per_key(comm):
    """``_agg(data, op, key=...)``: top-k with error feedback keeps a residual per key; without a
    key nothing is carried over (the residual of one tensor came back in another of the same
    size)."""
    s = agg.SparsifiedAggregation(k=1, comm=comm)
    first = torch.tensor([5.0, 1.0, 0.0, 0.0]) * (comm.rank + 1)
    s._agg(first, "avg")
    assert first.tolist() == [5.0 * (comm.size + 1) / 2, 0.0, 0.0, 0.0]
    zeros = torch.zeros(4)
    s._agg(zeros, "avg")
    assert zeros.tolist() == [0.0] * 4
    for step in range(2):  # keyed: the 1 left behind at step 0 is sent at step 1
        t = torch.tensor([5.0, 1.0, 0.0, 0.0]) * (comm.rank + 1) if step == 0 else \
            torch.zeros(4)
        s._agg(t, "avg", key="w")
    assert t.tolist() == [0.0, 1.0 * (comm.size + 1) / 2, 0.0, 0.0]


@pytest.mark.parametrize("make", [lambda c: agg.PowerAggregation(rank=1, comm=c),
                                  lambda c: agg.Aggregation(comm=c, codec=RandomK(k=5))],
                         ids=["powersgd", "randomk"])
def test_one_tensor_aggregation_without_a_key_with_a_random_codec(comm, make):
    """mlbench's ``_agg(data, op)`` without a key through codecs that draw random numbers
    (PowerSGD's start, a random selection): the same result on every rank (before: TypeError,
    a None key could not seed their generators)."""
    a = make(comm)
    x = torch.arange(12, dtype=torch.float32).view(3, 4) * (comm.rank + 1)
    out = a._agg(x, "avg")
    assert out is x and torch.isfinite(x).all()
    everyone = comm.allgather(x.clone())
    assert all(torch.equal(x, other) for other in everyone)


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


def test_custom_weight_mode_averages_or_refuses(comm):
    """agg_grad=False: the weights are averaged over the world (average_world); a custom
    denominator or no averaging mode would scale them by P / denom or P every step (mlbench
    summed them): ValueError on every rank."""
    _compare(comm,
             lambda m: optim.CustomCentralizedOptimizer(
                 m, None, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                 agg_grad=False, average_world=True, comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    for flags in ({"average_custom": True}, {}):
        net = _net()
        with pytest.raises(ValueError, match="average_world=True"):
            optim.CustomCentralizedOptimizer(net, None, torch.optim.SGD(net.parameters(), lr=1),
                                             agg_grad=False, comm=comm, **flags)


@pytest.mark.parametrize("divide_before", [False, True])
def test_custom_average_custom_sums_during_backward(comm, divide_before):
    """average_custom: the sum is formed during backward (so GradScaler and clipping see the
    same on every rank) and step(denom=) divides it, with and without divide_before."""
    _compare(comm,
             lambda m: optim.CustomCentralizedOptimizer(
                 m, None, torch.optim.SGD(m.parameters(), lr=0.1), average_custom=True,
                 divide_before=divide_before, comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
             loss_scale=comm.size / 3, step_kwargs={"denom": torch.tensor(3.0)})


def test_aggregation_accepts_mlbench_op_names(comm):
    """'avg_world' / 'avg_custom' (and the AVG_WORLD / AVG_CUSTOM constants) as in mlbench;
    DecentralizedAggregation takes 'avg_world', the op mlbench requires for it."""
    assert agg.AVG_WORLD == "avg_world" and agg.AVG_CUSTOM == "avg_custom"
    assert {agg.AVG_WORLD, agg.AVG_CUSTOM} <= set(agg.ALLREDUCE_AGGREGATION_OPS)
    P = comm.size
    everyone = torch.stack([torch.arange(6.0) * (q + 1) for q in range(P)])
    a = agg.AllReduceAggregation(world_size=P, comm=comm)
    for by_layer in (False, True):
        for op, denom, ref in ((agg.AVG_WORLD, None, everyone.mean(0)),
                               (agg.AVG_CUSTOM, torch.tensor(4.0), everyone.sum(0) / 4)):
            model = nn.Linear(3, 2, bias=False)
            model.weight.grad = everyone[comm.rank].view(2, 3).clone()
            a.agg_grad(by_layer)(model, op, denom=denom)
            torch.testing.assert_close(model.weight.grad.reshape(-1), ref)
            with torch.no_grad():
                model.weight.copy_(everyone[comm.rank].view(2, 3))
            a.agg_model(by_layer)(model, op, denom=denom)
            torch.testing.assert_close(model.weight.detach().reshape(-1), ref)
    t = torch.full((3,), float(comm.rank))
    torch.testing.assert_close(a._agg(t, agg.AVG_WORLD), torch.full((3,), (P - 1) / 2))
    with pytest.raises(ValueError, match="denom"):
        a._agg(t, agg.AVG_CUSTOM)
    neighbors = sorted({(comm.rank - 1) % P, (comm.rank + 1) % P} - {comm.rank})
    w = _net(seed=comm.rank)
    mean = _flat(w)
    comm.Allreduce(hl.IN_PLACE, mean)
    agg.DecentralizedAggregation(comm.rank, neighbors, comm=comm,
                                 weights="uniform").agg_model()(w, agg.AVG_WORLD)
    after = _flat(w)
    comm.Allreduce(hl.IN_PLACE, after)
    torch.testing.assert_close(after, mean, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="avg_world"):
        agg.DecentralizedAggregation(comm.rank, neighbors, comm=comm).agg_model()(w, "sum")


class _MlbenchTracker:
    """mlbench_core.utils.Tracker's batch-timing protocol, and nothing else (no add_bytes)."""

    def __init__(self):
        self.batch_times = []

    def record_batch_step(self, name):
        self.batch_times.append(name)

    def record_batch_agg(self):
        self.record_batch_step("agg")

    def record_batch_opt_step(self):
        self.record_batch_step("opt_step")


def _every_preset(comm, net):
    neighbors = sorted({(comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size} - {comm.rank})
    def generic():
        opt = optim.GenericCentralizedOptimizer(model=net, comm=comm)
        opt.optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        return opt

    return {
        "Generic": generic,
        "CentralizedSGD": lambda: optim.CentralizedSGD(model=net, lr=0.1, comm=comm),
        "CentralizedSGD-weights": lambda: optim.CentralizedSGD(model=net, lr=0.1, comm=comm,
                                                               agg_grad=False),
        "CentralizedAdam": lambda: optim.CentralizedAdam(model=net, lr=0.01, comm=comm),
        "Custom": lambda: optim.CustomCentralizedOptimizer(
            net, None, torch.optim.SGD(net.parameters(), lr=0.1), average_world=True,
            comm=comm),
        "PowerSGD": lambda: optim.PowerSGD(model=net, lr=0.1, rank=1, comm=comm),
        "DecentralizedSGD": lambda: optim.DecentralizedSGD(neighbors=neighbors, model=net,
                                                           lr=0.1, comm=comm),
        "SparsifiedSGD": lambda: optim.SparsifiedSGD(net.parameters(), lr=0.1, comm=comm),
        "CentralizedSparsifiedSGD": lambda: optim.CentralizedSparsifiedSGD(
            net.parameters(), lr=0.1, comm=comm),
        "SignSGD": lambda: optim.SignSGD(net.parameters(), lr=0.01, comm=comm),
    }


ORDER = {"CentralizedSGD-weights": ["opt_step", "agg"], "DecentralizedSGD": ["opt_step", "agg"]}


@pytest.mark.parametrize("name", sorted(_every_preset(hl.MPI_SELF, nn.Linear(1, 1))))
def test_step_takes_an_mlbench_tracker(comm, name):
    """step(tracker=...) with mlbench's Tracker (record_batch_agg / record_batch_opt_step, no
    add_bytes) in every preset; heatlike's Tracker also gets the bytes."""
    net = _net()
    opt = _every_preset(comm, net)[name]()
    for tracker in (_MlbenchTracker(), hl.utils.Tracker()):
        x, y = _data(comm.rank, B)
        opt.zero_grad()
        if isinstance(tracker, hl.utils.Tracker):
            tracker.batch_start()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step(tracker=tracker)
        if isinstance(tracker, _MlbenchTracker):
            assert tracker.batch_times == ORDER.get(name, ["agg", "opt_step"])
        else:
            assert set(tracker._current["phases"]) == {"agg", "opt_step"}
            assert tracker.step_bytes  # add_bytes was called (one rank may send nothing)
            assert sum(tracker.step_bytes.values()) > 0 or comm.size == 1
            tracker.batch_end()
            assert tracker.get_total_communication_time() > 0


def test_fp16_optimizer_takes_an_mlbench_tracker(comm):
    model = nn.Sequential(nn.Linear(6, 3)).half()
    fp = optim.FP16Optimizer(model, average_world=True, comm=comm)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
    tracker = _MlbenchTracker()
    x, y = _data(comm.rank, B)
    fp.backward_loss(nn.functional.cross_entropy(model(x.half()).float(), y))
    assert fp.step(tracker=tracker)
    assert tracker.batch_times == ["agg", "opt_step"]


@pytest.mark.parametrize("agg_grad", [True, False], ids=["gradients", "weights"])
def test_initial_weights_are_rank_0s(comm, agg_grad):
    """Differences from mlbench that stay: rank 0's initialization is broadcast in both modes
    (mlbench never made them equal in gradient mode and averaged them in weight mode);
    world_size defaults to the communicator's size."""
    net = _net(seed=comm.rank)
    rank0 = _flat(_net(seed=0))
    opt = optim.CentralizedSGD(model=net, lr=0.1, agg_grad=agg_grad, comm=comm)
    assert torch.equal(_flat(net), rank0)
    assert opt.world_size == comm.size


@pytest.mark.parametrize("per_rank", [False, True], ids=["gradient-mode", "agg_grad=False"])
def test_clipping_between_backward_and_step(comm, per_rank):
    """Averaging happens during backward, so clip_grad_norm_ between backward() and step()
    clips the average; with agg_grad=False the gradients are still each rank's own, so the same
    line clips per rank (for SGD, with or without momentum, averaging the weights after the local
    step is averaging the clipped gradients)."""
    P, clip = comm.size, 0.05
    ref_net, net = _net(), _net()
    ref = torch.optim.SGD(ref_net.parameters(), lr=0.5, momentum=0.9)
    opt = optim.CentralizedSGD(model=net, lr=0.5, momentum=0.9, agg_grad=not per_rank,
                               comm=comm)
    for step in range(3):
        x, y = _data(step, P * B)
        grads = []
        for q in range(P):
            ref_net.zero_grad()
            nn.functional.cross_entropy(ref_net(x[q * B:(q + 1) * B]),
                                        y[q * B:(q + 1) * B]).backward()
            if per_rank:
                nn.utils.clip_grad_norm_(ref_net.parameters(), clip)
            grads.append([p.grad.clone() for p in ref_net.parameters()])
        for i, p in enumerate(ref_net.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        if not per_rank:
            nn.utils.clip_grad_norm_(ref_net.parameters(), clip)
        ref.step()
        opt.zero_grad()
        mine = slice(comm.rank * B, (comm.rank + 1) * B)
        nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
        nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        torch.testing.assert_close(_flat(net), _flat(ref_net), **TOL, msg=f"step {step}")


def test_sums_where_mlbench_refused(comm):
    """mlbench raised NotImplementedError for PowerSGD(average_world=False) and for
    FP16Optimizer without an averaging mode; here they sum the gradients over the ranks."""
    P = comm.size
    _compare(comm, lambda m: optim.PowerSGD(model=m, lr=0.02, rank=64, average_world=False,
                                            comm=comm),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.02), loss_scale=P,
             tol=dict(rtol=1e-4, atol=1e-5))
    results = []
    for average_world in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).half()
        fp = optim.FP16Optimizer(model, average_world=average_world, comm=comm)
        fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1 if average_world else 0.1 / P))
        x, y = _data(comm.rank, B)
        fp.backward_loss(nn.functional.cross_entropy(model(x.half()).float(), y))
        assert fp.step()
        results.append(fp.fp32_params.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("divide_before", [False, True])
def test_fp16_average_custom(comm, divide_before):
    """FP16Optimizer(average_custom=True): the sum formed during backward, divided by
    step(denom=); denom = 2P gives half the average_world step."""
    P = comm.size
    results = []
    for custom in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).half()
        fp = optim.FP16Optimizer(model, average_world=not custom, average_custom=custom,
                                 divide_before=divide_before, comm=comm)
        fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1 if custom else 0.05))
        x, y = _data(comm.rank, B)
        fp.backward_loss(nn.functional.cross_entropy(model(x.half()).float(), y))
        assert fp.step(denom=torch.tensor(2.0 * P) if custom else None)
        results.append(fp.fp32_params.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=2e-3, atol=2e-4)


def test_step_returns_the_closures_loss(comm):
    """step(closure) re-evaluates through the closure (whose backward is averaged like any
    other) and returns its loss; mlbench's CustomCentralizedOptimizer returned True."""
    net, ref_net = _net(), _net()
    opt = optim.CustomCentralizedOptimizer(net, None, torch.optim.SGD(net.parameters(), lr=0.1),
                                           average_world=True, comm=comm)
    ref = torch.optim.SGD(ref_net.parameters(), lr=0.1)
    x, y = _data(0, comm.size * B)
    mine = slice(comm.rank * B, (comm.rank + 1) * B)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x[mine]), y[mine])
        loss.backward()
        return loss

    before = _flat(net)
    loss = opt.step(closure)
    with torch.no_grad():
        assert isinstance(loss, torch.Tensor) and not torch.equal(before, _flat(net))
        torch.testing.assert_close(loss, nn.functional.cross_entropy(_net()(x[mine]), y[mine]))
    ref.zero_grad()
    nn.functional.cross_entropy(ref_net(x), y).backward()
    ref.step()
    torch.testing.assert_close(_flat(net), _flat(ref_net), **TOL)


_DIGITS = {}


@pytest.mark.mpi(min_size=4)
@pytest.mark.mpi_timeout(150)
@pytest.mark.parametrize("name", sorted(__import__("heatlike.recipes",
                                                   fromlist=["ALGORITHMS"]).ALGORITHMS))
def test_every_algorithm_learns_digits(comm, name):
    """At 4 ranks on several nodes (the test matrix's multi-node run: DASO and the hierarchical
    presets use their node-local paths) every algorithm reaches >= 0.92 test accuracy on the
    digits in 5 epochs."""
    from heatlike.core.topology import get_topology
    from heatlike.recipes import load_digits_split, train_digits

    if comm.size != 4 or get_topology(comm).num_nodes < 2:
        pytest.skip("the accuracy check runs at 4 ranks on several nodes")
    data = _DIGITS.setdefault("data", load_digits_split(0))
    result = train_digits(name, comm, epochs=5, data=data)
    assert result.accuracy >= 0.92, f"{name}: {result.accuracy:.4f}"


@pytest.mark.parametrize("preset", ["centralized", "sparsified", "sparsified-shared", "sign"])
def test_presets_take_sparse_gradients(comm, preset):
    """``nn.Embedding(sparse=True)`` under the presets: a sparse gradient is used as its dense
    values. CentralizedSGD equals one process with the combined batch; the compressing presets
    train with replicas equal on every rank."""
    P, r = comm.size, comm.rank
    net = SparseEmbedding(30, 5, 3)
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = {"centralized": lambda: optim.CentralizedSGD(model=net, lr=0.1, comm=comm),
           "sparsified": lambda: optim.CentralizedSparsifiedSGD(net.parameters(), lr=0.1,
                                                                sparse_grad_size=4, comm=comm),
           "sparsified-shared": lambda: optim.SparsifiedSGD(net.parameters(), lr=0.1,
                                                            sparse_grad_size=4, comm=comm),
           "sign": lambda: optim.SignSGD(net.parameters(), lr=0.01, comm=comm)}[preset]()
    before = _flat(net)
    for step in range(3):
        x, y = _data(step, P * B)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        assert reference.table.weight.grad.is_sparse
        ref_opt.step()
    opt.close()  # its communicators (the matrix runs every test in one job)
    if preset == "centralized":
        torch.testing.assert_close(_flat(net), _flat(reference), **TOL)
    assert not torch.equal(_flat(net), before)
    _same_everywhere(comm, net)


def _residual(opt, p) -> torch.Tensor:
    """The error-feedback residual a preset's engine keeps for parameter ``p`` (zeros before
    there is one)."""
    sync = opt.sync
    bucket = sync.buckets[sync.buckets_of([p])[0]]
    i = next(j for j, q in enumerate(bucket.params) if q is p)
    r = sync.codec.residual_in(sync.codec.state_for(bucket.index), i, bucket.offsets[i],
                               p.numel())
    return torch.zeros(p.numel()) if r is None else r.reshape(-1)


class _TwoWeights(nn.Module):
    """Two weights; the second is used only when asked (a branch no rank takes in a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(4, 4))
        self.w2 = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x, use2: bool):
        out = ((self.w1 - x) ** 2).sum()
        return out + ((self.w2 - 2 * x) ** 2).sum() if use2 else out


@pytest.mark.parametrize("preset", ["sparsified-sgd", "centralized-sparsified-block",
                                    "centralized-sparsified-topk", "centralized-topk",
                                    "powersgd"])
def test_error_feedback_keeps_the_memory_of_a_parameter_no_rank_used(comm, preset):
    """Error feedback delays what it does not send, it never loses it: after T plain-SGD steps
    ``p0 - pT = (1/P) sum_r (sum_t lr g_{r,t} - lr e_{r,T})`` for every parameter (e_r: rank r's
    residual; the sparsified presets keep lr g in theirs), also when no rank used the parameter
    in one step (the codec compressed 0 + e and the result went unused: up to 0.7 off)."""
    lr = 0.1
    net = _TwoWeights()
    step_mode = preset.startswith("sparsified") or preset.startswith("centralized-sparsified")
    if preset == "sparsified-sgd":
        opt = optim.SparsifiedSGD(net.parameters(), lr=lr, sparse_grad_size=3, comm=comm)
    elif preset.startswith("centralized-sparsified"):
        opt = optim.CentralizedSparsifiedSGD(net.parameters(), lr=lr, sparse_grad_size=3,
                                             sparsifier=preset.rsplit("-", 1)[1], comm=comm)
    elif preset == "centralized-topk":
        opt = optim.CentralizedSGD(model=net, lr=lr, codec=TopK(k=3), comm=comm)
    else:
        opt = optim.PowerSGD(model=net, lr=lr, rank=1, comm=comm)
    start = [p.detach().clone() for p in net.parameters()]
    sent = [torch.zeros(16, dtype=torch.float64) for _ in range(2)]
    g = torch.Generator().manual_seed(100 + comm.rank)
    for step in range(3):
        x = torch.randn(4, 4, generator=g)
        use2 = step != 1  # step 1: w2 unused on every rank
        # this rank's own gradients, d/dw (w - c)^2 = 2 (w - c) (.grad may hold the average)
        sent[0] += lr * 2 * (net.w1.detach() - x).reshape(-1).double()
        if use2:
            sent[1] += lr * 2 * (net.w2.detach() - 2 * x).reshape(-1).double()
        opt.zero_grad()
        net(x, use2).backward()
        opt.step()
    for k, p in enumerate(net.parameters()):
        memory = _residual(opt, p).double() * (1.0 if step_mode else lr)
        mine = sent[k] - memory
        everyone = torch.zeros_like(mine)
        comm.Allreduce(mine, everyone)
        moved = (start[k] - p.detach()).reshape(-1).double()
        assert torch.allclose(moved, everyone / comm.size, atol=1e-5), \
            (preset, k, (moved - everyone / comm.size).abs().max().item())


def _rank_models(comm, lr):
    """Every rank's model and plain-SGD optimizer, simulated in this process from rank 0's
    initial weights (what the presets broadcast)."""
    nets = [_net() for _ in range(comm.size)]
    return nets, [torch.optim.SGD(n.parameters(), lr=lr) for n in nets]


def _local_steps(nets, opts, step):
    """Each simulated rank's local SGD step on its part of the combined batch."""
    x, y = _data(step, len(nets) * B)
    for r, (n, o) in enumerate(zip(nets, opts)):
        o.zero_grad()
        nn.functional.cross_entropy(n(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        o.step()


def _train_weights(comm, opt, net, steps):
    x_all = [_data(step, comm.size * B) for step in range(steps)]
    mine = slice(comm.rank * B, (comm.rank + 1) * B)
    for x, y in x_all:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
        opt.step()


def _set_flat(net, flat):
    offset = 0
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()


@pytest.mark.parametrize("codec", ["bf16", "topk"])
def test_weight_mode_codec_sends_changes_not_weights(comm, codec):
    """agg_grad=False with a lossy codec: the first step averages the weights exactly, later
    steps x <- x_ref + (1/P) sum_r C(x_r - x_ref) with x_ref the last synchronized weights (the
    codec never sees the weights: bf16 rounded every weight to bfloat16 at every step, losing
    updates below a bfloat16 step, and top-k zeroed all weights but k). Reference: every rank's
    local step and the formula, computed here (top-k with its error feedback per rank)."""
    P, lr, steps, k = comm.size, 0.01, 4, 5
    with torch.no_grad():  # weights near 1: bf16 rounding of the weights would be visible
        start = _flat(_net()) + 1.0
    net = _net()
    _set_flat(net, start)
    spec = "bf16" if codec == "bf16" else TopK(k=k)
    opt = optim.CentralizedSGD(model=net, lr=lr, agg_grad=False, codec=spec, comm=comm)
    _train_weights(comm, opt, net, steps)

    nets, opts = _rank_models(comm, lr)
    for n in nets:
        _set_flat(n, start)
    residuals = [torch.zeros_like(start) for _ in range(P)]
    ref = None
    for step in range(steps):
        _local_steps(nets, opts, step)
        xs = [_flat(n) for n in nets]
        if ref is None:
            x = torch.stack(xs).sum(0) / P
        elif codec == "bf16":  # bf16 contributions, summed in float32 and rounded once
            summed = torch.stack([(xr - ref).to(torch.bfloat16).float() for xr in xs]).sum(0)
            x = ref + summed.to(torch.bfloat16).float() / P
        else:
            summed = torch.zeros_like(start)
            for r, xr in enumerate(xs):
                total = xr - ref + residuals[r]
                idx = torch.topk(total.abs(), k).indices
                summed.index_add_(0, idx, total[idx])
                total[idx] = 0
                residuals[r] = total
            x = ref + summed / P
        ref = x.clone()
        for n in nets:
            _set_flat(n, x)
    tol = dict(rtol=0, atol=3e-5) if codec == "bf16" else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_flat(net), ref, **tol)
    _same_everywhere(comm, net)
    # the weights themselves through bf16 would be 2^-8 off: the change is far below that
    assert (_flat(net) - start).abs().max() < 0.05
    # the aggregation API's weights through a lossy codec: only the average, as changes
    sparse = agg.SparsifiedAggregation(net, k=3, comm=comm)
    before = _flat(net)
    sparse.agg_model()(net, op="avg")  # the first call: exact (replicas equal: unchanged)
    torch.testing.assert_close(_flat(net), before)
    with pytest.raises(ValueError, match="op='avg'"):
        sparse.agg_model()(net, op="sum")


def test_decentralized_sgd_bf16_gossips_changes(comm):
    """DecentralizedSGD(codec="bf16"): CHOCO-gossip with step 1 (public copies h, mixes y kept
    at full precision, bf16 changes on the wire) against the formula on every rank's model
    simulated here; lossy codecs it cannot reproduce raise ValueError on every rank."""
    P, lr, steps = comm.size, 0.01, 4
    with torch.no_grad():
        start = _flat(_net()) + 1.0
    net = _net()
    _set_flat(net, start)
    opt = optim.DecentralizedSGD(model=net, lr=lr, codec="bf16", comm=comm)
    _train_weights(comm, opt, net, steps)

    adjacency = opt.graph.adjacency
    degree = [len(a) for a in adjacency]
    weights = [[1.0 / (1 + max(degree[i], degree[j])) for j in adjacency[i]] for i in range(P)]
    selfw = [1.0 - sum(w) for w in weights]
    nets, opts = _rank_models(comm, lr)
    for n in nets:
        _set_flat(n, start)
    public = mixed = None
    for step in range(steps):
        _local_steps(nets, opts, step)
        xs = [_flat(n) for n in nets]
        if public is None:  # the first mix is exact; it sets h = x and y = W x
            public = [x.clone() for x in xs]
            new = []
            for i in range(P):
                y = xs[i].clone().mul_(selfw[i])  # the gossip's own operations
                for j, w in zip(adjacency[i], weights[i]):
                    y.add_(xs[j], alpha=w)
                new.append(y)
            mixed = [y.clone() for y in new]
        else:
            qs = [(xs[i] - public[i]).to(torch.bfloat16).float() for i in range(P)]
            new = []
            for i in range(P):
                mixed[i].add_(qs[i], alpha=selfw[i])
                for j, w in zip(adjacency[i], weights[i]):
                    mixed[i].add_(qs[j], alpha=w)
                public[i].add_(qs[i])
                new.append(xs[i] + mixed[i] - public[i])
        for n, x in zip(nets, new):
            _set_flat(n, x)
    torch.testing.assert_close(_flat(net), _flat(nets[comm.rank]), rtol=1e-6, atol=1e-6)
    mean = _flat(net).double()
    comm.Allreduce(hl.IN_PLACE, mean)
    plain = torch.stack([_flat(n).double() for n in nets]).sum(0)
    torch.testing.assert_close(mean, plain, rtol=1e-6, atol=1e-6)
    for bad in (TopK(k=2), hl.engine.RandomK(k=2)):
        with pytest.raises(ValueError, match="gossip"):
            optim.DecentralizedSGD(model=_net(), lr=lr, codec=bad, comm=comm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_powersgd_on_a_half_precision_model(comm, dtype):
    """PowerSGD on a bfloat16 / float16 model (torch has no QR for half types on the CPU: the
    factor is computed in float32 and rounded back). At a rank that makes the approximation
    exact the step is SGD on the average gradient, to half precision (reference: every rank's
    gradient computed here); at rank 1 the replicas stay equal and finite."""
    lr = 0.5
    for rank in (64, 1):
        net = _net().to(dtype)
        start = [p.detach().clone() for p in net.parameters()]
        opt = optim.PowerSGD(model=net, lr=lr, rank=rank, comm=comm)
        x, y = _data(0, comm.size * B)
        mine = slice(comm.rank * B, (comm.rank + 1) * B)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[mine].to(dtype)).float(), y[mine]).backward()
        opt.step()
        assert all(bool(torch.isfinite(p).all()) and p.dtype == dtype for p in net.parameters())
        _same_everywhere(comm, nn.ParameterList([nn.Parameter(p.detach().float())
                                                 for p in net.parameters()]))
        if rank == 1:
            continue
        ref = _net().to(dtype)
        grads = []
        for r in range(comm.size):
            ref.zero_grad()
            part = slice(r * B, (r + 1) * B)
            nn.functional.cross_entropy(ref(x[part].to(dtype)).float(), y[part]).backward()
            grads.append([p.grad.double() for p in ref.parameters()])
        moved = 0.0
        for i, (p, p0) in enumerate(zip(net.parameters(), start)):
            mean = torch.stack([g[i] for g in grads]).mean(0)
            expected = p0.double() - lr * mean
            got = p.detach().double()
            torch.testing.assert_close(got, expected, rtol=0, atol=4e-3)
            moved = max(moved, float((got - p0.double()).abs().max()))
        assert moved > 2e-2  # far more than the tolerance: the step was taken


def test_fp16_optimizer_stops_at_min_scale(comm):
    """An overflow that brings the loss scale down to min_scale raises RuntimeError on every
    rank, as mlbench's ``loss_scale <= min_scale`` (one that stays above it skips the step)."""
    for init, raises in ((4.0, False), (2.0, True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).half()
        fp = optim.FP16Optimizer(model, average_world=True, init_scale=init, min_scale=1.0,
                                 comm=comm)
        fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
        x, y = _data(0, B)
        fp.backward_loss(nn.functional.cross_entropy(model(x.half()).float(), y))
        if comm.rank == comm.size - 1:
            model[0].weight.grad[0, 0] = float("inf")
        if raises:
            with pytest.raises(RuntimeError, match="reached min_scale 1.0"):
                fp.step()
        else:
            assert not fp.step() and fp.loss_scale == 2.0


@pytest.mark.parametrize("make", [Sign, lambda: Clipped(Cast(torch.float16), 100.0),
                                  lambda: Threshold(0.01, error_feedback=False)],
                         ids=["sign", "clipped-fp16", "threshold"])
def test_presets_refuse_a_grad_scaler_with_a_codec_that_does_not_scale(comm, make):
    """(stateless codecs were stepped through GradScaler's unscale: Sign's step 1024 times too
    small, Clipped's limit applied in scaled units)"""
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    opt = optim.CentralizedSGD(model=net, lr=0.1, codec=make(), comm=comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt.zero_grad()
    scaler.scale(net(torch.randn(4, 8)).square().sum()).backward()
    with pytest.raises(ValueError, match="does not scale with its input"):
        scaler.step(opt)
