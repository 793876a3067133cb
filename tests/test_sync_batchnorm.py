"""heatlike.nn.SyncBatchNorm: P ranks normalize as one process does with the combined batch
(outputs, input/weight/bias gradients, running statistics), on every rank, at every size; in
DataParallel training; with uneven and empty batches; over a sub-communicator; and bad input
raises on every rank."""

from __future__ import annotations

import pytest
import torch
from _helpers import raises_on_every_rank
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel, SyncBatchNorm
from heatlike.optim import DataParallelOptimizer

pytestmark = pytest.mark.mpi

COMM = hl.MPI_WORLD
NORMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 1e-12, "rtol": 1e-12}


def _pair(dims: int, dtype: torch.dtype, **kwargs) -> tuple[nn.Module, SyncBatchNorm]:
    """A torch batch norm with random affine parameters and a SyncBatchNorm holding the same."""
    torch.manual_seed(1)
    ref = NORMS[dims](3, **kwargs).to(dtype)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 2.0)
            ref.bias.uniform_(-1.0, 1.0)
    sync = SyncBatchNorm(3, **kwargs).to(dtype)
    sync.load_state_dict(ref.state_dict())
    return ref, sync


def _check_against_combined(ref, sync, batches: list[int], dims: int, dtype, comm=COMM,
                            steps: int = 2) -> None:
    """Rank r normalizes ``batches[r]`` samples of the combined batch, the torch module all of
    them; everything a single process would get must match on every rank."""
    rank = comm.rank
    start = sum(batches[:rank])
    for step in range(steps):
        g = torch.Generator().manual_seed(10 + step)
        shape = (sum(batches), 3, *([4, 5, 2][:dims - 2]))
        full = (torch.randn(shape, generator=g, dtype=dtype) * 3 + 5)
        weights = torch.randn(shape, generator=g, dtype=dtype)
        xr = full.clone().requires_grad_()
        out_r = ref(xr)
        (out_r * weights).sum().backward()
        mine = slice(start, start + batches[rank])
        x = full[mine].clone().requires_grad_()
        out = sync(x)
        (out * weights[mine]).sum().backward()
        tol = _tol(dtype)
        torch.testing.assert_close(out, out_r[mine].detach(), **tol)
        torch.testing.assert_close(x.grad, xr.grad[mine], atol=tol["atol"] * 20,
                                   rtol=tol["rtol"] * 20)
        if ref.affine:  # each rank's part of the parameter gradients sums to the whole
            for mine_p, theirs in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
                total = mine_p.grad.clone()
                comm.Allreduce(hl.IN_PLACE, total)
                torch.testing.assert_close(total, theirs.grad, atol=tol["atol"] * 20,
                                           rtol=tol["rtol"] * 20)
                mine_p.grad = theirs.grad = None
        if ref.track_running_stats:
            torch.testing.assert_close(sync.running_mean, ref.running_mean, **tol)
            torch.testing.assert_close(sync.running_var, ref.running_var, **tol)
            assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1


@pytest.mark.parametrize("dims", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ranks_normalize_as_one_process_with_the_combined_batch(dims, dtype):
    ref, sync = _pair(dims, dtype)
    _check_against_combined(ref, sync, [3] * COMM.size, dims, dtype)


@pytest.mark.parametrize("kwargs", [{"momentum": None}, {"affine": False},
                                    {"track_running_stats": False}, {"eps": 0.1}],
                         ids=["cumulative-average", "no-affine", "no-running-stats", "eps"])
def test_the_options_of_batch_norm(kwargs):
    ref, sync = _pair(4, torch.float64, **kwargs)
    _check_against_combined(ref, sync, [2] * COMM.size, 4, torch.float64, steps=3)


def test_uneven_batches_and_an_empty_one():
    """Rank r holds r + (r == 1) samples: rank 0 none at all (its count is 0), 1 holds two."""
    if COMM.size == 1:
        pytest.skip("needs two ranks")
    ref, sync = _pair(4, torch.float64)
    _check_against_combined(ref, sync, [r + (r == 1) for r in range(COMM.size)], 4,
                            torch.float64)


def test_bfloat16_inputs_accumulate_in_float32():
    ref, sync = _pair(4, torch.float32)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2 * COMM.size, 3, 4, 4, generator=g) * 3 + 5
    mine = full[2 * COMM.rank:2 * COMM.rank + 2]
    out = sync(mine.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    expected = ref(full.to(torch.bfloat16).float())[2 * COMM.rank:2 * COMM.rank + 2]
    torch.testing.assert_close(out.float(), expected.detach(), atol=0.05, rtol=0.02)


def test_a_large_mean_keeps_torch_s_float32_precision():
    """Inputs of mean 1e3 and spread 1e-2 in float32: the errors against a float64 computation
    stay at torch's own float32 BatchNorm's (the shift of the two passes is corrected)."""
    torch.manual_seed(4)
    full = 1e3 + 1e-2 * torch.randn(16 * COMM.size, 3, 16, 16, dtype=torch.float64)
    weights = torch.randn_like(full)
    mine = slice(16 * COMM.rank, 16 * COMM.rank + 16)
    errors = {}
    for name, dtype in (("float64", torch.float64), ("torch", torch.float32),
                        ("heatlike", torch.float32)):
        norm = (SyncBatchNorm(3) if name == "heatlike" else nn.BatchNorm2d(3)).to(dtype)
        xs = (full[mine] if name == "heatlike" else full).to(dtype).clone().requires_grad_()
        out = norm(xs)
        (out * weights[mine if name == "heatlike" else slice(None)].to(dtype)).sum().backward()
        errors[name] = (out.detach().double(), xs.grad.double())
    reference = [t[mine] for t in errors.pop("float64")]
    torch_err = [float((a[mine] - r).abs().max()) for a, r in zip(errors["torch"], reference)]
    ours = [float((a - r).abs().max()) for a, r in zip(errors["heatlike"], reference)]
    assert all(o <= 3 * t + 1e-6 for o, t in zip(ours, torch_err)), (ours, torch_err)


def test_half_inputs_keep_float32_parameter_gradients():
    """A float16 input to float32 parameters (autocast's case): the bias gradient, a sum over
    40000 values of 2 per rank, stays float32 (80000 is no float16: it was inf)."""
    norm = SyncBatchNorm(2)
    x = torch.randn(40000, 2).to(torch.float16).requires_grad_()
    out = norm(x)
    assert out.dtype == torch.float16
    (2 * out.float()).sum().backward()
    assert norm.bias.grad.dtype == torch.float32 and x.grad.dtype == torch.float16
    torch.testing.assert_close(norm.bias.grad, torch.full((2,), 80000.0))


def test_a_second_derivative_raises_instead_of_being_wrong():
    norm = SyncBatchNorm(3)
    x = torch.randn(4, 3, requires_grad=True)
    (grad,) = torch.autograd.grad((norm(x) ** 3).sum(), x, create_graph=True)
    kinds = RuntimeError if COMM.size > 1 else ()  # one rank: torch's BatchNorm, differentiable
    if COMM.size > 1:
        raises_on_every_rank(COMM, kinds, lambda: grad.sum().backward(), "differentiate twice")
    else:
        grad.sum().backward()


def test_a_sub_communicator_normalizes_over_its_ranks_only():
    """process_group = the ranks of one parity: each group's statistics are its own."""
    group = COMM.Split(COMM.rank % 2, COMM.rank)
    try:
        ref, sync = _pair(4, torch.float64)
        sync.process_group = group
        rank_g = group.rank
        g = torch.Generator().manual_seed(20 + COMM.rank % 2)
        full = torch.randn(2 * group.size, 3, 3, 3, generator=g, dtype=torch.float64)
        out = sync(full[2 * rank_g:2 * rank_g + 2])
        torch.testing.assert_close(out, ref(full)[2 * rank_g:2 * rank_g + 2].detach(),
                                   **_tol(torch.float64))
        torch.testing.assert_close(sync.running_mean, ref.running_mean, **_tol(torch.float64))
    finally:
        group.Free()


def test_evaluation_is_local_and_can_run_on_one_rank():
    """eval() uses the running statistics without communicating: rank 0 alone evaluates."""
    ref, sync = _pair(4, torch.float32)
    _check_against_combined(ref, sync, [2] * COMM.size, 4, torch.float32, steps=1)
    ref.eval()
    sync.eval()
    if COMM.rank == 0:
        x = torch.randn(5, 3, 2, 2)
        torch.testing.assert_close(sync(x), ref(x))
    COMM.Barrier()


def _net(norm=nn.BatchNorm2d) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), norm(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 1, 6, 6, generator=g) * 2 + 1, torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_data_parallel_training_equals_one_process_with_the_combined_batch(blocking):
    """A conv net whose batch norms are converted: parameters and running statistics after
    four SGD steps equal one process's with the ranks' batches concatenated (plain BatchNorm)."""
    steps = 4
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(_batch(step, r) for r in range(COMM.size)))
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    net = SyncBatchNorm.convert_sync_batchnorm(_net())
    assert sum(isinstance(m, SyncBatchNorm) for m in net.modules()) == 2
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, COMM, opt)
    for step in range(steps):
        x, y = _batch(step, COMM.rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.flush()
    got, expected = net.state_dict(), ref.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=2e-5, rtol=2e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_convert_keeps_the_tensors_and_the_mode():
    inner = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 8))
    torch_sync = nn.SyncBatchNorm(8)
    net = nn.Sequential(nn.Linear(4, 8), inner, torch_sync, nn.InstanceNorm1d(8))
    net[1][0].eval()
    before = {n: t for n, t in net.state_dict(keep_vars=True).items()}
    converted = SyncBatchNorm.convert_sync_batchnorm(net, process_group=COMM)
    assert converted is net
    assert isinstance(net[1][0], SyncBatchNorm) and isinstance(net[2], SyncBatchNorm)
    assert not isinstance(net[3], SyncBatchNorm)  # instance norm is no batch norm
    assert not net[1][0].training and net[2].training
    assert net[2].process_group is COMM
    after = net.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    assert all(after[n] is t for n, t in before.items())  # the very same tensors
    alone = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(3))
    assert isinstance(alone, SyncBatchNorm) and alone.num_features == 3
    assert SyncBatchNorm.convert_sync_batchnorm(alone) is alone
    with pytest.raises(TypeError):
        SyncBatchNorm(3, process_group="world")


def test_an_input_one_rank_cannot_normalize_raises_on_every_rank():
    sync = SyncBatchNorm(3)
    last = COMM.rank == COMM.size - 1
    for bad in (torch.randn(2, 4, 3), torch.randn(6), torch.ones(2, 3, dtype=torch.int64),
                torch.randn(2, 3, 3, dtype=torch.float64)):  # float32 parameters
        x = bad if last else torch.randn(2, 3, 3)
        if COMM.size == 1:  # one process: torch's BatchNorm and its errors
            raises_on_every_rank(COMM, (ValueError, RuntimeError), lambda x=x: sync(x))
        else:
            raises_on_every_rank(COMM, ValueError, lambda x=x: sync(x), "SyncBatchNorm")
    untouched = int(sync.num_batches_tracked), sync.running_mean.clone()
    out = sync(torch.randn(2, 3, 3))  # the ranks are still in step
    assert untouched[0] == 0 and untouched[1].eq(0).all()  # a failed batch counts for nothing
    assert out.shape == (2, 3, 3) and int(sync.num_batches_tracked) == 1


def test_one_value_per_channel_raises_on_every_rank():
    sync = SyncBatchNorm(3)
    x = torch.randn(1 if COMM.rank == 0 else 0, 3)
    raises_on_every_rank(COMM, ValueError, lambda: sync(x),
                         "Expected more than 1 value per channel")


@pytest.fixture
def no_torch_distributed(monkeypatch):
    """As in a program that never started torch.distributed (another test of this process may
    have: the DDP benchmark's)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


def test_torch_sync_batchnorm_is_refused_by_data_parallel(no_torch_distributed):
    """Without a torch.distributed group torch's SyncBatchNorm would normalize each rank's batch
    alone, silently: DataParallel raises, naming the conversion."""
    net = nn.SyncBatchNorm.convert_sync_batchnorm(_net())
    raises_on_every_rank(COMM, ValueError, lambda: DataParallel(net, COMM),
                         "convert_sync_batchnorm")
    DataParallel(SyncBatchNorm.convert_sync_batchnorm(net), COMM).close()


def test_join_stands_in_for_sync_batchnorm_only_to_stop_every_rank():
    model = DataParallel(SyncBatchNorm.convert_sync_batchnorm(_net()), COMM)
    raises_on_every_rank(COMM, ValueError, lambda: hl.nn.Join([model]),
                         "Join cannot stand in for SyncBatchNorm")
    with hl.nn.Join([model], throw_on_early_termination=True):
        x, y = _batch(0, COMM.rank)
        nn.functional.cross_entropy(model(x), y).backward()
    model.close()
    # a centralized optimizer notices a rank out of inputs only after the forward: never
    net = SyncBatchNorm.convert_sync_batchnorm(_net())
    opt = hl.optim.CentralizedSGD(world_size=COMM.size, model=net, lr=0.1, comm=COMM)
    for throw in (False, True):
        raises_on_every_rank(COMM, ValueError, lambda throw=throw: hl.nn.Join(
            [opt], throw_on_early_termination=throw), "centralized optimizer")


def test_torch_sync_batchnorm_is_refused_by_the_centralized_optimizers_too(no_torch_distributed):
    net = nn.SyncBatchNorm.convert_sync_batchnorm(_net())
    raises_on_every_rank(COMM, ValueError, lambda: hl.optim.CentralizedSGD(
        world_size=COMM.size, model=net, lr=0.1, comm=COMM), "convert_sync_batchnorm")
