"""Distributed data loading: the rank's batches are slices of the single-process global batches,
independent of the world size, reshuffled per epoch."""

import numpy as np
import pytest
import torch

import heatlike as hl
from heatlike.utils.data import DataLoader, Dataset, DistributedBatchSampler

pytestmark = pytest.mark.mpi


def _global_batches(comm, loader_batches, b):
    """Gather the ranks' batches of every step into the global batch (rank order)."""
    out = []
    for batch in loader_batches:
        mine = torch.as_tensor(batch, dtype=torch.int64)
        everyone = torch.empty(comm.size * b, dtype=torch.int64)
        comm.Allgather(mine, everyone)
        out.append(everyone)
    return out


@pytest.mark.parametrize("n,b,drop_last", [(40, 3, False), (40, 3, True), (7, 2, False),
                                           (64, 4, True)])
def test_batches_are_slices_of_the_single_process_batches(comm, n, b, drop_last):
    P = comm.size
    if drop_last and n < P * b:
        with pytest.raises(ValueError, match="drop_last"):
            DistributedBatchSampler(n, b, comm, drop_last=True)
        return
    sampler = DistributedBatchSampler(n, b, comm, seed=5, drop_last=drop_last)
    steps = n // (P * b) if drop_last else -(-n // (P * b))
    assert len(sampler) == steps
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(5 + epoch))
        assert torch.equal(sampler.order(), order)  # no dependence on the world size
        batches = list(sampler)
        assert len(batches) == steps and all(len(x) == b for x in batches)
        full = torch.cat([order] * (1 + P * b * steps // n))
        for step, glob in enumerate(_global_batches(comm, batches, b)):
            assert torch.equal(glob, full[step * P * b:(step + 1) * P * b]), (epoch, step)


def test_epochs_reshuffle_and_no_shuffle_keeps_order(comm):
    s = DistributedBatchSampler(30, 2, comm, seed=1)
    assert not torch.equal(s.order(0), s.order(1))
    plain = DistributedBatchSampler(30, 2, comm, shuffle=False)
    assert torch.equal(plain.order(3), torch.arange(30))


def test_loader_over_local_tensors(comm):
    P, b, n = comm.size, 3, 50
    x = torch.arange(n * 2, dtype=torch.float32).view(n, 2)
    y = torch.arange(n)
    loader = DataLoader(Dataset(x, y), batch_size=b, seed=3, progress=True)
    assert len(loader) == -(-n // (P * b))
    for epoch in range(2):
        assert loader.epoch == epoch
        steps = 0
        for xb, yb in loader:
            assert xb.shape == (b, 2) and yb.shape == (b,)
            assert torch.equal(xb, x[yb])  # sample and target stay together
            steps += 1
        assert steps == len(loader)
    seen = torch.cat([yb for _, yb in loader])  # epoch 2: every sample is visited
    everyone = torch.empty(comm.size * seen.numel(), dtype=seen.dtype)
    comm.Allgather(seen, everyone)
    assert set(everyone.tolist()) == set(range(n))


@pytest.mark.parametrize("distributed", [False, True])
def test_an_epoch_leaves_the_global_random_stream_alone(comm, distributed):
    """Starting an epoch and drawing its batches consumes nothing of torch's global RNG (the
    stream dropout draws from), so a run resumed from a checkpoint that restored it draws the
    masks the uninterrupted run drew (torch's loader took its workers' seed from the global
    RNG at every epoch start: resumed runs with dropout were off by 0.09)."""
    n = 24
    x, y = torch.randn(n, 2), torch.arange(n)
    data = Dataset(hl.array(x, split=0), hl.array(y, split=0)) if distributed else Dataset(x, y)
    loader = DataLoader(data, batch_size=2, seed=5)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    for _ in range(2):
        for _batch in loader:
            pass
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("distributed", [False, True], ids=["local", "distributed"])
def test_collate_fn_shapes_every_batch(comm, distributed):
    """``collate_fn`` gets the batch's (sample, target) pairs and its result is the batch, for
    local and distributed (DNDarray) datasets alike, with or without transforms."""
    n, b = 12, 2
    x, y = torch.arange(2 * n, dtype=torch.float32).view(n, 2), torch.arange(n)
    data = Dataset(hl.array(x, split=0), hl.array(y, split=0)) if distributed else Dataset(x, y)

    def as_dict(items):
        return {"x": torch.stack([a for a, _ in items]), "y": torch.stack([t for _, t in items])}

    batches = list(DataLoader(data, batch_size=b, seed=2, collate_fn=as_dict))
    assert batches and all(isinstance(batch, dict) for batch in batches)
    for batch in batches:
        assert batch["x"].shape == (b, 2) and torch.equal(batch["x"], x[batch["y"]])


def test_dataset_transforms_and_numpy_input(comm):
    data = np.arange(20, dtype=np.float32).reshape(10, 2)
    ds = Dataset(data, np.arange(10), transform=lambda v: v * 2,
                 target_transform=lambda t: t + 100)
    x, y = ds[3]
    assert torch.equal(x, torch.tensor([12.0, 14.0])) and y == 103
    with pytest.raises(ValueError, match="samples"):
        Dataset(torch.zeros(3, 2), torch.zeros(4))


def test_sampler_bad_arguments(comm):
    with pytest.raises(ValueError, match="num_samples"):
        DistributedBatchSampler(0, 2, comm)
    with pytest.raises(ValueError, match="batch_size"):
        DistributedBatchSampler(10, 0, comm)
