"""DASO: Distributed Asynchronous and Selective Optimization (Coquelin et al., J. Big Data 2022).

For clusters whose links between nodes are much slower than inside a node: gradients are averaged
inside each node often and cheaply, *parameters* are averaged between nodes rarely, in a narrow
float type, without blocking, and merged a few batches later.

Ranks and groups
    The topology module finds the nodes (``HEATLIKE_RANKS_PER_NODE`` emulates them). Cross-node
    group i holds local rank i of every node; groups i = 0 .. min(local sizes) - 1 (those span
    every node) take turns, one per global synchronization.

Per batch b of an epoch of N batches (F = N - 1 is the last one), after the local optimizer step:

1. every pending global synchronization whose receive batch is b is merged: its carriers wait
   for the all-reduce and the node gets ``p = (2*btw*p_local + n*avg) / (n + 2*btw)`` (n nodes,
   btw the batches it was in flight): each carrier merges its shard and the node all-gathers
   them where the node's ranks hold the same parameters (every batch since the last merge was
   averaged inside the node), else the group's member gathers the sum, merges and broadcasts;
2. if ``global_skip == 0`` (warmup and cooldown), b % global_skip == 0, or b == F, group
   ``b``'s turn starts a global synchronization: each member sends its parameters (and
   floating-point buffers); with ``batches_to_wait`` = 0, or on the last batch, it is completed
   at once (blocking: ``p = avg``), otherwise it is merged at batch ``b + min(btw, F - b)``;
3. the next batch's backward averages gradients inside the node if ``global_skip == 0``,
   ``local_skip <= 1``, ``b % local_skip == 0``, ``b % global_skip <= batches_to_wait`` (from a
   send until its merge), or b == F.

What goes over the wire: every rank keeps ``ref``, the parameters after the last blocking
synchronization (identical everywhere). A member sends ``w * (p - ref)`` in ``downcast_type``
(``w`` = its node's share of the ranks) in chunks of ``sending_chunk_size`` elements, one
non-blocking all-reduce (float32 accumulation) per chunk, carried in shards by the node's
ranks (each computes its own where the node's ranks hold the same parameters, after a broadcast
of the member's floating-point buffers; else the member scatters them); ``avg = ref + sum``.
So the weights a rank keeps are never rounded to bfloat16 (only the recent change is), and
nodes of different sizes are weighted by their ranks: a blocking DASO step equals a blocking
data-parallel step for SGD.

Warmup: with ``warmup_sync="gradients"`` (default) on several nodes, the warmup epochs average
every batch's *gradients* over every rank (DataParallelMultiGPU's GradientSync over the whole
communicator, ``downcast_type`` on the wire) instead of steps 1-3: with equal averages and equal
optimizer states every rank takes the same step, so nothing else is sent (floating-point buffers
are averaged after the step), and ``ref`` is taken when the warmup ends. Valid only while every
rank holds the same parameters and optimizer state: from the start until the first batch that
is not gradient-averaged; a warmup entered after that (``reset``) synchronizes parameters, as
``warmup_sync="parameters"`` always does.

Schedule between epochs (:meth:`DASO.epoch_loss_logic`, called with the epoch's training loss):
epochs < ``warmup_epochs`` and the last ``cooldown_epochs`` synchronize every batch, blocking
(the warmup as above).
Entering the cycling phase sets global_skip = min(4, max_global_skips), local_skip = 1,
batches_to_wait = 1. After that the loss (averaged over ranks) feeds a plateau detector
(patience 2, relative threshold ``stability_level``); on a plateau with global_skip > 1 the skips
are divided by ``skip_reduction_factor`` and batches_to_wait decremented (global_skip, local_skip
and batches_to_wait floored at 1); on a plateau at global_skip == 1 they restart from
``max_global_skips`` and ``max_global_skips // local_skip_factor``.

Checkpoints (``state_dict``) record the layout they were saved at: the world size and the node
of every rank. Loaded at another layout, the global synchronizations in flight (shards laid out
for the saved nodes) are dropped, the groups take turns from group 0 again, and the ranks of a
node are no longer taken to hold the same parameters; at another world size the position in the
epoch, counted in batches of the saved global batch size, is unknown until :meth:`DASO.resume_at`
sets it (``heatlike.utils.checkpoint.load`` does, from the data loader passed to it).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from ..core import checks as _checks
from ..core.agreement import agree_on, raise_together
from ..core.communication import (
    MPI_WORLD,
    MPICommunication,
    Request,
    collecting,
    sanitize_comm,
)
from ..core.log import get_logger
from ..core.topology import Topology
from ..engine.buckets import comm_buffer, pack, pack_range, unpack
from ..engine.codecs import Cast
from ..engine.exchange import Context, Lane
from ..engine.links import SimulatedLink
from ..engine.reducers import AllReduce
from ..engine.replicas import average_tensors, broadcast_optimizer_state, broadcast_tensors
from ..nn.buffers import ModuleBuffers
from .wrapping import (
    WrappedOptimizer,
    driving_grad_scaler,
    materialized_group,
    synchronized_check,
    unsynchronized_grads,
)

__all__ = ["DASO", "PlateauDetector"]

_DOWNCAST = (torch.bfloat16, torch.float16, torch.float32)
# where a node's ranks hold the same parameters, each computes its own shard of a global
# synchronization (False: always the member's scatter and broadcast; the tests compare both)
_LOCAL_SHARDS = True


class PlateauDetector:
    """Has a metric (lower is better) stopped improving?

    A value improves on the best so far if it is below ``best * (1 - threshold)`` (relative
    threshold; ``best * (1 + threshold)`` for a negative best). :meth:`step` returns True once
    more than ``patience`` consecutive values did not improve, and then starts counting again.
    """

    def __init__(self, patience: int = 2, threshold: float = 0.05) -> None:
        self.patience = patience
        self.threshold = threshold
        self.reset()

    def reset(self) -> None:
        self.best = math.inf
        self.bad = 0

    def _improves(self, value: float) -> bool:
        if self.best == math.inf:
            return True
        scale = 1.0 - self.threshold if self.best >= 0 else 1.0 + self.threshold
        return value < self.best * scale

    def step(self, value: float) -> bool:
        if self._improves(value):
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        if self.bad > self.patience:
            self.bad = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad = float(state["best"]), int(state["bad"])


@dataclass
class _Sync:
    """A global synchronization in flight."""

    group: int
    start: int           # batch it was sent in
    receive_at: int      # batch it is merged in
    btw: int             # batches between send and merge
    requests: list[Request] = field(default_factory=list)
    payload: torch.Tensor | None = None
    ready_at: float = 0.0


class DASO(WrappedOptimizer):
    """DASO optimizer wrapper (Heat's signature; see the module docstring for the algorithm).

    Use with :class:`heatlike.nn.DataParallelMultiGPU`, set ``last_batch`` to the number of
    batches per epoch, call :meth:`step` after every backward and :meth:`epoch_loss_logic` after
    every epoch. A ``torch.optim.Optimizer`` whose ``param_groups``/``state``/``defaults`` are the
    local optimizer's (:class:`~heatlike.optim.wrapping.WrappedOptimizer`): torch LR schedulers
    and optimizer hooks work on it as on the local optimizer.

    Loaded from a checkpoint of another world size in the middle of an epoch, DASO does not know
    its position in the epoch (:attr:`position_unknown`) and :meth:`step` raises ValueError until
    :meth:`resume_at` is called (``heatlike.utils.checkpoint.load`` calls it when the data loader
    is passed to it).
    """

    eager_methods = ("epoch_loss_logic", "set_model", "reset")

    def __init__(self, local_optimizer: torch.optim.Optimizer, total_epochs: int,
                 comm: MPICommunication = MPI_WORLD, warmup_epochs: int = 4,
                 cooldown_epochs: int = 4, scheduler=None, stability_level: float = 0.05,
                 max_global_skips: int = 8, sending_chunk_size: int = 10_000_000,
                 downcast_type: torch.dtype = torch.bfloat16, use_mpi_groups: bool = True,
                 skip_reduction_factor: int = 2, local_skip_factor: int = 4,
                 verbose: bool = False, *, warmup_sync: str = "gradients") -> None:
        comm = sanitize_comm(comm)
        raise_together(_check_arguments(locals()), comm)
        agree_on({k: v for k, v in locals().items()
                  if k not in ("self", "comm", "local_optimizer", "scheduler", "verbose")},
                 comm, "DASO")
        self._wrap(local_optimizer)
        self.comm = comm
        self.local_optimizer = local_optimizer
        self.total_epochs = total_epochs
        self.warmup_epochs = warmup_epochs
        self.cooldown_epochs = cooldown_epochs
        self.scheduler = scheduler
        self.max_gs = max_global_skips
        self.split_val = sending_chunk_size
        self.cast_dtype = downcast_type
        self.skip_reduction_factor = skip_reduction_factor
        self.local_skip_factor = local_skip_factor
        self.verbose = verbose
        self.warmup_sync = warmup_sync
        self.stability = PlateauDetector(patience=2, threshold=stability_level)
        self.topology = Topology(comm, cross_method="group" if use_mpi_groups else "split")
        self.groups = min(self.topology.local_sizes)
        self.loc_gpus = self.topology.local_size
        self.codec = Cast(downcast_type)
        self._cross_lane = Lane(self.codec, AllReduce(self.topology.cross_comm, op="sum"))
        self.link: SimulatedLink | None = None
        self.module: torch.nn.Module | None = None
        self.last_batch: int | None = None
        self.amp = False
        self.scaler = None
        self.trace: list[tuple] | None = None  # set to [] to record (epoch, batch, event, ...)
        self._pending: list[_Sync] = []
        self._merged: torch.Tensor | None = None  # the merge buffer, reused by every merge
        self._total: torch.Tensor | None = None   # the member's gathered sum, likewise
        self._delta: torch.Tensor | None = None   # the member's change, likewise
        self._free: list[torch.Tensor] = []       # a merged synchronization's shard buffer
        # the ranks of this node hold the same parameters: every batch since the last merge
        # was averaged inside the node (each rank then computes its own shard of a sync, with
        # the member's buffers)
        self._node_agrees = False
        # the ranks of this node hold the same optimizer state: no batch since the warmup was
        # stepped with a rank's own gradients (after one, a merge equalizes the parameters but
        # momentum and the like stay apart, so _node_agrees cannot hold again)
        self._node_states_agree = False
        # every rank holds the same parameters, buffers and optimizer state (from set_model's
        # broadcast until the warmup ends): the gradient warmup keeps them so
        self._replicas_agree = False
        # DataParallelMultiGPU's gradient synchronization over every rank, while the warmup
        # averages gradients (None otherwise)
        self.warmup_grads = None
        weakref.finalize(self, _complete_pending, self._pending)
        self.bytes_cross = 0  # bytes this rank sent over the cross-node communicator
        self.bytes_node = 0   # bytes this rank moved in node-local parameter broadcasts
        self.bytes_warmup = 0  # payload bytes of the warmup's gradient all-reduces (this rank)
        self.closed = False
        # loaded at another world size in the middle of an epoch: (saved world size, saved batch)
        # until resume_at gives the position in this run's batches
        self._lost_position: tuple[int, int] | None = None
        self._agree_position = False  # the next step checks that every rank has the same
        self.reset()

    # -- Heat's methods ------------------------------------------------------------------------

    @property
    def params_ref(self) -> list[torch.nn.Parameter]:
        return [p for g in self.local_optimizer.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict) -> None:
        """Collective once DASO has its model: it synchronizes the module's parameters, so a
        group of other trainable parameters raises ValueError on every rank."""
        if self.__dict__.get("module") is None:  # not yet wrapped: set_model checks
            super().add_param_group(param_group)
            return
        group = materialized_group(param_group)
        synchronized = [t for t in self._tensors if isinstance(t, torch.nn.Parameter)]
        error, _ = synchronized_check(group.get("params", []), synchronized,
                                      "DASO (over DataParallelMultiGPU's module)")
        raise_together(error, self.comm)
        super().add_param_group(group)

    def add_scaler(self, scaler) -> None:
        """Step through ``scaler`` (``torch.amp.GradScaler``); a step is skipped on every rank when
        any rank has non-finite gradients."""
        self.scaler = scaler
        self.amp = True

    def print0(self, *args, **kwargs) -> None:
        """print() on rank 0 if ``verbose``."""
        if self.verbose and self.comm.rank == 0:
            print(*args, **kwargs, flush=True)

    def reset(self) -> None:
        """Back to the state before the first epoch (schedule, plateau detector, counters)."""
        _complete_pending(self._pending)
        self._pending.clear()
        self.stability.reset()
        self.epoch = 0
        self.current_batch = 0
        self._send_mod = 0
        self._lost_position = None
        self._set_epoch_parameters()

    @property
    def position_unknown(self) -> bool:
        """Whether DASO was loaded from a checkpoint of another world size in the middle of an
        epoch and waits for :meth:`resume_at` (every rank holds the same value)."""
        return self._lost_position is not None

    def resume_at(self, batch: int) -> None:
        """Continue the current epoch with its batch ``batch`` (0-based: the number of batches of
        the epoch already served, a data loader's position after loading its state). Call it on
        every rank with the same value (the next :meth:`step` checks); it clears
        :attr:`position_unknown`. ``batch`` equal to ``last_batch`` means the epoch was served
        completely: DASO continues with the next epoch's first batch. The global
        synchronizations in flight are merged at the next step if their batch has passed."""
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise TypeError(f"DASO.resume_at: batch must be an int, got {type(batch).__name__}")
        if batch < 0:
            raise ValueError(f"DASO.resume_at: batch must be >= 0, got {batch}")
        self._lost_position = None
        self._agree_position = True
        if isinstance(self.last_batch, int) and batch == self.last_batch:
            _complete_pending(self._pending)  # (nothing is merged after an epoch's last batch)
            self._pending.clear()
            self.epoch += 1
            self.current_batch = 0
            self._send_mod = 0
            return
        self.current_batch = batch

    def set_model(self, model: torch.nn.Module) -> None:
        """The module whose parameters DASO synchronizes (done by DataParallelMultiGPU;
        collective): every trainable parameter of the optimizer must be one of them."""
        error, _ = synchronized_check(self.params_ref,
                                      [p for p in model.parameters() if p.requires_grad],
                                      "DASO (over DataParallelMultiGPU's module)")
        raise_together(error, self.comm)
        self.module = model
        self._module_buffers = ModuleBuffers(model)
        self._buffers = self._float_buffers()
        self._tensors = [p for p in model.parameters() if p.requires_grad] + self._buffers
        self._frozen = [p for p in model.parameters() if not p.requires_grad]  # never synced
        # the warmup relies on equal replicas, optimizer states included: a local optimizer
        # stepped or loaded per rank before (a second training phase after DASO's node-local
        # states) takes rank 0's, as the parameters do
        broadcast_optimizer_state(self.local_optimizer, self.comm, root=0)
        self._replicas_agree = self._node_agrees = self._node_states_agree = True
        size = sum(t.numel() for t in self._tensors)
        device = self._tensors[0].device if self._tensors else torch.device("cpu")
        self._ref = comm_buffer(size, self._ref_dtype(), device)
        if self._tensors:
            with torch.no_grad():
                pack(self._tensors, self._ref)

    def _float_buffers(self) -> list[torch.Tensor]:
        """The module's floating-point buffers that hold values, in ``module.buffers()``'s
        order."""
        return [b for b in self._module_buffers() if b.is_floating_point() and b.numel()]

    def _current_buffers(self) -> None:
        """Take the module's buffers as they are now: ``module.to()``, ``double()`` or an
        assignment after ``set_model`` replaces buffer tensors, and DASO must synchronize the
        new ones, not the tensors it was given. A buffer of another shape, or one added or
        removed, would change the parameter vector that ``ref`` and the synchronizations in
        flight are laid out by: ValueError (on every rank that changed its module; build the
        module completely before wrapping it)."""
        current = self._float_buffers()
        if len(current) == len(self._buffers) and all(
                a is b for a, b in zip(current, self._buffers)):
            return
        before = [tuple(b.shape) for b in self._buffers]
        now = [tuple(b.shape) for b in current]
        if now != before:
            raise ValueError(
                f"DASO: the model's floating-point buffers changed since it was wrapped (shapes "
                f"{before} -> {now}); register every buffer before wrapping the module with "
                f"DataParallelMultiGPU, or wrap it again")
        self._tensors = self._tensors[:len(self._tensors) - len(self._buffers)] + current
        self._buffers = current

    @property
    def gradient_warmup(self) -> bool:
        """Whether this batch is one of the warmup's gradient-averaged batches (module
        docstring, "Warmup"): an epoch before ``warmup_epochs``, the replicas still equal
        everywhere, and the wrapper's synchronization over every rank in place."""
        return (self.warmup_grads is not None and self._replicas_agree
                and self.epoch < self.warmup_epochs)

    def plans_gradient_warmup(self) -> bool:
        """Whether the model's wrapper should average the warmup's gradients over every rank
        (and hand that synchronization to ``warmup_grads``)."""
        return (self.warmup_sync == "gradients" and self._replicas_agree
                and self.epoch < self.warmup_epochs and self.topology.num_nodes > 1)

    # -- the schedule --------------------------------------------------------------------------

    def _in_cooldown(self, epoch: int) -> bool:
        return epoch >= self.total_epochs - self.cooldown_epochs

    def _set_epoch_parameters(self) -> None:
        """global_skip, local_skip, batches_to_wait for an epoch without plateau logic: the start
        (or a blocking phase)."""
        if self.epoch < self.warmup_epochs or self._in_cooldown(self.epoch):
            self.global_skip = self.local_skip = self.batches_to_wait = 0
        else:
            self.global_skip = max(1, min(4, self.max_gs))
            self.local_skip = 1
            self.batches_to_wait = 1

    @torch.no_grad()
    def epoch_loss_logic(self, loss, loss_globally_averaged: bool = False) -> None:
        """Collective unless ``loss_globally_averaged``: choose the skips of the next epoch from
        this epoch's training loss (module docstring)."""
        value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if not loss_globally_averaged:
            value = self.comm.allreduce(value, MPI.SUM) / self.comm.size
        e = self.epoch  # the epoch that comes next
        if e < self.warmup_epochs or self._in_cooldown(e):
            self._set_epoch_parameters()
            self.print0(f"DASO epoch {e} (blocking phase): {self._describe()}")
            return
        if e == self.warmup_epochs:  # the cycling phase begins
            self._set_epoch_parameters()
        plateau = self.stability.step(value)
        if plateau and self.global_skip > 1:
            self.global_skip = max(1, self.global_skip // self.skip_reduction_factor)
            self.local_skip = max(1, self.local_skip // self.skip_reduction_factor)
            self.batches_to_wait = max(1, self.batches_to_wait - 1)
        elif plateau and self.global_skip == 1:
            self.global_skip = max(1, self.max_gs)
            self.local_skip = max(1, self.max_gs // self.local_skip_factor)
            self.batches_to_wait = max(1, self.max_gs // self.local_skip_factor)
        self.print0(f"DASO epoch {e}: loss {value:.4f}, plateau {plateau}: {self._describe()}")

    def _describe(self) -> str:
        return (f"global_skip {self.global_skip}, local_skip {self.local_skip}, "
                f"batches_to_wait {self.batches_to_wait}")

    def local_sync_now(self) -> bool:
        """Whether the coming batch's backward averages gradients inside the node."""
        b, gs, ls = self.current_batch, self.global_skip, self.local_skip
        final = self.last_batch is not None and b == self.last_batch - 1
        return (gs == 0 or ls <= 1 or b % ls == 0 or b % gs <= self.batches_to_wait or final)

    # -- step ----------------------------------------------------------------------------------

    def step(self) -> None:
        """Local optimizer step, then the synchronizations this batch calls for (module
        docstring). Collective over the communicator."""
        if self.closed:
            raise RuntimeError("this DASO was closed (close()): build a new one")
        if self.module is None:
            raise RuntimeError("DASO has no model: wrap it with "
                               "heatlike.nn.DataParallelMultiGPU(module, daso)")
        if driving_grad_scaler() is not None:  # a rank whose gradients overflow would not call
            raise ValueError(                   # step(), and the others would wait for it
                "DASO steps through its GradScaler itself: call daso.add_scaler(scaler) once "
                "and daso.step() (not scaler.step(daso); DASO also calls scaler.update()), so "
                "that a step is skipped on every rank together")
        if self._lost_position is not None:  # the same on every rank: every rank raises
            size, batch = self._lost_position
            raise ValueError(
                f"DASO was loaded from a checkpoint saved at {size} ranks in the middle of an "
                f"epoch ({batch} batches of it served, of that run's global batch size), so its "
                f"position in the epoch at {self.comm.size} ranks is unknown: pass the data "
                f"loader to heatlike.utils.checkpoint.load (as saved, e.g. loader=loader), or "
                f"call DASO.resume_at(batch) with the number of this epoch's batches already "
                f"served")
        if self.current_batch == 0 or self._agree_position:  # every rank starts its epochs
            agree_on({"last_batch": self.last_batch,  # (and a resumed one) here together
                      "current_batch": self.current_batch}, self.comm, "DASO.last_batch")
            self._agree_position = False
        if not isinstance(self.last_batch, int) or self.last_batch < 1:
            raise ValueError("set DASO.last_batch to the number of batches per epoch "
                             f"(a positive int) before step(), got {self.last_batch!r}")
        if self.current_batch >= self.last_batch:
            raise ValueError(f"DASO.current_batch ({self.current_batch}) is not below "
                             f"last_batch ({self.last_batch}): the epoch has fewer batches than "
                             f"DASO has already stepped in it; set last_batch to the number of "
                             f"batches per epoch, or call resume_at() with the loader's position")
        unsynchronized_grads(self._frozen, "DASO's model (DataParallelMultiGPU)")
        self._current_buffers()
        if self.gradient_warmup:
            self._gradient_warmup_step()
            return
        if self.warmup_grads is not None:  # a gradient warmup that cannot resume (a checkpoint
            self.warmup_grads.close()      # of a later phase was loaded): collective, as step()
            self.warmup_grads = None
        self._replicas_agree = False  # from here on, optimizer states may differ by node
        self._progress()
        self._local_step()
        if not self.local_sync_now():  # this batch's gradients were this rank's own
            self._node_agrees = self._node_states_agree = False
        b, final = self.current_batch, self.last_batch - 1
        if self.trace is not None and self.local_sync_now():
            self.trace.append((self.epoch, b, "local"))
        # (at the epoch's last batch everything in flight is merged: last_batch may have been
        # lowered since a synchronization was sent, after the batch it was due in)
        for sync in [s for s in self._pending if s.receive_at <= b or b == final]:
            self._pending.remove(sync)
            self._receive(sync, blocking=False)
        gs = self.global_skip
        if gs == 0 or b % gs == 0 or b == final:
            btw = 0 if (gs == 0 or b == final) else min(self.batches_to_wait, final - b)
            sync = self._send(self._send_mod, b, btw)
            if btw == 0:
                self._receive(sync, blocking=True)
            else:
                self._pending.append(sync)
            self._send_mod = (self._send_mod + 1) % self.groups
        if b == final:
            self.epoch += 1
            self.current_batch = 0
            self._send_mod = 0
        else:
            self.current_batch += 1

    def _gradient_warmup_step(self) -> None:
        """A warmup batch whose gradients DataParallelMultiGPU averaged over every rank: the
        local step, the floating-point buffers averaged (the parameters need nothing: equal
        averages and equal optimizer states give equal steps), and at the warmup's end ``ref``
        taken from the parameters, from which the cycling phase's changes are measured."""
        self._local_step()
        self._node_agrees = True
        self.bytes_warmup = self.warmup_grads.bytes_sent
        if self.trace is not None:
            self.trace.append((self.epoch, self.current_batch, "gradients"))
        # BatchNorm's statistics, averaged as the parameter synchronization did
        average_tensors(self._buffers, self.comm)
        if self.current_batch == self.last_batch - 1:
            self.epoch += 1
            self.current_batch = 0
        else:
            self.current_batch += 1
        if self.epoch >= self.warmup_epochs:  # the warmup is over, for good
            self._replicas_agree = False
            if self._tensors:
                with torch.no_grad():
                    pack(self._tensors, self._ref)
            self.warmup_grads.close()  # collective: every rank is in this step
            self.warmup_grads = None

    def _progress(self) -> None:
        """Advance the global synchronizations in flight: an exchange of several collectives
        (the half-precision sum) issues its next one only when its request is tested, and MPI
        moves data only inside MPI calls, so without this the whole exchange would happen in
        the wait at the merge batch instead of during the batches in between."""
        for sync in self._pending:
            for request in sync.requests:
                request.Test()

    def _local_step(self) -> None:
        if not self.amp:
            self.local_optimizer.step()
        else:
            unscaled = self._adopt_unscale()
            if self._agree_on_finite_gradients() and unscaled is not None:
                for found in unscaled["found_inf_per_device"].values():
                    found.fill_(1.0)
            self.scaler.step(self.local_optimizer)
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()

    def _ref_dtype(self) -> torch.dtype:
        """The dtype of the reference copy and the merge buffers: float32, or float64 where a
        synchronized tensor is float64 (its weights are then never rounded to float32; only the
        change sent across the nodes is cast to ``downcast_type``)."""
        return torch.float64 if any(t.dtype == torch.float64 for t in self._tensors) \
            else torch.float32

    def _adopt_unscale(self) -> dict | None:
        """``scaler.unscale_(daso)`` (before clipping, torch's recipe) divided the gradients and
        noted it under this DASO; the step goes through the local optimizer, so the note moves
        there (else ``scaler.step`` would divide them again). Returns the moved note, None when
        the program did not unscale."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict) or id(self) not in states:
            return None
        state = states.pop(id(self))
        states[id(self.local_optimizer)] = state
        return state

    def _agree_on_finite_gradients(self) -> bool:
        """GradScaler skips a step when this rank's gradients are not finite; make that decision
        the same on every rank (one small all-reduce) by marking a gradient as inf on ranks whose
        own gradients are finite while another rank's are not. Returns whether any rank's were
        not finite."""
        grads = [p.grad for p in self.params_ref if p.grad is not None]
        bad = any(not bool(torch.isfinite(g).all()) for g in grads)
        anywhere = self.comm.any_rank(bad)
        if anywhere and not bad and grads:
            grads[0].view(-1)[0] = float("inf")
        return anywhere

    # -- global synchronization ----------------------------------------------------------------

    def _carried(self) -> list[int]:
        """Elements of the parameter vector each local rank carries across the nodes: the
        vector cut into near-equal shards among the local ranks < ``groups`` (each has a
        partner with its local rank on every node), nothing for the others."""
        n, carriers = self._ref.numel(), self.groups
        return [n // carriers + (1 if i < n % carriers else 0) if i < carriers else 0
                for i in range(self.topology.local_size)]

    def _shard(self) -> tuple[int, int]:
        """The elements of the parameter vector this rank carries across the nodes."""
        counts = self._carried()
        start = sum(counts[:self.topology.local_rank])
        return start, start + counts[self.topology.local_rank]

    def _members_buffers(self, group: int) -> None:
        """Give the node's ranks the member's floating-point buffers (BatchNorm's statistics
        are each rank's own even where its gradients are averaged inside the node)."""
        broadcast_tensors(self._buffers, self.topology.node_comm, group)

    def _payload(self, numel: int) -> torch.Tensor:
        """A buffer (``ref``'s dtype) for a synchronization's shard: one a merged
        synchronization returned, or a new one."""
        for i, buf in enumerate(self._free):
            if buf.numel() == numel and buf.device == self._ref.device:
                return self._free.pop(i)
        return comm_buffer(numel, self._ref.dtype, self._ref.device)

    @torch.no_grad()
    def _send(self, group: int, batch: int, btw: int) -> _Sync:
        """Start a global synchronization of group ``group``'s parameters: the weighted change
        ``w * (p - ref)`` of the member's parameters, every local rank that has a partner on
        every node carrying its shard across the nodes (the node's link carries the member's
        bytes once, in several flows at once). Where the node's ranks hold the same parameters
        (every batch since the last merge was averaged inside the node), each computes its shard
        itself; otherwise the member computes the change and scatters it inside the node."""
        sync = _Sync(group, batch, batch + btw, btw)
        if self.trace is not None:
            self.trace.append((self.epoch, batch, "send", group, btw))
        topo = self.topology
        if not self._tensors:
            return sync
        weight = topo.local_size / self.comm.size
        if topo.local_size == 1:
            shard = pack(self._tensors, self._payload(self._ref.numel()))
            shard.sub_(self._ref).mul_(weight)
        elif self._node_agrees and _LOCAL_SHARDS:
            self._members_buffers(group)
            start, stop = self._shard()
            shard = pack_range(self._tensors, start, stop, self._payload(stop - start))
            shard.sub_(self._ref[start:stop]).mul_(weight)
        else:
            delta = None
            if topo.local_rank == group:
                delta = pack(self._tensors, self._buffer("_delta"))
                delta.sub_(self._ref).mul_(weight)
            counts = self._carried()
            shard = self._payload(counts[topo.local_rank])
            topo.node_comm.Scatterv((delta, counts) if delta is not None else None, shard,
                                    root=group)
        lane = self._cross_lane
        before = lane.reducer.bytes_sent
        # one node: the sum over nodes is this change itself, exact (nothing to send or round)
        chunks = range(0, shard.numel(), self.split_val) if topo.cross_comm.size > 1 else ()
        for start in chunks:
            ctx = Context(key=start, shapes=[], size=topo.cross_comm.size,
                          rank=topo.cross_comm.rank)
            sync.requests.append(lane.start(shard[start:start + self.split_val], ctx))
        nbytes = lane.reducer.bytes_sent - before
        self.bytes_cross += nbytes
        if self.link is not None:
            sync.ready_at = self.link.ready_at(nbytes)
        sync.payload = shard
        return sync

    @torch.no_grad()
    def _receive(self, sync: _Sync, blocking: bool) -> None:
        """Merge a global synchronization: every carrier waits for its shard of the sum; the
        merged value (blocking: ``ref + sum``; else the stale-merge formula of the module
        docstring) is computed shard by shard and all-gathered inside the node where the
        node's ranks hold the same parameters (or the merge is blocking, which does not read
        them); otherwise the group's member gathers the sum, merges and broadcasts."""
        topo = self.topology
        if self.trace is not None:
            self.trace.append((self.epoch, self.current_batch,
                               "blocking" if blocking else "merge", sync.group))
        if not self._tensors:
            return
        merged, part = self._buffer("_merged"), sync.payload
        for request in sync.requests:
            request.Wait()
        if self.link is not None:
            self.link.wait_until(sync.ready_at)
        n, weight = topo.num_nodes, 2.0 * sync.btw
        if topo.local_size > 1 and (blocking or self._node_agrees) and _LOCAL_SHARDS:
            start, stop = self._shard()
            part.add_(self._ref[start:stop])  # ref + sum: the average of this shard
            if not blocking:  # (weight p + n avg) / (n + weight) = p + (avg - p) n / (n + weight)
                self._members_buffers(sync.group)
                mine = pack_range(self._tensors, start, stop, merged)
                part.copy_(mine.lerp_(part, n / (n + weight)))
            topo.node_comm.Allgatherv(part, (merged, self._carried()))
            self.bytes_node += (merged.numel() - part.numel()) * merged.element_size()
        else:
            member = topo.local_rank == sync.group
            total = part
            if topo.local_size > 1:  # the sum's shards, gathered by the member
                total = self._buffer("_total") if member else None
                topo.node_comm.Gatherv(part, (total, self._carried()) if member else None,
                                       root=sync.group)
            if member:
                if blocking:
                    torch.add(self._ref, total, out=merged)
                else:
                    avg = total.add_(self._ref)  # the sum is not needed any more
                    pack(self._tensors, merged)
                    merged.lerp_(avg, n / (n + weight))
            topo.node_comm.Bcast(merged, root=sync.group)
            if topo.local_size > 1:
                self.bytes_node += merged.numel() * merged.element_size()
        unpack(merged, self._tensors)
        if blocking:
            self._ref.copy_(merged)
        self._node_agrees = self._node_states_agree
        self._free = [part]  # free for the next send (one in flight keeps its own)

    def close(self) -> None:
        """Collective: complete the synchronizations in flight and free the communicators this
        DASO created (its node and cross-node communicators, its cross-node channel, the
        warmup's gradient synchronization). MPI has room for a couple of thousand communicators
        per process, and a dropped DASO cannot free them safely from the garbage collector: a
        program that builds many (a sweep) closes each when done. Idempotent; ``step`` raises
        afterwards. ``DataParallelMultiGPU.close`` calls it."""
        if self.closed:
            return
        self.closed = True
        _complete_pending(self._pending)
        self._pending.clear()
        if self.warmup_grads is not None:
            self.warmup_grads.close()
            self.warmup_grads = None
        self._cross_lane.close()
        self.topology.free()

    def _buffer(self, name: str) -> torch.Tensor:
        """A buffer of the parameter vector's size and ``ref``'s dtype, kept as attribute
        ``name`` and reused by every merge."""
        buf = getattr(self, name)
        if buf is None or buf.numel() != self._ref.numel() or buf.device != self._ref.device:
            buf = comm_buffer(self._ref.numel(), self._ref.dtype, self._ref.device)
            setattr(self, name, buf)
        return buf

    # -- state ---------------------------------------------------------------------------------

    def _layout(self) -> dict:
        """The layout a checkpoint is saved at: the world size, the ranks per node and the node
        of every rank (what the shards of a synchronization and the node flags refer to)."""
        topo = self.topology
        return {"world_size": self.comm.size, "local_sizes": list(topo.local_sizes),
                "node_ids": list(topo.node_ids)}

    def _same_layout(self, saved: dict | None) -> bool:
        """Whether a checkpoint's recorded layout is this DASO's (one without a record, from an
        older version, is taken as saved at this layout)."""
        if not isinstance(saved, dict):
            return True
        here = self._layout()
        return all(k not in saved or [int(v) for v in saved[k]] == here[k]
                   for k in ("local_sizes", "node_ids")) and \
            int(saved.get("world_size", here["world_size"])) == here["world_size"]

    def _engine_state(self) -> dict:
        """The global synchronizations in flight (their all-reduces are completed; each is still
        merged at its own batch, so a run resumed from this state continues exactly) and the
        layout their shards are cut for."""
        pending = []
        for sync in self._pending:
            for request in sync.requests:
                request.Wait()
            sync.requests = []
            pending.append({"group": sync.group, "start": sync.start,
                            "receive_at": sync.receive_at, "btw": sync.btw,
                            "payload": sync.payload.clone() if sync.payload is not None
                            else None})
        return {"pending": pending, "layout": self._layout()}

    def _load_engine_state(self, state: dict) -> None:
        """Restore the synchronizations in flight; those of a checkpoint saved at another layout
        are dropped (their shards are cut for the saved nodes)."""
        _complete_pending(self._pending)
        self._pending.clear()
        saved_pending = state.get("pending", [])
        if saved_pending and not self._same_layout(state.get("layout")):
            get_logger().info(
                "DASO: the checkpoint was saved at another layout (%s), this run has %s: its %d "
                "global synchronization(s) in flight are dropped", _describe_layout(
                    state["layout"]), _describe_layout(self._layout()), len(saved_pending))
            return
        for saved in saved_pending:
            payload = saved["payload"]
            self._pending.append(_Sync(saved["group"], saved["start"], saved["receive_at"],
                                       saved["btw"], payload=None if payload is None else
                                       payload.to(self._ref.device)))

    def state_dict(self) -> dict:
        """torch's state dict of the local optimizer, DASO's schedule (``"daso"``) and the global
        synchronizations in flight (``"engine"``), each with the layout it was saved at."""
        state = super().state_dict()
        state["daso"] = {"epoch": self.epoch, "current_batch": self.current_batch,
                         "global_skip": self.global_skip, "local_skip": self.local_skip,
                         "batches_to_wait": self.batches_to_wait, "send_mod": self._send_mod,
                         "stability": self.stability.state_dict(),
                         "ref": self._ref.detach().clone(),
                         "replicas_agree": self._replicas_agree,
                         "node_agrees": self._node_agrees,
                         "node_states_agree": self._node_states_agree,
                         "layout": self._layout(),
                         "lost_position": (list(self._lost_position)
                                           if self._lost_position is not None else None),
                         # the scheduler DASO steps: a resumed run continues its schedule
                         # even when the program saves only the optimizer
                         "scheduler": (self.scheduler.state_dict()
                                       if self.scheduler is not None else None)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`. At the layout it was saved at, everything continues exactly.
        At another layout (module docstring, "Checkpoints"): the synchronizations in flight are
        dropped, the groups' turns restart at group 0 and the node flags are cleared; at another
        world size, a state saved in the middle of an epoch leaves :attr:`position_unknown` set
        until :meth:`resume_at`."""
        state_dict = dict(state_dict)
        daso = state_dict.pop("daso", None)
        super().load_state_dict(state_dict)
        if daso is None:  # a plain torch optimizer state: the schedule stays as it is
            return
        self.epoch, batch = int(daso["epoch"]), int(daso["current_batch"])
        self.global_skip, self.local_skip = daso["global_skip"], daso["local_skip"]
        self.batches_to_wait = daso["batches_to_wait"]
        self.stability.load_state_dict(daso["stability"])
        if self.scheduler is not None and daso.get("scheduler") is not None:
            self.scheduler.load_state_dict(daso["scheduler"])
        self._ref.copy_(daso["ref"])
        self._replicas_agree = bool(daso.get("replicas_agree", False))
        lost = daso.get("lost_position")
        self._lost_position = (int(lost[0]), int(lost[1])) if lost is not None else None
        self._agree_position = True
        layout = daso.get("layout")
        if self._same_layout(layout):
            self.current_batch, self._send_mod = batch, int(daso["send_mod"]) % self.groups
            self._node_agrees = bool(daso.get("node_agrees", False))
            self._node_states_agree = bool(daso.get("node_states_agree", self._node_agrees))
            return
        # another layout: the saved node flags are about other nodes (each rank got its own
        # parameters back at the same world size); the replicas' flag holds everywhere
        self._send_mod = 0
        self._node_agrees = self._node_states_agree = self._replicas_agree
        size = int(layout.get("world_size", self.comm.size))
        if size == self.comm.size:  # same global batch: the position holds
            self.current_batch = batch
        else:
            self.current_batch = 0
            if batch != 0:  # batches of the saved global batch size
                self._lost_position = (size, batch)
        get_logger().info(
            "DASO: state saved at %s loaded at %s: the groups take turns from group 0%s",
            _describe_layout(layout), _describe_layout(self._layout()),
            "; the position in the epoch is unknown until resume_at() (checkpoint.load does it "
            "when the data loader is passed)" if self._lost_position is not None else "")


def _describe_layout(layout: dict) -> str:
    sizes = layout.get("local_sizes")
    return (f"{layout.get('world_size', '?')} ranks on nodes of "
            f"{'+'.join(str(n) for n in sizes) if sizes is not None else '?'} ranks, "
            f"node ids {layout.get('node_ids', '?')}")


def _complete_pending(pending: list) -> None:
    """Wait for the cross-node all-reduces still in flight (at reset, or when the program ends);
    from the garbage collector, hand them to ``heatlike.core.checks.adopt`` instead, as a
    gradient synchronization's finalizer does."""
    if MPI.Is_finalized():
        return
    if collecting():
        _checks.adopt([r for sync in pending for r in sync.requests])
        return
    for sync in pending:
        for request in sync.requests:
            if not request.done:
                request.Wait()


def _check_arguments(args: dict) -> Exception | None:
    ints = ("total_epochs", "warmup_epochs", "cooldown_epochs", "max_global_skips",
            "sending_chunk_size", "skip_reduction_factor", "local_skip_factor")
    if not isinstance(args["local_optimizer"], torch.optim.Optimizer):
        return TypeError("local_optimizer must be a torch.optim.Optimizer, got "
                         f"{type(args['local_optimizer']).__name__}")
    for name in ints:
        if isinstance(args[name], bool) or not isinstance(args[name], int):
            return TypeError(f"{name} must be an int, got {type(args[name]).__name__}")
    for name in ("warmup_epochs", "cooldown_epochs", "max_global_skips"):
        if args[name] < 0:
            return ValueError(f"{name} must be >= 0, got {args[name]}")
    for name in ("total_epochs", "sending_chunk_size", "skip_reduction_factor",
                 "local_skip_factor"):
        if args[name] <= 0:
            return ValueError(f"{name} must be > 0, got {args[name]}")
    if args["total_epochs"] <= args["warmup_epochs"] + args["cooldown_epochs"]:
        return ValueError(f"total_epochs ({args['total_epochs']}) must exceed warmup_epochs + "
                          f"cooldown_epochs ({args['warmup_epochs']} + "
                          f"{args['cooldown_epochs']})")
    if not isinstance(args["stability_level"], (int, float)) or args["stability_level"] < 0:
        return ValueError(f"stability_level must be a number >= 0, got "
                          f"{args['stability_level']!r}")
    if args["downcast_type"] not in _DOWNCAST:
        return ValueError(f"downcast_type must be one of {list(_DOWNCAST)}, got "
                          f"{args['downcast_type']!r}")
    if args["warmup_sync"] not in ("gradients", "parameters"):
        return ValueError(f"warmup_sync must be 'gradients' or 'parameters', got "
                          f"{args['warmup_sync']!r}")
    scheduler = args["scheduler"]
    if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return TypeError("scheduler must be a torch.optim.lr_scheduler scheduler object, got "
                         f"{type(scheduler).__name__}")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return TypeError("DASO steps its scheduler after every step, without a metric; "
                         "ReduceLROnPlateau needs one: step it yourself (scheduler.step(loss))")
    for name in ("use_mpi_groups", "verbose"):
        if not isinstance(args[name], bool):
            return TypeError(f"{name} must be a bool, got {type(args[name]).__name__}")
    return None

