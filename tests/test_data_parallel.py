"""DataParallel: P ranks with batch b follow one process with batch P*b (same data, same order).

Every rank also runs the single-process reference on the combined batch (the models are tiny), so
the comparison happens on every rank, after every step; parameters must also be bitwise equal
across ranks.
"""

import copy

import pytest
import torch
from _helpers import SparseEmbedding
from torch import nn

import heatlike as hl
from heatlike.engine import gradsync
from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer

pytestmark = pytest.mark.mpi

B = 4  # per-rank batch
TOL = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    """An MLP with a frozen input layer, a layer used only for samples of class 3 (so only on
    some ranks in some steps), and a layer never used."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.frozen = nn.Linear(6, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.extra = nn.Linear(8, 4)
        self.never = nn.Linear(3, 3)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.frozen.requires_grad_(False)

    def forward(self, x, y):
        h = torch.tanh(self.frozen(x))
        out = self.fc2(torch.relu(self.fc1(h)))
        rare = y == 3
        if bool(rare.any()):
            out = out + rare.unsqueeze(1) * self.extra(h)
        return out


def _data(step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = [{"params": list(model.fc1.parameters()), "lr": 0.05},
              {"params": [*model.fc2.parameters(), *model.extra.parameters(),
                          *model.never.parameters()]}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(groups, lr=0.01, weight_decay=0.01)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_all_ranks(comm, model) -> None:
    mine = _flat(model)
    everyone = torch.empty(comm.size * mine.numel())
    comm.Allgather(mine, everyone)
    for r, other in enumerate(everyone.view(comm.size, -1)):
        assert torch.equal(other, mine), f"parameters differ between this rank and rank {r}"


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _step_both(comm, model, dp_opt, reference, ref_opt, step: int) -> None:
    """One step of the reference on the whole batch of ``step`` and of DataParallel on this
    rank's share of it."""
    x, y = _data(step, comm.size * B)
    ref_opt.zero_grad()
    _loss(reference(x, y), y).backward()
    ref_opt.step()
    mine = slice(comm.rank * B, (comm.rank + 1) * B)
    dp_opt.zero_grad()
    _loss(model(x[mine], y[mine]), y[mine]).backward()
    dp_opt.step()


def _train_side_by_side(comm, model, dp_opt, reference, ref_opt, steps: int) -> None:
    """``steps`` steps of DataParallel (each rank its share of the batch) and of the reference
    (the whole batch), compared after every step, and the same parameters on every rank."""
    local = model.module
    for step in range(steps):
        _step_both(comm, model, dp_opt, reference, ref_opt, step)
        if not dp_opt.blocking:
            assert dp_opt.update_next or model.grad_sync.passthrough
            model.flush()
        torch.testing.assert_close(_flat(local), _flat(reference), **TOL, msg=f"step {step}")
        _same_on_all_ranks(comm, local)


@pytest.fixture(params=["copied", "in-place"])
def sums(request, monkeypatch):
    """The two paths of a plain average: gradients copied into buckets, or (the parameters of at
    least 64 bytes here, every trainable one of ``Net`` but a bias of 4 values) summed where
    they are, in ``.grad``, with their use flags summed apart (``extra``: used on some ranks in
    some steps; ``never``: on none)."""
    monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES",
                        64 if request.param == "in-place" else 1 << 62)
    return request.param


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0005], ids=["one-bucket", "many-buckets"])
def test_matches_single_process_with_combined_batch(comm, kind, blocking, bucket_mb, sums):
    r = comm.rank
    reference = Net(seed=0)
    local = Net(seed=100 + r)  # different on every rank: DataParallel broadcasts rank 0's
    if r == 0:
        local.load_state_dict(reference.state_dict())
    ref_opt = _optimizer(kind, reference)
    rng_before = torch.get_rng_state()
    dp_opt = DataParallelOptimizer(_optimizer(kind, local), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=bucket_mb,
                         first_bucket_mb=bucket_mb)
    assert torch.equal(torch.get_rng_state(), rng_before), "construction touched the RNG"
    assert len(model.grad_sync.buckets) > (1 if bucket_mb < 1 else 0)
    assert any(model.grad_sync._solo) == (sums == "in-place" and comm.size > 1)
    never_before = local.never.weight.detach().clone()
    frozen_before = local.frozen.weight.detach().clone()
    _train_side_by_side(comm, model, dp_opt, reference, ref_opt, steps=4)
    assert torch.equal(local.never.weight, never_before), "an unused parameter was updated"
    assert torch.equal(local.frozen.weight, frozen_before), "a frozen parameter was updated"


class _Layers(nn.Module):
    """A conv layer, BatchNorm, a transformer encoder block (attention, LayerNorm) and a head:
    weights of 288 bytes and more between biases and norms of 32 to 192 bytes."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)  # (B, 8, 4, 4)
        return self.head(self.block(h.flatten(2)).mean(dim=1))  # 8 tokens of 16 features


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0005], ids=["one-bucket", "many-buckets"])
@pytest.mark.parametrize("path", ["copied", "in-place"])
def test_conv_batchnorm_and_transformer_layers_average_each_rank_s_gradient(
        comm, monkeypatch, blocking, bucket_mb, path):
    """Every layer kind through both paths of a plain average (in place: the parameters of 256
    bytes and more, so that solo and small parameters interleave, the small ones sharing
    buckets): the parameters follow one process that averages the ranks' gradients, each
    computed on that rank's share of the batch (BatchNorm normalizes by each share's statistics,
    as under DDP), on every rank."""
    monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES", 256 if path == "in-place" else 1 << 62)
    P, r = comm.size, comm.rank
    reference, local = _Layers(seed=0), _Layers(seed=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    dp_opt = DataParallelOptimizer(torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9),
                                   blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=bucket_mb,
                         first_bucket_mb=bucket_mb)
    sync = model.grad_sync
    if path == "in-place" and P > 1:
        assert any(sync._solo) and any(len(b.params) > 1 for b in sync.buckets)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(P * B, 1, 8, 8, generator=g), torch.randint(0, 3, (P * B,), generator=g)
        ref_opt.zero_grad()
        for q in range(P):
            share = slice(q * B, (q + 1) * B)
            (_loss(reference(x[share]), y[share]) / P).backward()
        ref_opt.step()
        dp_opt.zero_grad()
        mine = slice(r * B, (r + 1) * B)
        _loss(model(x[mine]), y[mine]).backward()
        dp_opt.step()
        model.flush()
        torch.testing.assert_close(_flat(local), _flat(reference), **TOL, msg=f"step {step}")
        _same_on_all_ranks(comm, local)
    model.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_node_aware_sums_match_single_process(comm, monkeypatch, blocking, sums):
    """With 2 ranks per node (4 ranks: two nodes) every bucket is summed node-aware, in chunks
    of 256 floats, and training still follows one process with the combined batch; elsewhere
    the same run takes MPI's all-reduce."""
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "2" if comm.size % 2 == 0 else "1")
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_MIN_KB", "0")
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_CHUNK_KB", "1")
    c = comm.Dup()
    try:
        reference = Net(seed=0)
        local = copy.deepcopy(reference)
        ref_opt = _optimizer("sgd", reference)
        dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=blocking)
        model = DataParallel(local, c, optimizer=dp_opt)
        layered = c.size >= 4 and c.size % 2 == 0
        assert model.grad_sync.reducer.node_aware is layered
        _train_side_by_side(c, model, dp_opt, reference, ref_opt, steps=3)
    finally:
        c.Free()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_deferred_update_happens_in_next_forward(comm, blocking):
    """Non-blocking: parameters change only at the next forward (or flush); the result equals
    blocking training, including the LR a scheduler changed in between."""
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer("sgd", reference)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    local = copy.deepcopy(reference)
    opt = _optimizer("sgd", local)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    dp_opt = DataParallelOptimizer(opt, blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005)
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        for m, o, s, xs, ys in ((reference, ref_opt, ref_sched, x, y),
                                (model, dp_opt, sched, x[mine], y[mine])):
            o.zero_grad()
            _loss(m(xs, ys), ys).backward()
            before = _flat(local)
            o.step()
            s.step()
            if m is model and not blocking and not model.grad_sync.passthrough:
                assert dp_opt.update_next
                with torch._C.DisableTorchFunction():  # (a read would apply the update)
                    assert torch.equal(_flat(local), before), "non-blocking step updated at once"
    model.eval()  # applies the pending update
    torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    _same_on_all_ranks(comm, local)


def test_deferred_updates_wait_until_a_parameter_is_first_used(comm):
    """A non-blocking optimizer's updates are applied as the next forward first uses each
    parameter (heatlike.nn.deferred): with a bucket per parameter, fc2's update is still pending
    while fc1 runs, and fc1's is applied by then; no hook is put on the layers."""
    local = Net(seed=0)
    opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=False)
    model = DataParallel(local, comm, optimizer=opt, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    assert not [m for m in local.modules() if m is not local and m._forward_pre_hooks]
    seen = []
    local.fc1.register_forward_hook(lambda m, a, o: seen.append(
        (set(opt._pending), model.grad_sync.buckets_of([local.fc1.weight, local.fc1.bias]),
         model.grad_sync.buckets_of([local.fc2.weight]))))
    for step in range(2):
        x, y = _data(step, B)
        opt.zero_grad()
        _loss(model(x, y), y).backward()
        opt.step()
    pending, fc1, fc2 = seen[-1]
    model.close()  # its communicators (the matrix runs every test in one job)
    assert not pending & set(fc1)
    if not model.grad_sync.passthrough:
        assert set(fc2) <= pending, "fc2's update was applied before its first use"


def test_an_optimizer_switched_to_deferred_updates_still_updates_first(comm):
    """Switched to non-blocking behind DataParallel's back, the optimizer's deferred updates
    are applied as the next forward begins: every forward sees the updated parameters."""
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer("sgd", reference)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=True)
    model = DataParallel(local, comm, optimizer=dp_opt)
    dp_opt.blocking = False
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        out = model(x[mine], y[mine])
        with torch.no_grad():
            torch.testing.assert_close(out, reference(x[mine], y[mine]), **TOL)
        dp_opt.zero_grad()
        _loss(out, y[mine]).backward()
        dp_opt.step()
        ref_opt.zero_grad()
        _loss(reference(x, y), y).backward()
        ref_opt.step()
    model.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_gradient_accumulation_with_no_sync(comm, blocking):
    """k micro-steps under no_sync plus one synchronizing backward equal one process
    accumulating the same micro-batches; parameters used only in an early micro-step are synced."""
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer("adam", reference)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(_optimizer("adam", local), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005)
    mine = slice(r * B, (r + 1) * B)
    for step in range(2):
        micro = [_data(10 * step + k, P * B) for k in range(3)]
        # only the first micro-batch has class-3 samples, so `extra` gets gradients only there
        micro = [(x, y if k == 0 else y.clamp(max=2)) for k, (x, y) in enumerate(micro)]
        ref_opt.zero_grad()
        for x, y in micro:
            _loss(reference(x, y), y).backward()
        ref_opt.step()
        dp_opt.zero_grad()
        with model.no_sync():
            for x, y in micro[:-1]:
                _loss(model(x[mine], y[mine]), y[mine]).backward()
        x, y = micro[-1]
        _loss(model(x[mine], y[mine]), y[mine]).backward()
        dp_opt.step()
        model.flush()
        torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
        _same_on_all_ranks(comm, local)


def test_without_optimizer_grads_are_averaged_after_backward(comm):
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    local = copy.deepcopy(reference)
    model = DataParallel(local, comm)
    x, y = _data(0, P * B)
    _loss(reference(x, y), y).backward()
    mine = slice(r * B, (r + 1) * B)
    _loss(model(x[mine], y[mine]), y[mine]).backward()
    for (name, p), q in zip(local.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


@pytest.mark.parametrize("fuse_from", [1, None], ids=["fused-with-copies", "one-pass"])
def test_the_division_is_folded_into_packing(comm, monkeypatch, fuse_from):
    """With no codec each gradient is divided by P as it is packed (with its copy, or in place
    when ``.grad`` is already the bucket view; a bucket of small parameters in one pass at its
    launch) and the all-reduce only sums: ``.grad`` is bit for bit the MPI sum of the ``g_r / P``
    packed the same way. A codec keeps dividing after the sum."""
    if fuse_from is not None:
        monkeypatch.setattr(gradsync, "_FUSE_MIN_NUMEL", fuse_from)
    P = comm.size
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    plain = copy.deepcopy(local)
    model = DataParallel(local, comm, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    sync = model.grad_sync
    twin = dict(zip(map(id, local.parameters()), plain.parameters()))
    for step, set_to_none in enumerate([True, True, False, False]):
        x, y = _data(100 * comm.rank + step, B)
        for m in (local, plain):
            m.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(plain(x), y).backward()
        nn.functional.cross_entropy(model(x), y).backward()
        if sync.passthrough:  # one rank: .grad is the local gradient, untouched
            assert all(torch.equal(p.grad, twin[id(p)].grad) for p in local.parameters())
            continue
        assert sync._fold == P and all(sync._fused) == (fuse_from is not None)
        for bucket in sync.buckets:
            packed = torch.cat([twin[id(p)].grad.reshape(-1) / P for p in bucket.params] +
                               [torch.ones(len(bucket.params))])
            comm.Iallreduce(hl.MPI.IN_PLACE, packed, hl.MPI.SUM).Wait()
            for p, offset in zip(bucket.params, bucket.offsets):
                expected = packed[offset:offset + p.numel()].view_as(p)
                assert torch.equal(p.grad, expected), f"step {step}"
        if not set_to_none:  # accumulated in place into the bucket views
            views = {v.data_ptr() for b in sync.buckets for v in b.views}
            assert all(p.grad.data_ptr() in views for p in local.parameters())
    bf16 = DataParallel(copy.deepcopy(plain), comm, codec="bf16")
    x, y = _data(comm.rank, B)
    nn.functional.cross_entropy(bf16(x), y).backward()
    assert bf16.grad_sync._fold is None
    bf16.close()
    model.close()


class _OneUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 4)
        self.never = nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


class _Wide(nn.Module):
    """A 1 MiB weight (summed in place by default) between small layers; ``wide`` is used only
    on ranks whose batch holds class 3, ``idle`` (also 1 MiB) never."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 512)
        self.wide = nn.Linear(512, 512)
        self.idle = nn.Linear(512, 512, bias=False)
        self.out = nn.Linear(512, 4)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if bool((y == 3).any()):
            h = h + torch.tanh(self.wide(h))
        return self.out(h)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_large_gradients_summed_in_place_equal_the_copied_path_bit_for_bit(comm, monkeypatch,
                                                                           blocking):
    """A parameter of at least ``INPLACE_MIN_BYTES`` gets a bucket of its own and its gradient
    is divided and summed where backward left it (no copy: ``.grad`` is still the tensor
    backward made), except on a rank without that gradient, which sums zeros from the bucket
    and learns from the summed flags whether any rank used it. Every step gives bitwise the
    gradients and parameters of the copying path (with MPICH; ``_same_sum``), the same on every
    rank; a parameter no rank used keeps ``.grad`` None."""
    torch.manual_seed(0)
    nets = [_Wide(), None]
    nets[1] = copy.deepcopy(nets[0])
    opts, models = [], []
    for net, threshold in zip(nets, [gradsync.INPLACE_MIN_BYTES, 1 << 62]):
        monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES", threshold)
        opts.append(DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1,
                                                          momentum=0.9), blocking=blocking))
        models.append(DataParallel(net, comm, optimizer=opts[-1]))
    in_place, copied = models
    several = comm.size > 1
    assert any(in_place.grad_sync._solo) == several and not any(copied.grad_sync._solo)
    made = {}
    nets[0].wide.weight.register_post_accumulate_grad_hook(
        lambda p: made.__setitem__("wide", p.grad.data_ptr()))
    for step in range(4):
        x, y = _data(10 * comm.rank + step, B)
        if step == 1:
            y = torch.full_like(y, 3) if comm.rank == 0 else torch.zeros_like(y)  # rank 0 only
        made.clear()
        for model, opt in zip(models, opts):
            opt.zero_grad()
            _loss(model(x, y), y).backward()
            if not blocking:
                opt.synchronize()
        for (name, p), q in zip(nets[0].named_parameters(), nets[1].parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name}"
            if p.grad is not None:
                _same_sum(comm, p.grad, q.grad, f"step {step}: {name}")
        assert nets[0].idle.weight.grad is None
        if "wide" in made and several:  # this rank had the gradient: summed where it was made
            assert nets[0].wide.weight.grad.data_ptr() == made["wide"]
        for opt in opts:
            opt.step()
        for model in models:
            model.flush()
        _same_sum(comm, _flat(nets[0]), _flat(nets[1]), f"step {step}")
        _same_on_all_ranks(comm, nets[0])
    for model in models:
        model.close()


@pytest.mark.mpi(min_size=2)
def test_a_bucket_summed_in_place_allocates_no_buffer_until_a_rank_lacks_the_gradient(comm):
    """Gradient memory is the bare model's: the bucket of a gradient summed in place gets no
    buffer while every rank has that gradient. A rank without it (a parameter unused there or
    everywhere) allocates the bucket to sum zeros from; the averages are those of the local
    gradients all-reduced by hand, on every rank."""
    from mpi4py import MPI

    torch.manual_seed(0)
    net = _Wide()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt)
    sync = model.grad_sync

    def bucket(p):
        return sync.buckets[sync._where[id(p)][0]]

    for step in range(4):
        x, y = _data(10 * comm.rank + step, B)
        if step < 3:
            y[0] = 3  # every rank uses `wide`
        else:
            y = torch.full_like(y, 3) if comm.rank == 0 else torch.zeros_like(y)  # rank 0 only
        local = copy.deepcopy(net)
        _loss(local(x, y), y).backward()
        opt.zero_grad()
        _loss(model(x, y), y).backward()
        # the plan is rebuilt in the second step: look at the buckets of this one
        assert bucket(net.wide.weight).materialized == (step == 3 and comm.rank != 0), step
        assert bucket(net.idle.weight).materialized, step  # no rank has its gradient
        assert net.idle.weight.grad is None
        mine = local.wide.weight.grad
        mine = torch.zeros_like(net.wide.weight) if mine is None else mine
        expected = torch.from_numpy(comm.handle.allreduce(mine.numpy(), MPI.SUM)) / comm.size
        torch.testing.assert_close(net.wide.weight.grad, expected, rtol=1e-6, atol=1e-7)
        opt.step()
    model.close()


def _same_sum(comm, a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    """Bitwise equal where the sums' grouping cannot depend on the element count: 2 ranks (one
    addition), or MPICH's all-reduce on one node or on at most two nodes of at most two ranks
    (where the node-aware sum, which a bucket's byte size selects, groups as MPICH does); else
    equal to the last bit's rounding. With the host buffers' shared-memory sum on
    (``HEATLIKE_NODE_REDUCE_HOST=1``), on one node of more than two ranks a bucket's byte size
    also selects that sum (rank order), which groups otherwise."""
    from mpi4py import MPI

    from heatlike.core import _nodereduce
    from heatlike.core.topology import get_topology

    topo = get_topology(comm)
    grouped_alike = topo.num_nodes == 1 or (topo.num_nodes <= 2 and max(topo.local_sizes) <= 2)
    grouped_alike = grouped_alike and not (comm.size > 2 and _nodereduce.host_enabled() and
                                           _nodereduce.one_node(comm))
    if comm.size <= 2 or ("MPICH" in MPI.Get_library_version() and grouped_alike):
        assert torch.equal(a, b), msg
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=msg)


@pytest.mark.mpi(min_size=2)
def test_an_in_place_gradient_changed_in_flight_is_reported(comm):
    """Non-blocking: a gradient summed in place is the exchange's buffer until the deferred
    update uses it; changing it (or replacing it) before step() raises on every rank that did,
    as for a copied one, and synchronize() recovers."""
    torch.manual_seed(0)
    net = _Wide()
    dp_opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
    model = DataParallel(net, comm, optimizer=dp_opt)
    for change in ("in place", "replaced"):
        x, y = _data(comm.rank, B)
        y[0] = 3  # every rank uses ``wide``
        dp_opt.zero_grad()
        _loss(model(x, y), y).backward()
        if change == "in place":
            torch.nn.utils.clip_grad_norm_([net.wide.weight], 1e-3)
        else:
            net.wide.weight.grad = net.wide.weight.grad.clone()
        with pytest.raises(RuntimeError, match=r"wide\.weight'\] were changed between backward"):
            dp_opt.step()
        dp_opt.synchronize()
        dp_opt.step()
        model.flush()
        _same_on_all_ranks(comm, net)
    model.close()


class _Concatenated(nn.Module):
    """Two 1 MiB weights used through ``torch.cat``: autograd gives their gradients one buffer
    (so one version counter)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(512, 512, generator=g) * 0.01)
        self.b = nn.Parameter(torch.randn(512, 512, generator=g) * 0.01)

    def forward(self, x, y=None):
        return nn.functional.linear(x, torch.cat([self.a, self.b], 0))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_gradients_sharing_a_buffer_or_a_tensor_are_averaged_as_copied_ones(comm, sums,
                                                                            blocking):
    """Gradients that share one storage (a ``torch.cat`` of parameters) and one tensor assigned as
    the gradient of two parameters are averaged exactly as when copied: in place, the division
    of one would change the other (and the in-flight check would report the engine's own
    division as the user's change); such gradients are copied."""
    net = _Concatenated()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    reference = _Concatenated()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-3)
    probe = _Concatenated()
    probe(torch.ones(1, 512)).sum().backward()
    assert probe.a.grad.untyped_storage().data_ptr() == \
        probe.b.grad.untyped_storage().data_ptr(), "the case this test is about"
    P = comm.size
    for step in range(3):
        xs = [torch.randn(4, 512, generator=torch.Generator().manual_seed(10 * r + step))
              for r in range(P)]
        opt.zero_grad()
        model(xs[comm.rank]).pow(2).sum().backward()
        ref_opt.zero_grad()
        sum(reference(x).pow(2).sum() for x in xs).div(P).backward()
        opt.step()  # non-blocking: no "changed between backward() and step()"
        model.flush()
        ref_opt.step()
        torch.testing.assert_close(_flat(net), _flat(reference), **TOL, msg=f"step {step}")
        _same_on_all_ranks(comm, net)
    shared = torch.full((512, 512), float(comm.rank + 1))
    opt.zero_grad()
    net.a.grad, net.b.grad = shared, shared  # one tensor, two parameters' gradients
    opt.step()  # no backward on any rank: the step launches the buckets
    model.flush()
    expected = torch.full((512, 512), (P + 1) / 2)
    assert torch.equal(net.a.grad, expected) and torch.equal(net.b.grad, expected)
    model.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_a_post_accumulate_hook_registered_after_the_wrapper_is_part_of_the_average(
        comm, sums, blocking):
    """The engine takes a gradient once every post-accumulate-grad hook of its parameter has
    run, the user's own registered after DataParallel included: a hook that halves ``.grad``
    in place halves the average, on the copying path and in place alike (before, the copy
    ignored it, and in place it would have raced with the all-reduce)."""
    nets = [_Wide(), None]
    nets[1] = copy.deepcopy(nets[0])
    models, opts = [], []
    for net in nets:
        opts.append(DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                          blocking=blocking))
        models.append(DataParallel(net, comm, optimizer=opts[-1]))

    def halve(p):
        p.grad.mul_(0.5)

    for p in nets[0].parameters():
        p.register_post_accumulate_grad_hook(halve)
    x, y = _data(comm.rank, B)
    y[0] = 3
    for model, opt in zip(models, opts):
        opt.zero_grad()
        _loss(model(x, y), y).backward()
        opt.synchronize()
    for (name, p), q in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, 0.5 * q.grad), name
    for opt, model in zip(opts, models):
        opt.step()
        model.flush()
        model.close()


@pytest.mark.mpi(min_size=2)
def test_the_flags_sum_is_started_once_per_step_whatever_is_written_back_first(comm):
    """Non-blocking: a rank without a large gradient waits for the flags' sum when its bucket is
    written back (here by a forward that fails half way); a later ``sync_gradients()`` on every
    rank must not start that sum again on that rank only (the collectives would no longer
    match)."""
    torch.manual_seed(0)
    net = _Wide()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
    model = DataParallel(net, comm, optimizer=opt)
    x, y = _data(comm.rank, B)
    y = torch.full_like(y, 3) if comm.rank == 0 else torch.zeros_like(y)  # wide: rank 0 only
    opt.zero_grad()
    _loss(model(x, y), y).backward()
    opt.step()  # deferred

    def boom(*_):
        raise ValueError("boom")

    handle = net.out.register_forward_pre_hook(boom)  # after ``wide`` got its update
    with pytest.raises(ValueError, match="boom"):
        model(x, torch.full_like(y, 3))
    handle.remove()
    model.sync_gradients()
    model.flush()
    for step in range(2):
        x, y = _data(10 * comm.rank + step, B)
        opt.zero_grad()
        _loss(model(x, y), y).backward()
        opt.step()
        model.flush()
        _same_on_all_ranks(comm, net)
    model.close()


def test_a_non_finite_gradient_summed_in_place_raises_on_every_rank(comm):
    """check_finite sees a gradient summed in ``.grad`` as it sees a bucket: every rank raises
    FloatingPointError naming it, and the rank whose own gradient was NaN says so."""
    torch.manual_seed(0)
    net = _Wide()
    last = comm.size - 1

    def poison(p):  # runs before the engine's hook (registered first)
        p.grad.view(-1)[7] = float("nan")

    if comm.rank == last:
        net.wide.weight.register_post_accumulate_grad_hook(poison)
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt, check_finite=True)
    x, y = _data(comm.rank, B)
    y[0] = 3
    here = "were non-finite in" if comm.rank == last else "were finite"
    with pytest.raises(FloatingPointError,
                       match=rf"non-finite averaged gradients of \['wide\.weight'\].*"
                             rf"own gradients {here}"):
        _loss(model(x, y), y).backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16],
                         ids=["float64", "float16", "bfloat16"])
def test_gradients_of_every_float_type_are_averaged(comm, dtype):
    """Buckets of float64, float16 and bfloat16 parameters: ``.grad`` is the average of every
    rank's gradient, and a parameter no rank used keeps ``grad=None`` (its flag, which a
    bucket sets through a numpy view where numpy has the type, else in a host array copied
    into the bucket at its launch)."""
    torch.manual_seed(0)
    plain = _OneUsed().to(dtype)
    model = DataParallel(copy.deepcopy(plain), comm)

    def data(rank: int) -> torch.Tensor:
        return torch.randn(B, 6, generator=torch.Generator().manual_seed(rank)).to(dtype)

    expected = []
    for rank in range(comm.size):
        plain.zero_grad()
        plain(data(rank)).float().square().sum().backward()
        expected.append([p.grad.double() for p in plain.used.parameters()])
    model(data(comm.rank)).float().square().sum().backward()
    tol = {torch.float64: 1e-12, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for got, *each in zip(model.module.used.parameters(), *expected):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.double(), sum(each) / comm.size, rtol=tol, atol=tol)
    assert all(p.grad is None for p in model.module.never.parameters())
    model.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_rank_without_backward_does_not_hang(comm, blocking):
    """A rank that gets no data in a step (no backward at all) still takes part at step()."""
    local = Net(seed=0)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005)
    for step in range(3):
        dp_opt.zero_grad()
        if comm.rank != 1 or step == 1:
            x, y = _data(step, B)
            _loss(model(x, y), y).backward()
        dp_opt.step()
    model.flush()
    _same_on_all_ranks(comm, local)


@pytest.mark.mpi(min_size=2)  # one rank accumulates as plain torch does (nothing in flight)
def test_second_backward_without_step_is_an_error_in_nonblocking_mode(comm):
    local = Net(seed=0)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=False)
    model = DataParallel(local, comm, optimizer=dp_opt)
    x, y = _data(0, B)
    _loss(model(x, y), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(model(x, y), y).backward()
    # the second backward accumulated into a gradient whose average was in flight: step() says
    # so instead of applying a corrupted or outdated average; synchronize() recovers
    with pytest.raises(RuntimeError, match="changed between backward"):
        dp_opt.step()
    dp_opt.synchronize()
    dp_opt.step()
    model.flush()
    _same_on_all_ranks(comm, local)


@pytest.mark.parametrize("mode", ["broadcast", "average"])
def test_buffers_are_synchronized(comm, mode):
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.0))
    model = DataParallel(net, comm, sync_buffers=mode)
    bn = net[1]
    with torch.no_grad():
        bn.running_mean.fill_(float(comm.rank))
        bn.running_var.fill_(1.0 + comm.rank)
    model(torch.randn(5, 3))  # momentum 0: the forward itself leaves the statistics alone
    if mode == "broadcast":
        expected_mean, expected_var = 0.0, 1.0
    else:
        expected_mean = sum(range(comm.size)) / comm.size
        expected_var = 1.0 + expected_mean
    assert torch.allclose(bn.running_mean, torch.full((4,), expected_mean))
    assert torch.allclose(bn.running_var, torch.full((4,), expected_var))


@pytest.mark.parametrize("change", ["unfrozen", "added"])
def test_a_parameter_it_does_not_synchronize_is_refused_without_an_optimizer(comm, change):
    """DataParallel(module) with a torch optimizer: a parameter frozen at wrapping and unfrozen
    later, or a layer added after wrapping, would be trained with each rank's own gradient
    (the replicas drifted apart by 2e-2): the next training forward raises instead."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    net[0].requires_grad_(False)
    model = DataParallel(net, comm)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    if change == "unfrozen":
        net[0].requires_grad_(True)
        match = r"\['0.weight', '0.bias'\] did not require gradients when DataParallel"
    else:
        net[2] = nn.Linear(8, 4)
        match = r"\['2.weight', '2.bias'\] were added to the module after DataParallel"
    with pytest.raises(RuntimeError, match=match):
        model(x)
    with torch.no_grad():
        model.eval()(x)  # evaluation trains nothing: allowed


def test_a_state_dict_saved_from_ddp_loads_into_the_wrapper(comm):
    """DDP's ``state_dict()`` has the same ``module.`` keys and no ``_extra_state``: it loads
    with ``strict=True``; a key really missing or unexpected still raises, as in torch."""
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = DataParallel(net, comm)
    source = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ddp_style = {f"module.{k}": v + 1 if v.is_floating_point() else v
                 for k, v in source.state_dict().items()}
    result = model.load_state_dict(ddp_style)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in source.state_dict().items():
        expected = v + 1 if v.is_floating_point() else v
        assert torch.equal(net.state_dict()[k], expected), k
    broken = dict(ddp_style)
    del broken["module.0.bias"]
    broken["module.9.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"module.9.weight".*\n.*'
                                           r'Missing key\(s\).*"module.0.bias"'):
        model.load_state_dict(broken)
    model.load_state_dict(model.state_dict())  # its own, engine state included
    # the other way (docs/data_parallel.md, migration table): the engine's state is one key
    # beside the module's; a plain module takes model.module.state_dict()
    assert set(model.state_dict()) == {f"module.{k}" for k in net.state_dict()} | {"_extra_state"}
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    plain.load_state_dict(model.module.state_dict())
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in plain.state_dict().items())


def test_the_modules_state_dict_includes_the_last_nonblocking_update(comm):
    """``model.module.state_dict()`` right after a non-blocking ``step()`` (DDP's usual save
    call) applies the pending update first, as ``model.state_dict()`` does."""
    reference, local = Net(seed=0), Net(seed=0)
    ref_opt = DataParallelOptimizer(_optimizer("sgd", reference), blocking=True)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=False)
    ref_model = DataParallel(reference, comm, optimizer=ref_opt)
    model = DataParallel(local, comm, optimizer=dp_opt)
    for step in range(2):
        x, y = _data(step, B)
        for m, o in ((ref_model, ref_opt), (model, dp_opt)):
            o.zero_grad()
            _loss(m(x, y), y).backward()
            o.step()
    saved = model.module.state_dict()
    for name, value in ref_model.module.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["broadcast", "average"])
def test_synchronize_buffers_gives_every_rank_one_model(comm, mode):
    """Training on different batches per rank leaves each rank its own BatchNorm statistics;
    ``synchronize_buffers()`` makes them rank 0's (or their average) on every rank, so an
    evaluation after it (no collective) gives the same outputs everywhere; evaluation forwards
    themselves never communicate."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 3))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt, sync_buffers=mode)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        x = torch.randn(6, 1, 6, 6, generator=g) + comm.rank
        opt.zero_grad()
        _loss(model(x), torch.randint(0, 3, (6,), generator=g)).backward()
        opt.step()
    mine = net[1].running_mean.clone()
    everyone = comm.handle.allgather(mine)
    model.eval()
    if comm.size > 1:
        assert not all(torch.equal(m, mine) for m in everyone)  # each rank's own statistics
    model.synchronize_buffers()
    expected = everyone[0] if mode == "broadcast" else sum(everyone) / comm.size
    torch.testing.assert_close(net[1].running_mean, expected, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        out = model(torch.ones(2, 1, 6, 6))
    assert all(torch.equal(o, out) for o in comm.handle.allgather(out))
    for name, buffer in net.named_buffers():
        assert all(torch.equal(b, buffer) for b in comm.handle.allgather(buffer)), name


def test_buffers_registered_replaced_or_converted_after_wrapping_are_the_ones_synchronized(comm):
    """DataParallel finds the buffers without walking the module at every forward: a buffer
    registered after wrapping, one replaced by assignment, a submodule added, and buffers
    converted by ``module.double()`` are still the ones broadcast from rank 0."""
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.0))
    model = DataParallel(net, comm)
    model(torch.randn(5, 3))
    net[1].register_buffer("late", torch.full((2,), float(comm.rank)))
    # a submodule with buffers added later (without parameters: DataParallel refuses
    # parameters added after it was built)
    net.append(nn.BatchNorm1d(4, momentum=0.0, affine=False))
    net[2].running_mean = torch.full((4,), 10.0 + comm.rank)  # replaced by assignment
    model(torch.randn(5, 3))
    assert torch.equal(net[1].late, torch.zeros(2))
    assert torch.equal(net[2].running_mean, torch.full((4,), 10.0))
    net.double()  # every buffer replaced by a float64 copy, with no registration
    with torch.no_grad():
        net[1].running_var.fill_(1.0 + comm.rank)
        # (a forward that builds a graph raises: the gradient buckets are float32)
        model(torch.randn(5, 3, dtype=torch.float64))
    assert torch.equal(net[1].running_var, torch.ones(4, dtype=torch.float64))
    model.close()


def test_module_buffers_follow_every_change_of_the_module():
    """``ModuleBuffers(m)()`` equals ``list(m.buffers())`` (identity and order) after
    registrations, assignments, conversions, deletions, shared submodules and shared tensors."""
    from heatlike.nn.buffers import ModuleBuffers

    shared = nn.BatchNorm1d(3)
    net = nn.Sequential(nn.Linear(3, 3), shared, nn.Sequential(shared, nn.BatchNorm1d(3)))
    found = ModuleBuffers(net)

    def same():
        mine, torch_s = found(), list(net.buffers())
        assert len(mine) == len(torch_s) and all(a is b for a, b in zip(mine, torch_s))

    same()
    net[0].register_buffer("extra", torch.zeros(1))
    same()
    net[0].extra = torch.ones(1)
    same()
    net[0].register_buffer("alias", net[2][1].running_mean)  # one tensor under two names
    same()
    net.half()
    same()
    del net[0].extra
    same()
    net.add_module("more", nn.BatchNorm1d(3))
    same()
    net[0].register_buffer("nothing", None)
    same()
    del net.more  # no registration hook runs for a deleted submodule
    same()
    del net[2][1]  # nor for one deleted from a Sequential below the top
    same()
    inner = net[2]
    del net[2]  # the shared BatchNorm is still reachable as net[1]
    same()
    inner.add_module("late", nn.BatchNorm1d(2))  # outside the module: nothing changes
    same()


def test_module_buffers_follow_structural_changes_that_call_no_hook():
    """Submodules built earlier and inserted by writes to ``_modules`` that call no registration
    hook (``nn.Sequential.insert``, ``nn.ModuleList.insert``, direct writes: a replacement, a
    child given to a leaf, one deleted and one added between two calls) are found."""
    from heatlike.nn.buffers import ModuleBuffers

    early = [nn.BatchNorm1d(4) for _ in range(6)]  # built (registered) before the first call
    net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.ModuleList([nn.ReLU()]),
                        nn.Sequential(), nn.Linear(4, 4), nn.Tanh())
    found = ModuleBuffers(net)

    def same():
        mine, torch_s = found(), list(net.buffers())
        assert len(mine) == len(torch_s) and all(a is b for a, b in zip(mine, torch_s))

    same()
    net.insert(1, early[0])  # between a BatchNorm and a Linear
    same()
    net[3].insert(1, early[1])  # at the end of a ModuleList
    same()
    net[4].insert(0, early[2])  # into an empty Sequential
    same()
    net._modules["6"] = early[3]  # a module without buffers replaced by one with them
    same()
    net[5]._modules["inner"] = early[4]  # a child for a leaf
    same()
    del net[3][0]  # one deleted (no hook) ...
    net[6]._modules["inner"] = early[5]  # ... and one added at once: the total size is the same
    same()


def test_buffers_of_a_module_inserted_after_wrapping_are_synchronized(comm):
    """A BatchNorm built before wrapping and inserted with ``nn.Sequential.insert`` afterwards
    (no registration hook runs) has its statistics broadcast from rank 0 like the others: after
    ``synchronize_buffers()`` every rank holds what one process running rank 0's batches holds."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 2))

    def batches(rank):
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(8, 4, generator=g) * (1 + rank) for _ in range(4)]

    late, ref_late = nn.BatchNorm1d(4, affine=False), nn.BatchNorm1d(4, affine=False)
    net, reference = build(), build()
    model = DataParallel(net, comm)
    for step, x in enumerate(batches(comm.rank)):
        if step == 1:
            net.insert(2, late)
        model(x).sum().backward()
    for step, x in enumerate(batches(0)):  # one process, rank 0's batches
        if step == 1:
            reference.insert(2, ref_late)
        reference(x).sum().backward()
    model.synchronize_buffers()
    for (name, mine), ref in zip(net.named_buffers(), reference.buffers()):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7, msg=name)
        assert all(torch.equal(b, mine) for b in comm.handle.allgather(mine)), name
    model.close()


def test_bf16_codec_halves_bytes_and_stays_close(comm):
    reference = Net(seed=0)
    ref_opt = _optimizer("sgd", reference)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=True)
    model = DataParallel(local, comm, optimizer=dp_opt,
                         codec=hl.engine.Cast(torch.bfloat16))
    for step in range(3):
        _step_both(comm, model, dp_opt, reference, ref_opt, step)
    torch.testing.assert_close(_flat(local), _flat(reference), rtol=2e-2, atol=2e-3)
    _same_on_all_ranks(comm, local)
    numel = sum(b.buffer.numel() for b in model.grad_sync.buckets)
    assert model.grad_sync.bytes_sent == 3 * 2 * numel


def test_bad_construction_fails_on_every_rank(comm):
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DataParallelOptimizer("sgd")
    with pytest.raises(TypeError, match="nn.Module"):
        DataParallel("not a module", comm)
    net = Net(seed=0)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not own"):
        DataParallel(net, comm, optimizer=DataParallelOptimizer(torch.optim.SGD(
            other.parameters(), lr=0.1)))
    with pytest.raises(TypeError, match="DataParallelOptimizer"):
        DataParallel(net, comm, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="sync_buffers"):
        DataParallel(net, comm, sync_buffers="sometimes")
    if comm.size > 1:  # a module built differently on one rank
        width = 5 if comm.rank == comm.size - 1 else 4
        with pytest.raises(ValueError, match="differs between ranks"):
            DataParallel(nn.Linear(3, width), comm)
        extra = [nn.Linear(2, 2)] if comm.rank == 0 else []
        with pytest.raises(ValueError, match="differs between ranks"):
            DataParallel(nn.Sequential(nn.Linear(2, 2), *extra), comm)
    with pytest.raises(RuntimeError, match="not attached"):
        DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1)).step()


@pytest.mark.mpi(min_size=2)  # one rank has nothing to launch
def test_buckets_launch_during_backward(comm):
    """After the first step the buckets follow the gradient arrival order, so all but the
    bucket of the first layer are on the wire before backward ends."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt, bucket_cap_mb=0.004, first_bucket_mb=0.001)
    nb = len(model.grad_sync.buckets)
    assert nb >= 3
    seen = []  # buckets launched when the last gradient (first layer's weight) arrives
    net[0].weight.register_post_accumulate_grad_hook(
        lambda _p: seen.append(model.grad_sync._next))
    for step in range(4):
        x, y = _data(step, B)
        opt.zero_grad()
        _loss(model(torch.cat([x, x[:, :2]], 1)), y).backward()
        opt.step()
    assert all(n >= nb - 1 for n in seen[1:]), (seen, nb)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("deferred", [False, True], ids=["torch-optimizer", "deferred"])
def test_a_step_its_verdict_refuses_issues_nothing_and_the_next_steps_train(comm, monkeypatch,
                                                                            deferred):
    """The step board's verdict on a training step (``StepBoard.confirm``) is taken in the
    backward pass, before the step's first exchange. Where it raises (here on every rank, as a
    verdict that a rank ended or runs another step does), the backward pass fails, nothing of
    the step is issued then or by a later ``synchronize()``, and the steps that follow train
    the single process's model. Before, the refused cycle stayed active: ``synchronize()`` (or
    ``close()``) then started its exchanges with no verdict."""
    local = Net(0)
    reference = copy.deepcopy(local)
    opt, ref_opt = _optimizer("sgd", local), _optimizer("sgd", reference)
    if deferred:  # the update applied at the next forward
        opt = DataParallelOptimizer(opt, blocking=False)
    model = DataParallel(local, comm, optimizer=opt if deferred else None)
    sync = model.grad_sync
    board = sync._board
    confirm = board.confirm

    def refuse() -> None:
        monkeypatch.setattr(board, "confirm", confirm)
        raise RuntimeError("refused by the step board (test)")

    _step_both(comm, model, opt, reference, ref_opt, 0)
    monkeypatch.setattr(board, "confirm", refuse)
    x, y = _data(1, B)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="refused by the step board"):
        _loss(model(x, y), y).backward()
    assert not sync.active and not sync._requests
    sync.synchronize()
    assert not sync._requests, "synchronize() started the refused step's exchanges"
    for step in range(1, 4):
        _step_both(comm, model, opt, reference, ref_opt, step)
        model.flush()
        torch.testing.assert_close(_flat(local), _flat(reference), **TOL, msg=f"step {step}")
    _same_on_all_ranks(comm, local)
    model.close()


@pytest.mark.mpi(min_size=2)  # one rank has nothing to launch
def test_a_bucket_launches_at_its_last_gradient_when_no_hook_follows(comm):
    """Where the engine's hook is a parameter's last post-accumulate-grad hook, the gradient is
    final when the hook runs: the bucket it completes launches then, before the backward pass
    computes the layers below (taken at the engine's next event, it waited for the next
    gradient, a layer later). A probe between the layers records how many buckets are launched
    when the backward pass reaches it: those of the four parameters above it."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            seen.append(model.grad_sync._next)
            return g

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low, self.mid, self.top = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x):
            h = Probe.apply(torch.relu(self.low(x)))
            return self.top(torch.relu(self.mid(h)))

    torch.manual_seed(0)
    net = Net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    assert len(model.grad_sync.buckets) == 6  # one per parameter
    for step in range(3):
        x, y = _data(step, B)
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    assert seen == [4, 4, 4]
    model.close()


def test_hold_from_holds_what_the_link_cannot_carry_during_the_backward_pass():
    """The rule of held buckets (``heatlike.engine.gradsync.hold_from``): on one link of the
    cycle's measured rate, in launch order, a bucket starts as it fills where the link is idle
    then or would be done with it by the end of the backward pass; the first that is neither is
    the first held."""
    def timing(ready, end, waited):
        t = gradsync._CycleTiming(len(ready))
        t.ready, t.first_start, t.end, t.waited = list(ready), ready[0], end, waited
        return t

    # 40 bytes in 8 s: 2 s per bucket; bucket 1 would be done at 4 s, after the end (3.5 s)
    assert gradsync.hold_from(timing([0, 1, 2, 3], 3.5, 8.0), [10] * 4) == 1
    assert gradsync.hold_from(timing([0, 1, 2, 3], 6.5, 8.0), [10] * 4) == 3
    # a fast link: each bucket done before the next fills
    assert gradsync.hold_from(timing([0, 1, 2, 3], 3.5, 0.8), [10] * 4) == 4
    # the link idle when a large bucket fills: it starts, whenever it would be done
    assert gradsync.hold_from(timing([0, 1], 1.5, 11.0), [10, 100]) == 2
    assert gradsync.hold_from(timing([0, 1], 1.5, 11.0), [100, 10]) == 1
    # no wait found an exchange in flight: the exchanges kept up, nothing is held
    assert gradsync.hold_from(timing([0, 1, 2, 3], 3.5, None), [10] * 4) == 4


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_held_buckets_start_last_launched_first_and_change_no_result(comm, kind, sums,
                                                                     monkeypatch):
    """Non-blocking: the buckets held to the end of the backward pass start from the last
    launched (the order in which the next forward pass uses them). Rank 0's choice (forced
    here: hold from bucket 1), agreed at the end of a backward pass from the cycle before,
    holds on every rank from the fourth cycle on (the plan is rebuilt in the second); the
    model is the single process's with the combined batch, updates applied as the forward
    passes use them."""
    monkeypatch.setattr(gradsync, "hold_from", lambda timing, nbytes: 1)
    r = comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer(kind, reference)
    local = Net(seed=100 + r)
    if r == 0:  # (rank 0's parameters are broadcast)
        local.load_state_dict(reference.state_dict())
    dp_opt = DataParallelOptimizer(_optimizer(kind, local), blocking=False)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005,
                         first_bucket_mb=0.0005)
    started = []
    exchange = model.grad_sync._exchange

    def spy(bucket):
        started.append(bucket.index)
        return exchange(bucket)

    model.grad_sync._exchange = spy
    orders = []
    for step in range(6):
        _step_both(comm, model, dp_opt, reference, ref_opt, step)
        orders.append(started[:])
        started.clear()
    model.flush()
    torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    _same_on_all_ranks(comm, local)
    if not model.grad_sync.passthrough:
        n = len(model.grad_sync.buckets)
        assert n >= 3
        assert all(order == sorted(order) for order in orders[:3]), orders
        assert orders[3:] == [[0, *range(n - 1, 0, -1)]] * 3, orders
    model.close()


@pytest.mark.parametrize("zero_grad_after_forward", [False, True],
                         ids=["zero-grad-first", "zero-grad-after-forward"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_find_unused_parameters(comm, blocking, zero_grad_after_forward):
    """Walking the graph launches the buckets of unused parameters early and changes no
    result, also where ``zero_grad()`` comes between forward and backward (an unused
    parameter's gradient is taken in the backward pass, as DDP takes it: taken at the forward,
    the last step's gradient was averaged again, 3e-2 to 1e-1 off)."""
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer("sgd", reference)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005,
                         find_unused_parameters=True)
    seen = []
    local.fc1.weight.register_post_accumulate_grad_hook(
        lambda _p: seen.append(model.grad_sync._next))
    mine = slice(r * B, (r + 1) * B)
    for step in range(4):
        x, y = _data(step, P * B)
        ref_opt.zero_grad()
        _loss(reference(x, y), y).backward()
        ref_opt.step()
        if zero_grad_after_forward:
            out = model(x[mine], y[mine])
            dp_opt.zero_grad(set_to_none=step % 2 == 1)
        else:
            dp_opt.zero_grad(set_to_none=step % 2 == 1)
            out = model(x[mine], y[mine])
        _loss(out, y[mine]).backward()
        dp_opt.step()
        model.flush()
        torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    nb = len(model.grad_sync.buckets)
    assert model.grad_sync.passthrough or all(n >= nb - 1 for n in seen[1:]), (seen, nb)
    _same_on_all_ranks(comm, local)


def test_find_unused_parameters_looks_inside_dataclass_outputs(comm):
    """A forward returning a dataclass (as many model libraries do): the parameters reached
    through its fields are used (they were taken for unused, and their gradients then raised)."""
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        extra: torch.Tensor

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.unused = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)

        def forward(self, x):
            h = self.body(x)
            return Output(self.head(h), h.sum(1))

    torch.manual_seed(0)
    net = Net2()
    reference = copy.deepcopy(net)
    model = DataParallel(net, comm, find_unused_parameters=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(comm.size * 2, 3, generator=g)
    mine = x[comm.rank * 2:(comm.rank + 1) * 2]
    out = model(mine)
    (out.logits.square().mean() + out.extra.mean()).backward()
    ref = reference(x)
    (ref.logits.square().mean() + ref.extra.mean()).backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_find_unused_parameters_names_a_gradient_from_outside_the_forward(comm):
    """With ``find_unused_parameters`` a parameter the forward's output does not reach is
    launched as unused; a loss term on it outside the forward then gives it a gradient anyway.
    The error names the parameter and the cause (it blamed a second backward pass)."""
    if comm.size == 1:
        pytest.skip("one rank averages nothing: no parameter is launched early")
    net = nn.Sequential(nn.Linear(3, 2))
    extra = nn.Linear(2, 2)
    holder = nn.ModuleDict({"body": net, "extra": extra})
    holder.forward = net.forward
    model = DataParallel(holder, comm, find_unused_parameters=True)
    loss = model(torch.randn(4, 3)).sum() + extra.weight.square().sum()
    with pytest.raises(RuntimeError, match=r"'extra.weight' received a gradient although the "
                                           r"forward's output does not reach it"):
        loss.backward()


def test_buckets_are_rebuilt_in_arrival_order(comm):
    """A parameter that got no gradient in the first step moves to the last bucket, identically
    on every rank."""
    local = Net(seed=0)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=True)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005)
    sync = model.grad_sync
    assert any(p is local.never.weight for p in sync.buckets[0].params)  # reverse order
    for step in range(2):
        x, y = _data(step, B)
        dp_opt.zero_grad()
        _loss(model(x, y), y).backward()
        dp_opt.step()
    assert any(p is local.never.weight for p in sync.buckets[-1].params)
    plan = [[id(p) for p in b.params] for b in sync.buckets]
    names = {id(p): n for n, p in local.named_parameters()}
    mine = [[names[i] for i in bucket] for bucket in plan]
    assert comm.handle.allgather(mine) == [mine] * comm.size


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_gradients_live_in_the_buckets(comm, blocking):
    """With zero_grad(set_to_none=False) the gradients stay views of the bucket buffers (no
    copies) and training still matches the single process."""
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer("adam", reference)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(_optimizer("adam", local), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=0.0005)
    mine = slice(r * B, (r + 1) * B)
    for step in range(4):
        x, y = _data(step, P * B)
        ref_opt.zero_grad(set_to_none=False)
        _loss(reference(x, y), y).backward()
        ref_opt.step()
        dp_opt.zero_grad(set_to_none=False)
        _loss(model(x[mine], y[mine]), y[mine]).backward()
        dp_opt.step()
        model.flush()
        torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    sync = model.grad_sync
    if sync.passthrough:
        return  # one rank: the gradients stay where backward put them
    views = {v.data_ptr() for b in sync.buckets for v in b.views}
    assert all(p.grad.data_ptr() in views for p in (local.fc1.weight, local.fc2.bias))


def test_one_rank_does_no_work_and_equals_the_bare_model():
    """World size 1 with a lossless codec: no hooks, no copies, no collectives, and bit for bit
    the bare model's training (both modes, with the module's own communicator of one rank)."""
    one = hl.MPI_WORLD.Split(hl.MPI_WORLD.rank)
    calls = []
    for name in ("Bcast", "Ibcast", "Allreduce", "Iallreduce", "Allgather", "Iallgather"):
        setattr(one, name, lambda *a, _name=name, **k: calls.append(_name))
    for blocking in (True, False):
        bare, local = Net(seed=0), Net(seed=0)
        bare_opt = _optimizer("adam", bare)
        dp_opt = DataParallelOptimizer(_optimizer("adam", local), blocking=blocking)
        model = DataParallel(local, one, optimizer=dp_opt)
        assert calls == []  # before: the initial broadcast packed and sent the whole model
        assert model.grad_sync.passthrough and not model.grad_sync._hooks
        for step in range(3):
            x, y = _data(step, B)
            for m, o in ((bare, bare_opt), (model, dp_opt)):
                o.zero_grad()
                _loss(m(x, y), y).backward()
                o.step()
            assert torch.equal(_flat(local), _flat(bare))
        assert model.grad_sync.bytes_sent == 0 and calls == []
    for name in ("Bcast", "Ibcast", "Allreduce", "Iallreduce", "Allgather", "Iallgather"):
        delattr(one, name)
    one.Free()


@pytest.mark.parametrize("flag", [True, False])
def test_heat_s_constructor_call_selects_the_mode(comm, flag):
    """Heat's DataParallel(module, comm, optimizer, blocking_parameter_updates): the module's
    flag sets the optimizer's mode (in Heat it overrides the optimizer's ``blocking``), a list
    holding one optimizer is accepted, and training matches the single process."""
    P, r = comm.size, comm.rank
    reference = Net(seed=0)
    ref_opt = _optimizer("sgd", reference)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=not flag)
    model = DataParallel(local, comm, [dp_opt], blocking_parameter_updates=flag)
    assert dp_opt.blocking is flag and dp_opt.blocking_parameter_updates is flag
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        ref_opt.zero_grad()
        _loss(reference(x, y), y).backward()
        ref_opt.step()
        dp_opt.zero_grad()
        _loss(model(x[mine], y[mine]), y[mine]).backward()
        dp_opt.step()
    model.flush()
    torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    with pytest.raises(RuntimeError, match="fixed once DataParallel is built"):
        dp_opt.blocking_parameter_updates = not flag


def test_heat_s_calls_that_heatlike_cannot_honour_say_what_to_write(comm):
    net = Net(seed=0)
    two = [DataParallelOptimizer(_optimizer("sgd", net)) for _ in range(2)]
    with pytest.raises(ValueError, match="one parameter group per part"):
        DataParallel(net, comm, two)
    with pytest.raises(TypeError, match="blocking_parameter_updates must be a bool"):
        DataParallel(net, comm, two[0], blocking_parameter_updates="yes")
    with pytest.raises(ValueError, match="selects the mode of the optimizer"):
        DataParallel(net, comm, None, blocking_parameter_updates=True)


class _UsesChildParameters(nn.Module):
    """Parameters used without calling their module: ``nn.MultiheadAttention`` hands
    ``out_proj.weight`` to ``F.multi_head_attention_forward``, and the head's parameters are
    read directly (the head module is never called)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x, y=None):
        h = self.embed(x.view(-1, 2, 3).repeat(1, 1, 2))
        h, _ = self.attn(h, h, h, need_weights=False)
        return nn.functional.linear(h.mean(1), self.head.weight, self.head.bias)


def test_deferred_updates_reach_parameters_used_without_their_module(comm):
    """Non-blocking updates with one bucket per parameter on a model that uses parameters of
    modules it never calls: every forward sees the updated parameters (it equals one process
    with the combined batch, step by step), where a hook before each module would have let
    ``out_proj`` and the head run with their old values."""
    P, r = comm.size, comm.rank
    reference = _UsesChildParameters(seed=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9),
                                   blocking=False)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=1e-6,
                         first_bucket_mb=1e-6)
    assert len(model.grad_sync.buckets) == len(list(local.parameters()))
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        out = model(x[mine])
        with torch.no_grad():
            torch.testing.assert_close(out, reference(x[mine]), **TOL)
        dp_opt.zero_grad()
        _loss(out, y[mine]).backward()
        dp_opt.step()
        ref_opt.zero_grad()
        _loss(reference(x), y).backward()
        ref_opt.step()
    model.close()
    torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    _same_on_all_ranks(comm, local)


def test_calling_the_wrapped_module_directly_applies_pending_updates_first(comm):
    """Non-blocking updates pending, the wrapped module called directly (not through the
    wrapper): every update is applied before its forward, which sees the updated parameters."""
    P, r = comm.size, comm.rank
    reference = _UsesChildParameters(seed=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(torch.optim.SGD(local.parameters(), lr=0.1), blocking=False)
    model = DataParallel(local, comm, optimizer=dp_opt, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    mine = slice(r * B, (r + 1) * B)
    x, y = _data(0, P * B)
    _loss(model(x[mine]), y[mine]).backward()
    dp_opt.step()
    _loss(reference(x), y).backward()
    ref_opt.step()
    with torch.no_grad():
        torch.testing.assert_close(local(x[mine]), reference(x[mine]), **TOL)
    assert not dp_opt._pending
    model.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_sparse_gradients_are_averaged_densely(comm, blocking):
    """``nn.Embedding(sparse=True)``: each rank's sparse gradient enters its bucket densely and
    the average comes back as a dense ``.grad``; the model equals one process with the combined
    batch (whose SGD applies the sparse gradients)."""
    P, r = comm.size, comm.rank
    reference = SparseEmbedding(40, 6, 4)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    local = copy.deepcopy(reference)
    dp_opt = DataParallelOptimizer(torch.optim.SGD(local.parameters(), lr=0.5), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt)
    mine = slice(r * B, (r + 1) * B)
    for step in range(3):
        x, y = _data(step, P * B)
        dp_opt.zero_grad()
        _loss(model(x[mine]), y[mine]).backward()
        dp_opt.step()
        ref_opt.zero_grad()
        _loss(reference(x), y).backward()
        assert reference.table.weight.grad.is_sparse
        ref_opt.step()
    model.flush()
    if not model.grad_sync.passthrough:  # one rank: .grad is what backward left
        assert local.table.weight.grad.layout == torch.strided
    model.close()
    torch.testing.assert_close(_flat(local), _flat(reference), **TOL)
    _same_on_all_ranks(comm, local)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_a_module_wrapped_again_is_synchronized_once(comm, blocking):
    """Wrapping a module a second time (a second training phase, a notebook cell run again)
    closes the earlier wrapper: its hooks leave the module and its buckets send nothing more.
    Before, every wrapper the module ever had kept synchronizing it (each step slower by one
    more all-reduce of the gradients). Training through the new wrapper still follows one
    process with the combined batch; the earlier wrapper refuses to train, on every rank."""
    reference = Net(seed=0)
    local = copy.deepcopy(reference)
    ref_opt = _optimizer("sgd", reference)
    first_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=blocking)
    first = DataParallel(local, comm, optimizer=first_opt)
    _train_side_by_side(comm, first, first_opt, reference, ref_opt, steps=2)
    sent = first.grad_sync.bytes_sent
    # the second phase: a new optimizer over the same parameters (its state starts afresh, as
    # the reference's does)
    ref_opt = _optimizer("sgd", reference)
    dp_opt = DataParallelOptimizer(_optimizer("sgd", local), blocking=blocking)
    model = DataParallel(local, comm, optimizer=dp_opt)
    assert first.grad_sync.closed
    hooks = [h for m in local.modules() for h in m._forward_pre_hooks.values()]
    assert [getattr(h.fn, "__self__", None) for h in hooks] == [model]
    _train_side_by_side(comm, model, dp_opt, reference, ref_opt, steps=3)
    assert first.grad_sync.bytes_sent == sent, "the earlier wrapper still exchanged gradients"
    with pytest.raises(RuntimeError, match="closed"):
        first(*_data(0, B))


def test_wrapping_again_over_other_ranks_raises_and_keeps_the_wrapper(comm):
    """A module still wrapped over the world cannot be wrapped again over half of it: closing
    the earlier wrapper would be collective over ranks that do not take part. Every rank of
    each half raises the same clear error, and the earlier wrapper goes on working."""
    if comm.size < 2:
        pytest.skip("needs two ranks to split")
    local = Net(seed=0)
    opt = DataParallelOptimizer(_optimizer("sgd", local))
    model = DataParallel(local, comm, optimizer=opt)
    half = comm.Split(comm.rank % 2, comm.rank)
    try:
        with pytest.raises(ValueError, match="other ranks"):
            DataParallel(local, half, optimizer=DataParallelOptimizer(_optimizer("sgd", local)))
    finally:
        half.Free()
    x, y = _data(0, B)
    opt.zero_grad()
    _loss(model(x, y), y).backward()
    opt.step()
    _same_on_all_ranks(comm, local)
    assert not model.grad_sync.closed


@pytest.mark.parametrize("kind", ["DataParallel", "DASO", "FP16Optimizer"])
def test_a_dropped_model_and_its_wrapper_are_freed(comm, kind, monkeypatch):
    """A model dropped with its wrapper is freed by the garbage collector: module, wrapper,
    gradient buckets. torch holds gradient hooks where the collector cannot see them, so a hook
    bound to the wrapper kept every model of a sweep alive (memory, hooks and communicators)
    until the end of the program; heatlike's gradient hooks hold their owner weakly."""
    import gc
    import weakref

    from heatlike.nn import DataParallelMultiGPU
    from heatlike.optim import DASO, FP16Optimizer

    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "2" if comm.size % 2 == 0 else "1")

    def build_and_train():
        net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        if kind == "DataParallel":
            opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        blocking=False)
            model = DataParallel(net, comm, optimizer=opt)
        elif kind == "DASO":
            opt = DASO(torch.optim.SGD(net.parameters(), lr=0.1), total_epochs=2, comm=comm,
                       warmup_epochs=1, cooldown_epochs=0)
            model = DataParallelMultiGPU(net, opt)
            opt.last_batch = 2
        else:
            net = net.half()
            model = opt = FP16Optimizer(net, average_world=True, comm=comm)
            opt.set_optimizer(torch.optim.SGD([opt.fp32_params], lr=0.1))
            for _ in range(2):
                opt.zero_grad()
                opt.backward_loss(net(torch.randn(4, 6).half()).float().sum())
                opt.step()
            return weakref.ref(net), weakref.ref(opt), weakref.ref(opt.sync)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 6)).sum().backward()
            opt.step()
        return weakref.ref(net), weakref.ref(model), weakref.ref(opt)

    refs = build_and_train()
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True], \
        "a dropped model or its wrapper is still alive"
