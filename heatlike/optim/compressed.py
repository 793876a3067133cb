"""mlbench-core's compressed optimizers as presets over the engine's codecs.

* :class:`PowerSGD`: centralized SGD whose gradients travel through the PowerSGD codec (rank-r
  power iteration with error feedback, optional warm start).
* :class:`CentralizedSparsifiedSGD`: each rank keeps a memory of not yet applied updates
  ``m <- m + lr (g + wd p)``, sends k coordinates of it per tensor (a random block, or random
  coordinates with ``random_sparse``; each rank its own choice, as (index, value) pairs gathered
  from all ranks: every tensor's in one all-gather per bucket, ``heatlike.engine.PerTensor``),
  and every rank applies the average of what was sent.
* :class:`SparsifiedSGD`: the same memory and sparsified update with a random block shared by all
  ranks (so only values travel and are summed), plus the weighted average of the iterates of
  Stich et al. (2018), :meth:`~SparsifiedSGD.get_estimated_weights`.
* :class:`SignSGD`: SGD direction (momentum as torch's SGD), its sign per coordinate (-1, 0 or
  +1: a zero or missing gradient casts no vote); the ranks' signs are combined by majority vote
  and every rank steps ``lr * sign(vote)``.

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
from ..engine.buckets import dense
from ..engine.exchange import Context
from ..engine.gradsync import GradientSync
from ..engine.hooks import EagerSteps
from ..engine.reducers import AllReduce
from ..engine.replicas import broadcast_module
from .centralized import GenericCentralizedOptimizer, _check_lr, world_size_error
from .wrapping import (
    amp_skip,
    materialized_group,
    synchronized_check,
    track,
    unsynchronized_grads,
)

__all__ = ["PowerSGD", "CentralizedSparsifiedSGD", "SparsifiedSGD", "SignSGD"]


class PowerSGD(GenericCentralizedOptimizer):
    """Centralized SGD with PowerSGD gradient compression (Vogels et al. 2019).

    ``rank`` is the rank of the approximation (mlbench's name; not an MPI rank), ``reuse_query``
    warm-starts the power iteration from the last averaged Q. See
    :class:`heatlike.engine.PowerSGD` for the math. ``warmup_steps`` (keyword only, not in
    mlbench; default 0): the first steps average the gradients exactly, uncompressed, as PyTorch's
    PowerSGD hook does before ``start_powerSGD_iter`` (:class:`heatlike.engine.Warmup`).
    """

    def __init__(self, model: torch.nn.Module | None = None, lr=required, momentum: float = 0,
                 weight_decay: float = 0, dampening: float = 0, nesterov: bool = False,
                 average_world: bool = True, use_cuda: bool = False, by_layer: bool = False,
                 reuse_query: bool = False, world_size: int | None = None, rank: int = 1,
                 *, warmup_steps: int = 0, **engine) -> None:
        comm = sanitize_comm(engine.get("comm"))
        error = _check_lr(lr)
        if error is None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            error = ValueError(f"rank (of the approximation) must be a positive int, got {rank!r}")
        if error is None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
                              or warmup_steps < 0):
            error = ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if error is None and warmup_steps and "codec" in engine:
            error = ValueError("give warmup_steps or codec, not both (wrap the codec in "
                               "heatlike.engine.Warmup instead)")
        raise_together(error, comm)
        codec = codecs.PowerSGD(rank, reuse_query=reuse_query)
        engine.setdefault("codec", codecs.Warmup(codec, warmup_steps) if warmup_steps else codec)
        super().__init__(world_size, model, use_cuda, by_layer, False, True,
                         _op="avg" if average_world else "sum", **engine)
        self.rank = rank
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                         dampening=dampening, weight_decay=weight_decay,
                                         nesterov=nesterov)


class _UpdateSync(EagerSteps, torch.optim.Optimizer):
    """A torch optimizer whose per-step update of every parameter goes through the engine: the
    update is written to ``.grad``, exchanged (codec + reducer; one bucket per tensor unless
    ``bucket_cap_mb`` lets tensors share one, for codecs that act on each entry alone), and the
    result applied (the base of the sparsified and sign optimizers).

    It is its own local optimizer: ``param_groups``, ``state``, ``defaults`` are torch's, and
    ``state_dict()`` is torch's with the engine's state (the codecs' memory) under ``"engine"``.
    Every parameter is synchronized; ``add_param_group`` refuses parameters the engine was not
    built with (ValueError on every rank). ``torch.amp.GradScaler``: the gradients are each rank's
    own when the scaler checks them, so the scaler calls ``step()`` on every rank
    (``_step_supports_amp_scaling``) and the ranks agree there: any rank's non-finite gradient
    makes every rank skip the step, nothing exchanged and no memory changed.
    """

    def __init__(self, params, defaults: dict, comm: MPICommunication | None,
                 world_size: int | None, codec: codecs.Codec, op: str,
                 bucket_cap_mb: float = 1e-6) -> None:
        comm = sanitize_comm(comm)
        error = _check_lr(defaults.get("lr", required)) or world_size_error(world_size, comm)
        for name in ("weight_decay", "momentum", "dampening"):
            if error is None and name in defaults:
                error = _nonnegative_error(name, defaults[name])
        if error is None:
            try:  # torch's own checks of the parameters, shared like the others
                super().__init__(params, defaults)
            except (TypeError, ValueError) as bad:
                error = bad
        raise_together(error, comm)
        self.comm = comm
        self.world_size = comm.size
        plist = [p for g in self.param_groups for p in g["params"]]
        broadcast_module(torch.nn.ParameterList(plist), comm)  # rank 0's initialization kept
        self.sync = GradientSync(plist, comm, bucket_cap_mb, bucket_cap_mb, codec=codec,
                                 reducer=AllReduce(comm, op=op), hooks=False,
                                 grad_as_bucket_view=False)
        self._synchronized = {id(p) for p in self.sync.params}
        _, self._frozen = synchronized_check(plist, self.sync.params, type(self).__name__)
        self._step_supports_amp_scaling = True
        self._bytes_reported = 0

    def add_param_group(self, param_group: dict) -> None:
        """Collective once the optimizer is built: the engine synchronizes the parameters it was
        built with, so a group of other parameters raises ValueError on every rank."""
        if "sync" not in self.__dict__:  # torch's __init__ adding the initial groups
            super().add_param_group(param_group)
            return
        group = materialized_group(param_group)
        error, frozen = synchronized_check(group.get("params", []), self.sync.params,
                                           type(self).__name__)
        raise_together(error, self.comm)
        super().add_param_group(group)
        self._frozen += frozen

    def close(self) -> None:
        """Collective: free the communicators of the gradient synchronization's private
        channel, for programs that build many optimizers in one process."""
        self.sync.close()

    def _synced(self):
        """(group, parameter) for every synchronized parameter that has a gradient."""
        unsynchronized_grads(self._frozen, type(self).__name__)
        return [(group, p) for group in self.param_groups for p in group["params"]
                if p.grad is not None and id(p) in self._synchronized]

    def _open_step(self, closure) -> tuple:
        """Evaluate ``closure`` (with gradients on) and decide, on every rank alike, whether a
        GradScaler that found non-finite gradients skips this step: ``(loss, skip)``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss, amp_skip(self, self.comm, self.sync.params)

    def _exchange_and_apply_sgd_updates(self, tracker=None) -> None:
        """``p -= combine_r(lr (g_r + wd p))`` for every parameter with a gradient, the update
        going through the codec (with its memory) and the reducer."""
        updates = {}
        for group, p in self._synced():
            wd, lr = group["weight_decay"], group["lr"]
            grad = dense(p.grad)
            view = self.sync.view_of(p)  # the update is written into its bucket: no copies
            if view.dtype != grad.dtype:
                view = torch.empty_like(grad)
            if wd:
                torch.add(grad, p, alpha=wd, out=view).mul_(lr)
            else:
                torch.mul(grad, lr, out=view)
            updates[p] = view
        self._exchange_updates(updates, tracker)
        for p in self.sync.params:
            if p.grad is None:
                continue
            support = self.sync.support_of(p) if p.is_contiguous() else None
            if support is None:
                p.sub_(p.grad)
            else:  # a sparsified update is zero elsewhere: touch only its coordinates (each
                # once, even where indices repeat)
                p.view(-1)[support] -= p.grad.reshape(-1)[support]
        self._restore_grads()
        track(tracker, "opt_step")

    def _exchange_updates(self, updates: dict, tracker=None) -> None:
        """Exchange the updates (param -> tensor) through the engine; afterwards each
        parameter's ``.grad`` holds the combined update (None where no rank had one)."""
        saved = {}
        for p in self.sync.params:
            saved[p] = p.grad
            p.grad = updates.get(p)
        self.sync.launch_all()
        self.sync.synchronize()
        self._saved = saved
        sent = self.sync.bytes_sent
        track(tracker, "agg", sent - self._bytes_reported, type(self.sync.reducer).__name__)
        self._bytes_reported = sent

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
        # k coordinates of each tensor, every tensor's in one all-gather per bucket
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, comm, world_size,
                         codecs.PerTensor(codec), "avg" if average_world else "sum",
                         bucket_cap_mb=25.0)
        self.sparse_grad_size = sparse_grad_size
        self.random_sparse = random_sparse
        self.average_world = average_world

    @torch.no_grad()
    def step(self, closure=None, tracker=None):
        """Collective: exchange every parameter's sparsified update and apply the combination
        (``tracker``: ``record_batch_agg()`` after the exchange, ``record_batch_opt_step()``
        after the update)."""
        loss, skip = self._open_step(closure)
        if skip:
            return loss
        self._exchange_and_apply_sgd_updates(tracker)
        return loss


def _nonnegative_error(name: str, value) -> Exception | None:
    """torch's (and mlbench's) check of a hyperparameter that must be a number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return ValueError(f"Invalid {name} value: {value!r}")
    return None


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

    mlbench's call protocol, one training step::

        loss.backward()
        optimizer.step()                                   # collective
        optimizer.update_estimated_weights(t, sparse_grad_size)

    :meth:`update_estimated_weights` (called by the training loop, never by ``step()``) keeps the
    weighted average of the iterates that :meth:`get_estimated_weights` returns,
    ``est <- (1 - rho) est + rho p``, ``rho_t = 6 (t + tau)^2 / ((1 + t)(6 tau^2 + t + 6 tau t +
    2 t^2))``, ``tau = d / min(k, d)`` for a tensor of d elements.

    A loop that aggregates by itself calls :meth:`sparsify_gradients` for every parameter after
    backward, combines the returned coordinates across ranks, writes the average into ``.grad``
    and calls ``step()``, which then applies ``p -= p.grad`` to every parameter with a gradient and
    sends nothing (mlbench's ``SparsifiedSGD.step``). All ranks must use the same protocol in a
    step (the first one is collective, the second has the loop's own communication).
    """

    def __init__(self, params, lr=required, weight_decay: float = 0, sparse_grad_size: int = 10,
                 *, comm: MPICommunication | None = None, random_sparse: bool = False) -> None:
        comm = sanitize_comm(comm)
        raise_together(_sparsifier_error("random" if random_sparse else "block",
                                         sparse_grad_size), comm)
        codec = (codecs.RandomK(k=sparse_grad_size) if random_sparse else
                 codecs.RandomBlock(k=sparse_grad_size))
        # k coordinates of each tensor, every tensor's in one all-reduce per bucket
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, comm, None,
                         codecs.PerTensor(codec), "avg", bucket_cap_mb=25.0)
        self._drawn: dict[int, int] = {}  # bucket -> exchange count drawn by sparsify_gradients
        self.sparse_grad_size = sparse_grad_size
        self.num_coordinates = sparse_grad_size  # mlbench's name
        self.random_sparse = random_sparse
        self._sparsified = False  # sparsify_gradients called since the last step
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["estimated_weights"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure=None, tracker=None):
        """Collective (unless :meth:`sparsify_gradients` was called since the last step): add
        ``lr (g + wd p)`` to every parameter's memory, average a block of it over the ranks and
        apply it. After :meth:`sparsify_gradients`: ``p -= p.grad`` for every parameter with a
        gradient, nothing sent. The estimated weights are not touched (the loop calls
        :meth:`update_estimated_weights`)."""
        loss, skip = self._open_step(closure)
        if skip:
            self._sparsified = False
            self._drawn.clear()
            return loss
        if self._sparsified:
            self._sparsified = False
            self._drawn.clear()
            for _, p in self._synced():
                p.sub_(p.grad)
            track(tracker, "opt_step")
            return loss
        self._exchange_and_apply_sgd_updates(tracker)
        return loss

    @torch.no_grad()
    def sparsify_gradients(self, param: torch.nn.Parameter, lr: float) -> torch.Tensor:
        """Add ``lr (param.grad + weight_decay param)`` to ``param``'s memory and take k
        (``sparse_grad_size``) of its coordinates out of it; no communication.

        The coordinates are those ``step()`` would send: a random block, or with
        ``random_sparse`` random coordinates, drawn from the engine's generator for this tensor
        and step, the same on every rank. Returns, in float64 (exact for any index and
        value), mlbench's layouts over ``param.view(-1)``: a block as a ``(1, 1 + k)`` tensor
        ``[start, values...]``, random coordinates as a ``(2, k)`` tensor ``[indices; values]``.
        The memory is the one ``step()`` uses, and is in :meth:`state_dict`."""
        if not self.sync.buckets_of([param]):
            raise ValueError("sparsify_gradients: the parameter is not one this optimizer "
                             "synchronizes")
        b, i = self.sync._where[id(param)]
        group = next(g for g in self.param_groups if any(q is param for q in g["params"]))
        n = param.numel()
        update = torch.zeros(n, dtype=param.dtype, device=param.device) if param.grad is None \
            else dense(param.grad).reshape(-1).to(param.dtype)
        if group["weight_decay"]:
            update = update.add(param.reshape(-1), alpha=group["weight_decay"])
        state = self.sync.codec.state_for(b).setdefault(i, {})  # PerTensor's, of tensor i
        memory = state.get("residual")
        total = update.mul(lr) if memory is None or memory.shape != (n,) else \
            memory.add(update, alpha=lr)
        # the choice the engine's next exchange of this tensor's bucket would make (its
        # counter, saved in the engine's state, advances once per step, as if it had run)
        if b not in self._drawn:
            self._drawn[b] = self.sync._exchanges[b]
            self.sync._exchanges[b] += 1
        ctx = Context(key=(b, i), shapes=[param.shape], size=self.comm.size,
                      rank=self.comm.rank, step=self._drawn[b], seed=self.sync.seed)
        codec = self.sync.codec.inner
        k = min(self.sparse_grad_size, n)
        chosen = codec._select(n, k, ctx.generator(shared=codec.shared), param.device)
        values = total[chosen].to(torch.float64)
        total[chosen] = 0
        state["residual"] = total
        self._sparsified = True
        if isinstance(chosen, slice):
            out = torch.empty(1, 1 + k, dtype=torch.float64, device=param.device)
            out[0, 0] = chosen.start
            out[0, 1:] = values
        else:
            out = torch.empty(2, k, dtype=torch.float64, device=param.device)
            out[0] = chosen.to(torch.float64)
            out[1] = values
        return out

    @torch.no_grad()
    def update_estimated_weights(self, iteration: int, sparse_vector_size: int) -> None:
        """``est <- (1 - rho_t) est + rho_t p`` with ``t = iteration`` (class docstring)."""
        t = iteration
        for group in self.param_groups:
            for p in group["params"]:
                tau = p.numel() / max(1, min(sparse_vector_size, p.numel()))
                rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau ** 2 + t + 6 * tau * t +
                                                       2 * t ** 2))
                est = self.state[p]["estimated_weights"]
                est.mul_(1 - rho).add_(p.detach(), alpha=rho)

    def get_estimated_weights(self) -> list[torch.Tensor]:
        """The weighted average of the iterates, one tensor per parameter."""
        return [self.state[p]["estimated_weights"] for g in self.param_groups
                for p in g["params"]]


class SignSGD(_UpdateSync):
    """Sign SGD with majority vote: direction ``d`` as torch SGD's (weight decay, momentum,
    dampening, Nesterov); each rank sends ``sign(d)`` (``sign(0) = 0``: a coordinate on which a
    rank has no opinion, and a parameter it got no gradient for, get no vote from it) and steps
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
        # signs are per entry, so the tensors share buckets: one vote for up to 25 MB of
        # directions instead of one collective per tensor, the same result
        super().__init__(params, defaults, comm, None, codecs.Sign(), "sum", bucket_cap_mb=25.0)

    @torch.no_grad()
    def step(self, closure=None, tracker=None):
        """Collective: the vote and the step (``tracker``: ``record_batch_agg()`` after the
        vote, ``record_batch_opt_step()`` after the update)."""
        loss, skip = self._open_step(closure)
        if skip:
            return loss
        directions = {}
        lrs = {}
        for group, p in self._synced():
            g = dense(p.grad)  # a sparse embedding gradient cannot take the dense decay term
            d = g.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else g.clone()
            if group["momentum"]:
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = d.clone()
                else:
                    buf.mul_(group["momentum"]).add_(d, alpha=1 - group["dampening"])
                d = d.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()
            directions[p] = d
        for group in self.param_groups:
            for p in group["params"]:
                lrs[p] = group["lr"]
        self._exchange_updates(directions, tracker)
        for p in self.sync.params:
            if p.grad is not None:  # some rank voted
                p.add_(torch.sign(p.grad), alpha=-lrs[p])
        self._restore_grads()
        track(tracker, "opt_step")
        return loss
