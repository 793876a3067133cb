"""A Heat user's program with ``import heatlike as ht``: create and split arrays, reduce,
resplit, exchange DNDarrays through the communicator, then train with Heat's DataParallel call
and with DASO, written only with the names and calls a Heat program uses. Every result is checked
on every rank against numpy or a single-process run."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import heatlike as ht

pytestmark = pytest.mark.mpi


def test_arrays_reductions_resplit_and_exchanges_as_in_heat():
    comm = ht.MPI_WORLD
    data = np.arange(7 * 5, dtype=np.float32).reshape(7, 5) ** 1.5
    x = ht.array(data, split=0)
    assert x.shape == (7, 5) and x.split == 0 and x.comm.size == comm.size
    np.testing.assert_allclose(ht.sum(x, axis=0).numpy(), data.sum(0), rtol=1e-6)
    np.testing.assert_allclose(x.mean(axis=1).numpy(), data.mean(1), rtol=1e-6)
    np.testing.assert_allclose(float(x.max()), data.max())
    y = ht.resplit(x, 1)
    assert y.split == 1 and y.lshape[0] == 7
    np.testing.assert_array_equal(y.numpy(), data)
    x.resplit_(None)
    assert x.split is None and tuple(x.larray.shape) == (7, 5)
    z = ht.exp(ht.array(data, split=1) / 50) - 1
    np.testing.assert_allclose(z.numpy(), np.exp(data / 50) - 1, rtol=1e-5)
    w = ht.random.randn(5, 3, split=None)
    np.testing.assert_allclose((ht.array(data, split=0) @ w).numpy(), data @ w.numpy(),
                               rtol=1e-4, atol=1e-4)
    # exchanges of DNDarrays through the communicator, as Heat's code writes them
    mine = ht.full((2, 3), float(comm.rank + 1))
    total = ht.zeros((2, 3))
    mine.comm.Allreduce(mine, total, ht.MPI.SUM)
    np.testing.assert_array_equal(total.numpy(), np.full((2, 3), comm.size * (comm.size + 1) / 2))
    counts, displs, _ = comm.counts_displs_shape((comm.size * (comm.size + 1) // 2, 3), 0)
    rows = ht.ones((comm.rank + 1, 3)) * comm.rank
    gathered = ht.zeros((comm.size * (comm.size + 1) // 2, 3))
    sizes = tuple(range(1, comm.size + 1))
    offsets = tuple(np.cumsum((0,) + sizes[:-1]))
    comm.Allgatherv(rows, (gathered, sizes, offsets))
    expected = np.concatenate([np.full((r + 1, 3), r) for r in range(comm.size)])
    np.testing.assert_array_equal(gathered.numpy(), expected)
    assert len(counts) == len(displs) == comm.size


def _digits():
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def test_training_with_heats_data_parallel_call_equals_one_process():
    comm = ht.MPI_WORLD
    x, y = _digits()
    x, y = x[:32 * comm.size * 4], y[:32 * comm.size * 4]

    def net():
        torch.manual_seed(3)
        return ht.nn.Sequential(ht.nn.Linear(64, 32), ht.nn.ReLU(), ht.nn.Linear(32, 10))

    reference, local = net(), net()
    ref_opt = ht.optim.SGD(reference.parameters(), lr=0.05)
    opt = ht.optim.DataParallelOptimizer(ht.optim.SGD(local.parameters(), lr=0.05), True)
    model = ht.nn.DataParallel(local, comm, opt, blocking_parameter_updates=True)
    loss_fn = ht.nn.CrossEntropyLoss()
    b = 32
    for step in range(4):
        glob = slice(step * b * comm.size, (step + 1) * b * comm.size)
        mine = slice(glob.start + comm.rank * b, glob.start + (comm.rank + 1) * b)
        ref_opt.zero_grad()
        loss_fn(reference(x[glob]), y[glob]).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_fn(model(x[mine]), y[mine]).backward()
        opt.step()
        for p, q in zip(local.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_training_with_daso_as_in_heat(monkeypatch):
    """Heat's DASO loop (``DataParallelMultiGPU``, ``last_batch``, ``epoch_loss_logic``) on
    two emulated nodes: it learns the digits and the replicas agree at the end."""
    comm = ht.MPI_WORLD
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(max(1, (comm.size + 1) // 2)))
    x, y = _digits()
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    torch.manual_seed(0)
    net = ht.nn.Sequential(ht.nn.Linear(64, 64), ht.nn.ReLU(), ht.nn.Linear(64, 10))
    epochs = 8
    daso = ht.optim.DASO(local_optimizer=ht.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                         total_epochs=epochs, comm=comm, warmup_epochs=1, cooldown_epochs=1)
    model = ht.nn.DataParallelMultiGPU(net, daso)
    loader = ht.utils.data.DataLoader(ht.utils.data.Dataset(x_train, y_train), batch_size=16)
    daso.last_batch = len(loader)
    loss_fn = ht.nn.CrossEntropyLoss()
    for _ in range(epochs):
        model.train()
        losses = []
        for xb, yb in loader:
            daso.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            daso.step()
            losses.append(loss.item())
        daso.epoch_loss_logic(float(np.mean(losses)))
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert accuracy > 0.9, accuracy
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    everyone = torch.empty(comm.size * flat.numel())
    comm.Allgather(flat, everyone)
    for other in everyone.view(comm.size, -1):
        torch.testing.assert_close(other, flat, rtol=1e-5, atol=1e-6)
