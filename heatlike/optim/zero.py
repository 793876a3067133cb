"""ZeroRedundancyOptimizer: each rank keeps the optimizer state of its share of the parameters.

torch's ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1) over MPI, with its
constructor. Adam's two moments take twice the model's memory on every rank of plain data
parallelism; here rank r holds them for its *shard* only, about 1/P of the parameters:

* **Partition.** Group by group, the parameters are assigned, largest first, to the rank whose
  shard is smallest so far (torch's greedy rule; ties to the lowest rank). It depends on the
  shapes only, so every rank computes the same partition.
* **Step.** The gradients must already be the averages (``heatlike.nn.DataParallel`` without an
  ``optimizer=`` puts them in ``.grad`` at the end of ``backward()``). ``step()`` copies the
  hyperparameters of every group (a scheduler's ``lr``) to a local ``optimizer_class`` that holds
  this rank's shard and steps it. The ranks then agree, in one small all-gather, that every
  local step succeeded (an error on one rank, e.g. a gradient the optimizer refuses, raises on
  every rank before anything is exchanged) and that the parameters' dtypes and devices are the
  same everywhere (a model converted on every rank alike after construction just works). Then
  each rank in turn broadcasts its updated shard with the engine's ``broadcast_tensors``:
  parameters of 256 KiB or more where they are, the smaller ones packed per dtype and device
  (a transient copy of at most one shard's small parameters; no copy of the model is kept).
  The update of a parameter is computed by one rank from the same averaged gradient every rank
  holds, so the model is the unsharded optimizer's, bit for bit.
* ``param_groups`` hold *every* parameter (so LR schedulers, ``GradScaler.unscale_`` and
  gradient clipping see the whole model, and ``GradScaler``'s skip decision is the same on every
  rank); ``state`` holds this rank's shard's.
* **State dicts.** ``consolidate_state_dict(to=0)`` (collective) gathers the shards' states on
  rank ``to`` (``to=None``: on every rank); ``state_dict()`` then returns torch's format for all
  parameters (global indices), and raises on a rank that holds no consolidated state (torch's
  behaviour: a hidden collective in ``state_dict()`` would hang a program that calls it on rank 0
  only). ``load_state_dict`` takes such a full state dict on every rank, at any world size: each
  rank keeps its shard's entries. :func:`heatlike.utils.checkpoint.save` consolidates on every
  rank itself.

``parameters_as_bucket_view`` is accepted and changes nothing (the shards are packed at every
step either way); ``overlap_with_ddp=True`` needs DDP's communication hook and raises; an
optimizer whose ``step`` needs a closure (LBFGS: its direction is a function of every
parameter's gradient) and a parameter listed twice raise ``ValueError``. With
:class:`heatlike.nn.Join`, pass the optimizer among the joinables (``Join([model, opt])``): a
rank out of inputs must step it in the others' steps, and does so with the settings and
(clipped) gradients of the highest rank still training. The optimizer cannot be pickled or
deep-copied (``TypeError``): save its state with ``consolidate_state_dict`` and ``state_dict``.
"""

from __future__ import annotations

import copy
import gc
import inspect
import weakref
import zlib
from collections.abc import Iterable
from typing import Any

import torch
from mpi4py import MPI

from ..core.agreement import agree_on, gather_or_raise, raise_together
from ..core.communication import MPICommunication, sanitize_comm
from ..engine.hooks import EagerSteps
from ..engine.replicas import broadcast_tensors

__all__ = ["ZeroRedundancyOptimizer", "partition", "unjoined_over"]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every ZeroRedundancyOptimizer built here


def partition(sizes: list[int], ranks: int, totals: list[int] | None = None) -> list[int]:
    """The rank owning each of the parameters of ``sizes`` elements: largest first, each to the
    rank with the fewest elements so far (the lowest such rank); ``totals`` (each rank's
    elements from earlier groups) is updated in place."""
    totals = [0] * ranks if totals is None else totals
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (totals[r], r))
        owner[i] = r
        totals[r] += sizes[i]
    return owner


def _refuse_scaled_shadow(comm) -> None:
    """RuntimeError (raised on every rank by ``step``'s error exchange) where a GradScaler steps
    this optimizer inside a ``heatlike.nn.Join`` that a rank has joined: that rank steps its
    shard in its shadow iterations with the exchanged gradients still scaled, and cannot know
    which steps the scaler skips."""
    from ..nn.join import _CURRENT
    from .wrapping import driving_grad_scaler

    join = _CURRENT[-1] if _CURRENT else None
    if join is None or join.joined or join.active >= comm.size:
        return
    if driving_grad_scaler() is not None:
        raise RuntimeError(
            "a GradScaler steps a ZeroRedundancyOptimizer while a rank that ran out of inputs "
            "stands in under heatlike.nn.Join: that rank steps its shard with the gradients "
            "still scaled and cannot follow the scaler's skipped steps. Give every rank the "
            "same number of batches (heatlike.utils.data.DataLoader does), or train without "
            "the GradScaler (bfloat16 autocast needs none)")


def _standing_in(comm) -> bool:
    """Whether a :class:`heatlike.nn.Join` is current and some rank of it has run out of inputs
    (the same answer on every rank: the training ranks learn it from the iteration's
    notification, the others are standing in)."""
    from ..nn.join import _CURRENT

    join = _CURRENT[-1] if _CURRENT else None
    return join is not None and (join.joined or join.active < comm.size) and \
        MPI.Comm.Compare(join.comm.handle, comm.handle) in (MPI.IDENT, MPI.CONGRUENT)


class ZeroRedundancyOptimizer(EagerSteps, torch.optim.Optimizer):
    """Shard the state of ``optimizer_class(params, **defaults)`` over the ranks of
    ``process_group`` (module docstring). ``process_group``: an
    :class:`~heatlike.core.communication.MPICommunication`, an mpi4py communicator, or None
    (heatlike's default communicator)."""

    _synchronizes_itself = True  # DataParallelOptimizer and the presets refuse to drive it

    def __init__(self, params: Iterable, optimizer_class: type[torch.optim.Optimizer],
                 process_group: MPICommunication | MPI.Intracomm | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        comm = sanitize_comm(process_group)
        error = _class_error(optimizer_class)
        if error is None and overlap_with_ddp:
            error = ValueError("overlap_with_ddp=True needs torch DDP's communication hook; "
                               "heatlike steps the shards after DataParallel's backward: leave "
                               "it False")
        if error is None:
            try:
                super().__init__(params, dict(defaults))
                self._comm = comm
                self._build(optimizer_class, defaults)
            except Exception as bad:  # noqa: BLE001 - e.g. torch's RuntimeError for fused=True
                error = bad  # with foreach=True: raised on every rank below
        raise_together(error, comm)
        agree_on({"optimizer_class": optimizer_class.__qualname__, "defaults": defaults,
                  "parameters": [[(tuple(p.shape), str(p.dtype)) for p in g["params"]]
                                 for g in self.param_groups]}, comm, "ZeroRedundancyOptimizer")
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._consolidated: dict | None = None
        _LIVE.add(self)

    def __getstate__(self):
        raise TypeError("a ZeroRedundancyOptimizer cannot be pickled or copied (its state is "
                        "spread over the ranks): call consolidate_state_dict() on every rank, "
                        "then save state_dict()")

    # -- the shards ----------------------------------------------------------------------------

    def _build(self, optimizer_class: type[torch.optim.Optimizer], defaults: dict) -> None:
        """Partition every group and build the local optimizer over this rank's shard."""
        self.optimizer_class, self._defaults = optimizer_class, dict(defaults)
        self._owner: dict[int, int] = {}  # id(parameter) -> owning rank
        self._totals = [0] * self._comm.size  # elements per rank so far, over the groups
        for group in self.param_groups:
            _refuse_duplicates(group)
        local_groups = [self._local_group(g) for g in self.param_groups]
        self.optim = optimizer_class(local_groups, **defaults)
        # the local optimizer's defaults (betas, momentum) too, as a scheduler reads them
        self.defaults = {**self.optim.defaults, **self.defaults}
        self._complete_hyperparameters()
        self._plan_exchange()

    def _local_group(self, group: dict) -> dict:
        owners = partition([p.numel() for p in group["params"]], self._comm.size, self._totals)
        for p, r in zip(group["params"], owners):
            self._owner[id(p)] = r
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p, r in zip(group["params"], owners) if r == self._comm.rank]}

    def _complete_hyperparameters(self) -> None:
        """The local optimizer's defaults (``betas``, ...) appear in the full groups too."""
        for full, local in zip(self.param_groups, self.optim.param_groups):
            for k, v in local.items():
                if k != "params":
                    full.setdefault(k, v)

    def _layout(self) -> list[tuple[str, str]]:
        return [(str(p.dtype), str(p.device)) for g in self.param_groups for p in g["params"]]

    def _plan_exchange(self) -> None:
        """Each rank's shard in global order: what it broadcasts after its step."""
        everything = [p for g in self.param_groups for p in g["params"]]
        self._shards = [[p for p in everything if self._owner[id(p)] == r]
                        for r in range(self._comm.size)]

    @property
    def owned(self) -> list[torch.nn.Parameter]:
        """This rank's shard: the parameters whose state and update it holds."""
        return [p for g in self.optim.param_groups for p in g["params"]]

    def owner(self, p: torch.nn.Parameter) -> int:
        """The rank that updates ``p``."""
        return self._owner[id(p)]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to every rank's view and partition it (collective after construction:
        every rank must add the same group; a group torch refuses on one rank, or that differs
        between ranks, raises on every rank and adds nothing)."""
        if "optim" not in self.__dict__:  # torch.optim.Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        error, before = None, len(self.param_groups)
        try:
            super().add_param_group(param_group)
            _refuse_duplicates(self.param_groups[-1])
        except (TypeError, ValueError) as bad:
            error = bad
        added = len(self.param_groups) > before
        try:
            raise_together(error, self._comm)
            agree_on({"parameters": [(tuple(p.shape), str(p.dtype))
                                     for p in self.param_groups[-1]["params"]]},
                     self._comm, "ZeroRedundancyOptimizer.add_param_group")
        except (TypeError, ValueError, RuntimeError):
            if added:
                self.param_groups.pop()
            raise
        self.optim.add_param_group(self._local_group(self.param_groups[-1]))
        self._complete_hyperparameters()
        self._plan_exchange()

    # -- stepping ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Collective: step this rank's shard with the current hyperparameters, then give every
        rank every updated parameter (module docstring). ``kwargs`` go to the local step."""
        loss = None
        error = None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            _refuse_scaled_shadow(self._comm)
        except Exception as bad:  # noqa: BLE001 - any failure here is every rank's
            error = bad
        if _standing_in(self._comm):
            self._follow_training_ranks(error)  # (raises on every rank where one failed)
        if error is None:
            try:
                for full, local in zip(self.param_groups, self.optim.param_groups):
                    for k, v in full.items():
                        if k != "params":
                            local[k] = v
                self.optim.step(**kwargs)
            except Exception as bad:  # noqa: BLE001 - any failure here is every rank's
                error = bad
        layout = zlib.crc32(repr(self._layout()).encode())
        layouts = gather_or_raise(layout, error, self._comm, "ZeroRedundancyOptimizer.step")
        if len(set(layouts)) > 1:
            raise RuntimeError("the parameters' dtypes or devices differ between the ranks "
                               "(a model converted on some ranks only): convert it on every rank")
        self._share_parameters()
        self._consolidated = None
        return loss

    def _follow_training_ranks(self, error: Exception | None) -> None:
        """Collective, under :class:`heatlike.nn.Join` once a rank has run out of inputs: the
        shards of the ranks that stand in are stepped with the settings and gradients of the
        highest rank still training, which the training loop may have changed between backward
        and ``step()`` (a scheduler's learning rate, ``clip_grad_norm_``), where a standing-in
        rank has only the exchanged averages. One small all-gather (joined or not, the groups'
        hyperparameters, which gradients exist), then that rank broadcasts the gradients of
        each standing-in rank's shard."""
        from ..nn.join import _CURRENT

        joined = bool(_CURRENT[-1].joined)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        present = [[p.grad is not None for p in shard] for shard in self._shards]
        everyone = gather_or_raise((joined, hyper, present), error, self._comm,
                                   "ZeroRedundancyOptimizer.step under Join")
        root = max(r for r, (out, _, _) in enumerate(everyone) if not out)
        _, hyper, present = everyone[root]
        if joined:
            for group, values in zip(self.param_groups, hyper):
                group.update(values)
        for r, (out, _, _) in enumerate(everyone):
            if not out:
                continue
            grads = []
            for p, has in zip(self._shards[r], present[r]):
                if not has:
                    p.grad = None
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            broadcast_tensors(grads, self._comm, root=root)

    def _share_parameters(self) -> None:
        """Each rank in turn broadcasts its updated shard (the engine's broadcast: large
        parameters where they are, the small ones packed per dtype and device)."""
        for r, shard in enumerate(self._shards):
            broadcast_tensors([p.detach() for p in shard], self._comm, root=r)

    # -- state ---------------------------------------------------------------------------------

    @property
    def state(self):
        """This rank's shard's state (per parameter, as any torch optimizer's)."""
        local = self.__dict__.get("optim")
        return local.state if local is not None else self.__dict__.get("_full_state", {})

    @state.setter
    def state(self, value) -> None:
        local = self.__dict__.get("optim")
        if local is None:  # torch.optim.Optimizer.__init__ sets an empty one first
            self.__dict__["_full_state"] = value
        else:
            local.state = value

    def _index(self) -> dict[int, int]:
        """id(parameter) -> its index in torch's state-dict numbering (over every group)."""
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Collective: gather every shard's optimizer state on rank ``to`` (every rank with
        None; the same ``to`` on every rank, else ``ValueError`` everywhere), for
        :meth:`state_dict`. The state of the last ``step()``; a later step discards it."""
        comm = self._comm
        from ..core.checks import as_root, check_root

        to = None if to is None else as_root(to)
        agree_on({"to": to}, comm, "ZeroRedundancyOptimizer.consolidate_state_dict")
        if to is not None:
            check_root(to, comm.size)
        index = self._index()
        mine = {index[id(p)]: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor)
                                   else copy.deepcopy(v))
                               for k, v in self.optim.state[p].items()}
                for p in self.owned if p in self.optim.state}
        everyone = comm.allgather(mine) if to is None else comm.gather(mine, root=to)
        if everyone is None:
            self._consolidated = None
            return
        state: dict[int, dict] = {}
        for shard in everyone:
            state.update(shard)
        self._consolidated = dict(sorted(state.items()))

    def release_state_dict(self) -> None:
        """Drop the state :meth:`consolidate_state_dict` gathered (it holds every parameter's
        optimizer state until the next step otherwise)."""
        self._consolidated = None

    def state_dict(self) -> dict:
        """torch's format over every parameter (requires :meth:`consolidate_state_dict` on this
        rank since the last step); the optimizer's state-dict hooks run as torch's do."""
        if self._consolidated is None:
            raise RuntimeError(
                "the optimizer state is sharded over the ranks: call "
                "consolidate_state_dict(to=rank) on every rank first (collective), then "
                "state_dict() on that rank (heatlike.utils.checkpoint.save does both)")
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        state_dict = {"state": {k: dict(v) for k, v in self._consolidated.items()},
                      "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (:meth:`state_dict`'s, or a plain torch optimizer's over the
        same parameters) on every rank: each keeps its shard's entries, at any world size. The
        optimizer's load-state-dict hooks run as torch's do."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(g["params"])
                for saved, g in zip(groups, self.param_groups)):
            raise ValueError("the state dict's parameter groups do not match this optimizer's "
                             "(number of groups or of parameters per group)")
        index = self._index()
        saved_ids = [i for saved in groups for i in saved["params"]]
        by_position = dict(enumerate(saved_ids))  # position over the groups -> saved id
        local_state, local_groups = {}, []
        local_position = 0
        for saved, local in zip(groups, self.optim.param_groups):
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                 "params": list(range(local_position,
                                                      local_position + len(local["params"])))})
            for p in local["params"]:
                saved_id = by_position[index[id(p)]]
                if saved_id in state_dict["state"]:
                    local_state[local_position] = state_dict["state"][saved_id]
                local_position += 1
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        for saved, full in zip(groups, self.param_groups):
            full.update({k: v for k, v in saved.items() if k != "params"})
        self._consolidated = None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _class_error(optimizer_class: object) -> Exception | None:
    """Why ``optimizer_class`` cannot be sharded (None if it can)."""
    if not (isinstance(optimizer_class, type) and
            issubclass(optimizer_class, torch.optim.Optimizer)):
        return TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got "
                         f"{optimizer_class!r}")
    if getattr(optimizer_class, "_synchronizes_itself", False) or \
            optimizer_class.__module__.startswith("heatlike."):
        return TypeError(f"optimizer_class must be a local torch optimizer, got heatlike's "
                         f"{optimizer_class.__name__}")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return ValueError(f"{optimizer_class.__name__}.step needs a closure: its update is a "
                          "function of every parameter's gradient (LBFGS), which no shard holds; "
                          "use it without ZeroRedundancyOptimizer")
    return None


def _refuse_duplicates(group: dict) -> None:
    seen: set[int] = set()
    for p in group["params"]:
        if id(p) in seen:
            raise ValueError("a parameter appears twice in one parameter group: list it once "
                             "(its shard would be stepped twice)")
        seen.add(id(p))


def unjoined_over(parameters: Iterable[torch.Tensor], listed: Iterable) -> list:
    """The live ZeroRedundancyOptimizers holding one of ``parameters`` that are not in
    ``listed`` (:class:`heatlike.nn.Join` refuses to start without them: a rank out of inputs
    must step them in the others' steps, or their exchanges wait for it forever)."""
    params = {id(p) for p in parameters}
    named = {id(j) for j in listed}

    def missing() -> list:
        return [z for z in list(_LIVE) if id(z) not in named
                and any(id(p) in params for g in z.param_groups for p in g["params"])]

    if not missing():
        return []
    gc.collect()  # an optimizer the program dropped, still in a reference cycle, does not count
    return missing()

