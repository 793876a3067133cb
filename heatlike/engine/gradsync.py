"""Bucketed, overlapped gradient synchronization.

:class:`GradientSync` averages the gradients of a list of parameters over the ranks of a
communicator while the backward pass is still running (the idea of PyTorch DDP):

1. The parameters are grouped into buckets in reverse registration order (roughly the order
   backward produces their gradients), see :func:`~heatlike.engine.buckets.plan_buckets`. At the
   start of the second cycle the buckets are rebuilt once in the order the gradients actually
   arrived on rank 0 during the first (broadcast, so every rank builds the same plan), parameters
   that got no gradient last: a parameter unused in most steps then no longer holds back the
   buckets after it.
2. A post-accumulate-grad hook on every parameter reports its gradient. The engine takes it
   (copies it into its bucket and sets the parameter's flag) once every post-accumulate-grad
   hook of that parameter has run, the user's own registered after the engine's included, so
   what is averaged is what they leave in ``.grad``: at once where the engine's hook is the
   parameter's last, else at its next event (the next parameter's hook, or the end of the
   backward pass). When every parameter of bucket k has been taken and
   buckets 0..k-1 have been launched, bucket k is launched: the codec and the reducer run as
   one non-blocking exchange (``heatlike.engine.exchange``). Launching strictly in bucket
   order keeps the sequence of collectives identical on all ranks whatever order the hooks
   fire in. Exchanges of several collectives (node-aware sums, staged chunks, multi-round
   codecs) run on private channels:
   bucket k on channel ``k % concurrent_buckets``, so up to that many are in flight at once;
   waiting for one bucket also advances the others.
3. At the end of the backward pass (an autograd callback), every parameter that has not reported
   is filled in: with its ``.grad`` if it has one (gradients accumulated under ``no_sync``),
   else zeros and flag 0; the remaining buckets are launched. No rank waits for a bucket another
   rank never sends.
4. ``wait(bucket)`` completes a bucket's exchange (the reducer's division by P included),
   ``unpack(bucket)`` makes the averages the parameters' ``.grad``. A parameter
   whose summed flag is 0 was used on no rank; its ``.grad`` stays as it was (None), so the
   optimizer skips it exactly as a single process would.

With ``grad_as_bucket_view`` (default) ``unpack`` sets ``.grad`` to the parameter's view of the
bucket buffer instead of copying into it, and the next backward accumulates straight into the
bucket, so the hook has nothing to copy either (DDP's ``gradient_as_bucket_view``). Whenever
``.grad`` is some other tensor (``zero_grad(set_to_none=True)`` followed by a backward, or a
gradient assigned by hand) the hook copies it, so results never depend on it.

*Sums in place.* Where the exchange is a plain sum (the identity codec and an ``AllReduce`` or
``Hierarchical`` reducer that adds: DataParallel, DDP's spelling, the centralized presets) of
buffers MPI reads directly (host memory, or device memory with a CUDA-aware library), a parameter
of at least :data:`INPLACE_MIN_BYTES` gets a bucket of its own (*solo*), and its gradient, when it
is a dense contiguous tensor of its own (what backward allocates), is divided and summed where it
is, in ``.grad``: no copy in, none out (Heat's and Horovod's unfused tensors). A tensor the user
still holds as that ``.grad`` then holds the average (as under DDP, which copies the average back
into ``.grad``). A gradient that shares its storage with another tensor (autograd gives the
parameters of a ``torch.cat`` one buffer), or that is already another parameter's gradient, is
copied instead. A rank without that gradient (unused here, or not contiguous) sums its bucket's
buffer as before; MPI does not mind which memory each rank passes. Buckets allocate their buffers
at first use, so a solo bucket whose gradient every rank has holds no memory: gradient memory is
the bare model's. The solo buckets' use flags cannot ride in a gradient, so they are summed by one
small all-reduce per cycle, started after the last bucket at the end of the backward pass; only a
rank that had no gradient for a solo parameter waits for it (a rank that had one knows that its sum
is positive). The values are those of the copying path: the same division, then the same sum;
bitwise with MPICH's all-reduce, whose grouping of the sums does not depend on the element count,
on one node and on two nodes of at most two ranks (an all-reduce that splits a message by its
length, as a ring does, may round the two paths' sums differently by a last bit, and so may larger
nodes, where a bucket's byte size chooses between the node-aware sum and MPI's, which group the
ranks differently; every rank still gets the same bits). On 2 ranks (a 256-1024-1024-10
MLP, 5.3 MB of gradients) the copy of the 5.2 MB bucket was most of DataParallel's cost beyond a
bare all-reduce (docs/ports.md, "Speed against Heat").

Hooks also ``Test`` the requests in flight, which lets MPI progress them during the backward pass.

*Forward order* (``hold_back``, set by DataParallel for deferred updates). Buckets launch in the
order backward fills them, the last layers first, and the links complete them in about that
order; the next forward pass needs them the other way round, the first layer first, and waits
for each as it reaches it. Where the links cannot carry everything during the backward pass, the
first layers' buckets, launched last, arrived last, and the forward pass could not start until
the whole backlog had crossed: the links then idled while it ran. So the buckets that would only
queue up are held back to the end of the backward pass and started there from the last launched
on: the forward pass finds its first layers' averages early and computes while the rest cross.
How many start as they fill is rank 0's choice from the last complete cycle (:func:`hold_from`:
the cycle's exchange rate, the times the buckets filled and the end of the backward pass),
agreed by a small all-reduce started at the end of each backward pass and taken at the start of
the next cycle, so the order of collectives is the same on every rank. Nothing is held in the
first cycles or where the exchanges keep up with the computation. The values are unchanged:
only the order in which the exchanges start. On the virtual cluster (4 ranks on 2 nodes,
1 Gbit/s) a residual MLP of fourteen 1.6 MB gradients stepped 4-8% faster non-blocking this way
(docs/data_parallel.md).

``check_finite=True`` checks every averaged bucket and raises ``FloatingPointError`` on every rank
when it holds a NaN or an infinity (after completing the cycle's other exchanges). The averages
are the same on every rank, and no codec hides a non-finite input (``heatlike.engine.codecs``),
so the verdict agrees everywhere without an extra reduction; the message also says whether this
rank's own gradients were finite.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.autograd.function import BackwardCFunction

from ..core import _nodereduce
from ..core import checks as _checks
from ..core._buffers import staged
from ..core._staging import chunk_bytes
from ..core.agreement import agree_on, raise_together
from ..core.communication import MPICommunication, Request, collecting, sanitize_comm
from ..core.env import env_int
from .buckets import Bucket, dense, plan_buckets
from .codecs import Codec, Identity, all_finite
from .exchange import Context, Lane
from .hooks import at_backward_end, last_active_hook, on_gradient, remove_when_dropped, run_eagerly
from .liveness import board_of
from .reducers import AllReduce, Reducer, divide

__all__ = ["GradientSync", "hold_from"]

MiB = 1 << 20
#: mean elements per parameter from which a bucket fuses the folded division with the copies
_FUSE_MIN_NUMEL = 8192
#: gradients of at least this many bytes get a bucket of their own, summed in place where the
#: exchange is a plain sum over memory MPI reads directly (module docstring, "Sums in place")
INPLACE_MIN_BYTES = 1 << 20
#: whether a synchronization of one rank with a lossless codec and a plain sum skips the engine
#: (:attr:`GradientSync.passthrough`); ``heatlike.bench`` clears it to time the engine's own
#: work on a rank without the network
ONE_RANK_PASSTHROUGH = True


_NESTING_CODE = {fn.__code__ for fn in (getattr(BackwardCFunction, "apply", None),
                                         getattr(BackwardCFunction, "apply_boxed", None))
                 if fn is not None}


def _enclosing_node() -> object | None:
    """The node of a custom autograd Function whose backward runs the backward pass this thread
    is in (a reentrant backward), or None in an outermost pass."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _NESTING_CODE:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _is_view_of(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    """Whether ``grad`` is the bucket's ``view`` of its parameter (a dense tensor at the same
    address; a sparse gradient never is)."""
    return grad is not None and grad.layout == torch.strided and grad.data_ptr() == view.data_ptr()


def _complete_all(requests: dict) -> None:
    """The finalizer of a gradient synchronization: its exchanges still in flight are completed
    where the synchronization is dropped at the same point on every rank (reference counting,
    the end of the program); when the garbage collector drops it, at a point of its own on
    every rank, they are handed to ``heatlike.core.checks.adopt`` instead (waiting there could
    wait for ranks that wait for this one)."""
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    if collecting():
        _checks.adopt(requests.values())
        return
    for request in requests.values():
        if not request.done:
            try:
                request.Wait()
            except (RuntimeError, TimeoutError):
                return  # the job is failing already (a peer ended or diverged): it was reported


def _phase(start: Callable[[], Request]):
    """Operation of one phase: the request ``start()`` returns, started inside a heatlike
    operation (where ``heatlike.core.checks`` does not verify it again)."""
    yield start()


def _sums_plainly(reducer: Reducer) -> bool:
    """Whether ``reducer`` is an all-reduce with an adding op (a sum or an average: the flat
    :class:`AllReduce` or :class:`~heatlike.engine.reducers.Hierarchical`, whose three phases
    also leave the sum in the tensor they are given), whose exchanges can sum a gradient in
    place."""
    return isinstance(reducer, AllReduce) and reducer.sums


def _summable_in_place(grad: torch.Tensor, bucket: Bucket, i: int) -> bool:
    """Whether ``grad`` can be summed where it is instead of in its place in the bucket
    (parameter ``i``): a dense contiguous tensor of the parameter's shape and the bucket's dtype
    and device, alone in its storage (no view of another tensor, no part of a buffer shared with
    others: their version counter is shared too, and in-flight checks would see one gradient's
    division as a change of the other), the gradient of this parameter only, with no autograd
    history (``create_graph``)."""
    return grad.layout == torch.strided and grad.dtype == bucket.dtype and \
        grad.device == bucket.device and grad.shape == bucket.params[i].shape and \
        grad.is_contiguous() and \
        grad._base is None and not grad.requires_grad and grad.storage_offset() == 0 and \
        grad.untyped_storage().nbytes() == grad.numel() * grad.element_size() and \
        _held_once(grad)


def _held_once(t: torch.Tensor) -> bool:
    """Whether ``t`` is held by one owner besides its Python object: the ``.grad`` of a single
    parameter, not also another's (a tensor assigned as two parameters' gradients). Python
    references (a user's variable) do not count; without torch's use count, never."""
    use_count = getattr(t, "_use_count", None)
    return use_count is not None and use_count() <= 2


class _CycleTiming:
    """When, in one cycle, each bucket filled (``ready``), the first exchange started, the
    backward pass ended (``end``) and the last wait for an exchange in flight ended
    (``waited``), in ``time.perf_counter`` seconds."""

    __slots__ = ("ready", "first_start", "end", "waited")

    def __init__(self, n: int) -> None:
        self.ready: list[float | None] = [None] * n
        self.first_start: float | None = None
        self.end: float | None = None
        self.waited: float | None = None


def hold_from(timing: _CycleTiming, nbytes: Sequence[int]) -> int:
    """How many buckets (in launch order) to start as they fill, from a cycle's ``timing``; the
    rest are held to the end of the backward pass and started from the last (module docstring,
    "Forward order"). The rate of the exchanges is the cycle's bytes over the time from the
    first start to the end of the last wait that found an exchange still in flight; without
    such a wait the exchanges kept up with the computation, and nothing is held. On one link
    of that rate, in launch order, bucket k starts when it fills or when bucket k - 1 is done:
    it starts as it fills where the link is then idle or it would be done by the end of the
    backward pass; the first bucket that is neither is the first held, with all after it."""
    n = len(nbytes)
    if timing.waited is None or timing.first_start is None or timing.end is None or \
            any(t is None for t in timing.ready):
        return n
    span = timing.waited - timing.first_start
    if span <= 0:
        return n
    rate = sum(nbytes) / span
    done = float("-inf")
    for k, (ready, size) in enumerate(zip(timing.ready, nbytes)):
        idle = done <= ready
        done = max(done, ready) + size / rate
        if not idle and done > timing.end:
            return k
    return n


class _Advancing:
    """A request to wait for whose ``Test`` first tests ``others``: the exchanges on other
    channels advance to their next collectives while this rank waits for one of them (an
    exchange's later collectives are issued only when its own request is tested). ``_req`` is
    the request waited for, where timeout reports look for the collective it waits in."""

    __slots__ = ("_req", "_others")

    def __init__(self, request: Request, others: list[Request]) -> None:
        self._req, self._others = request, others

    def Test(self, status=None) -> bool:
        for other in self._others:
            other.Test()
        return self._req.Test(status)


class GradientSync:
    """Average the gradients of ``params`` over ``comm``, bucket by bucket, during backward.

    ``on_backward_end`` (optional) runs after the end-of-backward launch, e.g. to wait for the
    results right away (blocking data parallelism). ``fold_division`` (with the identity codec
    and a plain ``AllReduce`` average of denominator P): each rank packs ``g / P`` and the
    all-reduce only sums, so the average is ``sum_r(g_r / P)`` (DDP's order; the same bits as
    ``sum_r(g_r) / P`` where P is a power of two), at no pass of its own.
    ``concurrent_buckets``: how many buckets' multi-collective exchanges may be in flight at once
    (private channels, opened at construction: at most one per bucket); 1 runs them one after
    another; default ``HEATLIKE_CONCURRENT_BUCKETS``, else 4. On the virtual cluster (2 nodes x
    2 ranks, 1 Gbit/s) a model of 13 buckets stepped about 10% faster non-blocking with 4 than
    with 1 (docs/multinode.md). ``inplace`` (default True): where the exchange is a plain sum
    over memory MPI reads directly, parameters of at least :data:`INPLACE_MIN_BYTES`
    (``HEATLIKE_INPLACE_MIN_KB`` KiB where set) get buckets of their own and their gradients
    are summed in ``.grad`` (module docstring, "Sums in place"); False plans buckets by the caps
    alone (DistOpt: SINGA's fused buffers). ``cap_numel``: every bucket holds at most this many
    elements (whatever their dtype) instead of the caps in MB.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 comm: MPICommunication | None = None, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, codec: Codec | None = None,
                 reducer: Reducer | None = None,
                 on_backward_end: Callable[[], None] | None = None,
                 grad_as_bucket_view: bool = True, hooks: bool = True, seed: int = 0,
                 check_finite: bool = False, names: Sequence[str] | None = None,
                 fold_division: bool = False, concurrent_buckets: int | None = None,
                 inplace: bool = True, cap_numel: int | None = None) -> None:
        self.comm = sanitize_comm(comm)
        error = None
        try:
            solo_kib = env_int("HEATLIKE_INPLACE_MIN_KB", None, minimum=1)
            if concurrent_buckets is None:
                concurrent_buckets = env_int("HEATLIKE_CONCURRENT_BUCKETS", 4, minimum=1)
            if not isinstance(concurrent_buckets, int) or isinstance(concurrent_buckets, bool) \
                    or concurrent_buckets < 1:
                raise ValueError(f"concurrent_buckets must be a positive int, got "
                                 f"{concurrent_buckets!r}")
        except ValueError as bad:
            error = bad
        raise_together(error, self.comm)  # a bad value on one rank must not leave others waiting
        self.concurrent_buckets = concurrent_buckets
        self.fold_division = fold_division
        self.check_finite = check_finite
        self._local_bad: dict[int, list[int]] = {}  # bucket -> its non-finite parameters here
        self.grad_as_bucket_view = grad_as_bucket_view
        self.seed = seed
        self.params = [p for p in params if p.requires_grad]
        self._per_element = cap_numel is not None
        self._caps = (cap_numel, cap_numel) if cap_numel is not None else \
            (int(bucket_cap_mb * MiB), int(first_bucket_mb * MiB))
        staged_params = any(staged(p) for p in self.params)
        # the plan gives large parameters buckets of their own where their gradients can be
        # summed in place (the reducer may change later: _begin decides per cycle)
        self._solo_bytes = (INPLACE_MIN_BYTES if solo_kib is None else solo_kib * 1024) if (
            inplace and self.comm.size > 1 and not staged_params and
            (codec is None or type(codec) is Identity) and
            (reducer is None or _sums_plainly(reducer))) else None
        agree_on({"parameters": [(tuple(p.shape), str(p.dtype)) for p in self.params],
                  "bucket caps": self._caps, "codec": repr(codec), "reducer":
                  None if reducer is None else (type(reducer).__name__,
                                                getattr(reducer, "op", None)),
                  "check_finite": check_finite, "seed": seed, "fold_division": fold_division,
                  "concurrent_buckets": concurrent_buckets, "in place": self._solo_bytes,
                  "staged through host memory": staged_params},
                 self.comm, "the gradient synchronization")
        self._plan(list(reversed(self.params)))
        self.codec = codec if codec is not None else Identity()
        self.reducer = reducer if reducer is not None else AllReduce(self.comm)
        if getattr(self.reducer, "mixes", False):
            raise ValueError("gradient buckets need a summing reducer, not gossip")
        self.lane = self._new_lane(self.reducer, self._pipelined())
        # one rank, a lossless codec and a plain sum or average: the exchange is the identity, so
        # there is nothing to do (no hooks, no copies, no collectives); .grad stays as backward
        # left it, which is what the average of one rank is
        self.passthrough = (ONE_RANK_PASSTHROUGH and self.comm.size == 1 and
                            type(self.codec) is Identity and
                            type(self.reducer) is AllReduce and
                            getattr(self.reducer, "op", None) in ("avg", "sum") and
                            not check_finite)
        self._exchanges = [0] * len(self.buckets)
        self.on_backward_end = on_backward_end
        self._cycles = 0
        self._arrival: list[int] = []  # indices into self.params, in gradient arrival order
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.names = list(names) if names is not None else \
            [f"parameter {i}" for i in range(len(self.params))]
        self._requests: dict[int, Request] = {}
        self._touching = False  # inside _engine_touches (drive() then leaves the buffers alone)
        self._flag_requests: dict[str, Request] = {}  # the solo buckets' flags ("flags")
        self._held: tuple[int, int] | None = None  # reported, to take at the next event
        self._contexts: dict[int, Context] = {}  # each bucket's last exchange (its support)
        # what the user may change while a bucket is in flight, to detect it (changed_in_flight):
        # the version counter of each launched bucket's buffer after the engine last touched it,
        # and each gradient that was copied into a bucket (not a bucket view) with its version at
        # the end of the backward pass
        self._versions: dict[int, int] = {}
        self._handed: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._viewed: set[tuple[int, int]] = set()  # gradients that are their bucket's view
        self._declared_unused: set[tuple[int, int]] = set()  # by mark_unused, this cycle
        # declared unused but not yet taken: their .grad is read at the backward's first
        # gradient (a zero_grad() between forward and backward must count), as DDP does
        self._unused_pending: list[tuple[int, int]] = []
        self._armed: dict[int, object] = {}  # outer-graph nodes hooked by _arm this cycle
        # bucket -> [(parameter, offset, residual)] of parameters without a gradient here
        self._idle: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        self._tampered: set[int] = set()
        self._reduced: set[int] = set()
        self._consumed: set[int] = set()
        self.active = False
        self.closed = False
        self.enabled = True
        self.unsynced = False  # gradients were produced under no_sync since the last sync
        self._callback_queued = False
        self.seen_backward = False  # this rank ran a synchronizing backward since participate()
        self._unconfirmed = False  # the cycle's step is posted, its verdict not yet taken
        self._hooks = [on_gradient(p, self._on_grad)
                       for p in self.params] if hooks and not self.passthrough else []
        remove_when_dropped(self, self._hooks)
        # parameter -> the id of the engine's post-accumulate-grad hook in its hook dictionary
        self._hook_ids = {id(p): h.id for p, h in zip(self.params, self._hooks)}
        self._board = board_of(self.comm)  # collective on a communicator's first sync
        self.on_begin: Callable[[], None] | None = None  # heatlike.nn.Join's notification
        # each cycle is a training step on the communicator's step board; heatlike.nn.Join
        # counts a DataParallel model's steps per iteration instead (several models may train)
        self.posts_steps = True
        self.tracker = None  # a heatlike.utils.Tracker: waits become "comm wait" spans
        # holding back (module docstring, "Forward order"): set by DataParallel where the next
        # forward pass waits for the buckets one by one (deferred updates), the same on every rank
        self.hold_back = False
        self._hold_value = torch.zeros(1, dtype=torch.float64)
        self._hold_plan = -1  # the plan the value in flight was computed for
        self._hold_started = False  # this cycle's agreement has been started
        # requests still in flight when the program ends are completed, not left to MPI_Finalize
        weakref.finalize(self, _complete_all, self._requests)
        weakref.finalize(self, _complete_all, self._flag_requests)

    def _plan(self, order: list[torch.nn.Parameter], sizes: list[int] | None = None) -> None:
        self.buckets: list[Bucket] = plan_buckets(order, *self._caps, sizes=sizes,
                                                  solo_bytes=self._solo_bytes,
                                                  per_element=self._per_element)
        self._where = {id(p): (b.index, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._marked = [[False] * len(b.params) for b in self.buckets]
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._fold: float | None = None
        # where the division is folded, it is fused with each gradient's copy in buckets of
        # large parameters, and one pass over the bucket at its launch in buckets of small ones
        # (a torch call per tiny tensor costs more than the pass it saves); the same quotients
        self._fused = [b.size >= _FUSE_MIN_NUMEL * len(b.params) for b in self.buckets]
        # solo buckets (one parameter) sum in place in cycles that allow it (_inplace_now);
        # their use flags are summed together in _solo_flags, one entry per bucket
        self._solo = [self._solo_bytes is not None and len(b.params) == 1 and
                      b.size * b.itemsize >= self._solo_bytes for b in self.buckets]
        self._plans = getattr(self, "_plans", 0) + 1
        self._hold_from = len(self.buckets)  # buckets from this one on are held (this cycle)
        self._held_back: list[int] = []
        self._timing: _CycleTiming | None = None  # this cycle's, where held back
        self._last_timing: _CycleTiming | None = None  # the last cycle's
        self._solo_flags = torch.zeros(len(self.buckets), dtype=torch.float32)
        self._solo_view = self._solo_flags.numpy()
        self._inplace_now = False
        self._payload: dict[int, torch.Tensor] = {}  # bucket -> the .grad it sums in place
        self._flags_started = False  # the solo flags' sum of this cycle has been started
        self._finite_started = self._finite_checked = False  # (check_finite's verdict)
        self._finite_flag = torch.zeros(1)

    def _rebuild(self) -> None:
        """Collective (once, at the start of the second cycle): re-plan the buckets in rank 0's
        observed gradient order."""
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        order = self.comm.bcast(order, root=0)  # checked: a rank elsewhere raises, no hang
        self._plan([self.params[i] for i in order])
        # the new plan may have another number of buckets; each has had one exchange per cycle
        self._exchanges = [self._cycles - 1] * len(self.buckets)
        self._restage()

    def _restage(self) -> None:
        """Collective (the same on every rank), after a re-plan: a new bucket that is staged
        through host memory in several chunks needs the lane that pipelines them (a private
        channel); an unneeded one costs nothing and stays."""
        if not self.lane.private and self._pipelined():
            self.lane = self._new_lane(self.reducer, True)

    def _new_lane(self, reducer: Reducer, pipelined: bool) -> Lane:
        """Collective: the lane of the bucket exchanges. Where they run on private channels
        (multi-phase: node-aware sums, staged chunks, multi-round codecs), up to
        ``concurrent_buckets`` of them, one per channel, are in flight at once (a channel per
        bucket, at most that many): a bucket's exchange does not wait for the one launched
        before it, so the links carry several buckets' chunks between the rank's calls into
        MPI."""
        width = max(1, min(self.concurrent_buckets, len(self.buckets)))
        return Lane(self.codec, reducer, pipelined=pipelined, width=width)

    # -- the cycle: begin, mark, launch, wait, unpack, end --------------------------------------

    def _begin(self) -> None:
        if self.active or not self.buckets:
            return
        if self.on_begin is not None:
            self.on_begin()
        self._cycles += 1
        if self.posts_steps:
            # its verdict is taken before the cycle's first exchange (_launch_ready): across
            # nodes the reads wait for the other ranks' next MPI call, and at the start of a
            # backward pass they all compute
            self._board.post(defer=True)
            self._unconfirmed = True
        self._wait_flags()  # a cycle ended without its last bucket unpacked (an error)
        leftover = self._flag_requests.pop("finite", None)
        if leftover is not None and not leftover.done:
            leftover.Wait()
        if self._cycles == 2 and self._hooks and not self.codec.stateful:
            self._rebuild()
        self.active = True
        self._fold = self._fold_denominator()
        self._inplace_now = self._solo_bytes is not None and any(self._solo) and \
            type(self.codec) is Identity and _sums_plainly(self.reducer)
        self._payload.clear()
        if self.hold_back:
            self._take_holding()
        self._solo_view[:] = 0
        self._flags_started = False
        self._finite_started = self._finite_checked = False
        self._held = None
        self._callback_queued = False
        for marks in self._marked:
            marks[:] = [False] * len(marks)
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._requests.clear()
        self._reduced.clear()
        self._consumed.clear()
        self._handed.clear()
        self._viewed.clear()
        self._declared_unused.clear()
        self._unused_pending.clear()
        self._tampered.clear()
        for handle in self._armed.values():
            handle.remove()
        self._armed.clear()
        self._idle.clear()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            self.unsynced = True
            return
        self._begin()
        if not self._callback_queued:
            self.seen_backward = True
            self._arm()
        b, i = self._where[id(p)]
        if self._cycles == 1 and not self._marked[b][i]:
            self._arrival.append(self._index[id(p)])
        if (b, i) in self._declared_unused:
            raise RuntimeError(
                f"{self.names[self._index[id(p)]]!r} received a gradient although the forward's "
                "output does not reach it (find_unused_parameters launched its bucket without "
                "it): a loss term outside the forward pass, or a second forward before this "
                "backward. Build DataParallel without find_unused_parameters (correctness never "
                "needs it)")
        if self._marked[b][i] or self._held == (b, i):
            inner = _enclosing_node() is not None
            raise RuntimeError(
                f"{self.names[self._index[id(p)]]!r} received a second gradient before the "
                "previous ones were used: "
                + ("it is used in several blocks run by a reentrant torch.utils.checkpoint (each "
                   "block's backward is a pass of its own): checkpoint with use_reentrant=False"
                   if inner else
                   "run optimizer.step() between backward passes, or accumulate inside "
                   "model.no_sync()"))
        self._take_held()
        self._held = (b, i)
        if last_active_hook(p, self._hook_ids[id(p)]):
            self._take_held()  # no hook after the engine's changes .grad: final now
        self._take_unused()
        self._launch_ready()
        self._progress()

    def _arm(self) -> None:
        """Queue the end-of-backward launch on the outermost backward pass. A gradient can arrive
        in a backward pass that a custom autograd Function's backward runs inside another (the
        reentrant ``torch.utils.checkpoint``): that inner pass ends before the outer one has
        computed the other gradients, so its end is no end of the cycle. There the Function's
        node in the outer graph gets a hook that arms again once its backward has returned,
        in the outer pass (which may itself be nested)."""
        node = _enclosing_node()
        if node is None:
            self._callback_queued = True
            at_backward_end(self._backward_done)
        elif id(node) not in self._armed:
            self._armed[id(node)] = node.register_hook(
                lambda _inputs, _outputs: None if self._callback_queued else run_eagerly(self._arm))

    def _take_held(self) -> None:
        """Take the gradient reported last: every post-accumulate-grad hook of its parameter has
        run since (the engine's is the first of them when it was registered first)."""
        if self._held is not None:
            b, i = self._held
            self._held = None
            self._mark(b, i, self.buckets[b].params[i].grad)

    def _fold_denominator(self) -> float | None:
        """The average's denominator when the division is folded into packing (``fold_division``,
        an identity codec, a plain average): each gradient is divided as it is copied into its
        bucket (a bucket of small parameters: in one pass when it is launched), so the division
        costs no pass of its own, or one over hot data, and the reducer then only sums. Read
        once per cycle (``heatlike.nn.Join`` sets the denominator before a cycle begins), so the
        same on every rank."""
        reducer = self.reducer
        if not self.fold_division or type(self.codec) is not Identity or \
                not isinstance(reducer, AllReduce) or reducer.op != "avg" or \
                reducer.divide_before:
            return None
        return reducer.denom

    def _mark(self, b: int, i: int, grad: torch.Tensor | None) -> None:
        bucket = self.buckets[b]
        solo = self._inplace_now and self._solo[b]
        if grad is None:
            bucket.views[i].zero_()
        else:
            fuse = self._fold is not None and self._fused[b]
            # a bucket summed in place is never allocated unless a rank needs it
            if bucket.materialized and _is_view_of(grad, bucket.views[i]):
                if fuse:
                    divide(bucket.views[i], self._fold)
                self._viewed.add((b, i))
            elif solo and _summable_in_place(grad, bucket, i):
                if fuse:
                    divide(grad, self._fold)
                self._payload[b] = grad
            else:
                view = bucket.views[i]
                if fuse:
                    divide(dense(grad), self._fold, out=view)
                else:
                    view.copy_(dense(grad))
                self._handed[(b, i)] = (grad, -1)
        if solo:
            self._solo_view[b] = 0 if grad is None else 1
        else:
            bucket.set_flag(i, 0 if grad is None else 1)
        self._marked[b][i] = True
        self._ready[b] += 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next].params):
            if self._unconfirmed:
                self._confirm_step()
            bucket = self.buckets[self._next]
            if self._timing is not None:
                self._timing.ready[self._next] = time.perf_counter()
            if self._next >= self._hold_from:
                self._held_back.append(bucket.index)
            else:
                self._start(bucket)
            self._next += 1

    def _confirm_step(self) -> None:
        """The step board's verdict on this cycle (posted deferred in :meth:`_begin`), taken
        before its first exchange. Where it raises (a rank ended, or runs another step), the
        cycle is over before anything of it was issued, as when the verdict was taken at its
        start: a later ``synchronize()`` or ``close()`` starts no exchange of it."""
        try:
            self._board.confirm()
        except BaseException:
            self.active = False
            raise
        self._unconfirmed = False

    def _start(self, bucket: Bucket) -> None:
        if self._timing is not None and self._timing.first_start is None:
            self._timing.first_start = time.perf_counter()
        self._requests[bucket.index] = self._exchange(bucket)
        self._versions[bucket.index] = self._payload_of(bucket.index)._version

    def _start_held(self) -> None:
        """At the end of the backward pass: the held buckets, the last launched first (the
        order in which the next forward pass uses them)."""
        for b in reversed(self._held_back):
            self._start(self.buckets[b])
        self._held_back.clear()

    def _take_holding(self) -> None:
        """At the start of a cycle: the number of buckets to start as they fill in this cycle,
        as agreed at the end of the last backward pass (:meth:`_agree_on_holding`)."""
        request = self._flag_requests.pop("hold", None)
        agreed = len(self.buckets)
        if request is not None:
            if not request.done:
                _checks.wait(request, lambda: "the agreement on held gradient buckets",
                             request._board, request._seq, watch=self._board.check)
            if self._hold_plan == self._plans:
                agreed = int(self._hold_value[0])
        self._hold_from = min(max(agreed, 0), len(self.buckets))
        self._last_timing, self._timing = self._timing, _CycleTiming(len(self.buckets))
        self._held_back.clear()
        self._hold_started = False

    def _agree_on_holding(self) -> None:
        """At the end of the backward pass, once per cycle on every rank (after its exchanges,
        so after the step's verdict): start agreeing on the holding of the next cycle, rank 0's
        choice from the last complete cycle (:func:`hold_from`), summed over the ranks so that
        every rank gets it. One small all-reduce per cycle, complete long before the next cycle
        takes it."""
        self._hold_started = True
        value = 0
        if self.comm.rank == 0:
            value = len(self.buckets)
            if self._last_timing is not None:
                value = hold_from(self._last_timing, [b.nbytes for b in self.buckets])
        self._hold_value = held = torch.tensor([float(value)], dtype=torch.float64)
        self._hold_plan = self._plans
        reducer = self.reducer  # (the request, kept past the cycle, must not hold this object)
        self._flag_requests["hold"] = Request(_phase(lambda: reducer.start_flags(held)))

    def _payload_of(self, b: int) -> torch.Tensor:
        """The tensor bucket ``b``'s exchange writes this cycle: a gradient summed in place, else
        the bucket's buffer."""
        payload = self._payload.get(b)
        return self.buckets[b].buffer if payload is None else payload

    def _parts(self, b: int) -> list[torch.Tensor]:
        """Bucket ``b``'s values per parameter, where this cycle's exchange sums them."""
        payload = self._payload.get(b)
        return self.buckets[b].views if payload is None else [payload]

    def _flag(self, b: int, i: int) -> float:
        """Parameter i of bucket b's use flag (this rank's, or the sum once exchanged)."""
        if self._inplace_now and self._solo[b]:
            return float(self._solo_view[b])
        return float(self.buckets[b].flags[i])

    def _wait_flags(self) -> None:
        """Complete the sum of the solo buckets' flags, if one is in flight."""
        request = self._flag_requests.pop("flags", None)
        if request is not None and not request.done:
            _checks.wait(request, lambda: "the sum of the gradient buckets' use flags",
                         request._board, request._seq, watch=self._board.check)

    def _exchange(self, bucket: Bucket) -> Request:
        b = bucket.index
        if self.check_finite:
            self._local_bad[b] = [self._index[id(p)] for p, v in zip(bucket.params, self._parts(b))
                                  if not all_finite(v)]
        state = self.codec.state_for(b)
        if self.codec.stateful:
            self._keep_idle_residuals(bucket, state)
        ctx = Context(key=b, shapes=[p.shape for p in bucket.params], size=self.comm.size,
                      rank=self.comm.rank, step=self._exchanges[b], seed=self.seed,
                      state=state)
        self._exchanges[b] += 1
        self._contexts[b] = ctx
        scaled = self._fold is not None
        if self._inplace_now and self._solo[b]:  # flags summed apart (_solo_flags)
            values = self._payload.get(b)
            if values is None:  # no gradient here, or one that could not be summed in place
                values = bucket.values
            if scaled and not self._fused[b]:
                divide(values, self._fold)
            return self.lane.start(values, ctx, scaled=scaled)
        bucket.publish_flags()
        if scaled and not self._fused[b]:
            divide(bucket.values, self._fold)
        if self.codec.carries_flags and getattr(self.reducer, "sums", True):
            return self.lane.start(bucket.buffer, ctx, scaled=scaled)
        return self.lane.start(bucket.values, ctx, bucket.flags, scaled=scaled)

    def _keep_idle_residuals(self, bucket: Bucket, state: dict) -> None:
        """Copy the residuals of the parameters without a gradient on this rank before the
        codec compresses them (their value is 0 + residual). If no rank had one, the exchange's
        result is not used (no ``.grad``: torch's optimizers skip the parameter), and
        :meth:`_restore_idle_residuals` puts the copies back: what the codec took out of them
        would otherwise be lost, not delayed (mlbench-core skips such a parameter altogether)."""
        kept = []
        for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            if self._flag(bucket.index, i) == 0:
                residual = self.codec.residual_in(state, i, offset, p.numel())
                if residual is not None:
                    kept.append((i, offset, residual.clone()))
        if kept:
            self._idle[bucket.index] = kept
        else:
            self._idle.pop(bucket.index, None)

    def _restore_idle_residuals(self, bucket: Bucket, summed: Sequence[float]) -> None:
        for i, offset, residual in self._idle.pop(bucket.index, ()):
            if summed[i] <= 0:
                now = self.codec.residual_in(self.codec.state_for(bucket.index), i, offset,
                                             residual.numel())
                if now is not None:
                    now.copy_(residual)

    def _pipelined(self) -> bool:
        """Whether a bucket's exchange has phases of its own: staged through host memory in
        several chunks, or summed through the node's shared memory (``_nodereduce``); such
        exchanges run one at a time on a private channel. The same on every rank: staging was
        agreed at construction, bucket sizes are equal."""
        if self.comm.size < 2:
            return False
        if any(staged(b.params[0]) and (b.nbytes > chunk_bytes() or
                                        _nodereduce.possible(b.buffer)) for b in self.buckets):
            return True
        host = any(not staged(b.params[0]) and
                   _nodereduce.possible_for(b.nbytes, b.params[0].dtype, b.params[0].device, False)
                   for b in self.buckets)
        return host and _nodereduce.one_node(self.comm)

    def set_reducer(self, reducer: Reducer) -> None:
        """Use ``reducer`` from the next cycle on. Collective, between steps: the old lane's
        private channels are freed and the new lane's opened."""
        if self.passthrough:
            raise RuntimeError("a one-rank gradient synchronization has no exchange whose "
                               "reducer could change")
        raise_together(RuntimeError("change the reducer between steps, not while gradients "
                                    "are being synchronized") if self.active else None,
                       self.comm)
        old, self.reducer = self.lane, reducer
        self.lane = self._new_lane(reducer, self._pipelined())
        old.close()

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank handed to collectives so far."""
        return self.reducer.bytes_sent

    def _progress(self) -> None:
        pending = [request for request in self._requests.values() if not request.done]
        if pending:
            self._engine_touches(lambda: [request.Test() for request in pending])

    def _engine_touches(self, operation: Callable[[], object]) -> None:
        """Run ``operation`` (steps of exchanges, which write their buckets' buffers), noting
        first whether anything else wrote the buffer of a bucket in flight since the engine last
        did. Every bucket in flight is checked, not only the one waited for: on a private lane an
        exchange starts once the one before it completes, so waiting for one bucket advances the
        exchanges of the buckets launched before it too."""
        flying = [b for b in self._requests if b not in self._reduced]
        for b in flying:
            buffer = self._payload_of(b)
            if buffer._version != self._versions.get(b, buffer._version):
                self._tampered.add(b)
        self._touching = True
        try:
            operation()
        finally:
            self._touching = False
        for b in flying:
            self._versions[b] = self._payload_of(b)._version

    def changed_in_flight(self, buckets: Iterable[int] | None = None) -> list[str]:
        """Names of the parameters whose gradient was changed in place, replaced or reset to
        None after it was handed to an exchange that has not been written back to ``.grad`` yet
        (the change would be lost or would corrupt the average), among ``buckets`` (default:
        all). Empty outside that window."""
        if not self.active:
            return []
        changed = set()
        for b in range(len(self.buckets)) if buckets is None else buckets:
            if b in self._consumed or b not in self._requests:
                continue
            bucket = self.buckets[b]
            payload = self._payload.get(b)
            if payload is not None:  # summed in .grad: any change to it or of it counts
                p = bucket.params[0]
                if p.grad is not payload or b in self._tampered or \
                        payload._version != self._versions[b]:
                    changed.add(self._index[id(p)])
                continue
            if b not in self._reduced and (b in self._tampered or
                                           bucket.buffer._version != self._versions[b]):
                changed.update(self._index[id(p)] for p in bucket.params if p.grad is not None)
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                handed = self._handed.get((b, i))
                grad = p.grad
                if handed is not None:
                    if grad is not handed[0] or grad._version != handed[1]:
                        changed.add(self._index[id(p)])
                elif (b, i) in self._viewed:  # reset to None or replaced
                    if grad is None or not _is_view_of(grad, view):
                        changed.add(self._index[id(p)])
                elif grad is not None and not _is_view_of(grad, view) and self._flag(b, i) > 0:
                    changed.add(self._index[id(p)])
        return [self.names[i] for i in sorted(changed)]

    def _backward_done(self) -> None:
        self.launch_all()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this gradient synchronization was closed (close()): its model "
                               "or optimizer no longer synchronizes; build a new one")

    def launch_filled(self) -> None:
        """Fill in every parameter that has not reported and start the buckets a backward pass
        starts as they fill (the held ones wait for :meth:`launch_all`), none of the collectives
        of the end of a backward pass. A rank out of inputs (``heatlike.nn.Join``) shadowing
        several models calls this for each before :meth:`launch_all` for each: the training
        ranks' backward pass starts every model's buckets before any model's end-of-backward
        callback starts its held buckets and flags, all on one communicator."""
        self._check_open()
        if self.passthrough:
            return
        self._begin()
        self._take_held()
        self._unused_pending.clear()  # taken below with every parameter not yet marked
        for b, bucket in enumerate(self.buckets):
            if self._ready[b] == len(bucket.params):
                continue
            for i, p in enumerate(bucket.params):
                if not self._marked[b][i]:
                    self._mark(b, i, p.grad)
        self._launch_ready()

    def launch_all(self) -> None:
        """Fill in every parameter that has not reported and launch every bucket (collective:
        all ranks must call it, which the end-of-backward callback and ``step`` ensure)."""
        self.launch_filled()
        if self.passthrough:
            return
        if self._timing is not None and self._timing.end is None:
            self._timing.end = time.perf_counter()
        self._start_held()
        if self.hold_back and not self._hold_started:
            self._agree_on_holding()
        if self._inplace_now and not self._flags_started:
            self._flags_started = True  # once per cycle on every rank, after every bucket
            # a phase of the engine's step, like the exchanges: not checked again at issue
            self._flag_requests["flags"] = Request(_phase(
                lambda: self.reducer.start_flags(self._solo_flags)))
        if self.check_finite and not self._finite_started:
            # once per cycle on every rank, after every bucket: how many ranks' own gradients
            # of this cycle were non-finite (each checked its own as they were packed)
            self._finite_started = True
            bad = any(self._local_bad.get(b) for b in range(len(self.buckets)))
            self._finite_flag = torch.tensor([1.0 if bad else 0.0])
            self._flag_requests["finite"] = Request(_phase(
                lambda: self.reducer.start_flags(self._finite_flag)))
        self.unsynced = False
        # the backward pass is over: from here on only the user changes these gradients (taken
        # now, as gradients that are views of one buffer share one version counter)
        for key, (grad, _) in self._handed.items():
            self._handed[key] = (grad, grad._version)

    def mark_unused(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Report ``params`` as getting no gradient in the coming backward pass (found by walking
        the autograd graph after forward), so their buckets can launch without waiting for the
        end of the backward pass. Their ``.grad`` (None, zeros, or what ``no_sync`` passes
        accumulated) is taken at the backward pass's first gradient, not now: the program may
        still call ``zero_grad()`` between forward and backward."""
        if not self.enabled or self.passthrough:
            return
        self._begin()
        for p in params:
            b, i = self._where[id(p)]
            if not self._marked[b][i] and (b, i) not in self._declared_unused:
                self._declared_unused.add((b, i))
                self._unused_pending.append((b, i))

    def _take_unused(self) -> None:
        """Take the gradients of the parameters declared unused (at the backward's first
        gradient; ``launch_all`` takes any left)."""
        for b, i in self._unused_pending:
            if not self._marked[b][i]:
                self._mark(b, i, self.buckets[b].params[i].grad)
        self._unused_pending.clear()

    def participate(self) -> None:
        """Called once per optimizer step on every rank: a rank that ran no synchronizing backward
        since the last step (no data, a loss without parameters, only ``no_sync`` passes) launches
        its buckets now, so ranks that did are not left waiting for it."""
        self._check_open()
        if not self.seen_backward or self.unsynced:
            self.launch_all()
        self.seen_backward = False

    @property
    def launched(self) -> bool:
        """Whether every bucket of the current cycle has been launched."""
        return self.active and self._next == len(self.buckets)

    def wait(self, b: int) -> None:
        """Complete the reduction of bucket ``b`` (its buffer then holds the averages)."""
        if b in self._reduced:
            return
        request = self._requests[b]
        if not request.done:
            waiting = self.tracker.span(f"bucket {b}", "comm wait") \
                if self.tracker is not None else contextlib.nullcontext()
            others = [r for k, r in self._requests.items() if k != b and not r.done]
            waitable = _Advancing(request, others) if others else request
            with waiting:
                self._engine_touches(lambda: _checks.wait(
                    waitable, lambda: f"the exchange of gradient bucket {b}", request._board,
                    request._seq, watch=self._board.check))
            if self._timing is not None:
                self._timing.waited = time.perf_counter()
        self._reduced.add(b)

    def unpack(self, b: int) -> list[torch.nn.Parameter]:
        """Write bucket ``b``'s averages into ``.grad`` of the parameters some rank used; returns
        those parameters."""
        if self.check_finite:
            self.agree_finite()
        self.wait(b)
        bucket = self.buckets[b]
        payload = self._payload.get(b)
        if self.check_finite and not all_finite(bucket.values if payload is None else payload):
            self._fail_nonfinite(bucket)
        if payload is not None:  # summed in place: this rank had the gradient, its sum is used
            p = bucket.params[0]
            if p.grad is not payload:
                p.grad = payload
            return self._consume(b, [p])
        if self._inplace_now and self._solo[b]:
            if not self._flags_started:  # launch_all (collective) starts it: never before
                raise RuntimeError("internal error: a gradient bucket was written back before "
                                   "the end of its backward pass")
            self._wait_flags()
            summed = [float(self._solo_view[b])]
        else:
            summed = bucket.summed_flags()
        if b in self._idle:
            self._restore_idle_residuals(bucket, summed)
        used = []
        with torch.no_grad():
            for p, view, flag in zip(bucket.params, bucket.views, summed):
                if flag <= 0:
                    continue
                in_bucket = _is_view_of(p.grad, view)
                if not in_bucket and self.grad_as_bucket_view and p.is_contiguous():
                    try:
                        p.grad = view
                    except RuntimeError as e:  # torch refuses a gradient of another dtype
                        self._refuse_converted(p, bucket, e)
                elif not in_bucket:
                    if p.grad is None or p.grad.layout != torch.strided:
                        p.grad = torch.empty_like(p)  # a sparse gradient's average is dense
                    p.grad.copy_(view)
                used.append(p)
        return self._consume(b, used)

    def _refuse_converted(self, p: torch.nn.Parameter, bucket: Bucket, error: Exception) -> None:
        """Raise the clear error for a parameter converted on its own after the buckets were
        planned (``model.fc1.double()``: the forward's check looks at each bucket's first
        parameter only), else ``error`` as it is."""
        if p.dtype == bucket.dtype and p.device == bucket.device:
            raise error
        raise RuntimeError(
            f"{self.names[self._index[id(p)]]!r} was converted after its gradient bucket was "
            f"planned ({bucket.dtype} on {bucket.device} then, {p.dtype} on {p.device} now): "
            "convert the module (.double(), .to(...)) before wrapping it") from error

    def _consume(self, b: int, used: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        for i in range(len(self.buckets[b].params)):
            self._handed.pop((b, i), None)
            self._viewed.discard((b, i))
        self._consumed.add(b)
        if len(self._consumed) == len(self.buckets):
            self._wait_flags()
            self.active = False
        return used

    def drive(self) -> None:
        """Advance this cycle's exchanges in flight without waiting (called by the polled waits
        inside :func:`heatlike.core.checks.driving`, which the wrapper's forward puts around its
        own collectives): a rank waiting in another collective (the buffer broadcast) still
        issues the next phases of its multi-phase sums, which a rank that applied a deferred
        update early (a read after ``step()``) waits for."""
        if self.active and not self._touching and \
                any(not r.done for r in self._requests.values()):
            # (as the engine's own waits: the buffers it writes are noted as its writes)
            self._engine_touches(lambda: [r.Test() for r in list(self._requests.values())
                                          if not r.done])

    def agree_finite(self) -> None:
        """With ``check_finite``, before any bucket of the cycle is written back (:meth:`unpack`
        calls it, and a deferred ``step()``): the verdict of the sum every rank started after its
        last bucket (:meth:`launch_all`), whether some rank's own gradients of this cycle were
        non-finite. If so, this rank completes the exchanges, ends the cycle and raises
        FloatingPointError naming the parameters, with nothing written back. Each rank meets
        the verdict where it first writes a bucket back (the next forward, ``synchronize()``,
        ``step()``), with no collective in between, so the ranks stay in step whichever of
        these comes first on each (buckets checked one by one as the next forward used them
        were applied in that order: the finite ones used before the failing one were stepped).
        A sum that overflows from finite gradients is still caught bucket by bucket."""
        request = self._flag_requests.get("finite")
        if request is None or self._finite_checked:
            return
        if not request.done:
            _checks.wait(request, lambda: "the sum of the gradients' non-finite flags",
                         request._board, request._seq, watch=self._board.check)
        self._flag_requests.pop("finite", None)
        self._finite_checked = True
        if float(self._finite_flag[0]) == 0:
            return
        for b in range(len(self.buckets)):
            if b in self._requests:
                self.wait(b)
        for bucket in self.buckets:
            payload = self._payload.get(bucket.index)
            if not all_finite(bucket.values if payload is None else payload):
                self._fail_nonfinite(bucket)
        self.active = False
        raise FloatingPointError("non-finite gradients on some rank (check_finite)")

    def _fail_nonfinite(self, bucket: Bucket) -> None:
        """Complete the cycle's other exchanges, end the cycle, raise FloatingPointError."""
        for other in range(len(self.buckets)):
            if other in self._requests:
                self.wait(other)
        self.active = False
        bad = [self.names[self._index[id(p)]] for p, v in zip(bucket.params,
                                                              self._parts(bucket.index))
               if not all_finite(v)]
        mine = [self.names[i] for bs in self._local_bad.values() for i in bs]
        here = f"this rank's own gradients were non-finite in {mine[:5]}" if mine else \
            "this rank's own gradients were finite"
        raise FloatingPointError(f"non-finite averaged gradients of {bad[:5]}"
                                 f"{' ...' if len(bad) > 5 else ''} (check_finite); {here}")

    def synchronize(self) -> None:
        """Launch what is left, wait for every bucket and write all averages into ``.grad``."""
        self._check_open()
        if not self.active and not self.unsynced:
            return
        self.launch_all()
        for b in range(len(self.buckets)):
            if b not in self._consumed:
                self.unpack(b)

    def pending(self) -> list[int]:
        """Buckets of the current cycle whose averages have not been written to ``.grad``."""
        if not self.active:
            return []
        return [b for b in range(len(self.buckets)) if b not in self._consumed]

    def view_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s place in its bucket (``p``'s shape): a gradient written there and set as
        ``p.grad`` is exchanged without being copied in or out."""
        b, i = self._where[id(p)]
        return self.buckets[b].views[i]

    def support_of(self, p: torch.nn.Parameter) -> slice | torch.Tensor | None:
        """Where the last combined value of ``p`` can be nonzero, over ``p.view(-1)``: the
        slice or indices its codec reported (a sparsifier's selection: the bucket's support when
        ``p`` is alone in it, else the codec's part for ``p``), or None when it can be anywhere
        (a dense codec, a non-finite input, a shared bucket whose codec reports no parts)."""
        b, i = self._where[id(p)]
        ctx = self._contexts.get(b)
        if ctx is None or b not in self._consumed:
            return None
        if len(self.buckets[b].params) == 1:
            return ctx.support
        return ctx.parts[i] if ctx.parts is not None else None

    def check_layout(self, who: str) -> None:
        """RuntimeError when the parameters no longer have the dtype or device their buckets
        were planned for (``model.double()``, ``model.to(...)`` after ``who`` was built): their
        gradients could not be averaged in those buckets. One rank averages nothing: no check."""
        if self.passthrough:
            return
        for bucket in self.buckets:
            p = bucket.params[0]
            if p.dtype != bucket.dtype or p.device != bucket.device:
                raise RuntimeError(
                    f"the parameters were converted after {who} was built ({bucket.dtype} on "
                    f"{bucket.device} then, {p.dtype} on {p.device} now): convert the module "
                    f"(.double(), .to(...)) before building {who}")

    def buckets_of(self, params: Iterable[torch.nn.Parameter]) -> list[int]:
        """Indices of the buckets holding any of ``params`` (sorted)."""
        return sorted({self._where[id(p)][0] for p in params if id(p) in self._where})

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The bucket plan (parameter indices in bucket order), the cycle and per-bucket exchange
        counters (seeds of randomized codecs), the first cycle's gradient arrival order and the
        codec's state. Take it between steps."""
        order = [self._index[id(p)] for b in self.buckets for p in b.params]
        return {"cycles": self._cycles, "order": order,
                "sizes": [len(b.params) for b in self.buckets],
                "arrival": list(self._arrival) if self._cycles < 2 else [],
                "exchanges": list(self._exchanges), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the same parameters, in the same order). Collective when
        the saved bucket plan differs from the current one (every rank loads the same state)."""
        if self.active:
            raise RuntimeError("load the gradient synchronizer's state between steps, not "
                               "during a backward pass")
        order, sizes = list(state["order"]), list(state["sizes"])
        if sorted(order) != list(range(len(self.params))) or sum(sizes) != len(order):
            raise ValueError(f"the saved bucket plan covers {len(order)} parameters, this "
                             f"model has {len(self.params)} trainable parameters")
        params = [self.params[i] for i in order]
        # parameters compare by identity: == on tensors compares their values
        if [len(b.params) for b in self.buckets] != sizes or \
                [id(p) for b in self.buckets for p in b.params] != [id(p) for p in params]:
            self._plan(params, sizes)
            self._restage()
        self._cycles = int(state["cycles"])
        self._arrival = list(state["arrival"])
        self._exchanges = [int(n) for n in state["exchanges"]]
        self.codec.load_state_dict(state["codec"])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        """Collective, between steps: remove the hooks and free the private channel's
        communicators (rather than leave them to the garbage collector, which cannot free
        communicators safely; see heatlike.core.communication). A cycle in progress is completed
        first; gradients held back by ``enabled = False`` are dropped. The synchronizer is
        unusable afterwards."""
        if self.active:
            self.synchronize()
        request = self._flag_requests.pop("hold", None)
        if request is not None and not request.done:
            _checks.wait(request, lambda: "the agreement on held gradient buckets",
                         request._board, request._seq, watch=self._board.check)
        self.remove_hooks()
        self.lane.close()
        self.closed = True
