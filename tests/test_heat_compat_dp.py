"""Heat's spelling of data-parallel training runs unchanged: ``heat.nn`` / ``heat.optim`` /
``heat.nn.functional`` forward to torch, ``heat.utils.data.datatools`` and Heat's ``Dataset``
keywords, ``DataParallel(model, comm, [opt, opt])`` and Heat's argument checks.

Trainings are compared on every rank with a single process running the same steps on the
combined batch, and parameters must be bitwise equal across ranks.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import warnings

import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, raises_everywhere

import heatlike as hl
import heatlike.nn.functional as F
from heatlike import nn as hnn
from heatlike import optim as hoptim
from heatlike.utils import data as hdata

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-5, atol=1e-6)


# -- names forwarded to torch ------------------------------------------------------------------

def test_nn_and_optim_names_are_torch_s():
    assert hnn.Linear is torch.nn.Linear
    assert hnn.Conv2d is torch.nn.Conv2d
    assert hnn.Module is torch.nn.Module
    assert hnn.MSELoss is torch.nn.MSELoss
    assert hoptim.SGD is torch.optim.SGD
    assert hoptim.Adam is torch.optim.Adam
    assert hoptim.lr_scheduler is torch.optim.lr_scheduler
    assert hl.nn.functional is F and F.max_pool2d is torch.nn.functional.max_pool2d
    # heatlike's own names are not replaced by torch's
    assert hnn.DataParallel.__module__ == "heatlike.nn.data_parallel"
    assert hoptim.DataParallelOptimizer.__module__ == "heatlike.optim.dp_optimizer"
    # torch's SyncBatchNorm needs torch.distributed: heatlike.nn's is heatlike's, over MPI
    assert hnn.SyncBatchNorm.__module__ == "heatlike.nn.sync_batchnorm"
    assert issubclass(hnn.SyncBatchNorm, torch.nn.modules.batchnorm._BatchNorm)
    from heatlike.nn import Linear  # noqa: F401  (module __getattr__ serves from-imports)
    for module, name in ((hnn, "Linear"), (hoptim, "SGD"), (F, "relu")):
        assert name in dir(module)


def test_functional_computes_what_torch_computes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, 8, generator=g)
    assert torch.equal(F.relu(x), torch.clamp(x, min=0))
    pooled = F.max_pool2d(x, 2)
    assert torch.equal(pooled, x.unfold(2, 2, 2).unfold(3, 2, 2).amax(dim=(-1, -2)))


@pytest.mark.parametrize("module,name", [(hnn, "NoSuchLayer"), (hoptim, "NoSuchOptimizer"),
                                         (F, "no_such_function"), (hnn, "_private")])
def test_unknown_names_raise_attribute_error_naming_the_module(module, name):
    with pytest.raises(AttributeError, match=module.__name__.replace(".", r"\.")):
        getattr(module, name)
    assert not hasattr(module, name)
    with pytest.raises(ImportError):
        exec(f"from {module.__name__} import {name}", {})


# -- heatlike.utils.data: datatools, Heat's Dataset keywords, DataLoader checks ----------------

def test_datatools_is_importable_under_heat_s_name():
    assert hl.utils.data is hdata
    dt = importlib.import_module("heatlike.utils.data.datatools")
    assert hdata.datatools is dt
    assert dt.DataLoader is hdata.DataLoader and dt.Dataset is hdata.Dataset
    assert importlib.util.find_spec("heatlike.utils.data.datatools") is not None
    from heatlike.utils.data.datatools import DataLoader, Dataset  # noqa: F401


def _global_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.arange(n, dtype=torch.float32)


def _global_batches(loader) -> list[torch.Tensor]:
    """Every step's targets of all ranks, in rank order (the global batch)."""
    out = []
    for _, yb in loader:
        everyone = torch.empty(COMM.size * yb.numel())
        COMM.Allgather(yb.contiguous(), everyone)
        out.append(everyone)
    return out


def test_dataset_takes_heat_s_keywords():
    n = 4 * COMM.size + 1
    x, y = _global_data(n)
    ds = hdata.Dataset(hl.array(x, split=0), hl.array(y, split=0), ishuffle=True)
    assert ds.ishuffle is True and ds.test_set is False and ds.transforms is None
    assert len(ds) == n and ds.distributed
    heat_style = hdata.Dataset(hl.array(x, split=0), ishuffle=False, test_set=True)
    assert heat_style.ishuffle is False and heat_style.test_set is True
    # Heat's transforms: a callable or a list whose first entry applies to each sample
    local = hdata.Dataset(x, y, transforms=lambda v: 2 * v)
    assert torch.equal(local[1][0], 2 * x[1]) and len(local.transforms) == 1
    listed = hdata.Dataset(x, transforms=[lambda v: v + 1, lambda v: v - 1])
    assert torch.equal(listed[2], x[2] + 1) and len(listed.transforms) == 2


def test_ishuffle_changes_nothing_and_test_set_keeps_the_order():
    """Shuffling follows heatlike's rule whatever ``ishuffle`` says: the same seed gives the same
    global batches; ``test_set=True`` serves the samples in order."""
    n, b = 5 * COMM.size, 2
    x, y = _global_data(n)
    runs = []
    for ishuffle in (False, True):
        loader = hdata.DataLoader(hdata.Dataset(hl.array(x, split=0), hl.array(y, split=0),
                                                ishuffle=ishuffle), batch_size=b, seed=4)
        runs.append([_global_batches(loader) for _ in range(2)])
    for e in range(2):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(4 + e)).float()
        order = torch.cat([order, order])
        for step, (plain, ring) in enumerate(zip(runs[0][e], runs[1][e])):
            want = order[step * COMM.size * b:(step + 1) * COMM.size * b]
            assert torch.equal(plain, want) and torch.equal(ring, want), (e, step)
    test = hdata.DataLoader(hdata.Dataset(hl.array(x, split=0), hl.array(y, split=0),
                                          test_set=True), batch_size=b)
    assert test.sampler.shuffle is False
    for _ in range(2):  # every epoch, in order
        assert torch.equal(torch.cat(_global_batches(test))[:n], y)
    # an explicit shuffle wins over the test set's default
    assert hdata.DataLoader(hdata.Dataset(x, y, test_set=True), 2, shuffle=True).sampler.shuffle


def test_heat_style_dataset_subclass_is_served_by_the_loader():
    """Heat's test data set: a subclass passing ``ishuffle`` and defining Heat's shuffle hooks
    (never called: heatlike's loader shuffles by its own rule); one batch per rank per epoch."""

    class Ring(hdata.Dataset):
        def __init__(self, array, ishuffle):
            super().__init__(array, ishuffle=ishuffle)

        def Shuffle(self):  # noqa: N802  (Heat's name)
            raise AssertionError("heatlike's DataLoader does not call Heat's Shuffle()")

        Ishuffle = Shuffle

    n, b = 2 * COMM.size, 2
    x, _ = _global_data(n)
    loader = hdata.datatools.DataLoader(dataset=Ring(hl.array(x, split=0), True), batch_size=b)
    assert len(loader) == 1
    for epoch in range(2):
        (batch,) = list(loader)
        everyone = torch.empty(n, 3)
        COMM.Allgather(batch.contiguous(), everyone)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        assert torch.equal(everyone, x[order]), epoch


def test_dataloader_default_batch_size_is_one():
    n = 3 * COMM.size + 2
    loader = hdata.DataLoader(torch.arange(n))
    assert loader.sampler.batch_size == 1 and len(loader) == math.ceil(n / COMM.size)
    assert all(batch.shape == (1,) for batch in loader)


@pytest.mark.parametrize("bad", ["asdf", 3.5, {"a": 1}, None])
def test_dataloader_refuses_what_is_not_a_dataset_on_every_rank(bad):
    raises_everywhere(TypeError, lambda: hdata.DataLoader(bad), "dataset must be")


def test_dataset_bad_heat_keywords():
    x = torch.zeros(4, 2)
    for call, says in ((lambda: hdata.Dataset(x, ishuffle="yes"), "ishuffle must be a bool"),
                       (lambda: hdata.Dataset(x, test_set=1), "test_set must be a bool"),
                       (lambda: hdata.Dataset(x, transforms="f"), "transforms must be"),
                       (lambda: hdata.Dataset(x, transform=abs, transforms=abs), "not both"),
                       (lambda: hdata.Dataset(x, abs), "transforms=..."),
                       (lambda: hdata.Dataset("asdf"), "data must be")):
        raises_everywhere(TypeError, call, says)


# -- DataParallel / DataParallelOptimizer, Heat's calls -----------------------------------------

class ConvNet(hnn.Module):
    """Heat's test model in miniature, written with Heat's names."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = hnn.Conv2d(1, 3, 3)
        self.fc1 = hnn.Linear(3 * 3 * 3, 8)
        self.fc2 = hnn.Linear(8, 2)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The reference and this rank's model: different on every rank but rank 0, which
    DataParallel broadcasts."""
    torch.manual_seed(seed)
    reference = ConvNet()
    torch.manual_seed(seed + 100 + COMM.rank)
    local = ConvNet()
    if COMM.rank == 0:
        local.load_state_dict(reference.state_dict())
    return reference, local


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_all_ranks(model: torch.nn.Module) -> None:
    mine = _flat(model)
    everyone = torch.empty(COMM.size * mine.numel())
    COMM.Allgather(mine, everyone)
    for r, other in enumerate(everyone.view(COMM.size, -1)):
        assert torch.equal(other, mine), f"parameters differ from rank {r}'s"


def _train_against_reference(model, dp_opt, local, reference, ref_opt, epochs: int = 2) -> None:
    """Heat's loop over a DataLoader of a split DNDarray; the reference takes the global batch."""
    P, b, n = COMM.size, 2, 4 * COMM.size
    g = torch.Generator().manual_seed(7)
    x, y = torch.rand(n, 1, 8, 8, generator=g), torch.randn(n, 2, generator=g)
    loader = hdata.datatools.DataLoader(
        dataset=hdata.Dataset(hl.array(x, split=0), hl.array(y, split=0), ishuffle=True),
        batch_size=b, seed=11)
    loss_fn = hnn.MSELoss()
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(11 + epoch))
        for step, (xb, yb) in enumerate(loader):
            glob = order[step * P * b:(step + 1) * P * b]
            assert torch.equal(xb, x[glob[COMM.rank * b:(COMM.rank + 1) * b]])
            ref_opt.zero_grad()
            loss_fn(reference(x[glob]), y[glob]).backward()
            ref_opt.step()
            dp_opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            dp_opt.step()
            model.flush()
            torch.testing.assert_close(_flat(local), _flat(reference), **TOL,
                                       msg=f"epoch {epoch} step {step}")
            _same_on_all_ranks(local)


@pytest.mark.parametrize("flag", [False, None], ids=["module-flag-false", "optimizer-mode"])
def test_a_list_naming_one_optimizer_twice_warns_and_trains_blocking(flag):
    reference, local = _models()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    dp_opt = hoptim.DataParallelOptimizer(hoptim.SGD(local.parameters(), lr=0.05, momentum=0.9),
                                          False)
    with pytest.warns(UserWarning, match="fallback on blocking"):
        model = hnn.DataParallel(local, COMM, [dp_opt, dp_opt],
                                 blocking_parameter_updates=flag)
    assert model.optimizer is dp_opt
    assert model.blocking_parameter_updates is True and dp_opt.blocking is True
    _train_against_reference(model, dp_opt, local, reference, ref_opt)


def test_a_list_naming_one_optimizer_in_blocking_mode_does_not_warn():
    _, local = _models()
    dp_opt = hoptim.DataParallelOptimizer(hoptim.SGD(local.parameters(), lr=0.05), True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hnn.DataParallel(local, COMM, (dp_opt, dp_opt, dp_opt))
    assert not [w for w in caught if "fallback" in str(w.message)]
    assert model.optimizer is dp_opt and model.blocking_parameter_updates is True


def test_a_list_of_different_optimizers_is_still_refused():
    _, local = _models()
    two = [hoptim.DataParallelOptimizer(hoptim.SGD(local.parameters(), lr=0.1))
           for _ in range(2)]
    raises_everywhere(ValueError, lambda: hnn.DataParallel(local, COMM, [two[0], two[1], two[0]]),
                      "one parameter group per part")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_heat_s_call_trains_like_one_process(blocking):
    reference, local = _models(seed=1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    dp_opt = hoptim.DataParallelOptimizer(hoptim.SGD(local.parameters(), lr=0.05), blocking)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hnn.DataParallel(local, COMM, dp_opt, blocking_parameter_updates=blocking)
    assert not [w for w in caught if "fallback" in str(w.message)]
    assert model.blocking_parameter_updates is blocking
    _train_against_reference(model, dp_opt, local, reference, ref_opt)


def test_blocking_parameter_updates_is_read_only_and_none_without_optimizer():
    _, local = _models()
    model = hnn.DataParallel(local, COMM)
    assert model.blocking_parameter_updates is None
    with pytest.raises(AttributeError):
        model.blocking_parameter_updates = True
    _, other = _models()
    dp_opt = hoptim.DataParallelOptimizer(hoptim.SGD(other.parameters(), lr=0.1))
    assert hnn.DataParallel(other, COMM, dp_opt).blocking_parameter_updates is False


@pytest.mark.parametrize("blocking", ["asdf", 1, 0, None, np.bool_(True)])
def test_dp_optimizer_blocking_must_be_a_bool(blocking):
    opt = hoptim.SGD(ConvNet().parameters(), lr=0.1)
    raises_everywhere(TypeError, lambda: hoptim.DataParallelOptimizer(opt, blocking),
                      "blocking must be a bool")
    assert hoptim.DataParallelOptimizer(opt, True).blocking is True
