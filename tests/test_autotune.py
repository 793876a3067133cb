"""The autotuner: its rule against the formula in its docstring, the same choice on every rank,
and DataParallel with ``bucket_cap_mb="auto"`` still training exactly like one process."""

import pytest
import torch

import heatlike as hl
from heatlike.engine import Cast, LinkFit, autotune, choose_bucket_bytes, measure_allreduce
from heatlike.engine.autotune import MAX_BUCKET, MIN_BUCKET, MiB
from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer

pytestmark = pytest.mark.mpi
COMM = hl.MPI_WORLD


@pytest.mark.parametrize("alpha,beta,total", [(50e-6, 1 / 2e9, 100 * MiB),
                                              (1e-6, 1 / 10e9, 100 * MiB),
                                              (1e-3, 1 / 1e9, 100 * MiB),
                                              (50e-6, 1 / 2e9, 300_000)])
def test_bucket_rule_is_the_documented_formula(alpha, beta, total):
    link = LinkFit(alpha, beta)
    got = choose_bucket_bytes(link, total, overhead=0.1)
    wanted = alpha * 0.9 / (0.1 * beta)
    assert got == int(min(max(wanted, MIN_BUCKET), MAX_BUCKET, total))
    if MIN_BUCKET < wanted < min(MAX_BUCKET, total):
        assert link.alpha / link.time(got) == pytest.approx(0.1, rel=1e-4)


def test_bucket_rule_rejects_a_bad_overhead():
    with pytest.raises(ValueError, match="overhead"):
        choose_bucket_bytes(LinkFit(1e-5, 1e-9), 1 << 20, overhead=1.5)


def test_measurement_and_choice_are_the_same_on_every_rank():
    link = measure_allreduce(COMM, rounds=3)
    assert link.alpha > 0 and link.beta > 0
    assert len(set(COMM.handle.allgather((link.alpha, link.beta)))) == 1
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 10))
    choice = autotune(model, COMM, allow_lossy=True, rounds=3)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert 0 < choice.bucket_cap_mb * MiB <= total
    assert choice.first_bucket_mb <= choice.bucket_cap_mb
    assert choice.codec is None or isinstance(choice.codec, Cast)
    assert "latency" in choice.reason and "bandwidth" in choice.reason
    seen = COMM.handle.allgather((choice.bucket_cap_mb, choice.first_bucket_mb,
                                  repr(choice.codec)))
    assert len(set(seen)) == 1, seen


def test_data_parallel_with_auto_buckets_matches_one_process():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 3))
    reference.load_state_dict(net.state_dict())
    model = DataParallel(net, COMM, DataParallelOptimizer(torch.optim.SGD(net.parameters(),
                                                                           lr=0.1),
                                                          blocking=True),
                         bucket_cap_mb="auto")
    assert model.autotuned is not None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        xs = torch.randn(COMM.size, 4, 8, generator=g)
        ys = torch.randint(0, 3, (COMM.size, 4), generator=g)
        model.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[COMM.rank]), ys[COMM.rank]).backward()
        model.optimizer.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(xs.reshape(-1, 8)), ys.reshape(-1)).backward()
        ref_opt.step()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_auto_on_some_ranks_only_is_a_clear_error():
    if COMM.size == 1:
        pytest.skip("a setting can differ only between ranks")
    net = torch.nn.Linear(4, 2)
    cap = "auto" if COMM.rank == 0 else 25.0
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DataParallel(net, COMM, bucket_cap_mb=cap)
