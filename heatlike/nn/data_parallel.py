"""DataParallel: train one torch module on every rank as one model with the combined batch.

Each rank runs the module on its own part of the batch; gradients are averaged over ranks during
the backward pass by the engine's :class:`~heatlike.engine.GradientSync` (flat buckets, one
non-blocking all-reduce per bucket, launched as soon as the bucket's gradients are ready). With
per-rank batches of b samples on P ranks and a loss that averages over the batch, the averaged
gradient is the gradient of the loss over the combined batch of P*b samples, so the parameters
follow the single-process trajectory up to floating-point rounding.

At construction the module is checked to be the same on every rank (names, shapes, dtypes of
parameters and buffers; otherwise ValueError on every rank) and rank 0's parameters and buffers
are broadcast to all ranks; the global random number generators are not touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..core import checks as _checks
from ..core.agreement import agree_on, raise_together
from ..core.communication import MPI_WORLD, MPICommunication, sanitize_comm
from ..core.env import env_flag, env_float
from ..core.log import get_logger
from ..engine.autotune import autotune
from ..engine.codecs import Cast, Codec, codec_error
from ..engine.gradsync import GradientSync
from ..engine.hooks import on_gradient, remove_when_dropped
from ..engine.replicas import (
    average_tensors,
    broadcast_module,
    broadcast_tensors,
    check_replicas,
    no_trainable_parameters,
    verify_replicas,
)
from ..optim.daso import DASO
from ..optim.dp_optimizer import DataParallelOptimizer
from ..optim.wrapping import watch_unscalable
from .buffers import ModuleBuffers
from .deferred import ApplyBeforeUse
from .hooks import WrapperHook, compiled_parts, run_eagerly

__all__ = ["DataParallel", "DataParallelMultiGPU", "broadcast_module", "check_replicas",
           "verify_replicas"]

_BUFFER_MODES = ("broadcast", "average", None)

_registrations = [0]  # parameters and submodules registered in this process so far


def _registered(*_args) -> None:
    _registrations[0] += 1  # returns None: the registration itself is left as it is


register_module_parameter_registration_hook(_registered)
register_module_module_registration_hook(_registered)



class DataParallel(torch.nn.Module):
    """Data-parallel wrapper of ``module`` over ``comm``.

    Parameters
    ----------
    module: the torch module, built the same way on every rank.
    comm: the communicator (default ``MPI_WORLD``).
    optimizer: a :class:`heatlike.optim.DataParallelOptimizer` over exactly the module's trainable
        parameters (or a list/tuple holding one, as Heat accepts); its ``blocking`` flag selects
        the mode. A list naming that one optimizer several times selects blocking updates with a
        ``UserWarning``, as Heat does for any list of more than one; a list of different
        optimizers is a ValueError (use one torch optimizer with several parameter groups).
        Without one, the averaged gradients are in ``.grad`` at the end of every ``backward()``
        for any optimizer to use (``blocking_parameter_updates`` then reads None).
    blocking_parameter_updates: Heat's argument: when given, it sets the optimizer's mode (as in
        Heat, the module's flag wins over the optimizer's ``blocking``); None keeps the
        optimizer's.
    bucket_cap_mb, first_bucket_mb: bucket sizes (DDP's defaults: 25 MiB, first 1 MiB;
        ``bucket_cap_mb=None`` reads ``HEATLIKE_BUCKET_CAP_MB``, as Horovod reads
        ``HOROVOD_FUSION_THRESHOLD``, else 25);
        ``bucket_cap_mb="auto"`` measures the communicator at construction and picks both
        (:func:`heatlike.engine.autotune`; the choice and the reason are logged on rank 0 and kept
        in ``self.autotuned``).
    sync_buffers: before each training forward, ``"broadcast"`` rank 0's buffers (BatchNorm
        statistics, DDP's behaviour), ``"average"`` them, or ``None`` to leave them local.
    codec: what goes on the wire (default: float32 as is; ``"bf16"`` or
        ``heatlike.engine.Cast(torch.bfloat16)`` halves the bytes, averaged with float32
        accumulation; the names are those of :func:`heatlike.engine.codecs.codec_from`;
        ``"auto"`` lets the autotuner choose bfloat16 where it measures it faster).
    find_unused_parameters: after each training forward, walk the autograd graph from the output
        and launch the buckets of parameters the loss cannot reach at once (DDP's option of the
        same name). Correctness never needs it (unused parameters are handled at the end of
        backward); it restores overlap when parameters go unused in some steps, for the cost of
        the graph walk. Assumes one forward per backward.
    check_finite: raise ``FloatingPointError`` on every rank when the averaged gradients or the
        parameters (checked before each training forward) hold a NaN or an infinity.
    """

    def __init__(self, module: torch.nn.Module, comm: MPICommunication = MPI_WORLD,
                 optimizer: DataParallelOptimizer | None = None,
                 blocking_parameter_updates: bool | None = None, *,
                 bucket_cap_mb: float | str | None = None, first_bucket_mb: float = 1.0,
                 sync_buffers: str | None = "broadcast", codec: Codec | str | None = None,
                 find_unused_parameters: bool = False, check_finite: bool = False) -> None:
        super().__init__()
        comm = sanitize_comm(comm)
        error = None
        force_blocking = False
        if isinstance(optimizer, (list, tuple)) and len(optimizer) > 1 and \
                all(o is optimizer[0] for o in optimizer):
            # Heat's list naming one optimizer several times: Heat falls back to blocking
            # updates for any list of more than one entry, and so does heatlike
            optimizer = optimizer[0]
            force_blocking = isinstance(optimizer, DataParallelOptimizer)
        if isinstance(optimizer, (list, tuple)) and len(optimizer) == 1:
            optimizer = optimizer[0]  # Heat's list of optimizers, with its one optimizer
        if not isinstance(module, torch.nn.Module):
            error = TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        elif isinstance(optimizer, (list, tuple)):
            error = ValueError(f"DataParallel takes one DataParallelOptimizer, got a list of "
                               f"{len(optimizer)}: give its torch optimizer one parameter group "
                               "per part of the model (torch.optim.SGD([{'params': ...}, "
                               "{'params': ..., 'lr': ...}]))")
        elif blocking_parameter_updates is not None and \
                not isinstance(blocking_parameter_updates, bool):
            error = TypeError(f"blocking_parameter_updates must be a bool or None, got "
                              f"{type(blocking_parameter_updates).__name__}")
        elif blocking_parameter_updates is not None and optimizer is None:
            error = ValueError("blocking_parameter_updates selects the mode of the optimizer: "
                               "pass optimizer=DataParallelOptimizer(torch_optimizer)")
        elif optimizer is not None and not isinstance(optimizer, DataParallelOptimizer):
            error = TypeError("optimizer must be a heatlike.optim.DataParallelOptimizer "
                              f"(wrap your torch optimizer), got {type(optimizer).__name__}")
        elif sync_buffers not in _BUFFER_MODES:
            error = ValueError(f"sync_buffers must be one of {_BUFFER_MODES}, "
                               f"got {sync_buffers!r}")
        else:
            error = no_trainable_parameters(module, "DataParallel")
        if error is None and bucket_cap_mb is None:
            try:
                bucket_cap_mb = env_float("HEATLIKE_BUCKET_CAP_MB", 25.0, minimum=1e-6,
                                          meaning="MiB per gradient bucket")
            except ValueError as bad:
                error = bad
        hold_back = True
        if error is None:
            try:
                hold_back = bool(env_flag("HEATLIKE_HOLD_BACK", True))
            except ValueError as bad:
                error = bad
        if error is None and not (isinstance(codec, str) and codec == "auto"):
            codec, error = codec_error(codec)
        raise_together(error, comm)
        _take_over(module, comm, "DataParallel")
        if force_blocking:
            requested = optimizer.blocking if blocking_parameter_updates is None else \
                blocking_parameter_updates
            if not requested:
                warnings.warn("Usage of more than one DataParallelOptimizer causes fallback on "
                              "blocking MPI communication during parameter updates (the list "
                              "names the same optimizer more than once; pass it alone to keep "
                              "non-blocking updates)", UserWarning, stacklevel=2)
            blocking_parameter_updates = True
        if blocking_parameter_updates is not None:
            optimizer.blocking = blocking_parameter_updates
        agree_on({"optimizer": None if optimizer is None else optimizer.blocking,
                  "sync_buffers": sync_buffers, "find_unused_parameters": find_unused_parameters,
                  "check_finite": check_finite, "bucket_cap_mb": bucket_cap_mb,
                  "first_bucket_mb": first_bucket_mb, "codec": codec,
                  "HEATLIKE_HOLD_BACK": hold_back}, comm, "DataParallel")
        check_replicas(module, comm)
        if optimizer is not None:
            raise_together(_ownership_error(module, optimizer), comm)
        self.module = module
        self.comm = comm
        self.optimizer = optimizer
        self.sync_buffers = sync_buffers
        self._module_buffers = ModuleBuffers(module)  # module.buffers() without a walk per call
        self.find_unused_parameters = find_unused_parameters
        self.check_finite = check_finite
        self._join = None  # the heatlike.nn.Join context this model is in
        self._buffer_root = 0  # the rank whose buffers are broadcast (Join may change it)
        broadcast_module(module, comm, check=False)
        self.autotuned = None
        if bucket_cap_mb == "auto" or codec == "auto":
            self.autotuned = autotune(module, comm, allow_lossy=codec == "auto")
            if bucket_cap_mb == "auto":
                bucket_cap_mb = self.autotuned.bucket_cap_mb
                first_bucket_mb = self.autotuned.first_bucket_mb
            if codec == "auto":
                codec = self.autotuned.codec
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # frozen now, so never synchronized: DataParallelOptimizer.step refuses them unfrozen
        self._frozen = [p for p in module.parameters() if not p.requires_grad]
        self._synced = {id(p) for _, p in named}
        self._registrations = _registrations[0]  # the module's parameters are checked again
        self.grad_sync = GradientSync(
            [p for _, p in named], comm, bucket_cap_mb, first_bucket_mb, codec=codec,
            on_backward_end=self._backward_end, check_finite=check_finite,
            names=[n for n, _ in named], fold_division=True)
        if optimizer is not None:
            optimizer._attach(self)
        else:  # a GradScaler stepping the program's torch optimizer meets no heatlike step
            watch_unscalable(self.grad_sync)
        # deferred updates are applied as the next forward first uses each parameter
        # (heatlike.nn.deferred): only a non-blocking optimizer defers them, only on several ranks
        self._defers = not self.grad_sync.passthrough and optimizer is not None and \
            not optimizer.blocking
        # the next forward pass uses the buckets from the last launched on: hold back those the
        # links cannot carry during the backward pass and start them in that order at its end
        # (HEATLIKE_HOLD_BACK=0: never; one rank, exchanging with a lossy codec: nothing to hold)
        self.grad_sync.hold_back = self._defers and hold_back and comm.size > 1
        self._in_wrapper = False  # inside forward(): the module's own hooks leave the work to it
        self._handles = [module.register_forward_pre_hook(WrapperHook(self._module_pre_hook))]
        if self.grad_sync.passthrough:  # one rank: nothing is ever pending or in flight
            return
        self._handles.append(module.register_forward_hook(WrapperHook(self._module_post_hook)))
        # values loaded into the module replace the parameters as a blocking step() left them
        self._handles.append(module.register_load_state_dict_pre_hook(
            WrapperHook(lambda *_: self.flush())))
        # and the module's own state dict (torch.save(model.module.state_dict())) includes them
        self._handles.append(module.register_state_dict_pre_hook(
            WrapperHook(lambda *_: self.flush())))

    # -- hooks ---------------------------------------------------------------------------------

    def _backward_end(self) -> None:
        if self.optimizer is None or self.optimizer.blocking:
            self.grad_sync.synchronize()

    def _module_pre_hook(self, _module, _args) -> None:
        if not self._in_wrapper:  # the module called directly: every pending update first
            if self.optimizer is not None:
                self.optimizer._disarm_guard()
            self._before_forward(defer=False)
            self._raise_read_error()

    def _module_post_hook(self, _module, _args, output) -> None:
        if not self._in_wrapper:
            self._after_forward(output)

    def _enter(self, traced: bool):
        """The start of :meth:`forward`, always run eagerly (never inside a compiled graph):
        the checks, the buffers' synchronization and the pending updates: applied now, or, in
        eager code, returned as the :class:`~heatlike.nn.deferred.ApplyBeforeUse` context that
        applies each as the forward first uses its parameters. Under ``torch.compile`` (the
        wrapper traced, ``traced``, or compiled parts inside the module) every pending update is
        applied now: hooks and modes inside compiled code cannot be relied on."""
        if self.optimizer is not None:  # the forward pass's own mode (or a flush) takes over
            self.optimizer._disarm_guard()
        defer = self._defers and not traced and bool(self.optimizer._pending) and \
            not compiled_parts(self.module)
        self._before_forward(defer)
        self._raise_read_error()
        self._in_wrapper = True
        if defer and self.optimizer._pending:
            return _WrapperCall(self, ApplyBeforeUse(self.optimizer, self.grad_sync.buckets))
        return None if traced else _WrapperCall(self, None)

    def _raise_read_error(self) -> None:
        """The error of a deferred update applied for a read between ``step()`` and this
        forward (``check_finite``), raised here, where the ranks that did not read meet it."""
        if self.optimizer is not None:
            self.optimizer._raise_read_error()

    def _leave(self, output) -> None:
        self._in_wrapper = False
        if not self.grad_sync.passthrough:  # one rank: nothing pending, no bucket to launch
            self._after_forward(output)

    def _before_forward(self, defer: bool) -> None:
        if self.training and torch.is_grad_enabled():
            if self.grad_sync.closed:
                raise RuntimeError("this DataParallel was closed (close()): it no longer "
                                   "averages gradients; build a new one to train")
            self.grad_sync.check_layout("DataParallel")
            self._check_parameters()
        # the collectives below (Join's notification, the buffers' broadcast) advance this
        # model's sums in flight while they wait: a rank that applied a deferred update early
        # (a read after step()) waits for their next phases
        pending = self.optimizer is not None and bool(self.optimizer._pending)
        with _checks.driving(self.grad_sync) if pending else contextlib.nullcontext():
            self._collectives_before_forward(defer)

    def _collectives_before_forward(self, defer: bool) -> None:
        begins = False  # under Join: whether this forward begins an iteration
        if self._join is not None and self.training:
            begins = self._join.notify(torch.is_grad_enabled() and self.grad_sync.enabled, self)
        if self.check_finite and self.training and self._join is None:  # else: in notify()
            bad = [n for n, p in self.module.named_parameters()
                   if not bool(torch.isfinite(p).all())]
            if bad:  # the replicas are equal, so every rank finds the same
                raise FloatingPointError(f"non-finite parameters {bad[:5]} (check_finite)")
        if not defer:
            self.flush()
        if self._join is not None and self.training:
            if begins:  # every joined model's, in an order the ranks out of inputs know
                self._join.sync_buffers()
        elif self.training and self.sync_buffers is not None and self.comm.size > 1:
            self._sync_buffers()

    def _check_parameters(self) -> None:
        """RuntimeError where a training forward would train a parameter DataParallel does not
        synchronize (each rank would step it with its own gradient): one frozen when the wrapper
        was built and trainable now, or one added to the module since (looked for only after a
        parameter or submodule was registered somewhere in the process)."""
        if any(p.requires_grad for p in self._frozen):
            names = [n for n, p in self.module.named_parameters()
                     if p.requires_grad and id(p) not in self._synced]
            raise RuntimeError(
                f"parameters {names[:4]} did not require gradients when DataParallel was built, "
                "so it does not synchronize them, but it requires gradients now: each rank "
                "would train them "
                "with its own gradient. Build DataParallel after unfreezing them (a parameter "
                "group with lr=0 keeps a trainable parameter still until then)")
        if self._registrations == _registrations[0]:
            return
        self._registrations = _registrations[0]
        added = [n for n, p in self.module.named_parameters()
                 if p.requires_grad and id(p) not in self._synced]
        if added:
            raise RuntimeError(
                f"parameters {added[:4]} were added to the module after DataParallel was built: "
                "it does not synchronize them, so each rank would train them with its own "
                "gradient. Build DataParallel after the module is complete (close() the old "
                "wrapper and wrap the module again)")

    def _after_forward(self, output) -> None:
        if self.optimizer is not None:
            self.optimizer.flush()
        if self.find_unused_parameters and self.training and torch.is_grad_enabled():
            reached = _parameters_reached(output)
            self.grad_sync.mark_unused(p for p in self.grad_sync.params if id(p) not in reached)

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        buffers = [b for b in self._module_buffers() if b.numel()]
        if not buffers:
            return
        if self.sync_buffers == "broadcast":
            broadcast_tensors(buffers, self.comm, self._buffer_root)
        else:
            average_tensors([b for b in buffers if b.is_floating_point()], self.comm)

    # -- public API ----------------------------------------------------------------------------

    @property
    def blocking_parameter_updates(self) -> bool | None:
        """Heat's attribute, read-only: whether parameter updates are blocking (the optimizer's
        mode); None without an optimizer."""
        return None if self.optimizer is None else self.optimizer.blocking

    def forward(self, *args, **kwargs):
        deferred = run_eagerly(self._enter, torch.compiler.is_compiling())
        if deferred is None:
            output = self.module(*args, **kwargs)
        else:
            with deferred:
                output = self.module(*args, **kwargs)
        run_eagerly(self._leave, output)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside do not communicate. The next
        backward outside (or ``step()``) averages everything accumulated, including parameters
        used only in earlier micro-steps. Under :class:`heatlike.nn.Join` the last micro-step's
        forward and backward must run outside (RuntimeError on every rank otherwise)."""
        old = self.grad_sync.enabled
        self.grad_sync.enabled = False
        try:
            yield
        finally:
            self.grad_sync.enabled = old

    def close(self) -> None:
        """Collective: apply pending updates, take the wrapper's hooks off the module and free
        the communicators of the gradient synchronization (its private channels), for programs
        that build many models in one process (MPI has room for a couple of thousand
        communicators). The module is then a plain module again; a training forward pass through
        this wrapper raises RuntimeError (it would not synchronize), evaluation still works.
        Wrapping the module again closes the earlier wrapper this way."""
        self.flush()
        self.grad_sync.close()
        for handle in self._handles:
            handle.remove()

    def flush(self) -> None:
        """Apply pending (non-blocking) parameter updates now."""
        if self.optimizer is not None:
            self.optimizer.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients; with non-blocking updates pending, once each is applied (the
        optimizer's ``zero_grad``): resetting them now would lose or corrupt averages still being
        computed."""
        if self.optimizer is not None and self.optimizer.update_next:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            super().zero_grad(set_to_none=set_to_none)

    def synchronize_buffers(self) -> None:
        """Collective: make every rank's buffers what ``sync_buffers`` makes them at the start of
        a training forward (rank 0's, or their average), now. Training leaves each rank with the
        BatchNorm statistics of its own last batch (DDP's too: it copies them in the next
        forward, evaluation included, which every rank must then run); heatlike's evaluation
        forwards do not communicate (they may run on some ranks only), so call this on every
        rank before evaluating shards of a test set or saving the module of one rank."""
        if self.sync_buffers is not None and self.comm.size > 1:
            self._sync_buffers()

    def sync_gradients(self) -> None:
        """Collective: average every outstanding gradient into ``.grad`` now (only needed without
        an optimizer when a rank may have run no backward)."""
        self.grad_sync.synchronize()

    def train(self, mode: bool = True) -> DataParallel:
        if not mode:
            self.flush()
        return super().train(mode)

    def state_dict(self, *args, **kwargs):
        """The module's state under ``module.`` and the engine's (bucket plan, counters, codec
        state) under ``_extra_state``; pending updates are applied first."""
        self.flush()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, where a state dict without the engine's ``_extra_state`` (one saved from
        torch DDP, ``ddp.state_dict()``: the same ``module.`` keys) loads too, even with
        ``strict``: the engine then keeps its own state."""
        if not strict or "_extra_state" in state_dict:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k != "_extra_state"]
        if missing or result.unexpected_keys:
            problems = []
            if result.unexpected_keys:
                problems.append("Unexpected key(s) in state_dict: "
                                + ", ".join(f'"{k}"' for k in result.unexpected_keys))
            if missing:
                problems.append("Missing key(s) in state_dict: "
                                + ", ".join(f'"{k}"' for k in missing))
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               + "\n\t".join(problems))
        return type(result)(missing, result.unexpected_keys)

    def get_extra_state(self) -> dict:
        if self.optimizer is not None:
            self.optimizer._settle_scales()
        return {"engine": self.grad_sync.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.flush()  # loading replaces what pending updates would have changed
        self.grad_sync.load_state_dict(state["engine"])


class DataParallelMultiGPU(torch.nn.Module):
    """The module side of :class:`heatlike.optim.DASO` (Heat's name; any device, any rank
    layout).

    Broadcasts rank 0's parameters and buffers to every rank, averages gradients inside each node
    (the topology's node communicator, the engine's bucketed GradientSync) on the batches DASO's
    schedule asks for, and hands the module to the optimizer, which synchronizes parameters
    between nodes. During DASO's gradient warmup (``DASO.gradient_warmup``) a second
    GradientSync averages the gradients over the whole communicator in DASO's wire type
    instead; it is dropped when the warmup ends.
    """

    def __init__(self, module: torch.nn.Module, optimizer: DASO,
                 comm: MPICommunication | None = None, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0) -> None:
        super().__init__()
        comm = sanitize_comm(comm if comm is not None else getattr(optimizer, "comm", None))
        error = None
        if not isinstance(module, torch.nn.Module):
            error = TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        elif not isinstance(optimizer, DASO):
            error = TypeError(f"optimizer must be a heatlike.optim.DASO, got "
                              f"{type(optimizer).__name__}")
        else:
            error = no_trainable_parameters(module, "DataParallelMultiGPU")
        raise_together(error, comm)
        _take_over(module, comm, "DataParallelMultiGPU")
        broadcast_module(module, comm)
        self.module = module
        self.optimizer = optimizer
        node = optimizer.topology
        self.grad_sync = None
        if node.local_size > 1:
            self.grad_sync = GradientSync(list(module.parameters()), node.node_comm,
                                          bucket_cap_mb, first_bucket_mb,
                                          on_backward_end=self._backward_end, fold_division=True)
        optimizer.set_model(module)
        # the warmup's gradient averaging over every rank, in DASO's wire type (DASO's module
        # docstring, "Warmup"); dropped when the warmup ends
        self.global_sync = None
        if optimizer.plans_gradient_warmup():
            codec = Cast(optimizer.cast_dtype) if optimizer.cast_dtype != torch.float32 else None
            self.global_sync = GradientSync(list(module.parameters()), optimizer.comm,
                                            bucket_cap_mb, first_bucket_mb, codec=codec,
                                            on_backward_end=self._global_backward_end,
                                            fold_division=True)
            optimizer.warmup_grads = self.global_sync
        self._in_wrapper = False  # inside forward(): the module's own hook leaves the work to it
        self._handle = module.register_forward_pre_hook(WrapperHook(self._module_pre_hook))
        # The global synchronizations in flight move on only inside MPI calls, and a phase of a
        # multi-phase exchange (the half-precision sum) starts only when its request is tested:
        # poll them before every leaf module's forward and after every gradient, so their bytes
        # cross the link during the batches between send and merge instead of in the merge's wait
        # (inside compiled code the leaves' polls are left out: they only help).
        leaves = [m for m in module.modules() if m is not module and not any(m.children())]
        self._poll_handles = [m.register_forward_pre_hook(WrapperHook(self._poll, optional=True))
                              for m in leaves] + \
            [on_gradient(p, self._poll, passive=True)
             for p in module.parameters() if p.requires_grad]
        remove_when_dropped(self, self._poll_handles[len(leaves):])

    def _module_pre_hook(self, _module, _args) -> None:
        if not self._in_wrapper:
            self._before_forward()

    def _before_forward(self) -> None:
        """Which synchronization this batch's backward pass runs (DASO's schedule); always
        run eagerly, before the module's forward, by :meth:`forward` or the module's hook."""
        self.optimizer._progress()
        warmup = self.optimizer.gradient_warmup
        if self.global_sync is not None and self.optimizer.warmup_grads is None:
            self.global_sync = None  # DASO closed it when the warmup ended
        if self.global_sync is not None:
            self.global_sync.enabled = warmup
        if self.grad_sync is not None:
            self.grad_sync.enabled = not warmup and (not self.training or
                                                     self.optimizer.local_sync_now())
        if self.training and torch.is_grad_enabled():
            for sync in (self.grad_sync, self.global_sync):
                if sync is not None:
                    sync.check_layout("DataParallelMultiGPU")

    def _poll(self, *_args) -> None:
        if self.optimizer._pending:
            self.optimizer._progress()

    def _backward_end(self) -> None:
        self.optimizer._progress()
        self.grad_sync.synchronize()

    def _global_backward_end(self) -> None:
        self.global_sync.synchronize()

    def close(self) -> None:
        """Collective: free the communicators of this wrapper's gradient synchronization and of
        its DASO optimizer (:meth:`heatlike.optim.DASO.close`), for programs that build many.
        Training afterwards raises RuntimeError; the module is a plain module again (its hooks
        are removed). Wrapping the module again closes the earlier wrapper this way."""
        if self.grad_sync is not None:
            self.grad_sync.close()
        self.global_sync = None  # DASO's warmup synchronization: DASO.close closes it
        self.optimizer.close()
        for handle in [self._handle, *self._poll_handles]:
            handle.remove()

    def forward(self, *args, **kwargs):
        run_eagerly(self._enter)
        try:
            return self.module(*args, **kwargs)
        finally:
            self._in_wrapper = False

    def _enter(self) -> None:
        self._before_forward()
        self._in_wrapper = True

    def _layout(self) -> dict:
        topology = self.optimizer.topology
        return {"world_size": self.optimizer.comm.size, "node_ids": list(topology.node_ids)}

    def get_extra_state(self) -> dict:
        return {"engine": self.grad_sync.state_dict() if self.grad_sync is not None else None,
                "warmup": self.global_sync.state_dict() if self.global_sync is not None
                else None, "layout": self._layout()}

    def set_extra_state(self, state: dict) -> None:
        """The engines' states; the node-local one only where the checkpoint was saved with the
        ranks on the same nodes (another node's plan would not match this node's ranks': it
        stays as built, as a checkpoint of another world size leaves it)."""
        layout = state.get("layout")
        same_nodes = layout is None or (
            int(layout["world_size"]) == self.optimizer.comm.size
            and [int(n) for n in layout["node_ids"]] == self._layout()["node_ids"])
        if self.grad_sync is not None and state.get("engine") is not None and same_nodes:
            self.grad_sync.load_state_dict(state["engine"])
        if self.global_sync is not None and state.get("warmup") is not None:
            self.global_sync.load_state_dict(state["warmup"])


class _WrapperCall:
    """The module's call inside :meth:`DataParallel.forward`: the deferred updates' mode around it
    (or none), and, should the module raise, the wrapper's state reset (its own hooks act again
    when the module is called directly)."""

    def __init__(self, model: DataParallel, mode: ApplyBeforeUse | None) -> None:
        self.model, self.mode = model, mode

    def __enter__(self) -> None:
        if self.mode is not None:
            self.mode.__enter__()

    def __exit__(self, kind, value, traceback) -> bool:
        if self.mode is not None:
            self.mode.__exit__(kind, value, traceback)
        if kind is not None:
            self.model._in_wrapper = False
            optimizer = self.model.optimizer
            if optimizer is not None and optimizer._pending:  # the rest stays guarded
                optimizer._arm_guard()
        return False


def _parameters_reached(output) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``output`` (tensors, nested in tuples, lists,
    dicts and dataclasses, as DDP looks for them) accumulates gradients into."""
    stack, seen, reached = [], set(), set()
    todo = [output]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                stack.append(item.grad_fn)
            elif item.requires_grad:
                reached.add(id(item))
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            todo.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return reached


def _wrappers_of(module: torch.nn.Module) -> list[DataParallel | DataParallelMultiGPU]:
    """The wrappers whose hooks are on ``module`` or one of its submodules (not closed)."""
    found: list = []
    for m in module.modules():
        for hook in m._forward_pre_hooks.values():
            owner = getattr(getattr(hook, "fn", None), "__self__", None)
            if isinstance(owner, (DataParallel, DataParallelMultiGPU)) and \
                    not any(owner is f for f in found):
                found.append(owner)
    return found


def _take_over(module: torch.nn.Module, comm: MPICommunication, name: str) -> None:
    """Collective over ``comm``: close the wrappers an earlier ``DataParallel`` or
    ``DataParallelMultiGPU`` left on ``module`` (or a submodule), so that a module wrapped again
    (a second training phase, a notebook cell run twice) is synchronized once, not once per
    wrapper it ever had. Each earlier wrapper must span the same ranks as ``comm`` (closing it is
    collective over its communicator): otherwise a clear error on every rank, nothing closed."""
    earlier = _wrappers_of(module)
    error = None
    for old in earlier:
        if not _same_ranks(old.comm if isinstance(old, DataParallel) else old.optimizer.comm,
                           comm):
            error = ValueError(f"the module is still wrapped by a {type(old).__name__} over "
                               f"other ranks than this {name}'s: close() that wrapper on its "
                               "ranks first")
            break
    raise_together(error, comm)
    agree_on({"earlier wrappers of the module": [type(old).__name__ for old in earlier]}, comm,
             name)
    for old in earlier:
        get_logger("heatlike.nn").info("%s: closing the earlier %s of this module (a module "
                                       "is wrapped once)", name, type(old).__name__)
        old.close()


def _same_ranks(a: MPICommunication, b: MPICommunication) -> bool:
    from mpi4py import MPI

    ga, gb = a.handle.Get_group(), b.handle.Get_group()
    try:
        return MPI.Group.Compare(ga, gb) in (MPI.IDENT, MPI.SIMILAR)
    finally:
        ga.Free()
        gb.Free()


def _ownership_error(module: torch.nn.Module,
                     optimizer: DataParallelOptimizer) -> ValueError | None:
    trainable = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    owned = {id(p) for p in optimizer.params_ref}
    missing = [n for i, n in trainable.items() if i not in owned]
    extra = len(owned - {id(p) for p in module.parameters()})
    if missing:
        return ValueError(f"the optimizer does not own the module's trainable parameters "
                          f"{missing[:5]}{' ...' if len(missing) > 5 else ''}: build the torch "
                          "optimizer from module.parameters()")
    if extra:
        return ValueError(f"the optimizer holds {extra} parameter(s) that are not parameters "
                          "of the module")
    return None
