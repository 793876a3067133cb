"""Training workloads shared by the benchmarks, the examples and the accuracy tests.

* :func:`load_digits_split`, :func:`mlp`, :func:`evaluate`: scikit-learn's bundled digits data
  (standardized, stratified 80/20 split), an MLP, sharded test accuracy.
* :data:`ALGORITHMS`: every distributed algorithm of heatlike behind one small interface
  (:class:`Runner`), so the same loop can train, time and count bytes for each.
"""

from __future__ import annotations

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
    ``bytes_sent()`` (payload bytes this rank handed to collectives so far)."""

    def __init__(self, model: nn.Module, step: Callable, sync, eval_model=None) -> None:
        self.model = model
        self._step = step
        self._sync = sync
        self._eval = eval_model

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self._step(x, y)

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

    return Runner(model, step, sync, **kw)


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

    return Runner(model, step, opt.sync)


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
        return Runner(net, step, syncs, eval_model=evaluate_model)
    return make


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
    differ)."""
    def average():
        import copy

        model = copy.deepcopy(net)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        comm.Allreduce(IN_PLACE, flat, MPI.SUM)
        flat /= comm.size
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
        return model
    return average


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
}


def make_runner(name: str, net: nn.Module, comm: MPICommunication, lr: float = 0.05) -> Runner:
    """The :class:`Runner` of algorithm ``name`` (a key of :data:`ALGORITHMS`)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}")
    return ALGORITHMS[name][0](net, comm, lr)


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
    runner = make_runner(name, net, comm, lr)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=batch_size, seed=seed)
    times = []
    for _ in range(epochs):
        for xb, yb in loader:
            start = time.perf_counter()
            runner.train_step(xb, yb)
            times.append(time.perf_counter() - start)
    accuracy = evaluate(runner.eval_model(), x_test, y_test, comm)
    return TrainResult(accuracy, times, runner.bytes_sent() / max(1, len(times)))
