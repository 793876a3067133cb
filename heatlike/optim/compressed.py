"""mlbench-core's compressed optimizers as presets over the engine's codecs.

* :class:`PowerSGD`: centralized SGD whose gradients travel through the PowerSGD codec (rank-r
  power iteration with error feedback, optional warm start).
* :class:`CentralizedSparsifiedSGD`: each rank keeps a memory of not yet applied updates
  ``m <- m + lr (g + wd p)``, sends k coordinates of it per tensor (a random block, or random
  coordinates with ``random_sparse``; each rank its own choice, as (index, value) pairs gathered
  from all ranks), and every rank applies the average of what was sent.
* :class:`SparsifiedSGD`: the same memory and sparsified update with a random block shared by all
  ranks (so only values travel and are summed), plus the weighted average of the iterates of
  Stich et al. (2018), :meth:`~SparsifiedSGD.get_estimated_weights`.
* :class:`SignSGD`: SGD direction (momentum as torch's SGD), one bit per coordinate; the ranks'
  signs are combined by majority vote and every rank steps ``lr * sign(vote)``.

The memory is the codec's error-feedback residual, kept per tensor in its ``state_dict()``.
mlbench's bugs are not copied: user initializations are kept (only made equal on all ranks),
parameters of any shape work, the learning rate is applied, the global RNG is never reseeded,
and PowerSGD compresses at every world size.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from ..core.agreement import raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..engine import codecs
from ..engine.gradsync import GradientSync
from ..engine.reducers import AllReduce
from ..engine.replicas import broadcast_module
from .centralized import GenericCentralizedOptimizer, _check_lr, world_size_error

__all__ = ["PowerSGD", "CentralizedSparsifiedSGD", "SparsifiedSGD", "SignSGD"]


class PowerSGD(GenericCentralizedOptimizer):
    """Centralized SGD with PowerSGD gradient compression (Vogels et al. 2019).

    ``rank`` is the rank of the approximation (mlbench's name; not an MPI rank), ``reuse_query``
    warm-starts the power iteration from the last averaged Q. See
    :class:`heatlike.engine.PowerSGD` for the math.
    """

    def __init__(self, model: torch.nn.Module | None = None, lr=required, momentum: float = 0,
                 weight_decay: float = 0, dampening: float = 0, nesterov: bool = False,
                 average_world: bool = True, use_cuda: bool = False, by_layer: bool = False,
                 reuse_query: bool = False, world_size: int | None = None, rank: int = 1,
                 **engine) -> None:
        comm = sanitize_comm(engine.get("comm"))
        error = _check_lr(lr)
        if error is None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            error = ValueError(f"rank (of the approximation) must be a positive int, got {rank!r}")
        raise_together(error, comm)
        engine.setdefault("codec", codecs.PowerSGD(rank, reuse_query=reuse_query))
        super().__init__(world_size, model, use_cuda, by_layer, False, True,
                         _op="avg" if average_world else "sum", **engine)
        self.rank = rank
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                         dampening=dampening, weight_decay=weight_decay,
                                         nesterov=nesterov)


class _UpdateSync(torch.optim.Optimizer):
    """A torch optimizer whose per-step update of every parameter goes through the engine: the
    update is written to ``.grad``, exchanged (codec + reducer, one bucket per tensor), and the
    result applied (the base of the sparsified and sign optimizers)."""

    def __init__(self, params, defaults: dict, comm: MPICommunication | None,
                 world_size: int | None, codec: codecs.Codec, op: str) -> None:
        comm = sanitize_comm(comm)
        error = _check_lr(defaults.get("lr", required)) or world_size_error(world_size, comm)
        raise_together(error, comm)
        super().__init__(params, defaults)
        self.comm = comm
        self.world_size = comm.size
        plist = [p for g in self.param_groups for p in g["params"]]
        broadcast_module(torch.nn.ParameterList(plist), comm)  # rank 0's initialization kept
        self.sync = GradientSync(plist, comm, 1e-6, 1e-6, codec=codec,
                                 reducer=AllReduce(comm, op=op), hooks=False,
                                 grad_as_bucket_view=False)

    def _exchange_and_apply_sgd_updates(self) -> None:
        """``p -= combine_r(lr (g_r + wd p))`` for every parameter with a gradient, the update
        going through the codec (with its memory) and the reducer."""
        updates = {p: (p.grad + group["weight_decay"] * p).mul_(group["lr"])
                   for group in self.param_groups for p in group["params"] if p.grad is not None}
        self._exchange_updates(updates)
        for p in self.sync.params:
            if p.grad is not None:
                p.sub_(p.grad)
        self._restore_grads()

    def _exchange_updates(self, updates: dict) -> None:
        """Exchange the updates (param -> tensor) through the engine; afterwards each
        parameter's ``.grad`` holds the combined update."""
        saved = {}
        for p in self.sync.params:
            saved[p] = p.grad
            p.grad = updates.get(p)
        self.sync.launch_all()
        self.sync.synchronize()
        self._saved = saved

    def _restore_grads(self) -> None:
        for p, g in self._saved.items():
            p.grad = g

    def state_dict(self) -> dict:
        """torch's optimizer state plus the engine's (the memory: codec residuals)."""
        state = super().state_dict()
        state["engine"] = self.sync.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        engine = state_dict.pop("engine", None)
        super().load_state_dict(state_dict)
        if engine is not None:
            self.sync.load_state_dict(engine)


class CentralizedSparsifiedSGD(_UpdateSync):
    """Sparsified SGD with memory; each rank sends ``sparse_grad_size`` coordinates per tensor
    of its own choosing (a random block, or random coordinates with ``random_sparse``).

    ``sparsifier="topk"`` sends the largest coordinates instead (not in mlbench)."""

    def __init__(self, params=None, lr=required, weight_decay: float = 0,
                 sparse_grad_size: int = 10, random_sparse: bool = False,
                 world_size: int | None = None, average_world: bool = True, *,
                 comm: MPICommunication | None = None, sparsifier: str | None = None) -> None:
        comm = sanitize_comm(comm)
        kind = sparsifier or ("random" if random_sparse else "block")
        raise_together(_sparsifier_error(kind, sparse_grad_size), comm)
        codec = {"random": lambda: codecs.RandomK(k=sparse_grad_size, shared=False),
                 "block": lambda: codecs.RandomBlock(k=sparse_grad_size, shared=False),
                 "topk": lambda: codecs.TopK(k=sparse_grad_size)}[kind]()
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, comm, world_size,
                         codec, "avg" if average_world else "sum")
        self.sparse_grad_size = sparse_grad_size

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._exchange_and_apply_sgd_updates()
        return loss


def _sparsifier_error(kind: str, k) -> Exception | None:
    if kind not in ("random", "block", "topk"):
        return ValueError(f"sparsifier must be 'random', 'block' or 'topk', got {kind!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return ValueError(f"sparse_grad_size must be a positive int, got {k!r}")
    return None


class SparsifiedSGD(_UpdateSync):
    """Sparsified SGD with memory (Stich et al. 2018): ``m <- m + lr (g + wd p)``; a random block
    of ``sparse_grad_size`` coordinates of m per tensor, the same block on every rank, is averaged
    over the ranks, applied and removed from m.

    :meth:`get_estimated_weights` returns the weighted average of the iterates,
    ``est <- (1 - rho) est + rho p``, ``rho_t = 6 (t + tau)^2 / ((1 + t)(6 tau^2 + t + 6 tau t +
    2 t^2))``, ``tau = d / k`` for a tensor of d elements."""

    def __init__(self, params, lr=required, weight_decay: float = 0, sparse_grad_size: int = 10,
                 *, comm: MPICommunication | None = None, random_sparse: bool = False) -> None:
        comm = sanitize_comm(comm)
        raise_together(_sparsifier_error("random" if random_sparse else "block",
                                         sparse_grad_size), comm)
        codec = (codecs.RandomK(k=sparse_grad_size) if random_sparse else
                 codecs.RandomBlock(k=sparse_grad_size))
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, comm, None, codec,
                         "avg")
        self.sparse_grad_size = sparse_grad_size
        self.iteration = 0
        for p in self.sync.params:
            self.state[p]["estimated_weights"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._exchange_and_apply_sgd_updates()
        self.update_estimated_weights(self.iteration, self.sparse_grad_size)
        self.iteration += 1
        return loss

    def update_estimated_weights(self, iteration: int, sparse_vector_size: int) -> None:
        t = iteration
        for p in self.sync.params:
            tau = p.numel() / max(1, min(sparse_vector_size, p.numel()))
            rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau ** 2 + t + 6 * tau * t + 2 * t ** 2))
            est = self.state[p]["estimated_weights"]
            est.mul_(1 - rho).add_(p.detach(), alpha=rho)

    def get_estimated_weights(self) -> list[torch.Tensor]:
        """The weighted average of the iterates, one tensor per parameter."""
        return [self.state[p]["estimated_weights"] for p in self.sync.params]


class SignSGD(_UpdateSync):
    """Sign SGD with majority vote: direction ``d`` as torch SGD's (weight decay, momentum,
    dampening, Nesterov); each rank sends ``sign(d)`` (one bit per coordinate) and steps
    ``p <- p - lr * sign(sum of the ranks' signs)`` (no step where the vote ties)."""

    def __init__(self, params, lr=required, momentum: float = 0, weight_decay: float = 0,
                 dampening: float = 0, nesterov: bool = False, *,
                 comm: MPICommunication | None = None) -> None:
        comm = sanitize_comm(comm)
        error = None
        if nesterov and (momentum <= 0 or dampening != 0):
            error = ValueError("Nesterov momentum requires a momentum and zero dampening")
        raise_together(error, comm)
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "dampening": dampening, "nesterov": nesterov}
        super().__init__(params, defaults, comm, None, codecs.Sign(), "sum")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        directions = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad + group["weight_decay"] * p if group["weight_decay"] else \
                    p.grad.clone()
                if group["momentum"]:
                    buf = self.state[p].get("momentum_buffer")
                    if buf is None:
                        buf = self.state[p]["momentum_buffer"] = d.clone()
                    else:
                        buf.mul_(group["momentum"]).add_(d, alpha=1 - group["dampening"])
                    d = d + group["momentum"] * buf if group["nesterov"] else buf.clone()
                directions[p] = d
        self._exchange_updates(directions)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        self._restore_grads()
        return loss

