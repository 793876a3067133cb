"""SINGA's DistOpt on the engine: fused = unfused = one process with the combined batch; half
precision and clipping; top-k and threshold sparsification with residuals; partial updates;
state; SINGA's bugs fixed; SINGA's RMSProp / AdaGrad formulas."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from heatlike.optim import DistOpt, singa

pytestmark = pytest.mark.mpi
B = 4


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))


def _data(step, n):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _local_grads(model, x, y):
    m = copy.deepcopy(model)
    nn.functional.cross_entropy(m(x), y).backward()
    return [p.grad for p in m.parameters()]


@pytest.mark.parametrize("threshold", [10, 100000], ids=["unfused", "fused"])
def test_update_equals_single_process(comm, threshold):
    P, r = comm.size, comm.rank
    ref = _net()
    net = _net(seed=50 + r)  # DistOpt makes the replicas equal (rank 0's)
    if r == 0:
        net.load_state_dict(ref.state_dict())
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        loss = nn.functional.cross_entropy(net(x[mine]), y[mine])
        if threshold == 100000 and step == 0:
            dist(loss)  # __call__: backward_and_update with the default threshold (fused)
        else:
            dist.backward_and_update(loss, threshold=threshold)
        torch.testing.assert_close(_flat(net), _flat(ref), rtol=1e-5, atol=1e-6)
    sync = dist._sync("fused", threshold)
    assert len(sync.buckets) == (4 if threshold == 10 else 1)


@pytest.mark.parametrize("clip", [False, True])
def test_half_precision_and_clipping(comm, clip):
    """float16 on the wire within float16 tolerance; with clipping every rank's gradient
    elements are clamped before averaging."""
    P, r = comm.size, comm.rank
    ref = _net()
    net = copy.deepcopy(ref)
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm)
    x, y = _data(0, P * B)
    per_rank = [_local_grads(ref, x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(P)]
    limit = 0.02
    expected = []
    for i, p in enumerate(ref.parameters()):
        grads = [g[i].clamp(-limit, limit) if clip else g[i] for g in per_rank]
        expected.append(p.detach() - 0.1 * sum(grads) / P)
    mine = slice(r * B, (r + 1) * B)
    dist.backward_and_update_half(nn.functional.cross_entropy(net(x[mine]), y[mine]),
                                  threshold=64, clipping=clip, clip_Value=limit)
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=2e-4)


def test_topk_sparsification_magnitudes_below_one(comm):
    """SINGA truncated |x| to an int as the sort key, so with all |x| < 1 its top-k was the
    first k indices. Here the k largest magnitudes are sent; sent + residual = input."""
    g = torch.Generator().manual_seed(comm.rank)
    x = (torch.rand(100, generator=g) * 1.8 - 0.9)
    acc = torch.zeros(100)
    tensor = x.clone()
    dist = DistOpt(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), comm)
    dist.sparsification(tensor, acc, 0.05, topK=True)
    dist.wait()
    sent = x - acc
    assert set(sent.nonzero().view(-1).tolist()) == set(x.abs().topk(5).indices.tolist())
    everyone = torch.empty(comm.size * 100)
    comm.Allgather(sent, everyone)
    torch.testing.assert_close(tensor, everyone.view(comm.size, 100).sum(0))


def test_threshold_sparsification_sends_each_entry_once(comm):
    g = torch.Generator().manual_seed(10 + comm.rank)
    x = torch.randn(200, generator=g)
    before = torch.randn(200, generator=g) * 0.1
    acc = before.clone()
    tensor = x.clone()
    dist = DistOpt(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), comm)
    dist.sparsification(tensor, acc, 0.8, topK=False)
    dist.wait()
    total = x + before
    survivors = torch.where(total.abs() >= 0.8, total, torch.zeros_like(total))
    torch.testing.assert_close(x + before - acc, survivors)  # sent + residual = input
    everyone = torch.empty(comm.size * 200)
    comm.Allgather(survivors, everyone)
    torch.testing.assert_close(tensor, everyone.view(comm.size, 200).sum(0))
    lane = next(iter(dist._lanes.values()))
    assert lane.reducer.bytes_sent == int((survivors != 0).sum()) * 8  # once each


def test_sparse_update_residual_and_state(comm):
    P, r = comm.size, comm.rank
    net = _net()
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm)
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        dist.backward_and_sparse_update(nn.functional.cross_entropy(net(x[mine]), y[mine]),
                                        threshold=64, spars=0.1, topK=True, corr=True)
    sync = next(iter(dist._syncs.values()))
    residuals = [sync.codec.state_for(b)["residual"].clone() for b in range(len(sync.buckets))]
    assert all(res.abs().sum() > 0 for res in residuals)
    state = dist.state_dict()
    other_net = copy.deepcopy(net)
    other = DistOpt(torch.optim.SGD(other_net.parameters(), lr=0.1), comm)
    other.load_state_dict(state)
    x, y = _data(0, B)
    other.backward_and_sparse_update(nn.functional.cross_entropy(other_net(x), y), threshold=64,
                                     spars=0.1, topK=True, corr=True)
    restored = next(iter(other._syncs.values()))
    assert len(restored.codec.states) == len(residuals)
    dist.backward_and_sparse_update(nn.functional.cross_entropy(net(x), y), threshold=64,
                                    spars=0.1, topK=True, corr=True)
    torch.testing.assert_close(_flat(other_net), _flat(net))  # same residuals, same step


def test_partial_update_cycles_through_partitions(comm):
    """lr 0: local steps change nothing; partition k is averaged at step k; after a full cycle
    every rank holds the same parameters, before it some still differ."""
    net = _net()
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.0), comm)
    with torch.no_grad():  # make the replicas differ
        for p in net.parameters():
            p.add_(float(comm.rank))
    x, y = _data(0, B)
    parts = None
    for step in range(8):
        dist.backward_and_partial_update(nn.functional.cross_entropy(net(x), y), threshold=100)
        parts = parts or len(dist._partitions[100].buckets)
        mine = _flat(net)
        everyone = torch.empty(comm.size * mine.numel())
        comm.Allgather(mine, everyone)
        same = all(torch.equal(e, mine) for e in everyone.view(comm.size, -1))
        if step + 1 >= parts:
            assert same, f"step {step}: not equal after a full cycle of {parts}"
        elif comm.size > 1:
            assert not same
    assert parts == 4  # 3 | 40x3 | 40 | 40x6 elements, in backward order, groups <= 100
    assert dist.state_dict()["engine"]["partial"] == 8 % parts


def test_low_level_fused_and_half(comm):
    dist = DistOpt(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), comm, buffSize=64)
    a = torch.full((10,), float(comm.rank + 1))
    b = torch.full((5,), 2.0)
    dist.fused_all_reduce([a, b], send=False)  # staged
    dist.fused_all_reduce([a, b])
    big = torch.full((40000,), 1.5e4)  # the float16 sum would overflow at 5 ranks
    dist.all_reduce_half(big)
    c = torch.full((3,), 1.0)
    dist.all_reduce(c)
    dist.wait()
    total = sum(range(1, comm.size + 1))
    assert torch.equal(a, torch.full((10,), float(total))) and bool((b == 2 * comm.size).all())
    assert torch.allclose(big, torch.full((40000,), 1.5e4 * comm.size), rtol=1e-3)
    assert torch.equal(c, torch.full((3,), float(comm.size)))
    with pytest.raises(ValueError, match="buffSize"):
        dist.fused_all_reduce([torch.zeros(65)])
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(torch.zeros(4, 4).t())


def test_bad_input(comm):
    net = _net()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DistOpt(None, comm)
    with pytest.raises(ValueError, match="buffSize"):
        DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm, buffSize=0)
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm, buffSize=1000)
    x, y = _data(0, B)
    with pytest.raises(ValueError, match="exceeds buffSize"):
        dist.backward_and_update(nn.functional.cross_entropy(net(x), y), threshold=5000)
    with pytest.raises(ValueError, match="threshold"):
        dist.backward_and_update(nn.functional.cross_entropy(net(x), y), threshold=0)
    with pytest.raises(ValueError, match="spars"):
        dist.backward_and_sparse_update(nn.functional.cross_entropy(net(x), y), spars=2.0,
                                        topK=True)
    with pytest.raises(ValueError, match="clip_Value"):
        dist.backward_and_update_half(nn.functional.cross_entropy(net(x), y), clipping=True,
                                      clip_Value=-1)
    assert dist.world_size == comm.size and dist.global_rank == comm.rank
    assert 0 <= dist.local_rank < comm.size


def test_singa_rmsprop_and_adagrad_formulas():
    """SINGA puts epsilon inside the square root."""
    p0 = torch.tensor([1.0, -2.0, 3.0])
    g = torch.tensor([0.5, 0.1, -0.3])
    for cls, kwargs in ((singa.RMSProp, {"rho": 0.9}), (singa.AdaGrad, {})):
        p = nn.Parameter(p0.clone())
        opt = cls([p], lr=0.1, epsilon=1e-2, weight_decay=0.01, **kwargs)
        expected = p0.clone()
        state = torch.zeros(3)
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
            grad = g + 0.01 * expected
            if cls is singa.RMSProp:
                state = 0.9 * state + 0.1 * grad * grad
            else:
                state = state + grad * grad
            expected = expected - 0.1 * grad / torch.sqrt(state + 1e-2)
        torch.testing.assert_close(p.detach(), expected)
    with pytest.raises(ValueError):
        singa.RMSProp([nn.Parameter(p0.clone())], lr=-1)
    assert math.isfinite(float(p.detach().sum()))
    for cls in (singa.RMSProp, singa.AdaGrad):  # a closure runs its own backward (as torch's)
        p = nn.Parameter(p0.clone())
        opt = cls([p], lr=0.1)

        def closure(opt=opt, p=p):
            opt.zero_grad()
            loss = (p * g).sum()
            loss.backward()
            return loss

        assert float(opt.step(closure)) == pytest.approx(float((p0 * g).sum()))
        assert not torch.equal(p.detach(), p0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_threshold_counts_elements_whatever_the_dtype(comm, dtype):
    """Fused buffers of at most ``threshold`` elements for every dtype, and partial mode's
    partitions alike (before: a byte cap of 4 * threshold, so float64 models got buffers of half
    the elements and bfloat16 ones twice as many, above buffSize). Layers of 6*10, 10, 10*3, 3
    elements: [43, 60] with threshold 60."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).to(dtype)
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm, buffSize=60)
    x, y = _data(comm.rank, 4)
    dist.backward_and_update(nn.functional.cross_entropy(net(x.to(dtype)).float(), y),
                             threshold=60)
    sizes = [b.size for b in dist._sync("fused", 60).buckets]
    assert sorted(sizes) == [43, 60]
    dist.backward_and_partial_update(nn.functional.cross_entropy(net(x.to(dtype)).float(), y),
                                     threshold=60)
    assert sorted(b.size for b in dist._partitions[60].buckets) == [43, 60]


def test_a_parameter_group_it_was_not_built_with_is_refused(comm):
    """DistOpt averages the parameters it was built with: a group of others raises ValueError on
    every rank (before: trained with each rank's own gradient)."""
    body, head = _net(1), nn.Linear(3, 3)
    dist = DistOpt(torch.optim.SGD(body.parameters(), lr=0.1), comm)
    with pytest.raises(ValueError, match="not among them"):
        dist.add_param_group({"params": head.parameters()})
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    dist.add_param_group({"params": [frozen], "lr": 0.0})  # never trained: accepted
    assert len(dist.param_groups) == 2



def _sparse_reference(x, acc, spars, topK):
    """What one rank sends of ``x + acc`` and what it keeps (SINGA's sparsification)."""
    total = x + acc
    if topK:
        keep = torch.zeros_like(total, dtype=torch.bool)
        keep[total.abs().topk(math.ceil(spars * total.numel())).indices] = True
    else:
        keep = total.abs() >= spars
    return torch.where(keep, total, 0.0), torch.where(keep, 0.0, total)


@pytest.mark.parametrize("topK,spars", [(True, 0.25), (False, 1.5)], ids=["topk", "threshold"])
def test_pending_sparsifications_of_one_size_keep_their_own_residuals(comm, topK, spars):
    """Two same-size sparsifications pending together: each accumulation receives its own
    tensor's residual (before: both calls shared one state, and the first accumulation received
    the second's); results equal those of calls completed one at a time, bitwise."""
    dist = DistOpt(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), comm)

    def inputs(r):
        return ((torch.arange(8.0) + 1 + r) * torch.tensor([1.0, -1] * 4),
                -(torch.arange(8.0) + 1 + r) * 10, torch.full((8,), 0.5), torch.full((8,), 7.0))

    t1, t2, acc1, acc2 = inputs(comm.rank)
    dist.sparsification(t1, acc1, spars, topK)
    dist.sparsification(t2, acc2, spars, topK)
    dist.wait()
    sums = [torch.zeros(8), torch.zeros(8)]
    for r in range(comm.size):
        x1, x2, a1, a2 = inputs(r)
        sums[0] += _sparse_reference(x1, a1, spars, topK)[0]
        sums[1] += _sparse_reference(x2, a2, spars, topK)[0]
    x1, x2, a1, a2 = inputs(comm.rank)
    torch.testing.assert_close(acc1, _sparse_reference(x1, a1, spars, topK)[1])
    torch.testing.assert_close(acc2, _sparse_reference(x2, a2, spars, topK)[1])
    torch.testing.assert_close(t1, sums[0])
    torch.testing.assert_close(t2, sums[1])
    for x, acc, got, kept in ((x1, a1, t1, acc1), (x2, a2, t2, acc2)):  # one at a time
        dist.sparsification(x, acc, spars, topK)
        dist.wait()
        assert torch.equal(x, got) and torch.equal(acc, kept)


def test_step_refuses_gradients_it_did_not_synchronize(comm):
    """step() applies only gradients a backward_* call averaged or update() staged: after a
    plain backward (fresh or accumulated onto averaged gradients), and under GradScaler, it
    raises on every rank (before: each rank stepped with its own gradients). update() + step()
    with summed gradients equals one process on the combined batch."""
    P, r = comm.size, comm.rank
    net, ref = _net(), _net()
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _data(0, P * B)
    mine = slice(r * B, (r + 1) * B)
    nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
    with pytest.raises(RuntimeError, match="backward_and_update"):
        dist.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    dist.zero_grad()
    scaler.scale(nn.functional.cross_entropy(net(x[mine]), y[mine])).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(dist)
    dist.backward_and_update(nn.functional.cross_entropy(net(x[mine]), y[mine]))
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    torch.testing.assert_close(_flat(net), _flat(ref), rtol=1e-5, atol=1e-6)
    nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()  # onto the averaged ones
    with pytest.raises(RuntimeError, match="update"):
        dist.step()
    dist.zero_grad()
    nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
    grads = [p.grad.clone() * B for p in net.parameters()]  # sums over this rank's samples
    for g in grads:
        dist.all_reduce(g)
    dist.wait()
    for p, g in zip(net.parameters(), grads):
        dist.update(p, g / B)  # update divides by the world size: the mean over P * B
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)  # in place, allowed
    dist.step()
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    torch.testing.assert_close(_flat(net), _flat(ref), rtol=1e-5, atol=1e-6)


def test_internal_steps_run_hooks_and_count_for_schedulers(comm):
    """Every backward_* call steps through DistOpt.step: step hooks run, and an LR scheduler
    does not warn that it stepped before the optimizer (before: the local optimizer was stepped
    directly)."""
    net = _net()
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm)
    calls = []
    dist.register_step_pre_hook(lambda *_: calls.append("pre"))
    dist.register_step_post_hook(lambda *_: calls.append("post"))
    sched = torch.optim.lr_scheduler.StepLR(dist, 1, 0.5)
    x, y = _data(comm.rank, B)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist.backward_and_update(nn.functional.cross_entropy(net(x), y), threshold=100)
        sched.step()
        dist.backward_and_sparse_update(nn.functional.cross_entropy(net(x), y), threshold=100)
        dist.backward_and_partial_update(nn.functional.cross_entropy(net(x), y), threshold=100)
    assert calls == ["pre", "post"] * 3
    assert dist.param_groups[0]["lr"] == 0.05


def test_loading_a_checkpoint_resets_the_modes_it_lacks(comm):
    """Loading the state taken before any step into a trained DistOpt repeats a fresh run
    exactly (before: the residuals and cycle counters of modes absent from the checkpoint
    were kept)."""
    P, r = comm.size, comm.rank

    def train(net, dist):
        for step in range(2):
            x, y = _data(step, P * B)
            loss = nn.functional.cross_entropy(net(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B])
            dist.backward_and_sparse_update(loss, threshold=64, spars=0.2, topK=True)

    fresh = _net()
    train(fresh, DistOpt(torch.optim.SGD(fresh.parameters(), lr=0.1), comm))
    net = _net()
    dist = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm)
    state, weights = copy.deepcopy(dist.state_dict()), copy.deepcopy(net.state_dict())
    train(net, dist)
    net.load_state_dict(weights)
    dist.load_state_dict(state)
    train(net, dist)
    assert torch.equal(_flat(net), _flat(fresh))
