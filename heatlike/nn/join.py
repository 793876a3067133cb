"""Uneven inputs: ranks that run out of batches keep answering the others' collectives.

``with heatlike.nn.Join([model, optimizer]):`` around a training loop lets ranks run different
numbers of iterations (torch's ``Join`` semantics):

* At the start of every iteration a rank still training *notifies*: a sum of ``[1, syncing,
  non-finite]`` and a maximum of ``[its rank, the notifying model, the models' forward order]``,
  two small concurrent all-reduces on a private duplicate of the
  communicator (from the forward pre-hook of a :class:`~heatlike.nn.DataParallel`, or when a
  centralized optimizer's gradient synchronization begins). They tell every rank how many ranks
  A are still training, and the highest of them, which from then on broadcasts the buffers
  (BatchNorm statistics) in place of rank 0 (a rank that has joined has none to offer).
* A rank that leaves the loop joins (``__exit__``): it contributes ``[0, 0]`` to each
  notification, and for every iteration of the others runs a *shadow* of it: the buffer
  broadcast, the gradient exchange with no gradients (all zeros, every parameter's use flag 0)
  and the optimizer step with the averaged gradients the others computed, so its replica stays
  identical to theirs. When a notification returns A = 0 every rank has joined; the parameters
  and buffers are then broadcast from the last rank to join (a no-op when the shadows kept the
  replicas equal, a guarantee when they could not, e.g. a torch optimizer not passed to Join).
* While A < P, gradients are averaged over the A ranks that contributed (the gradient of the
  combined batch of the ranks still training), not over P.

Several DataParallel models trained together (each run forward once per iteration) notify once
per iteration, from the first forward: :meth:`Join.sync_buffers` then synchronizes every joined
model's buffers, and a shadow exchanges their gradients in the reverse of their forward order
(as backward produces them: every model's buckets, then each model's end of the backward pass)
and steps the torch optimizers once. A rank that never ran forward (no batch at all) learns that
order from the notifications (:meth:`Join._order_codes`). Shadows step with the averaged
gradients as the exchange leaves them, so what the loop does between backward and step
(clipping, a per-iteration scheduler) is not repeated there: after the last iteration the last
rank's torch optimizer states and settings are broadcast with the parameters. A
``ZeroRedundancyOptimizer``'s shards cannot be repaired that way: while a rank stands in, its
``step()`` takes the settings and the shards' gradients of the highest rank still training
(``ZeroRedundancyOptimizer._follow_training_ranks``); one stepped by a GradScaler while a rank
has joined raises ``RuntimeError`` on every rank.

``throw_on_early_termination=True`` instead raises ``RuntimeError`` on every rank as soon as one
rank runs out of inputs. Only the joinables' own collectives are shadowed: other collectives in
the loop (a metric all-reduce) need the same number of calls on every rank, and a model with a
:class:`~heatlike.nn.SyncBatchNorm` (whose every forward needs every rank's batch) joins only as a
DataParallel model with ``throw_on_early_termination=True`` (``ValueError`` on every rank
otherwise).

Joinables: :class:`~heatlike.nn.DataParallel` (with its DataParallelOptimizer, if any), the
centralized gradient-averaging optimizers (``CentralizedSGD``, ``CentralizedAdam``,
``CustomCentralizedOptimizer``, ``PowerSGD``) and torch optimizers (stepped in the shadow
iterations of a DataParallel they belong to), :class:`~heatlike.optim.ZeroRedundancyOptimizer`
included: one over a joined model's parameters must be among the joinables (``ValueError`` on
every rank otherwise, where its shard exchange would wait forever for the rank that joined).
DataParallel models and centralized optimizers are not joined together (``ValueError``). A
shadow follows a gradient exchange only where the iteration's forward pass announced it (the
notification's code); one that begins unannounced (a forward inside ``no_sync()``, then
``step()`` or a backward pass outside it) raises ``RuntimeError`` on every rank. A DataParallel
built with ``check_finite=True`` checks its parameters before each notification, which carries
the verdict: non-finite parameters raise ``FloatingPointError`` on every rank, those out of
inputs included.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch
from mpi4py import MPI

from ..core import checks as _checks
from ..core.agreement import raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..engine.reducers import AllReduce
from ..engine.replicas import broadcast_module, broadcast_optimizer_state
from .data_parallel import DataParallel
from .sync_batchnorm import SyncBatchNorm

__all__ = ["Join"]

_CURRENT: list[Join] = []


def _sync_batchnorm_error(models: list, optimizers: list, throw: bool) -> ValueError | None:
    """SyncBatchNorm needs every rank's batch in every forward pass, which a rank out of inputs
    has not: only a DataParallel model can join with it, and only to stop every rank (its
    notification comes before the forward; a centralized optimizer's comes after it)."""
    def has(module) -> bool:
        return module is not None and any(isinstance(m, SyncBatchNorm) for m in module.modules())

    if any(has(getattr(opt, "model", None)) for opt in optimizers):
        return ValueError(
            "Join cannot stand in for SyncBatchNorm in a model trained by a centralized "
            "optimizer: a rank that ran out of inputs is noticed only when the others' "
            "gradients are exchanged, after their forward pass already waits for it. Give every "
            "rank the same number of batches (heatlike.utils.data.DataLoader does)")
    if not throw and any(has(model.module) for model in models):
        return ValueError(
            "Join cannot stand in for SyncBatchNorm: its statistics need every rank's batch in "
            "every forward pass, which a rank that ran out of inputs has not. Give every rank "
            "the same number of batches (heatlike.utils.data.DataLoader does), or use "
            "Join(..., throw_on_early_termination=True) to stop every rank when one runs out")
    return None


def _unjoined_zero_error(models: list, joinables: list) -> ValueError | None:
    """A ZeroRedundancyOptimizer over a joined model exchanges its shards at every step: a rank
    out of inputs must step it too, so it must be among the joinables."""
    from ..optim.zero import unjoined_over

    missing = unjoined_over((p for m in models for p in m.module.parameters()), joinables)
    if missing:
        return ValueError(
            "a ZeroRedundancyOptimizer over the model's parameters is not among the joinables: "
            "a rank out of inputs must step it with the others (their shard exchange would wait "
            "for it forever). Pass it too: Join([model, optimizer])")
    return None


def _unannounced(size: int) -> int:
    """The code a training rank notifies with where a gradient exchange begins that no forward
    pass announced (1: the iteration's forward pass announced one, 0: it ran under
    ``no_sync()``): larger than the ranks' other codes together, so that every rank, training
    or not, sees the sum exceed the number of training ranks once any rank sent it."""
    return size + 1


_UNANNOUNCED_ERROR = (
    "rank {rank}: under heatlike.nn.Join a gradient exchange began that the iteration's forward "
    "pass did not announce (the forward ran inside no_sync() or in eval() mode, then a backward "
    "pass outside it or step() averaged the gradients): the ranks out of inputs could not "
    "follow it. Run the last micro-step's forward and backward outside no_sync()")


_ORDER_ERROR = (
    "rank {rank}: under heatlike.nn.Join a rank without any batch stood in for gradient "
    "exchanges before it knew the models' forward order, taking the joinables' order, but they "
    "run forward in another (model indices {order}): those exchanges were mismatched. "
    "List the DataParallel models in Join([...]) in the order they run forward")

_NONFINITE_ERROR = (
    "rank {rank}: non-finite parameters on the training ranks (check_finite)")


class Join:
    """Context manager for uneven inputs (module docstring).

    Parameters
    ----------
    joinables: DataParallel models, centralized optimizers and torch optimizers.
    enable: False makes the context a no-op (same code with and without uneven inputs).
    throw_on_early_termination: raise on every rank once any rank runs out of inputs.
    comm: the communicator (default: the joinables').
    """

    def __init__(self, joinables: Iterable, enable: bool = True,
                 throw_on_early_termination: bool = False,
                 comm: MPICommunication | None = None) -> None:
        from ..optim.centralized import GenericCentralizedOptimizer
        from ..optim.dp_optimizer import DataParallelOptimizer
        from ..optim.wrapping import WrappedOptimizer

        joinables = list(joinables) if not isinstance(joinables, (torch.nn.Module,
                                                                   torch.optim.Optimizer)) \
            else [joinables]
        self.models: list[DataParallel] = []
        self.optimizers: list[GenericCentralizedOptimizer] = []
        self.torch_optimizers: list[torch.optim.Optimizer] = []
        error: Exception | None = None
        comms = []
        for j in joinables:
            if isinstance(j, DataParallel):
                self.models.append(j)
                comms.append(j.comm)
            elif isinstance(j, DataParallelOptimizer):
                # joins through its model, which must be among the joinables
                if not any(m.optimizer is j for m in joinables if isinstance(m, DataParallel)):
                    error = error or ValueError(
                        "a DataParallelOptimizer joins through its DataParallel model: pass the "
                        "model (Join([model]) is enough)")
            elif isinstance(j, GenericCentralizedOptimizer) and j.agg_grad:
                self.optimizers.append(j)
                comms.append(j.comm)
            elif isinstance(j, WrappedOptimizer):
                error = error or TypeError(
                    f"Join cannot stand in for {type(j).__name__}: it shadows gradient averages "
                    "only (DataParallel, the centralized gradient-averaging optimizers and local "
                    "torch optimizers)")
            elif isinstance(j, torch.optim.Optimizer):
                self.torch_optimizers.append(j)
            else:
                error = error or TypeError(
                    f"Join supports heatlike.nn.DataParallel, the centralized gradient-averaging "
                    f"optimizers and torch optimizers, got {type(j).__name__}")
        comm = sanitize_comm(comm if comm is not None else (comms[0] if comms else None))
        if error is None and not (self.models or self.optimizers):
            error = ValueError("Join needs a DataParallel model or a centralized optimizer "
                               "among its joinables")
        if error is None and any(MPI.Comm.Compare(c.handle, comm.handle) not in
                                 (MPI.IDENT, MPI.CONGRUENT) for c in comms):
            error = ValueError("all joinables must work on the same communicator")
        if error is None and self.torch_optimizers and not self.models:
            error = ValueError("torch optimizers join through a DataParallel model: pass the "
                               "model too")
        if error is None and self.models and self.optimizers:
            # each announces its iterations (the model at its forward, the optimizer at its
            # first gradient): a rank out of inputs cannot tell one iteration's two apart
            error = ValueError("Join takes DataParallel models or centralized optimizers, not "
                               "both: train the two models with one kind of synchronization")
        if error is None and enable:
            error = _sync_batchnorm_error(self.models, self.optimizers,
                                          throw_on_early_termination)
        if error is None and enable:
            error = _unjoined_zero_error(self.models, joinables)
        raise_together(error, comm)
        self.comm = comm
        self.enable = bool(enable)
        self.throw = bool(throw_on_early_termination)
        self.iterations = 0      # iterations this rank ran itself
        self.joined = False
        self.active = comm.size  # ranks still training, from the last notification
        self._forwarded: list[DataParallel] = []  # run forward since the iteration began
        self._announced: set[int] = set()  # models whose exchange this iteration announced
        self._order = list(self.models)  # the forward order of the last complete iteration
        self._order_known = False  # _order was seen (or heard), not assumed
        # the last notification's: the notifying model's index, the forward order (_order_codes)
        self._heard_first, self._heard_order = -1, []
        self._channel: MPI.Intracomm | None = None

    # -- the context ---------------------------------------------------------------------------

    def __enter__(self) -> Join:
        if not self.enable:
            return self
        if _CURRENT:
            raise RuntimeError("Join contexts cannot be nested")
        # non-blocking duplicate, waited for with the deadline and the boards' ended ranks
        self._channel = _checks.private_duplicate(self.comm, "entering heatlike.nn.Join")
        self.iterations, self.joined, self.active = 0, False, self.comm.size
        self._forwarded, self._order = [], list(self.models)
        self._order_known, self._notifying = False, None
        self._heard_first, self._heard_order = -1, []
        self._first_active: int | None = None  # training ranks at the first notification
        self._guessed = False  # an exchange was shadowed in a guessed order (_check_guess)
        self._order_checked = False
        for model in self.models:
            model._join = self
            model.grad_sync.posts_steps = False
            model.grad_sync.on_begin = functools.partial(self._exchange_begins, model)
        for opt in self.optimizers:
            opt.sync.on_begin = lambda: self.notify(True)
        _CURRENT.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enable:
            return False
        try:
            if exc_type is None:
                self._join()
        finally:
            _CURRENT.remove(self)
            for model in self.models:
                model._join = None
                model._buffer_root = 0
                model.grad_sync.posts_steps = True
                model.grad_sync.on_begin = None
            for opt in self.optimizers:
                opt.sync.on_begin = None
            self._set_denominators(self.comm.size)
            self._channel.Free()
            self._channel = None
        return False

    # -- protocol ------------------------------------------------------------------------------

    def _allreduce(self, active: int, syncing: int, nonfinite: int = 0) -> tuple[int, int, int]:
        """One notification: the sums of ``active`` (training ranks), ``syncing`` (their codes:
        1 for an iteration that exchanges gradients, :func:`_unannounced`) and ``nonfinite``
        (ranks whose checked parameters are not finite)."""
        counts = np.array([active, syncing, nonfinite], dtype=np.int64)
        # and the highest training rank, and the models' forward order (_order_codes)
        highest = np.array([self.comm.rank if active else -1, *self._order_codes(active)],
                           dtype=np.int64)
        requests = [self._channel.Iallreduce(MPI.IN_PLACE, counts, MPI.SUM),
                    self._channel.Iallreduce(MPI.IN_PLACE, highest, MPI.MAX)]
        board = self.comm._hub.board
        watch = None
        if board is not None and board.established:
            # a rank whose program ended never notifies again
            def watch() -> None:
                board.verify(lambda: f"heatlike.nn.Join's notification on {self.comm!r}",
                             any_ended=True, steps=False, current=False)
        for request in requests:
            _checks.wait(request, lambda: f"heatlike.nn.Join's notification on {self.comm!r}",
                         watch=watch)
        if highest[0] >= 0:
            for model in self.models:
                model._buffer_root = int(highest[0])
        self._heard_first = int(highest[1])
        self._heard_order = [self.models[int(i)] for i in highest[2:] if i >= 0]
        self._check_guess(int(counts[0]), int(counts[1]))
        return int(counts[0]), int(counts[1]), int(counts[2])

    def _order_codes(self, active: int) -> list[int]:
        """What a rank tells the ranks that never ran the models forward (no batch at all) of
        their forward order, for those to shadow the exchanges in the order the training ranks'
        backward passes run them: the index of the model whose forward notifies (a training
        rank's) and the last complete iteration's order, one index per place (every rank that
        knows it), -1 where not known. The same on every rank that sends them: a maximum over
        the ranks delivers them."""
        first = -1
        if active:
            first = next((i for i, m in enumerate(self.models) if m is self._notifying), -1)
        places = [-1] * len(self.models)
        if self._order_known:
            index = {id(m): i for i, m in enumerate(self.models)}
            places[:len(self._order)] = [index[id(m)] for m in self._order]
        return [first, *places]

    def _check_guess(self, active: int, syncing: int) -> None:
        """After each notification, on every rank alike: where a rank had no batch at all
        (fewer training ranks at the first notification than ranks), note the iterations it
        shadowed with an exchange before the order was known (on :meth:`_guess`); at the first
        notification that carries the order, raise RuntimeError on every rank if the guess was
        used and wrong (three or more models listed in another order than they run forward):
        those exchanges met the wrong ones."""
        if self._first_active is None:
            self._first_active = active
        if self._first_active == self.comm.size or self._order_checked:
            return
        if not self._heard_order:
            if syncing > 0 and self._heard_first >= 0:
                self._guessed = True
            return
        self._order_checked = True
        order = self._heard_order
        if self._guessed and order != self._guess(order[0]):
            raise RuntimeError(_ORDER_ERROR.format(rank=self.comm.rank, order=[
                self.models.index(m) for m in order]))

    def _guess(self, first: DataParallel) -> list[DataParallel]:
        """The forward order a rank without a batch assumes until it hears the order: the model
        that notified, then the others in the joinables' order (right for two models)."""
        return [first] + [m for m in self.models if m is not first]

    def _learn_order(self) -> None:
        """On a rank out of inputs that never saw the models' forward order: take it from the
        notification (the last complete iteration's, else :meth:`_guess`; see
        :meth:`_check_guess`)."""
        if self._order_known:
            return
        if self._heard_order:
            self._order = list(self._heard_order)
            self._order_known = True
        elif self._heard_first >= 0:
            self._order = self._guess(self.models[self._heard_first])

    def notify(self, syncing: bool, model: DataParallel | None = None) -> bool:
        """A training rank starts an iteration (called by the joinables' hooks); True if this
        call began one. A DataParallel ``model`` begins an iteration with its forward only
        when no joined model has run forward since the last iteration began, or when ``model``
        has (several models trained together notify once per iteration, as the rank out of
        inputs shadows every model once per notification)."""
        if self.joined or self._channel is None:
            return False
        if model is not None:
            if self._forwarded and not any(m is model for m in self._forwarded):
                self._forwarded.append(model)
                return False
            if len(self._forwarded) > 1:  # the order a shadow exchanges their gradients in
                self._order = list(self._forwarded)
                self._order_known = True
            self._forwarded = [model]
        self.iterations += 1
        self._announced = {id(m) for m in self.models} if syncing else set()
        bad = self._nonfinite()
        self._notifying = model
        self.active, codes, nonfinite = self._allreduce(1, int(syncing), int(bool(bad)))
        if codes > self.active:  # another training rank's exchange was not announced
            raise RuntimeError(_UNANNOUNCED_ERROR.format(rank=self.comm.rank))
        if nonfinite:
            raise FloatingPointError(f"non-finite parameters {bad[:5]} (check_finite)" if bad
                                     else _NONFINITE_ERROR.format(rank=self.comm.rank))
        if self.throw and self.active < self.comm.size:
            raise RuntimeError(f"rank {self.comm.rank}: {self.comm.size - self.active} rank(s) "
                               "ran out of inputs (Join(throw_on_early_termination=True))")
        if model is not None:
            self._post_step()
        self._set_denominators(self.active)
        return True

    def _nonfinite(self) -> list[str]:
        """Names of the non-finite parameters of the training models built with
        ``check_finite=True`` (checked at each notification: a second model's forward in the
        same iteration notifies no more, and its parameters have not changed since)."""
        # read past the guards of deferred updates, as a model's own check does before its
        # forward applies them (a guard would apply another model's update here, early)
        with torch._C.DisableTorchFunction():
            return [name for model in self.models if model.check_finite and model.training
                    for name, p in model.module.named_parameters()
                    if not bool(torch.isfinite(p).all())]

    def _exchange_begins(self, model: DataParallel) -> None:
        """``model``'s gradient exchange begins on a training rank (its first gradient, or
        ``step()`` after backward passes that did not synchronize). The ranks out of inputs
        shadow an exchange only where the iteration's forward pass announced it; one it did not
        (a forward pass inside ``no_sync()``, then a backward pass outside it or ``step()``)
        raises RuntimeError on every rank, those out of inputs included, where it would leave
        them behind."""
        if self.joined or self._channel is None:
            return
        if id(model) in self._announced:
            self._announced.discard(id(model))
            return
        self._allreduce(1, _unannounced(self.comm.size), 0)
        raise RuntimeError(_UNANNOUNCED_ERROR.format(rank=self.comm.rank))

    def _post_step(self) -> None:
        """A training step on the step board (``heatlike.engine.liveness``): one per iteration
        of the DataParallel models, on training ranks and shadows alike, however many models
        train (their gradient synchronizations do not count it themselves under Join)."""
        if self.models:
            self.models[0].grad_sync._board.post()

    def sync_buffers(self) -> None:
        """Collective: every joined training model's buffer synchronization, in the joinables'
        order (at the start of each iteration, so that a rank out of inputs can shadow them in
        the same order whatever order the models run forward in)."""
        for model in self.models:
            if model.training and model.sync_buffers is not None and model.comm.size > 1:
                model._sync_buffers()

    def _join(self) -> None:
        """This rank ran out of inputs: shadow the others' iterations until all have joined."""
        self.joined = True
        if len(self._forwarded) > 1:
            self._order = list(self._forwarded)
            self._order_known = True
        for model in self.models:
            model.flush()
        while True:
            active, syncing, nonfinite = self._allreduce(0, 0, 0)
            if active == 0:
                break
            if syncing > active:  # some training rank sent _unannounced()
                raise RuntimeError(_UNANNOUNCED_ERROR.format(rank=self.comm.rank))
            if nonfinite:
                raise FloatingPointError(_NONFINITE_ERROR.format(rank=self.comm.rank))
            if self.throw:
                raise RuntimeError(f"rank {self.comm.rank} ran out of inputs after "
                                   f"{self.iterations} iteration(s) while {active} rank(s) "
                                   "still train (Join(throw_on_early_termination=True))")
            self._set_denominators(active)
            self._learn_order()
            self._shadow(syncing > 0)
        self._finish()

    def _shadow(self, syncing: bool) -> None:
        self._post_step()
        self.sync_buffers()
        if syncing:
            # in the order the others' backward passes produce them: the reverse of the
            # models' forward order (as this rank ran its own iterations); every model's
            # buckets as they fill, then the end of the backward pass for each (its held
            # buckets and flags), as the others' end-of-backward callbacks run
            models = list(reversed(self._order))
            for model in models:
                for p in model.grad_sync.params:
                    p.grad = None
            for model in models:
                model.grad_sync.launch_filled()
            for model in models:
                model.grad_sync.launch_all()
            for model in models:
                if model.optimizer is not None:
                    model.optimizer.step()
                    model.optimizer.flush()
                else:
                    model.grad_sync.synchronize()
            if any(model.optimizer is None for model in self.models):
                for opt in self.torch_optimizers:  # once per iteration, as the others do
                    opt.step()
        for opt in self.optimizers:
            for p in opt.sync.params:
                p.grad = None
            opt.step()

    def _finish(self) -> None:
        """Every rank has joined: make the replicas equal to the last rank to join."""
        counts = _checks.gather_objects(self.comm, self.iterations, "heatlike.nn.Join's end")
        last = int(np.argmax(counts))
        for model in self.models:
            broadcast_module(model.module, self.comm, root=last)
        for opt in self.optimizers:
            broadcast_module(opt.model, self.comm, root=last)
        if max(counts) != min(counts):
            # what the loop did between backward and step (clipping, a GradScaler's unscale or
            # skip, a scheduler's learning rate) the shadows could not repeat
            for opt in self._local_optimizers():
                broadcast_optimizer_state(opt, self.comm, root=last)

    def _local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state every rank holds whole (not a ZeRO's shards)."""
        from ..optim.zero import ZeroRedundancyOptimizer

        found = list(self.torch_optimizers)
        found += [m.optimizer.torch_optimizer for m in self.models if m.optimizer is not None]
        return [o for o in dict.fromkeys(found) if not isinstance(o, ZeroRedundancyOptimizer)]

    def _set_denominators(self, active: int) -> None:
        syncs = [m.grad_sync for m in self.models] + [o.sync for o in self.optimizers]
        for sync in syncs:
            reducer = sync.reducer
            if isinstance(reducer, AllReduce) and reducer.op == "avg" and active > 0:
                reducer.set_denom(active)
