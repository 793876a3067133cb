"""Deferred parameter updates applied as the next forward pass first uses each parameter.

A non-blocking :class:`~heatlike.optim.DataParallelOptimizer` records its update at ``step()``
and leaves the gradients' all-reduces in flight. During the next forward pass through
:class:`~heatlike.nn.DataParallel`, :class:`ApplyBeforeUse` (a ``TorchFunctionMode``) sees
every torch function call; the first call that takes a parameter whose update is pending waits
for that parameter's bucket and applies the bucket's update before the call runs. Later layers'
buckets stay in flight while earlier layers compute.

Watching uses rather than module calls is what makes this correct for any module: a module may
use a parameter of a submodule it never calls (``nn.MultiheadAttention`` passes
``out_proj.weight`` to ``F.multi_head_attention_forward``; tied weights are read through
another module), and a hook before each module's forward would let such a call run with the
old value. The cost is a Python call per torch function in a forward pass with updates
pending (about 2-3 us each on one CPU core).

Between ``step()`` and that forward pass, :class:`ApplyBeforeRead` (installed by ``step()``)
does the same for any code that reads a parameter with a pending update, or its gradient: a
regularizer computed before ``model(x)``, an ``AveragedModel`` (EMA) updated after ``step()``,
a norm logged between steps, the bare module's own ``zero_grad()``. Such a read waits for the
average and sees the updated values, as after a blocking step; calls that only read metadata
(shape, dtype, device, ...) and calls on other tensors (the next batch's loading) pass through,
so a loop that reads the parameters only in the forward pass keeps the overlap. It is a mode on
the calling thread's stack, taken off at the next forward pass through the wrapper, or when
nothing is pending any more.
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

from .hooks import run_eagerly

__all__ = ["ApplyBeforeUse", "ApplyBeforeRead", "drop_guard", "make_inert", "on_stack",
           "push_under", "remove_mode"]


class ApplyBeforeUse(TorchFunctionMode):
    """While active: before a torch function runs, apply the pending deferred updates of the
    buckets holding the parameters among its arguments (direct, or in a list or tuple
    argument). ``optimizer`` is the non-blocking DataParallelOptimizer, ``buckets`` its model's
    gradient buckets (``grad_sync.buckets``)."""

    def __init__(self, optimizer, buckets) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.owner = {id(p): b for b in optimizer._pending for p in buckets[b].params}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.owner:
            hit = _buckets_of(self.owner, args, kwargs)
            if hit:
                self._apply(hit)
        return func(*args, **kwargs)

    def _apply(self, hit: set) -> None:
        # (a graph break in code torch.compile traces: the update runs eagerly)
        run_eagerly(self.optimizer.apply, sorted(hit))
        pending = set(self.optimizer._pending)
        self.owner = {k: b for k, b in self.owner.items() if b in pending}


def _buckets_of(owner: dict, args: tuple, kwargs: dict) -> set | None:
    """The buckets (``owner``: parameter id -> bucket) of the parameters among ``args`` and
    ``kwargs``, direct or in a list or tuple."""
    hit = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, (list, tuple)):
            for t in a:
                b = owner.get(id(t))
                if b is not None:
                    hit = hit or set()
                    hit.add(b)
        else:
            b = owner.get(id(a))
            if b is not None:
                hit = hit or set()
                hit.add(b)
    return hit


# calls on a tensor that read none of its values: they may see a parameter whose update is pending
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "layout", "ndim", "names", "grad_fn",
    "is_cuda", "is_sparse", "is_meta", "is_quantized", "is_mkldnn", "is_nested", "size", "dim",
    "numel", "nelement", "element_size", "__len__", "data_ptr", "is_contiguous", "stride",
    "storage_offset", "is_floating_point", "is_complex", "get_device", "_version"})


def _metadata_only(func) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property: named by its descriptor
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name in _METADATA


class ApplyBeforeRead(ApplyBeforeUse):
    """:class:`ApplyBeforeUse` for the code between a deferred ``step()`` and the next forward
    pass (see the module docstring): reads of metadata pass through, and so does the
    optimizer's own work while it applies an update (``optimizer._applying``). It holds the
    optimizer weakly (a model dropped with an update pending is freed; the guard is then
    inert, and taken off the stack by the next :func:`drop_guard`). It sits at the bottom of
    the stack (:func:`push_under`), so a mode the program entered before ``step()`` and leaves
    after it is the one its ``__exit__`` takes off. An error of the update applied for a read
    (``check_finite``'s FloatingPointError) is kept for the next forward pass, where the other
    ranks meet it (``optimizer._read_error``); the read sees the parameters of the skipped
    step."""

    def __init__(self, optimizer, buckets) -> None:
        super().__init__(optimizer, buckets)
        self.optimizer = None  # (held weakly: _ref)
        self._ref = weakref.ref(optimizer)
        self.inert = False  # (make_inert, drop_guard: it passes every call from then on)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if torch.compiler.is_compiling():
            # looked up eagerly (a graph break): traced, ``owner`` gets a guard on every entry,
            # and the garbage collector may empty it (make_inert) between dynamo's trace and
            # its building of those guards, which then fails inside dynamo (KeyError)
            if not self.inert:
                run_eagerly(_before_read, self, func, args, kwargs)
        else:
            _before_read(self, func, args, kwargs)
        return func(*args, **kwargs)


def _before_read(guard: ApplyBeforeRead, func, args: tuple, kwargs: dict) -> None:
    """What ``guard`` does before ``func(*args, **kwargs)`` runs: apply the pending buckets of the
    parameters it reads (not for a metadata call, nor while the optimizer applies updates)."""
    if guard.owner:
        hit = _buckets_of(guard.owner, args, kwargs)
        if hit and not _metadata_only(func):
            optimizer = guard._ref()
            if optimizer is not None and not optimizer._applying:
                _apply_for_read(guard, optimizer, hit)


def _apply_for_read(guard: ApplyBeforeRead, optimizer, hit: set) -> None:
    """Apply the buckets ``hit`` for a read (``optimizer.apply`` also narrows the guard's
    ``owner`` to what is still pending). check_finite's error is kept for the next forward or
    ``flush()``, where the ranks that did not read meet theirs."""
    try:
        optimizer.apply(sorted(hit))
    except FloatingPointError as error:
        optimizer._read_error = error


def make_inert(guard: ApplyBeforeRead) -> None:
    """Let ``guard`` pass every call (its optimizer is gone). Never changes the mode stack: this
    runs from the garbage collector, which may run between torch's look at the stack and its
    use of it; the guard is taken off at the next :func:`drop_guard`."""
    guard.owner = {}
    guard.inert = True


def drop_guard(guard: ApplyBeforeRead) -> None:
    """Make ``guard`` inert and take it off this thread's stack where it can be (not inside its
    own call, nor from another thread); with it, every inert guard left on the stack."""
    guard.owner = {}
    guard.inert = True
    stack_at = getattr(torch._C, "_get_function_stack_at", None)
    if stack_at is None:
        return
    for i in reversed(range(torch._C._len_torch_function_stack())):
        mode = stack_at(i)
        if isinstance(mode, ApplyBeforeRead) and not mode.owner:
            remove_mode(mode)


def on_stack(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on this thread's torch function mode stack (not while its own
    ``__torch_function__`` runs: torch takes it off the stack meanwhile)."""
    stack_at = getattr(torch._C, "_get_function_stack_at", None)
    if stack_at is None:
        return False
    return any(stack_at(i) is mode for i in range(torch._C._len_torch_function_stack()))


def remove_mode(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's torch function mode stack wherever it is (the modes above
    it stay, in their order); False where it is not there or torch lacks the stack's calls."""
    if not on_stack(mode):
        return False
    above = []
    while True:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
    return True


def push_under(mode: TorchFunctionMode) -> None:
    """Put ``mode`` at the bottom of this thread's torch function mode stack (above a
    ``torch.set_default_device`` context, which must stay the lowest): the modes entered before
    (``with SomeMode():`` around the step) stay above it, so their ``__exit__``, which takes off
    the top of the stack, takes them off, not ``mode``."""
    if getattr(torch._C, "_get_function_stack_at", None) is None:
        mode.__enter__()
        return
    above = [torch._C._pop_torch_function_stack()
             for _ in range(torch._C._len_torch_function_stack())]
    # torch.set_default_device's DeviceContext must stay at the very bottom (its exit checks)
    if above and type(above[-1]).__name__ == "DeviceContext":
        torch._C._push_on_torch_function_stack(above.pop())
    torch._C._push_on_torch_function_stack(mode)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
