"""Apache SINGA's ``DistOpt`` on the heatlike engine.

``DistOpt(opt)`` wraps a torch optimizer for data-parallel training with SINGA's four
communication strategies. Every ``backward_*`` method computes fresh gradients of ``loss``
(existing ``.grad`` are dropped, as SINGA's autograd returns new ones), starts communication from
autograd hooks while the backward pass runs, and steps the optimizer:

* :meth:`backward_and_update`: gradients averaged over the ranks; tensors of more than
  ``threshold`` elements are reduced alone, smaller ones fused into buffers of up to
  ``threshold`` elements (the engine's buckets, filled in backward order);
* :meth:`backward_and_update_half`: the same in float16 on the wire (each value divided by the
  world size before the sum, which is accumulated in float32: no overflow), optionally clipping
  every gradient element to ``[-clip_Value, clip_Value]`` first;
* :meth:`backward_and_sparse_update`: each fused buffer sparsified before it is sent:
  ``topK=True`` sends the ``ceil(spars * n)`` entries of largest magnitude, ``topK=False`` every
  entry with ``|x| >= spars``, as (index, value) pairs gathered from all ranks and summed; with
  ``corr`` the unsent rest is kept and added to the next step's gradients (residual);
* :meth:`backward_and_partial_update`: every rank steps with its own gradients; then one partition
  of the *parameters* (a large tensor or a fused group), chosen round-robin, is averaged over the
  ranks; after a full cycle every partition has been averaged once.

The low-level calls (:meth:`all_reduce`, :meth:`fused_all_reduce`, their ``_half`` forms,
:meth:`sparsification`, :meth:`fused_sparsification`) start non-blocking sums that
:meth:`wait` completes, as SINGA's communicator did on its CUDA streams. Sizes are checked with a
clear error instead of overflowing a buffer; top-k compares real magnitudes (SINGA truncated them
to integers); threshold mode sends each surviving entry exactly once; residuals and the partition
counter are part of :meth:`state_dict` (``get_states`` / ``set_states``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch

from ..core.agreement import agree_on, raise_together
from ..core.communication import MPICommunication, Request, sanitize_comm
from ..core.topology import get_topology
from ..engine import codecs
from ..engine.buckets import pack, unpack
from ..engine.exchange import Context, Lane
from ..engine.gradsync import GradientSync
from ..engine.paramsync import ParameterSync
from ..engine.reducers import AllReduce
from ..engine.replicas import broadcast_module
from .wrapping import WrappedOptimizer, materialized_group, synchronized_check, unsynchronized_grads

__all__ = ["DistOpt"]


def _positive_int(value, name: str) -> Exception | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return ValueError(f"{name} must be a positive int, got {value!r}")
    return None


class DistOpt(WrappedOptimizer):
    """SINGA's distributed optimizer wrapper (module docstring).

    ``opt`` is any torch optimizer (no shared default instance); ``comm`` the communicator
    (default: the world); ``buffSize`` the largest fused buffer, in elements.
    Attributes: ``world_size``, ``local_rank`` (rank on this node), ``global_rank``.
    A ``torch.optim.Optimizer`` whose ``param_groups``/``state``/``defaults`` are ``opt``'s
    (:class:`~heatlike.optim.wrapping.WrappedOptimizer`): torch LR schedulers work on it, and
    step pre/post hooks registered on it run at every step, the internal ones included.

    DistOpt trains through its ``backward_*`` calls (or the low-level sums followed by
    :meth:`update` and :meth:`step`). :meth:`step` applies only gradients that a ``backward_*``
    call averaged or :meth:`update` staged: after a plain ``loss.backward()`` every parameter's
    gradient is this rank's own, and :meth:`step` raises RuntimeError instead of letting the
    replicas drift apart. ``torch.amp.GradScaler`` cannot drive it (``scaler.step(opt)`` raises
    RuntimeError on every rank).

    Construction is collective and copies rank 0's parameter values to every rank (equal
    replicas). To resume from per-rank weights (partial mode keeps different replicas between
    cycles), build DistOpt first, then load the model's state, then the optimizer's.
    """

    eager_methods = ("update", "all_reduce", "all_reduce_half", "fused_all_reduce",
                     "fused_all_reduce_half", "sparsification", "fused_sparsification",
                     "wait", "backward_and_update", "backward_and_update_half",
                     "backward_and_sparse_update", "backward_and_partial_update")

    #: ``torch.amp.GradScaler`` then calls :meth:`step` on every rank with ``found_inf`` set,
    #: whatever the ranks found, so that every rank refuses it alike
    _step_supports_amp_scaling = True

    def __init__(self, opt: torch.optim.Optimizer, comm: MPICommunication | None = None,
                 buffSize: int = 4194304) -> None:
        comm = sanitize_comm(comm)
        error = None
        if not isinstance(opt, torch.optim.Optimizer):
            error = TypeError(f"opt must be a torch.optim.Optimizer, got {type(opt).__name__}")
        error = error or _positive_int(buffSize, "buffSize")
        raise_together(error, comm)
        agree_on({"buffSize": buffSize}, comm, "DistOpt")
        self._wrap(opt)
        self.opt = opt
        self.comm = comm
        self.buffSize = buffSize
        self.world_size = comm.size
        self.global_rank = comm.rank
        self.local_rank = get_topology(comm).local_rank
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self._frozen = [p for p in self.params if not p.requires_grad]  # never synchronized
        holder = torch.nn.ParameterList(self.params)
        broadcast_module(holder, comm)  # equal replicas, rank 0's values
        self.partial = 0
        self._syncs: dict = {}
        self._partitions: dict = {}
        self._pending: list[tuple[Request, object]] = []
        self._staged: list[torch.Tensor] = []
        self._saved_sync_states: dict = {}
        self._fresh_states: dict = {}  # each synchronizer's state when it was built
        self._lanes: dict = {}
        # id(param) -> (weak reference to the gradient a backward_* call averaged or update()
        # staged, its version counter then, or None where in-place changes are allowed)
        self._applicable: dict = {}

    # -- the local optimizer ---------------------------------------------------------------------

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Stage ``grad / world_size`` as ``param``'s gradient; :meth:`step` applies it (SINGA
        updated per parameter; torch optimizers step all parameters at once). ``grad`` is
        expected to be the sum over the ranks (e.g. from :meth:`all_reduce` and :meth:`wait`);
        the staged gradient may be changed in place (clipping) before :meth:`step`."""
        param.grad = grad / self.world_size
        self._applicable[id(param)] = (weakref.ref(param.grad), None)

    def _mark_applicable(self) -> None:
        """Record the current gradients as the ones a ``backward_*`` call produced: unchanged,
        :meth:`step` may apply them."""
        self._applicable = {id(p): (weakref.ref(p.grad), p.grad._version)
                            for p in self.params if p.grad is not None}

    def _foreign_grads(self) -> int:
        """How many parameters hold a gradient that no ``backward_*`` call produced and
        :meth:`update` did not stage (or that changed in place since a ``backward_*`` call)."""
        count = 0
        for p in self.params:
            if p.grad is None:
                continue
            ref, version = self._applicable.get(id(p), (None, None))
            if ref is None or ref() is not p.grad or (
                    version is not None and p.grad._version != version):
                count += 1
        return count

    def step(self, closure=None):
        """Apply the gradients of the last ``backward_*`` call, or those staged by
        :meth:`update`, with the local optimizer (the ``backward_*`` calls step through here,
        so step hooks and LR schedulers see every step). Local: no communication.

        RuntimeError (on every rank that holds them) where a parameter's gradient was neither
        averaged by a ``backward_*`` call nor staged by :meth:`update`, e.g. after a plain
        ``loss.backward()``: each rank would step with its own gradients and the replicas would
        drift apart. RuntimeError when ``torch.amp.GradScaler`` drives the step (every rank
        calls it) or a closure is given (it would compute unsynchronized gradients)."""
        if "found_inf" in self.__dict__ or "grad_scale" in self.__dict__:
            # set by GradScaler.step, which deletes them only after a step that returns
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            raise RuntimeError(
                "torch.amp.GradScaler cannot drive DistOpt: its gradients come from a plain "
                "backward of the scaled loss, which DistOpt does not synchronize. Train with "
                "DistOpt's backward_* calls on an unscaled loss (bfloat16 autocast needs no loss "
                "scaling; backward_and_update_half sends float16 without overflow)")
        if closure is not None:
            raise RuntimeError("DistOpt.step() takes no closure: the gradients it computes "
                               "would not be synchronized; use the backward_* calls")
        foreign = self._foreign_grads()
        if foreign:
            raise RuntimeError(
                f"DistOpt.step(): {foreign} parameter(s) hold gradients that no backward_* call "
                "averaged and update() did not stage (e.g. from a plain loss.backward()); a step "
                "would apply each rank's own gradients and the replicas would drift apart. "
                "Call backward_and_update(loss) (or another backward_* call, which also steps) "
                "instead of loss.backward() and step(), or sum the gradients with "
                "all_reduce()/wait() and stage them with update(param, grad) before step()")
        return self.opt.step()

    def __call__(self, loss: torch.Tensor) -> None:
        self.backward_and_update(loss)

    # -- low-level communication -----------------------------------------------------------------

    def _synchronizers(self) -> list:
        return [*self._syncs.values(), *self._partitions.values(), *self._lanes.values()]

    def _lane(self, kind: str, **config) -> Lane:
        """The lane of one kind of low-level call (created once; collective)."""
        key = (kind, tuple(sorted(config.items())))
        lane = self._lanes.get(key)
        if lane is None:
            if kind == "sum":
                lane = Lane(codecs.Identity(), AllReduce(self.comm, op="sum"))
            elif kind == "half":
                lane = Lane(codecs.Cast(torch.float16),
                            AllReduce(self.comm, op="avg", divide_before=True))
            else:
                lane = Lane(self._sparse_codec(config["spars"], config["topK"], config["corr"]),
                            AllReduce(self.comm, op="sum"))
            self._lanes[key] = lane
        return lane

    def _start(self, lane: Lane, values: torch.Tensor, key, finish=None,
               state: dict | None = None) -> None:
        raise_together(None if values.is_contiguous() else ValueError(
            "DistOpt communicates contiguous tensors in place; pass tensor.contiguous() and "
            "use the result"), self.comm)
        # a private state per call: two pending calls of one key must not share a residual
        ctx = Context(key=key, shapes=[values.shape], size=self.comm.size, rank=self.comm.rank,
                      state={} if state is None else state)
        self._pending.append((lane.start(values, ctx), finish))

    def _check_size(self, n: int, what: str) -> None:
        raise_together(None if n <= self.buffSize else ValueError(
            f"{what}: {n} elements do not fit the fusion buffer of buffSize={self.buffSize}"),
            self.comm)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Start summing ``tensor`` over the ranks, in place (complete with :meth:`wait`)."""
        self._start(self._lane("sum"), _flat(tensor), ("sum", tensor.numel()))

    def all_reduce_half(self, tensor: torch.Tensor) -> None:
        """Start summing ``tensor`` over the ranks in float16 on the wire: each rank sends
        ``tensor / world_size``, the average is accumulated in float32 and multiplied back, so
        the sum cannot overflow float16."""
        flat = _flat(tensor)
        self._start(self._lane("half"), flat, ("half", flat.numel()),
                    finish=lambda: flat.mul_(self.world_size))

    def _fused(self, tensors: Sequence[torch.Tensor], send: bool, half: bool) -> None:
        tensors = list(tensors)
        n = sum(t.numel() for t in tensors)
        if not send:
            self._check_size(sum(t.numel() for t in self._staged) + n, "fused_all_reduce")
            self._staged += tensors
            return
        self._check_size(n, "fused_all_reduce")
        self._staged = []
        flat = pack(tensors)

        def finish():
            if half:
                flat.mul_(self.world_size)
            unpack(flat, tensors)

        if half:
            self._start(self._lane("half"), flat, ("fused-half", n), finish)
        else:
            self._start(self._lane("sum"), flat, ("fused", n), finish)

    def fused_all_reduce(self, tensor: Sequence[torch.Tensor], send: bool = True) -> None:
        """Sum the tensors over the ranks through one fused buffer (``send=False``: only stage
        them; a later call with ``send=True`` sends its list)."""
        self._fused(tensor, send, half=False)

    def fused_all_reduce_half(self, tensor: Sequence[torch.Tensor], send: bool = True) -> None:
        """:meth:`fused_all_reduce` with float16 on the wire (see :meth:`all_reduce_half`)."""
        self._fused(tensor, send, half=True)

    def _sparse_codec(self, spars: float, topK: bool, corr: bool) -> codecs.Codec:
        if topK:
            return codecs.TopK(ratio=spars, error_feedback=corr)
        return codecs.Threshold(spars, error_feedback=corr)

    def sparsification(self, tensor: torch.Tensor, accumulation: torch.Tensor | None,
                       spars: float, topK: bool) -> None:
        """Start summing the sparsified ``tensor`` (+ ``accumulation``) over the ranks; the unsent
        rest goes back into ``accumulation`` (if given). ``topK``: the ``ceil(spars * n)``
        largest magnitudes; otherwise every ``|x| >= spars``."""
        self._sparse(_flat(tensor), accumulation, spars, topK, ("sparse", tensor.numel()))

    def fused_sparsification(self, tensor: Sequence[torch.Tensor],
                             accumulation: torch.Tensor | None, spars: float, topK: bool) -> None:
        """:meth:`sparsification` of the tensors fused into one buffer."""
        tensors = list(tensor)
        self._check_size(sum(t.numel() for t in tensors), "fused_sparsification")
        flat = pack(tensors)
        self._sparse(flat, accumulation, spars, topK, ("fused-sparse", flat.numel()),
                     then=lambda: unpack(flat, tensors))

    def _sparse(self, flat, accumulation, spars, topK, key, then=None) -> None:
        raise_together(_sparsity_error(spars, topK), self.comm)
        lane = self._lane("sparse", spars=float(spars), topK=topK, corr=accumulation is not None)
        state: dict = {}  # this call's own: its residual goes back to its own accumulation
        if accumulation is not None:
            if accumulation.numel() != flat.numel():
                raise_together(ValueError(f"accumulation has {accumulation.numel()} elements, "
                                          f"the tensor {flat.numel()}"), self.comm)
            state["residual"] = accumulation.view(-1).clone()

        def finish():
            if accumulation is not None:
                accumulation.view(-1).copy_(state["residual"])
            if then is not None:
                then()

        self._start(lane, flat, key, finish, state)

    def wait(self) -> None:
        """Complete every communication started by the low-level calls."""
        pending, self._pending = self._pending, []
        for request, finish in pending:
            request.Wait()
            if finish is not None:
                finish()

    def add_param_group(self, param_group: dict) -> None:
        """Collective once built: DistOpt synchronizes the parameters it was built with, so a
        group of other trainable parameters raises ValueError on every rank."""
        if "params" not in self.__dict__:  # the local optimizer's own construction
            super().add_param_group(param_group)
            return
        group = materialized_group(param_group)
        error, frozen = synchronized_check(group.get("params", []), self.params,
                                           type(self).__name__)
        raise_together(error, self.comm)
        super().add_param_group(group)
        self._frozen += frozen

    # -- training steps --------------------------------------------------------------------------

    def _sync(self, mode: str, threshold: int, **config) -> GradientSync:
        raise_together(_positive_int(threshold, "threshold") or (
            None if threshold <= self.buffSize else ValueError(
                f"threshold={threshold} exceeds buffSize={self.buffSize}: a fused buffer "
                "would overflow")), self.comm)
        key = (mode, threshold, tuple(sorted(config.items())))
        sync = self._syncs.get(key)
        if sync is None:
            if mode == "half":
                inner = codecs.Cast(torch.float16)
                codec = codecs.Clipped(inner, config["clip"]) if config["clip"] else inner
                reducer = AllReduce(self.comm, op="avg", divide_before=True)
            elif mode == "sparse":
                codec = self._sparse_codec(config["spars"], config["topK"], config["corr"])
                reducer = AllReduce(self.comm)
            else:
                codec, reducer = codecs.Identity(), AllReduce(self.comm)
            # the buckets are SINGA's fused buffers (and partial mode's partitions): at most
            # ``threshold`` elements each, planned by it alone (large gradients are not given
            # buckets of their own)
            sync = GradientSync(self.params, self.comm, codec=codec, reducer=reducer,
                                on_backward_end=lambda: self._syncs[key].synchronize(),
                                inplace=False, cap_numel=threshold)
            sync.enabled = False
            self._syncs[key] = sync
            self._fresh_states[key] = sync.state_dict()
            saved = self._saved_sync_states.pop(repr(key), None)
            if saved is not None:
                sync.load_state_dict(saved)
        return sync

    @contextlib.contextmanager
    def _communicating(self, sync: GradientSync | None) -> Iterator[None]:
        unsynchronized_grads(self._frozen, "DistOpt")
        for p in self.params:
            p.grad = None  # fresh gradients, as SINGA's autograd.backward returns them
        if sync is not None:
            sync.enabled = True
        try:
            yield
        finally:
            if sync is not None:
                sync.enabled = False

    def _backward(self, loss: torch.Tensor, sync: GradientSync | None) -> None:
        with self._communicating(sync):
            loss.backward()
        if sync is not None:
            sync.participate()
            sync.synchronize()
        self._mark_applicable()
        self.step()

    def backward_and_update(self, loss: torch.Tensor, threshold: int = 2097152) -> None:
        """Backward, average the gradients (fused below ``threshold`` elements), step."""
        self._backward(loss, self._sync("fused", threshold))

    def backward_and_update_half(self, loss: torch.Tensor, threshold: int = 2097152,
                                 clipping: bool = False, clip_Value: float = 100) -> None:
        """:meth:`backward_and_update` with float16 on the wire and optional element
        clipping."""
        if clipping:
            raise_together(None if clip_Value > 0 else ValueError(
                f"clip_Value must be positive, got {clip_Value!r}"), self.comm)
        self._backward(loss, self._sync("half", threshold,
                                        clip=float(clip_Value) if clipping else 0.0))

    def backward_and_sparse_update(self, loss: torch.Tensor, threshold: int = 2097152,
                                   spars: float = 0.05, topK: bool = False,
                                   corr: bool = True) -> None:
        """Backward, sparsified averaging of every fused buffer (module docstring), step."""
        raise_together(_sparsity_error(spars, topK), self.comm)
        self._backward(loss, self._sync("sparse", threshold, spars=float(spars), topK=topK,
                                        corr=corr))

    def backward_and_partial_update(self, loss: torch.Tensor, threshold: int = 2097152) -> None:
        """Backward and local step; then average one partition of the parameters (round
        robin)."""
        self._sync("fused", threshold)  # validates threshold
        partitions = self._partitions.get(threshold)
        if partitions is None:
            partitions = ParameterSync(list(reversed(self.params)), self.comm,
                                       cap_numel=threshold)
            self._partitions[threshold] = partitions
            self._fresh_states[("partition", threshold)] = partitions.state_dict()
        self._backward(loss, None)
        partitions.synchronize(buckets=[self.partial % len(partitions.buckets)])
        self.partial = (self.partial + 1) % len(partitions.buckets)

    # -- state -----------------------------------------------------------------------------------

    def _engine_state(self) -> dict:
        """Every mode's engine state (bucket plan, residuals) and the partition counter."""
        return {"partial": self.partial,
                "syncs": {repr(k): s.state_dict() for k, s in self._syncs.items()}}

    def _load_engine_state(self, state: dict) -> None:
        """Restore :meth:`_engine_state`. A mode already used here whose state the checkpoint
        lacks (it was not used before the checkpoint) goes back to its state when built
        (no residuals, first cycle), as do the partitions of partial mode, so that training from
        a loaded checkpoint repeats the steps that followed it."""
        self.partial = int(state["partial"])
        self._saved_sync_states = dict(state["syncs"])  # modes not used yet get theirs later
        for key, sync in self._syncs.items():
            saved = self._saved_sync_states.pop(repr(key), None)
            sync.load_state_dict(saved if saved is not None else self._fresh_states[key])
        for threshold, partitions in self._partitions.items():
            partitions.load_state_dict(self._fresh_states[("partition", threshold)])

    def get_states(self) -> dict:
        """SINGA's name for :meth:`state_dict`."""
        return self.state_dict()

    def set_states(self, states: dict) -> None:
        """SINGA's name for :meth:`load_state_dict`."""
        self.load_state_dict(states)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view (contiguous tensors) or the tensor itself (then rejected with a message)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor


def _sparsity_error(spars, topK: bool) -> Exception | None:
    if not isinstance(spars, (int, float)) or isinstance(spars, bool):
        return TypeError(f"spars must be a number, got {type(spars).__name__}")
    if topK and not 0 < spars <= 1:
        return ValueError(f"with topK, spars is the fraction to send, in (0, 1]; got {spars}")
    if not topK and spars < 0:
        return ValueError(f"spars (the magnitude threshold) must be >= 0, got {spars}")
    return None
