"""The bad-input table: every public entry point of the training stack, given wrong types, wrong
shapes, empty models, non-float parameters and configurations that differ between ranks, raises
one clear error on every rank (the same message everywhere) and leaves the ranks in step; given a
world of one rank it computes what plain torch computes.

The communicator's own table is in test_comm_errors.py and the DNDarray's in
test_dndarray_*.py (``raises_everywhere``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from _dndarray_helpers import COMM, raises_everywhere
from mpi4py import MPI

import heatlike as hl
from heatlike import aggregation, nn, optim
from heatlike.engine import Cast, TopK
from heatlike.utils import checkpoint, data

pytestmark = pytest.mark.mpi

RANK, SIZE = COMM.rank, COMM.size
MULTI = pytest.mark.skipif(SIZE == 1, reason="a configuration can differ only between ranks")


def mlp(width: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 2))


def frozen() -> torch.nn.Module:
    model = mlp()
    model.requires_grad_(False)
    return model


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def dp_optimizer(model: torch.nn.Module, blocking: bool = False) -> optim.DataParallelOptimizer:
    return optim.DataParallelOptimizer(sgd(model), blocking=blocking)


def on_rank(value_elsewhere, value_on_last):
    """``value_on_last`` on the last rank, ``value_elsewhere`` on the others."""
    return value_on_last if RANK == SIZE - 1 else value_elsewhere


@dataclass
class Case:
    entry: str
    kind: str
    call: Callable[[], object]
    error: type[Exception]
    says: str
    needs_ranks: bool = False

    @property
    def id(self) -> str:
        return f"{self.entry}: {self.kind}"


CASES = [
    # -- nn.DataParallel, optim.DataParallelOptimizer ---------------------------------------------
    Case("DataParallel", "wrong type: module", lambda: nn.DataParallel("mlp"),
         TypeError, "torch.nn.Module"),
    Case("DataParallel", "wrong type: torch optimizer unwrapped",
         lambda: (m := mlp(), nn.DataParallel(m, optimizer=sgd(m))),
         TypeError, "DataParallelOptimizer"),
    Case("DataParallel", "wrong value: sync_buffers",
         lambda: nn.DataParallel(mlp(), sync_buffers="sometimes"), ValueError, "sync_buffers"),
    Case("DataParallel", "wrong value: bucket size",
         lambda: nn.DataParallel(mlp(), bucket_cap_mb=-1), ValueError, "bucket"),
    Case("DataParallel", "empty model", lambda: nn.DataParallel(torch.nn.Sequential()),
         ValueError, "no trainable parameters"),
    Case("DataParallel", "empty model: all frozen", lambda: nn.DataParallel(frozen()),
         ValueError, "no trainable parameters"),
    Case("DataParallel", "optimizer over other parameters",
         lambda: nn.DataParallel(mlp(), optimizer=dp_optimizer(mlp())),
         ValueError, "parameters"),
    Case("DataParallelOptimizer", "wrong type", lambda: optim.DataParallelOptimizer([1.0]),
         TypeError, "torch.optim.Optimizer"),
    Case("DataParallel", "mismatch: architecture",
         lambda: nn.DataParallel(mlp(width=on_rank(3, 5))), ValueError, "rank", True),
    Case("DataParallel", "mismatch: blocking",
         lambda: (m := mlp(), nn.DataParallel(m, optimizer=dp_optimizer(m, on_rank(False, True)))),
         ValueError, "differs between ranks", True),
    Case("DataParallel", "mismatch: sync_buffers",
         lambda: nn.DataParallel(mlp(), sync_buffers=on_rank("broadcast", "average")),
         ValueError, "sync_buffers", True),
    Case("DataParallel", "mismatch: bucket size",
         lambda: nn.DataParallel(mlp(), bucket_cap_mb=on_rank(25.0, 1e-5)),
         ValueError, "differs between ranks", True),
    Case("DataParallel", "mismatch: codec",
         lambda: nn.DataParallel(mlp(), codec=on_rank(None, Cast(torch.bfloat16))),
         ValueError, "differs between ranks", True),
    # -- DASO ---------------------------------------------------------------------------------
    Case("DASO", "wrong type: local optimizer", lambda: optim.DASO("sgd", total_epochs=4),
         TypeError, "local_optimizer"),
    Case("DASO", "wrong value: total_epochs",
         lambda: optim.DASO(sgd(mlp()), total_epochs=0), ValueError, "total_epochs"),
    Case("DASO", "wrong value: downcast_type",
         lambda: optim.DASO(sgd(mlp()), total_epochs=10, downcast_type=torch.int8),
         ValueError, "downcast_type"),
    Case("DASO", "mismatch: total_epochs",
         lambda: optim.DASO(sgd(mlp()), total_epochs=on_rank(10, 11)),
         ValueError, "total_epochs", True),
    Case("DataParallelMultiGPU", "wrong type: optimizer",
         lambda: (m := mlp(), nn.DataParallelMultiGPU(m, sgd(m))), TypeError, "DASO"),
    # -- mlbench-core presets -------------------------------------------------------------------
    Case("CentralizedSGD", "wrong type: model", lambda: optim.CentralizedSGD(model="mlp", lr=0.1),
         TypeError, "torch.nn.Module"),
    Case("CentralizedSGD", "wrong value: world_size",
         lambda: optim.CentralizedSGD(world_size=SIZE + 1, model=mlp(), lr=0.1),
         ValueError, "world_size"),
    Case("CentralizedSGD", "missing lr", lambda: optim.CentralizedSGD(model=mlp()),
         TypeError, "lr is required"),
    Case("CentralizedSGD", "empty model",
         lambda: optim.CentralizedSGD(model=torch.nn.Sequential(), lr=0.1),
         ValueError, "no trainable parameters"),
    Case("CentralizedSGD", "mismatch: by_layer",
         lambda: optim.CentralizedSGD(model=mlp(), lr=0.1, by_layer=on_rank(False, True)),
         ValueError, "differs between ranks", True),
    Case("CentralizedSGD", "mismatch: architecture",
         lambda: optim.CentralizedSGD(model=mlp(width=on_rank(3, 5)), lr=0.1),
         ValueError, "rank", True),
    Case("CentralizedAdam", "wrong type: model", lambda: optim.CentralizedAdam(model=3, lr=0.1),
         TypeError, "torch.nn.Module"),
    Case("CustomCentralizedOptimizer", "wrong type: optimizer",
         lambda: optim.CustomCentralizedOptimizer(model=mlp(), optimizer="sgd"),
         TypeError, "torch.optim.Optimizer"),
    Case("PowerSGD", "wrong value: rank",
         lambda: optim.PowerSGD(model=mlp(), lr=0.1, rank=0), ValueError, "rank"),
    Case("PowerSGD", "mismatch: rank",
         lambda: optim.PowerSGD(model=mlp(), lr=0.1, rank=on_rank(1, 2)),
         ValueError, "differs between ranks", True),
    Case("CentralizedSparsifiedSGD", "wrong value: sparse_grad_size",
         lambda: optim.CentralizedSparsifiedSGD(mlp().parameters(), lr=0.1, sparse_grad_size=0),
         ValueError, "sparse_grad_size"),
    Case("CentralizedSparsifiedSGD", "mismatch: sparse_grad_size",
         lambda: optim.CentralizedSparsifiedSGD(mlp().parameters(), lr=0.1,
                                                sparse_grad_size=on_rank(2, 3)),
         ValueError, "differs between ranks", True),
    Case("SparsifiedSGD", "wrong value: sparse_grad_size",
         lambda: optim.SparsifiedSGD(mlp().parameters(), lr=0.1, sparse_grad_size=-2),
         ValueError, "sparse_grad_size"),
    Case("SignSGD", "empty parameter list", lambda: optim.SignSGD([], lr=0.1),
         ValueError, "empty parameter list"),
    Case("SignSGD", "wrong value: nesterov without momentum",
         lambda: optim.SignSGD(mlp().parameters(), lr=0.1, nesterov=True),
         ValueError, "Nesterov"),
    Case("SignSGD", "wrong value: momentum",
         lambda: optim.SignSGD(mlp().parameters(), lr=0.1, momentum=-1),
         ValueError, "Invalid momentum value: -1"),
    Case("SignSGD", "wrong value: weight_decay",
         lambda: optim.SignSGD(mlp().parameters(), lr=0.1, weight_decay=-1),
         ValueError, "Invalid weight_decay value: -1"),
    Case("SignSGD", "wrong value: dampening",
         lambda: optim.SignSGD(mlp().parameters(), lr=0.1, momentum=0.9, dampening=-0.5),
         ValueError, "Invalid dampening value: -0.5"),
    Case("SignSGD", "mismatch: momentum valid on some ranks only",
         lambda: optim.SignSGD(mlp().parameters(), lr=0.1, momentum=on_rank(0.9, -0.9)),
         ValueError, "Invalid momentum value", True),
    Case("SparsifiedSGD", "wrong value: weight_decay",
         lambda: optim.SparsifiedSGD(mlp().parameters(), lr=0.1, weight_decay=-1),
         ValueError, "Invalid weight_decay value: -1"),
    Case("CentralizedSparsifiedSGD", "wrong value: weight_decay",
         lambda: optim.CentralizedSparsifiedSGD(mlp().parameters(), lr=0.1, weight_decay=-1),
         ValueError, "Invalid weight_decay value: -1"),
    Case("CustomCentralizedOptimizer", "mismatch: denom",
         lambda: _custom_step(on_rank(4.0, 5.0)), ValueError, "denom differs between ranks",
         True),
    Case("CustomCentralizedOptimizer", "wrong value: denom",
         lambda: _custom_step(on_rank(4.0, 0.0)), ValueError, "positive denom"),
    Case("FP16Optimizer", "mismatch: denom",
         lambda: _custom_step(on_rank(4.0, 5.0), fp16=True), ValueError,
         "denom differs between ranks", True),
    Case("FP16Optimizer", "wrong value: grad_clip",
         lambda: optim.FP16Optimizer(mlp().half(), grad_clip=-1.0, average_world=True),
         ValueError, "grad_clip must be positive"),
    Case("DecentralizedSGD", "wrong value: rank",
         lambda: optim.DecentralizedSGD(rank=RANK + 1, neighbors=[], model=mlp(), lr=0.1),
         ValueError, "rank"),
    Case("DecentralizedSGD", "wrong type: model",
         lambda: optim.DecentralizedSGD(model=[1, 2], lr=0.1), TypeError, "torch.nn.Module"),
    Case("DecentralizedSGD", "wrong value: codec gossip cannot mix",
         lambda: optim.DecentralizedSGD(model=mlp(), lr=0.1, codec=TopK(k=2)),
         ValueError, "gossip mixes the ranks' models"),
    Case("DecentralizedAggregation", "mismatch: rank right on rank 0 only",
         lambda: aggregation.DecentralizedAggregation(rank=0), ValueError,
         "rank=0 but this process is rank", True),
    Case("FP16Optimizer", "wrong value: world_size",
         lambda: optim.FP16Optimizer(mlp().half(), world_size=SIZE + 2), ValueError,
         "world_size"),
    Case("FP16Optimizer", "wrong type: model", lambda: optim.FP16Optimizer("mlp"),
         TypeError, "torch.nn.Module"),
    Case("AllReduceAggregation", "wrong value: world_size",
         lambda: aggregation.AllReduceAggregation(world_size=SIZE + 1), ValueError,
         "world_size"),
    # -- SINGA DistOpt --------------------------------------------------------------------------
    Case("DistOpt", "wrong type: optimizer", lambda: optim.DistOpt("sgd"),
         TypeError, "torch.optim.Optimizer"),
    Case("DistOpt", "wrong value: buffSize", lambda: optim.DistOpt(sgd(mlp()), buffSize=0),
         ValueError, "buffSize"),
    Case("DistOpt", "mismatch: buffSize",
         lambda: optim.DistOpt(sgd(mlp()), buffSize=on_rank(4096, 8192)),
         ValueError, "differs between ranks", True),
    Case("DistOpt", "mismatch: architecture",
         lambda: optim.DistOpt(sgd(mlp(width=on_rank(3, 5)))), ValueError, "rank", True),
    # -- Join, verify_replicas ------------------------------------------------------------------
    Case("Join", "wrong type: joinable", lambda: nn.Join(["model"]), TypeError, "Join"),
    Case("Join", "nothing to join", lambda: nn.Join([]), ValueError, "Join needs"),
    Case("verify_replicas", "wrong type", lambda: nn.verify_replicas("model"),
         TypeError, "torch.nn.Module"),
    # -- data loading ---------------------------------------------------------------------------
    Case("DataLoader", "wrong value: batch_size",
         lambda: data.DataLoader(torch.zeros(8, 4), batch_size=0), ValueError, "batch_size"),
    Case("DataLoader", "wrong type: batch_size",
         lambda: data.DataLoader(torch.zeros(8, 4), batch_size=2.5), ValueError, "batch_size"),
    Case("DataLoader", "empty data set",
         lambda: data.DataLoader(torch.zeros(0, 4), batch_size=2), ValueError, "num_samples"),
    Case("DataLoader", "mismatch: batch_size",
         lambda: data.DataLoader(torch.zeros(64, 4), batch_size=on_rank(4, 8)),
         ValueError, "differs between ranks", True),
    Case("DataLoader", "mismatch: seed",
         lambda: data.DataLoader(torch.zeros(64, 4), batch_size=4, seed=on_rank(0, 1)),
         ValueError, "differs between ranks", True),
    Case("Dataset", "wrong shape: targets",
         lambda: data.Dataset(hl.zeros((8, 4), split=0), hl.zeros((6,), split=0)),
         ValueError, "samples"),
    Case("Dataset", "wrong split", lambda: data.Dataset(hl.zeros((8, 4), split=1)),
         ValueError, "split along axis 0"),
    Case("Dataset", "wrong type: mixed targets",
         lambda: data.Dataset(hl.zeros((8, 4), split=0), torch.zeros(8)),
         TypeError, "DNDarrays"),
    # -- checkpoints ----------------------------------------------------------------------------
    Case("checkpoint.save", "wrong type: model",
         lambda: checkpoint.save(TMP[0] / "a.ckpt", "model"), TypeError, "torch.nn.Module"),
    Case("checkpoint.load", "missing file",
         lambda: checkpoint.load(TMP[0] / "missing.ckpt", mlp()), FileNotFoundError,
         "missing.ckpt"),
    Case("checkpoint.load", "wrong shape: model",
         lambda: (checkpoint.save(TMP[0] / "b.ckpt", mlp()),
                  checkpoint.load(TMP[0] / "b.ckpt", mlp(width=5))),
         checkpoint.CheckpointError, "shape"),
    Case("checkpoint.save", "mismatch: path",
         lambda: checkpoint.save(TMP[0] / on_rank("c.ckpt", "d.ckpt"), mlp()),
         ValueError, "differs between ranks", True),
    Case("checkpoint.save", "wrong type: extra value",
         lambda: checkpoint.save(TMP[0] / "e.ckpt", mlp(), args=object()),
         checkpoint.CheckpointError, "the extra value 'args' is a builtins.object"),
    Case("checkpoint.save", "mismatch: extra value storable on some ranks only",
         lambda: checkpoint.save(TMP[0] / "e.ckpt", mlp(), args=on_rank({"lr": 0.1}, object())),
         checkpoint.CheckpointError, "the extra value 'args' is a builtins.object", True),
    Case("checkpoint.load", "wrong type: keyword object",
         lambda: (checkpoint.save(TMP[0] / "f.ckpt", mlp()),
                  checkpoint.load(TMP[0] / "f.ckpt", mlp(), loader=3)),
         TypeError, "'loader' must have state_dict()"),
    Case("checkpoint.load", "wrong value: optimizer of another class",
         lambda: _load_with(lambda model: torch.optim.Adam(model.parameters(), lr=0.1)),
         checkpoint.CheckpointError, "from a SGD optimizer, the optimizer given is a Adam"),
    Case("checkpoint.load", "wrong shape: optimizer parameters",
         lambda: _load_with(lambda model: torch.optim.SGD(
             [*model.parameters(), torch.nn.Parameter(torch.zeros(2))], lr=0.1)),
         checkpoint.CheckpointError, "groups of [4] parameters in the checkpoint, [5] here"),
]


def _custom_step(denom: float, fp16: bool = False) -> None:
    """One step of average_custom with ``denom`` (CustomCentralizedOptimizer or
    FP16Optimizer): a per-rank denominator would give every rank another model."""
    model = mlp().half() if fp16 else mlp()
    if fp16:
        opt = optim.FP16Optimizer(model, average_custom=True)
        opt.set_optimizer(torch.optim.SGD([opt.fp32_params], lr=0.1))
    else:
        opt = optim.CustomCentralizedOptimizer(model, None, sgd(model), average_custom=True)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(2, 4, dtype=torch.float16 if fp16 else torch.float32)
    model(x).float().sum().backward()
    try:
        opt.step(denom=denom)
    finally:
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def _load_with(make_optimizer) -> None:
    """Save mlp() with SGD, load into a fresh mlp() with another optimizer; the module must keep
    its weights (the load is refused before anything changes)."""
    model = mlp()
    checkpoint.save(TMP[0] / "g.ckpt", model, sgd(model))
    fresh = mlp(seed=1)
    before = [p.detach().clone() for p in fresh.parameters()]
    try:
        checkpoint.load(TMP[0] / "g.ckpt", fresh, make_optimizer(fresh))
    finally:
        assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))

TMP: list = []  # the test's shared temporary directory (rank 0's, broadcast)


@pytest.fixture
def shared_tmp(tmp_path):
    from pathlib import Path

    TMP[:] = [Path(COMM.handle.bcast(str(tmp_path), root=0))]
    yield TMP[0]
    COMM.Barrier()
    TMP.clear()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_raises_the_same_clear_error_on_every_rank(case, shared_tmp):
    if case.needs_ranks and SIZE == 1:
        pytest.skip("a configuration can differ only between ranks")
    message = raises_everywhere(case.error, case.call, case.says)
    if case.needs_ranks:
        assert "rank" in message, message


def test_the_table_covers_every_kind_of_bad_input():
    kinds = {c.kind.split(":")[0] for c in CASES}
    for kind in ("wrong type", "wrong value", "wrong shape", "empty model", "mismatch"):
        assert kind in kinds, kind
    entries = {c.entry for c in CASES}
    assert {"DataParallel", "DASO", "CentralizedSGD", "PowerSGD", "DistOpt", "DataLoader",
            "checkpoint.save", "checkpoint.load", "Join"} <= entries


# -- non-float parameters: an integer parameter and a float64 layer next to float32 ones ----------

class Mixed(torch.nn.Module):
    """float32 and float64 layers and a frozen int64 parameter (an offset table), which differs
    between ranks with ``table_differs`` until a wrapper broadcasts rank 0's."""

    def __init__(self, table_differs: bool = True) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2).double()
        offset = 10 * RANK if table_differs else 0
        self.table = torch.nn.Parameter(torch.arange(2) + offset, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).double()) + self.table


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g, dtype=torch.float64)


def _reference_step() -> dict[str, torch.Tensor]:
    """One SGD step of one process over every rank's batch (equal sizes: the mean of means)."""
    model = Mixed()
    with torch.no_grad():
        model.table.copy_(torch.arange(2))  # rank 0's table, which the wrappers broadcast
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in map(_batch, range(SIZE)))
    (loss / SIZE).backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _step_with(kind: str) -> dict[str, torch.Tensor]:
    # DistOpt, like SINGA's, synchronizes only its optimizer's parameters
    model = Mixed(table_differs=kind != "DistOpt")
    trainable = [p for p in model.parameters() if p.requires_grad]
    x, y = _batch(RANK)
    if kind == "DataParallel":
        wrapped = nn.DataParallel(model, optimizer=optim.DataParallelOptimizer(
            torch.optim.SGD(trainable, lr=0.1), blocking=True))
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        wrapped.optimizer.step()
    elif kind == "CentralizedSGD":
        opt = optim.CentralizedSGD(model=model, lr=0.1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    else:
        opt = optim.DistOpt(torch.optim.SGD(trainable, lr=0.1))
        opt.backward_and_update(torch.nn.functional.mse_loss(model(x), y))
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["DataParallel", "CentralizedSGD", "DistOpt"])
def test_non_float_parameters_are_kept_and_float64_ones_trained(kind):
    got, want = _step_with(kind), _reference_step()
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=name)


# -- a world of one rank: the same step as plain torch ---------------------------------------------

SELF = hl.MPICommunication(MPI.COMM_SELF)


def _one_rank_step(kind: str) -> list[torch.Tensor]:
    model = mlp(seed=5)
    x, y = _batch(RANK)
    y = y.float()
    params = list(model.parameters())
    if kind == "DataParallel":
        wrapped = nn.DataParallel(model, SELF, optimizer=optim.DataParallelOptimizer(
            torch.optim.SGD(params, lr=0.1)))
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        wrapped.optimizer.step()
        wrapped.flush()
        return [p.detach() for p in params]
    if kind == "DistOpt":
        opt = optim.DistOpt(torch.optim.SGD(params, lr=0.1), comm=SELF)
        opt.backward_and_update(torch.nn.functional.mse_loss(model(x), y))
        return [p.detach() for p in params]
    if kind == "DASO":
        opt = optim.DASO(torch.optim.SGD(params, lr=0.1), total_epochs=3, comm=SELF,
                         warmup_epochs=1, cooldown_epochs=1)
        wrapped = nn.DataParallelMultiGPU(model, opt)
        opt.last_batch = 4
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        return [p.detach() for p in params]
    opt = {"CentralizedSGD": lambda: optim.CentralizedSGD(model=model, lr=0.1, comm=SELF),
           "PowerSGD": lambda: optim.PowerSGD(model=model, lr=0.1, rank=4, comm=SELF),
           "SignSGD": lambda: optim.SignSGD(params, lr=0.1, comm=SELF)}[kind]()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [p.detach() for p in params]


def _plain_step(sign: bool = False) -> list[torch.Tensor]:
    model = mlp(seed=5)
    x, y = _batch(RANK)
    torch.nn.functional.mse_loss(model(x), y.float()).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * (p.grad.sign() if sign else p.grad)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["DataParallel", "DistOpt", "DASO", "CentralizedSGD",
                                  "PowerSGD", "SignSGD"])
def test_a_world_of_one_rank_steps_like_plain_torch(kind):
    got = _one_rank_step(kind)
    want = _plain_step(sign=kind == "SignSGD")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    COMM.Barrier()
