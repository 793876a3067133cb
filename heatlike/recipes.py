"""Recipes: every distributed algorithm of heatlike by name, and the training workloads the
examples, the benchmarks and the accuracy tests share.

* :func:`load_digits_split`, :func:`mlp`, :func:`evaluate`: scikit-learn's bundled digits data
  (standardized, stratified 80/20 split), an MLP, sharded test accuracy.
* :func:`load_synthetic_split`: a larger synthetic classification task (scikit-learn's
  ``make_classification``, fixed seed), standardized and split the same way.
* :data:`ALGORITHMS`: every distributed algorithm of heatlike behind one small interface
  (:class:`Runner`), so the same loop can train, time and count bytes for each.
* :func:`train_task`: train one algorithm on a :class:`Task`, with the test accuracy and the
  training wall time after every epoch (:class:`EpochPoint`), optionally until a target accuracy.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mpi4py import MPI
from torch import nn

from .core.communication import IN_PLACE, MPICommunication
from .engine import Cast, Hierarchical, RandomK, ScaledSign, TopK, Warmup

__all__ = ["load_digits_split", "load_synthetic_split", "mlp", "evaluate", "Runner", "ALGORITHMS",
           "make_runner", "Task", "digits_task", "synthetic_task", "EpochPoint", "TrainResult",
           "train_task", "train_digits"]


def load_digits_split(seed: int = 0):
    """``(x_train, y_train, x_test, y_test)`` of the digits, standardized with the training
    statistics; identical on every rank."""
    from sklearn.datasets import load_digits

    return _standardized_split(*load_digits(return_X_y=True), seed)


def load_synthetic_split(seed: int = 0, samples: int = 3000, features: int = 128,
                         classes: int = 10):
    """``(x_train, y_train, x_test, y_test)`` of a synthetic classification task: scikit-learn's
    ``make_classification`` (``features // 2`` informative features, one Gaussian cluster per
    class, class separation 2, ``random_state=seed``), standardized with the training statistics,
    stratified 80/20 split; identical on every rank."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=samples, n_features=features,
                               n_informative=features // 2, n_redundant=0, n_classes=classes,
                               n_clusters_per_class=1, class_sep=2.0, random_state=seed)
    return _standardized_split(x, y, seed)


def _standardized_split(x, y, seed: int):
    """Stratified 80/20 split, standardized with the training statistics, as torch tensors."""
    from sklearn.model_selection import train_test_split

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


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             comm: MPICommunication) -> float:
    """Accuracy over the whole test set (collective: every rank calls it with the same model);
    each rank scores its shard (moved to the model's device and dtype), one all-reduce.

    The model is scored as a trained model is used: in ``eval()`` mode (BatchNorm's running
    statistics, no Dropout) under ``torch.no_grad()``. The buffers (BatchNorm statistics) of a
    DataParallel model, or of a module a DataParallel wraps, are synchronized first
    (``synchronize_buffers()``), so that every shard is scored by the same model. Afterwards every
    submodule (the wrapper's included) is back in the training mode it was in: evaluation leaves
    the parameters, the buffers (beyond that synchronization) and the modes as they were, and no
    test sample reaches the running statistics."""
    owners = _buffer_owners(model)
    for owner in owners:
        owner.synchronize_buffers()
    tops = [*owners, model]
    modes = {id(m): (m, m.training) for top in tops for m in top.modules()}
    try:
        for top in tops:
            top.eval()  # a DataParallel applies its pending updates first
        _, _, shard = comm.chunk(x.shape, 0)
        xs = x[shard]
        first = next(model.parameters())
        with torch.no_grad():
            scores = model(xs.to(first.device, first.dtype))
        correct = (scores.argmax(1) == y[shard[0]].to(first.device)).sum().item()
    finally:
        for m, mode in modes.values():
            m.training = mode
    counts = torch.tensor([correct, xs.shape[0]], dtype=torch.float64)
    comm.Allreduce(IN_PLACE, counts, MPI.SUM)
    return float(counts[0] / counts[1])


def _buffer_owners(model: nn.Module) -> list[nn.Module]:
    """The wrappers whose ``synchronize_buffers()`` :func:`evaluate` calls: ``model`` itself when
    it has one, and the DataParallel wrappers (not closed) of ``model`` or of a submodule; the
    same on every rank, since every rank wraps the same modules."""
    from .nn.data_parallel import _wrappers_of

    found = [model] if callable(getattr(model, "synchronize_buffers", None)) else []
    for wrapper in _wrappers_of(model):
        if callable(getattr(wrapper, "synchronize_buffers", None)) and \
                not any(wrapper is f for f in found):
            found.append(wrapper)
    return found


class Runner:
    """One algorithm training one model: ``train_step(x, y)``, ``eval_model()``,
    ``bytes_sent()`` (payload bytes this rank handed to collectives so far), ``start_epoch(n)``
    and ``end_epoch(loss)`` around every epoch of n batches. ``model`` (bare or wrapped) and
    ``optimizer`` are what a checkpoint saves.

    ``train_step(x, y, tracker)`` reports the step to a :class:`heatlike.utils.Tracker`: the
    phases (init, fwd_pass, comp_loss, backprop, and agg / opt_step from optimizers that take a
    tracker), every wait of the engine's gradient synchronization as a "comm wait" span, and the
    bytes sent per communicator (``bytes_by_label``; by default the reducer's class name) when the
    optimizer did not report them itself. The step is one tracker step (``batch_start`` ..
    ``batch_end``) unless the caller already opened one."""

    def __init__(self, model: nn.Module, step: Callable, sync, eval_model=None, optimizer=None,
                 start_epoch: Callable | None = None, end_epoch: Callable | None = None,
                 grad_syncs: Callable[[], list] | None = None,
                 bytes_by_label: Callable[[], dict] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._step = step
        self._sync = sync
        self._eval = eval_model
        self._start_epoch = start_epoch
        self._end_epoch = end_epoch
        self._grad_syncs = grad_syncs if grad_syncs is not None else (
            lambda: [sync] if hasattr(sync, "tracker") else [])
        self._bytes_by_label = bytes_by_label if bytes_by_label is not None else (
            lambda: {type(getattr(sync, "reducer", sync)).__name__: self.bytes_sent()})
        self._reports = "tracker" in inspect.signature(step).parameters

    def train_step(self, x: torch.Tensor, y: torch.Tensor, tracker=None) -> float:
        if tracker is None:
            return self._step(x, y)
        opened = not tracker.in_batch
        if opened:
            tracker.batch_start()
        syncs = self._grad_syncs()
        for sync in syncs:
            sync.tracker = tracker
        before = self._bytes_by_label()
        try:
            if self._reports:
                loss = self._step(x, y, tracker)
            else:  # a step function that knows no tracker: one phase
                loss = self._step(x, y)
                tracker.record("step")
        finally:
            for sync in syncs:
                sync.tracker = None
        if not tracker.step_bytes:
            for label, sent in self._bytes_by_label().items():
                tracker.add_bytes(sent - before.get(label, 0), label)
        if opened:
            tracker.batch_end()
        return loss

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

    def close(self) -> None:
        """Collective: free the communicators of the model's wrapper and of the optimizer
        (their ``close()``), for programs that train many in one process."""
        for owner in (self.model, self.optimizer):
            close = getattr(owner, "close", None)
            if close is not None:
                close()

    def bytes_sent(self) -> int:
        return self._sync.bytes_sent


def _mark(tracker, phase: str) -> None:
    if tracker is not None:
        tracker.record(phase)


def _forward_loss(model, loss_fn, x, y, tracker):
    """The forward pass and the loss, each marked on ``tracker``."""
    out = model(x)
    _mark(tracker, "fwd_pass")
    loss = loss_fn(out, y)
    _mark(tracker, "comp_loss")
    return loss


def _plain(opt, model, sync, **kw) -> Runner:
    loss_fn = nn.CrossEntropyLoss()
    reports = "tracker" in inspect.signature(opt.step).parameters

    def step(x, y, tracker=None):
        opt.zero_grad()
        _mark(tracker, "init")
        loss = _forward_loss(model, loss_fn, x, y, tracker)
        loss.backward()
        _mark(tracker, "backprop")
        if reports and tracker is not None:
            opt.step(tracker=tracker)
        else:
            opt.step()
            _mark(tracker, "opt_step")
        return loss.item()

    return Runner(model, step, sync, optimizer=opt, **kw)


def _data_parallel(blocking: bool):
    def make(net, comm, lr):
        from .nn import DataParallel
        from .optim import DataParallelOptimizer

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
        from .optim import CentralizedSGD

        opt = CentralizedSGD(model=net, lr=lr * lr_scale, momentum=momentum, comm=comm, **engine)
        return _plain(opt, net, opt.sync)
    return make


def _adam(net, comm, lr):
    from .optim import CentralizedAdam

    opt = CentralizedAdam(model=net, lr=lr / 25, comm=comm)
    return _plain(opt, net, opt.sync)


def _custom(net, comm, lr):
    from .optim import CustomCentralizedOptimizer

    opt = CustomCentralizedOptimizer(net, None, torch.optim.SGD(net.parameters(), lr=lr,
                                                                momentum=0.9),
                                     grad_clip=5.0, average_world=True, comm=comm)
    return _plain(opt, net, opt.sync)


def _hierarchical(net, comm, lr):
    from .core.topology import get_topology

    return _centralized(reducer=Hierarchical(comm, topology=get_topology(comm)))(net, comm, lr)


def _powersgd(net, comm, lr):
    from .optim import PowerSGD

    opt = PowerSGD(model=net, lr=lr, momentum=0.9, rank=2, reuse_query=True, comm=comm,
                   warmup_steps=COMPRESSION_WARMUP)
    return _plain(opt, net, opt.sync)


def _sparsified(net, comm, lr):
    from .optim import CentralizedSparsifiedSGD

    opt = CentralizedSparsifiedSGD(net.parameters(), lr=6 * lr, sparse_grad_size=1024, comm=comm)
    return _plain(opt, net, opt.sync)


def _sparsified_local(net, comm, lr):
    from .optim import SparsifiedSGD

    opt = SparsifiedSGD(net.parameters(), lr=6 * lr, sparse_grad_size=1024, comm=comm)
    return _plain(opt, net, opt.sync)


def _sign(net, comm, lr):
    from .optim import SignSGD

    opt = SignSGD(net.parameters(), lr=lr / 50, momentum=0.9, comm=comm)
    return _plain(opt, net, opt.sync)


def _decentralized(net, comm, lr):
    from .optim import DecentralizedSGD

    opt = DecentralizedSGD(model=net, lr=lr, momentum=0.9, comm=comm)
    return _plain(opt, net, opt.sync, eval_model=_averaged(net, comm))


def _fp16(net, comm, lr):
    from .optim import FP16Optimizer

    model = net.half()
    opt = FP16Optimizer(model, average_world=True, comm=comm)
    opt.set_optimizer(torch.optim.SGD([opt.fp32_params], lr=lr, momentum=0.9))
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y, tracker=None):
        opt.zero_grad()
        _mark(tracker, "init")
        loss = _forward_loss(lambda v: model(v.half()).float(), loss_fn, x, y, tracker)
        opt.backward_loss(loss)
        _mark(tracker, "backprop")
        opt.step(tracker=tracker)
        return loss.item()

    return Runner(model, step, opt.sync, optimizer=opt)


def _distopt(mode: str, **options):
    def make(net, comm, lr):
        from .optim import DistOpt

        dist = DistOpt(torch.optim.SGD(net.parameters(), lr=lr * options.pop("lr_scale", 1.0),
                                       momentum=0.9), comm)
        backward = getattr(dist, f"backward_and_{mode}")
        loss_fn = nn.CrossEntropyLoss()

        def step(x, y, tracker=None):
            loss = _forward_loss(net, loss_fn, x, y, tracker)
            backward(loss, **options)  # backward, communication and the update in one call
            _mark(tracker, "backprop")
            return loss.item()

        syncs = _DistOptBytes(dist)
        evaluate_model = _averaged(net, comm) if mode == "partial_update" else None
        return Runner(net, step, syncs, eval_model=evaluate_model, optimizer=dist,
                      grad_syncs=lambda: list(dist._syncs.values()),
                      bytes_by_label=lambda: {"DistOpt": syncs.bytes_sent})
    return make


def _daso(net, comm, lr, epochs: int = 10):
    from .nn import DataParallelMultiGPU
    from .optim import DASO

    # DASO needs total_epochs > warmup + cooldown (no epochs: nothing is trained, DASO for one)
    total = max(epochs, 1)
    warmup = min(1, total - 1)
    daso = DASO(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9), total_epochs=total,
                comm=comm, warmup_epochs=warmup, cooldown_epochs=min(1, total - 1 - warmup),
                max_global_skips=4)
    model = DataParallelMultiGPU(net, daso)
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y, tracker=None):
        daso.zero_grad()
        _mark(tracker, "init")
        loss = _forward_loss(model, loss_fn, x, y, tracker)
        loss.backward()
        _mark(tracker, "backprop")
        daso.step()
        _mark(tracker, "opt_step")
        return loss.item()

    def start_epoch(batches):
        daso.last_batch = batches

    return Runner(model, step, _DasoBytes(daso, model), eval_model=_averaged(net, comm),
                  optimizer=daso, start_epoch=start_epoch, end_epoch=daso.epoch_loss_logic,
                  grad_syncs=lambda: [model.grad_sync] if model.grad_sync is not None else [],
                  bytes_by_label=lambda: {
                      "node gradients": model.grad_sync.bytes_sent if model.grad_sync else 0,
                      "node broadcast": daso.bytes_node, "cross-node": daso.bytes_cross,
                      "warmup gradients": daso.bytes_warmup})


class _DasoBytes:
    """DASO's payload: node-local gradient averaging, cross-node sends, node broadcasts, the
    warmup's gradient all-reduces."""

    def __init__(self, daso, model) -> None:
        self.daso = daso
        self.model = model

    @property
    def bytes_sent(self) -> int:
        node = self.model.grad_sync.bytes_sent if self.model.grad_sync is not None else 0
        return self.daso.bytes_cross + self.daso.bytes_node + self.daso.bytes_warmup + node


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
    differ), as a module that runs ``net`` with the averaged parameters and floating-point
    buffers (BatchNorm's running statistics: every shard is then scored by the same model)."""
    def average():
        tensors = dict(net.named_parameters())
        tensors.update((n, b) for n, b in net.named_buffers() if b.is_floating_point())
        first = next(iter(tensors.values()))
        flat = torch.cat([t.detach().reshape(-1).to(first.dtype) for t in tensors.values()])
        comm.Allreduce(IN_PLACE, flat, MPI.SUM)
        flat /= comm.size
        values, offset = {}, 0
        for name, t in tensors.items():
            values[name] = flat[offset:offset + t.numel()].view(t.shape).to(t.dtype)
            offset += t.numel()
        return _WithParameters(net, values)
    return average


class _WithParameters(nn.Module):
    """``net`` evaluated with other parameter values (``torch.func.functional_call``)."""

    def __init__(self, net: nn.Module, params: dict) -> None:
        super().__init__()
        self.net, self.values = net, params

    def forward(self, *args):
        return torch.func.functional_call(self.net, self.values, args)


#: steps that "powersgd-2" and "topk-1%" average exactly before they compress (the warm-up of
#: PyTorch's PowerSGD hook and of deep gradient compression): 8 of the 72 steps of 6 epochs of
#: digits at 4 ranks, batch 32
COMPRESSION_WARMUP = 8

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
    "powersgd-2": (_powersgd, f"PowerSGD rank 2, warm start, exact averages in the first "
                              f"{COMPRESSION_WARMUP} steps"),
    "topk-1%": (lambda n, c, lr: _centralized(
        codec=Warmup(TopK(ratio=0.01), COMPRESSION_WARMUP))(n, c, lr),
                f"CentralizedSGD, top-k 1% with error feedback, exact averages in the first "
                f"{COMPRESSION_WARMUP} steps"),
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
class Task:
    """A training workload: data ``(x_train, y_train, x_test, y_test)``, MLP widths, per-rank
    batch size and learning rate (each algorithm scales it as :data:`ALGORITHMS` says);
    ``model(seed)``, when given, builds the model instead of the MLP."""

    name: str
    data: tuple
    widths: list[int]
    batch_size: int = 16
    lr: float = 0.05
    model: Callable[[int], nn.Module] | None = None

    def build(self, seed: int = 0) -> nn.Module:
        """The task's model with the initial weights of ``seed``."""
        return self.model(seed) if self.model is not None else mlp(self.widths, seed)


def digits_task(seed: int = 0, data=None, hidden: tuple[int, ...] = (128, 64)) -> Task:
    """The digits MLP 64-128-64-10 (17K parameters), batch 16 per rank, lr 0.05."""
    return Task("digits", data if data is not None else load_digits_split(seed),
                [64, *hidden, 10])


def synthetic_task(seed: int = 0, samples: int = 3000, features: int = 128) -> Task:
    """:func:`load_synthetic_split` (10 classes) with an MLP features-256-128-10 (about 67K
    parameters at 128 features), batch 32 per rank, lr 0.1."""
    return Task("synthetic", load_synthetic_split(seed, samples, features),
                [features, 256, 128, 10], batch_size=32, lr=0.1)


@dataclass
class EpochPoint:
    """The state after ``epoch`` epochs: training wall time so far (seconds, slowest rank per
    epoch, evaluation excluded) and test accuracy."""

    epoch: int
    seconds: float
    accuracy: float


@dataclass
class TrainResult:
    accuracy: float
    step_times: list
    bytes_per_step: float
    curve: list[EpochPoint] = field(default_factory=list)

    def time_to_accuracy(self, target: float) -> EpochPoint | None:
        """The first epoch whose test accuracy is >= ``target`` (None: not reached)."""
        return next((p for p in self.curve if p.accuracy >= target), None)


def train_task(name: str, comm: MPICommunication, task: Task, epochs: int = 10, seed: int = 0,
               curve: bool = True, target: float | None = None,
               device: torch.device | str | None = None,
               on_runner: Callable[[Runner], None] | None = None,
               on_epoch: Callable[[EpochPoint, float], None] | None = None,
               progress: bool = False) -> TrainResult:
    """Train ``task``'s model with algorithm ``name`` for ``epochs`` epochs, or until the test
    accuracy reaches ``target`` (checked after every epoch, with or without ``curve``: every rank
    evaluates and stops at the same epoch), on ``device`` (default: the CPU; see
    :func:`heatlike.utils.select_device`). With ``curve``, every epoch ends with
    a test evaluation and adds an :class:`EpochPoint` (the time of the evaluation is not counted;
    epoch times are measured between a barrier and the slowest rank's end). Evaluations
    (:func:`evaluate`) leave the model as training left it. ``on_runner`` is
    called with the :class:`Runner` before the first step (to inspect or instrument it);
    ``on_epoch`` (with ``curve``) after each epoch's evaluation, with its point and the mean of
    the epoch's step losses over every rank; ``progress``: a tqdm bar per epoch on rank 0.
    Returns the final accuracy, every step's time on this rank and the mean bytes per step."""
    from mpi4py import MPI as _MPI

    from .utils.data import DataLoader, Dataset

    x_train, y_train, x_test, y_test = task.data
    net = task.build(seed)
    if device is not None:
        net = net.to(device)
    runner = make_runner(name, net, comm, task.lr, epochs)
    if on_runner is not None:
        on_runner(runner)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=task.batch_size, seed=seed,
                        progress=progress, comm=comm)
    times: list[float] = []
    points: list[EpochPoint] = []
    elapsed = 0.0
    accuracy = None
    for epoch in range(1, epochs + 1):
        if curve:
            comm.Barrier()
        epoch_start = time.perf_counter()
        runner.start_epoch(len(loader))
        losses = []
        for xb, yb in loader:
            start = time.perf_counter()
            if device is not None:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            losses.append(runner.train_step(xb, yb))
            times.append(time.perf_counter() - start)
        runner.end_epoch(sum(losses) / len(losses))
        if not curve and target is None:
            continue
        if curve:
            elapsed += comm.handle.allreduce(time.perf_counter() - epoch_start, op=_MPI.MAX)
        accuracy = evaluate(runner.eval_model(), x_test, y_test, comm)
        if curve:
            points.append(EpochPoint(epoch, elapsed, accuracy))
            if on_epoch is not None:
                local = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
                comm.Allreduce(_MPI.IN_PLACE, local, _MPI.SUM)
                on_epoch(points[-1], float(local[0] / local[1]))
        if target is not None and accuracy >= target:  # the same accuracy on every rank
            break
    if accuracy is None:
        accuracy = evaluate(runner.eval_model(), x_test, y_test, comm)
    return TrainResult(accuracy, times, runner.bytes_sent() / max(1, len(times)), points)


def train_digits(name: str, comm: MPICommunication, epochs: int = 10, batch_size: int = 16,
                 lr: float = 0.05, seed: int = 0, hidden: tuple[int, int] = (128, 64),
                 data=None, curve: bool = False,
                 device: torch.device | str | None = None,
                 on_epoch: Callable[[EpochPoint, float], None] | None = None,
                 progress: bool = False) -> TrainResult:
    """Train the digits MLP with algorithm ``name`` on ``device``; the final test accuracy, every
    step's time and the mean bytes per step (and, with ``curve``, the accuracy after every
    epoch, reported to ``on_epoch`` as in :func:`train_task`)."""
    task = digits_task(seed, data, hidden)
    task.batch_size, task.lr = batch_size, lr
    return train_task(name, comm, task, epochs, seed, curve=curve or on_epoch is not None,
                      device=device, on_epoch=on_epoch, progress=progress)
