"""Training workloads shared by the benchmarks, the examples and the accuracy tests.

* :func:`load_digits_split`, :func:`mlp`, :func:`evaluate`: scikit-learn's bundled digits data
  (standardized, stratified 80/20 split), an MLP, sharded test accuracy.
* :data:`ALGORITHMS`: every distributed algorithm of heatlike behind one small interface
  (:class:`Runner`), so the same loop can train, time and count bytes for each.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mpi4py import MPI
from torch import nn

from ..core.communication import IN_PLACE, MPICommunication
from ..engine import Cast, Hierarchical, RandomK, ScaledSign, TopK

__all__ = ["load_digits_split", "mlp", "evaluate", "Runner", "ALGORITHMS", "make_runner"]


def load_digits_split(seed: int = 0):
    """``(x_train, y_train, x_test, y_test)`` of the digits, standardized with the training
    statistics; identical on every rank."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=y)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6

    def as_x(a):
        return torch.tensor((a - mean) / std, dtype=torch.float32)

    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


def mlp(widths: list[int], seed: int = 0) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             comm: MPICommunication) -> float:
    """Accuracy over the whole test set; each rank scores its shard, one all-reduce."""
    _, _, shard = comm.chunk(x.shape, 0)
    xs = x[shard]
    dtype = next(model.parameters()).dtype
    correct = (model(xs.to(dtype)).argmax(1) == y[shard[0]]).sum().item()
    counts = torch.tensor([correct, xs.shape[0]], dtype=torch.float64)
    comm.Allreduce(IN_PLACE, counts, MPI.SUM)
    return float(counts[0] / counts[1])


class Runner:
    """One algorithm training one model: ``train_step(x, y)``, ``eval_model()``,
    ``bytes_sent()`` (payload bytes this rank handed to collectives so far), ``start_epoch(n)``
    and ``end_epoch(loss)`` around every epoch of n batches. ``model`` (bare or wrapped) and
    ``optimizer`` are what a checkpoint saves."""

    def __init__(self, model: nn.Module, step: Callable, sync, eval_model=None, optimizer=None,
                 start_epoch: Callable | None = None, end_epoch: Callable | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._step = step
        self._sync = sync
        self._eval = eval_model
        self._start_epoch = start_epoch
        self._end_epoch = end_epoch

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self._step(x, y)

    def start_epoch(self, batches: int) -> None:
        if self._start_epoch is not None:
            self._start_epoch(batches)

    def end_epoch(self, loss: float) -> None:
        """After an epoch, with this rank's mean training loss of it."""
        if self._end_epoch is not None:
            self._end_epoch(loss)

    def eval_model(self) -> nn.Module:
        """The model to evaluate, with every pending update applied."""
        return self._eval() if self._eval is not None else self.model

    def finish(self) -> None:
        """Apply pending updates (non-blocking modes) so nothing is left in flight."""
        self.eval_model()

    def bytes_sent(self) -> int:
        return self._sync.bytes_sent


def _plain(opt, model, sync, **kw) -> Runner:
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return Runner(model, step, sync, optimizer=opt, **kw)


def _data_parallel(blocking: bool):
    def make(net, comm, lr):
        from ..nn import DataParallel
        from ..optim import DataParallelOptimizer

        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
                                    blocking=blocking)
        model = DataParallel(net, comm, optimizer=opt)

        def evaluate_model():
            model.flush()
            return net

        return _plain(opt, model, model.grad_sync, eval_model=evaluate_model)
    return make


def _centralized(momentum: float = 0.9, lr_scale: float = 1.0, **engine):
    def make(net, comm, lr):
        from ..optim import CentralizedSGD

        opt = CentralizedSGD(model=net, lr=lr * lr_scale, momentum=momentum, comm=comm, **engine)
        return _plain(opt, net, opt.sync)
    return make


def _adam(net, comm, lr):
    from ..optim import CentralizedAdam

    opt = CentralizedAdam(model=net, lr=lr / 25, comm=comm)
    return _plain(opt, net, opt.sync)


def _custom(net, comm, lr):
    from ..optim import CustomCentralizedOptimizer

    opt = CustomCentralizedOptimizer(net, None, torch.optim.SGD(net.parameters(), lr=lr,
                                                                momentum=0.9),
                                     grad_clip=5.0, average_world=True, comm=comm)
    return _plain(opt, net, opt.sync)


def _hierarchical(net, comm, lr):
    from ..core.topology import get_topology

    return _centralized(reducer=Hierarchical(comm, topology=get_topology(comm)))(net, comm, lr)


def _powersgd(net, comm, lr):
    from ..optim import PowerSGD

    opt = PowerSGD(model=net, lr=lr, momentum=0.9, rank=2, reuse_query=True, comm=comm)
    return _plain(opt, net, opt.sync)


def _sparsified(net, comm, lr):
    from ..optim import CentralizedSparsifiedSGD

    opt = CentralizedSparsifiedSGD(net.parameters(), lr=6 * lr, sparse_grad_size=1024, comm=comm)
    return _plain(opt, net, opt.sync)


def _sparsified_local(net, comm, lr):
    from ..optim import SparsifiedSGD

    opt = SparsifiedSGD(net.parameters(), lr=6 * lr, sparse_grad_size=1024, comm=comm)
    return _plain(opt, net, opt.sync)


def _sign(net, comm, lr):
    from ..optim import SignSGD

    opt = SignSGD(net.parameters(), lr=lr / 50, momentum=0.9, comm=comm)
    return _plain(opt, net, opt.sync)


def _decentralized(net, comm, lr):
    from ..optim import DecentralizedSGD

    opt = DecentralizedSGD(model=net, lr=lr, momentum=0.9, comm=comm)
    return _plain(opt, net, opt.sync, eval_model=_averaged(net, comm))


def _fp16(net, comm, lr):
    from ..optim import FP16Optimizer

    model = net.half()
    opt = FP16Optimizer(model, average_world=True, comm=comm)
    opt.set_optimizer(torch.optim.SGD([opt.fp32_params], lr=lr, momentum=0.9))
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x.half()).float(), y)
        opt.backward_loss(loss)
        opt.step()
        return loss.item()

    return Runner(model, step, opt.sync, optimizer=opt)


def _distopt(mode: str, **options):
    def make(net, comm, lr):
        from ..optim import DistOpt

        dist = DistOpt(torch.optim.SGD(net.parameters(), lr=lr * options.pop("lr_scale", 1.0),
                                       momentum=0.9), comm)
        backward = getattr(dist, f"backward_and_{mode}")
        loss_fn = nn.CrossEntropyLoss()

        def step(x, y):
            loss = loss_fn(net(x), y)
            backward(loss, **options)
            return loss.item()

        syncs = _DistOptBytes(dist)
        evaluate_model = _averaged(net, comm) if mode == "partial_update" else None
        return Runner(net, step, syncs, eval_model=evaluate_model, optimizer=dist)
    return make


def _daso(net, comm, lr, epochs: int = 10):
    from ..nn import DataParallelMultiGPU
    from ..optim import DASO

    daso = DASO(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9), total_epochs=epochs,
                comm=comm, warmup_epochs=min(1, epochs), cooldown_epochs=min(1, epochs - 1),
                max_global_skips=4)
    model = DataParallelMultiGPU(net, daso)
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        daso.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        daso.step()
        return loss.item()

    def start_epoch(batches):
        daso.last_batch = batches

    return Runner(model, step, _DasoBytes(daso), eval_model=_averaged(net, comm), optimizer=daso,
                  start_epoch=start_epoch, end_epoch=daso.epoch_loss_logic)


class _DasoBytes:
    def __init__(self, daso) -> None:
        self.daso = daso

    @property
    def bytes_sent(self) -> int:
        return self.daso.bytes_cross + self.daso.bytes_node


class _DistOptBytes:
    """bytes_sent over every synchronizer a DistOpt uses."""

    def __init__(self, dist) -> None:
        self.dist = dist

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in (*self.dist._syncs.values(),
                                          *self.dist._partitions.values()))


def _averaged(net: nn.Module, comm: MPICommunication):
    """A function returning the average of the ranks' models (for methods whose replicas
    differ), as a module that runs ``net`` with the averaged parameters."""
    def average():
        names = [n for n, _ in net.named_parameters()]
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        comm.Allreduce(IN_PLACE, flat, MPI.SUM)
        flat /= comm.size
        params, offset = {}, 0
        for name, p in zip(names, net.parameters()):
            params[name] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return _WithParameters(net, params)
    return average


class _WithParameters(nn.Module):
    """``net`` evaluated with other parameter values (``torch.func.functional_call``)."""

    def __init__(self, net: nn.Module, params: dict) -> None:
        super().__init__()
        self.net, self.values = net, params

    def forward(self, *args):
        return torch.func.functional_call(self.net, self.values, args)


#: name -> (factory(net, comm, lr) -> Runner, description)
ALGORITHMS: dict[str, tuple[Callable, str]] = {
    "allreduce": (_data_parallel(True), "DataParallel, blocking (float32 all-reduce)"),
    "allreduce-nonblocking": (_data_parallel(False), "DataParallel, non-blocking"),
    "centralized-sgd": (_centralized(), "CentralizedSGD"),
    "centralized-adam": (_adam, "CentralizedAdam (lr / 25)"),
    "custom-clip": (_custom, "CustomCentralizedOptimizer, clipping, average_world"),
    "hierarchical": (_hierarchical, "CentralizedSGD, hierarchical all-reduce"),
    "bf16": (_centralized(codec=Cast(torch.bfloat16)), "CentralizedSGD, bfloat16 cast"),
    "fp16-optimizer": (_fp16, "FP16Optimizer, loss scaling"),
    "powersgd-2": (_powersgd, "PowerSGD rank 2, warm start"),
    "topk-1%": (lambda n, c, lr: _centralized(codec=TopK(ratio=0.01))(n, c, lr),
                "CentralizedSGD, top-k 1% with error feedback"),
    "randomk-10%": (lambda n, c, lr: _centralized(0.0, 4.0, codec=RandomK(ratio=0.1))(n, c, lr),
                    "CentralizedSGD without momentum (4x lr), shared random-k 10%, error feedback"),
    "sparsified-sgd": (_sparsified, "CentralizedSparsifiedSGD (6x lr), random blocks of 1024"),
    "sparsified-sgd-shared": (_sparsified_local,
                              "SparsifiedSGD (6x lr), shared random blocks of 1024"),
    "sign": (_sign, "SignSGD with momentum (lr / 50), majority vote"),
    "ef-sign": (lambda n, c, lr: _centralized(codec=ScaledSign())(n, c, lr),
                "CentralizedSGD, scaled sign with error feedback"),
    "decentralized": (_decentralized, "DecentralizedSGD, ring gossip"),
    "distopt-fused": (_distopt("update", threshold=4096),
                      "DistOpt.backward_and_update, fusion below 4096 elements"),
    "distopt-half": (_distopt("update_half", threshold=4096, clipping=True, clip_Value=10.0),
                     "DistOpt.backward_and_update_half, clipping at 10"),
    "distopt-partial": (_distopt("partial_update", threshold=4096),
                        "DistOpt.backward_and_partial_update, partitions of 4096 elements"),
    "distopt-sparse": (_distopt("sparse_update", threshold=4096, spars=0.01, topK=True),
                       "DistOpt.backward_and_sparse_update, top-k 1% with residual"),
    "daso": (_daso, "DASO: node-local gradient averaging, bfloat16 cross-node parameter "
                    "averaging every 4 batches (1 warmup, 1 cooldown epoch)"),
}


def make_runner(name: str, net: nn.Module, comm: MPICommunication, lr: float = 0.05,
                epochs: int = 10) -> Runner:
    """The :class:`Runner` of algorithm ``name`` (a key of :data:`ALGORITHMS`) for a run of
    ``epochs`` epochs (DASO's schedule depends on it)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}")
    factory = ALGORITHMS[name][0]
    if "epochs" in inspect.signature(factory).parameters:
        return factory(net, comm, lr, epochs=epochs)
    return factory(net, comm, lr)


@dataclass
class TrainResult:
    accuracy: float
    step_times: list
    bytes_per_step: float


def train_digits(name: str, comm: MPICommunication, epochs: int = 10, batch_size: int = 16,
                 lr: float = 0.05, seed: int = 0, hidden: tuple[int, int] = (128, 64),
                 data=None) -> TrainResult:
    """Train the digits MLP with algorithm ``name``; the final test accuracy, every step's time
    and the mean bytes per step."""
    import time

    from ..utils.data import DataLoader, Dataset

    x_train, y_train, x_test, y_test = data if data is not None else load_digits_split(seed)
    net = mlp([64, *hidden, 10], seed)
    runner = make_runner(name, net, comm, lr, epochs)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=batch_size, seed=seed)
    times = []
    for _ in range(epochs):
        runner.start_epoch(len(loader))
        losses = []
        for xb, yb in loader:
            start = time.perf_counter()
            losses.append(runner.train_step(xb, yb))
            times.append(time.perf_counter() - start)
        runner.end_epoch(sum(losses) / len(losses))
    accuracy = evaluate(runner.eval_model(), x_test, y_test, comm)
    return TrainResult(accuracy, times, runner.bytes_sent() / max(1, len(times)))
