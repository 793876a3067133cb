"""MPICommunication: one wrapper over an mpi4py intracommunicator.

The upper-case methods mirror mpi4py's buffer interface (``Allreduce(sendbuf, recvbuf, op)``,
``Bcast(buf, root)``, ...) and accept numpy arrays, torch tensors (CPU and CUDA), cupy arrays and
``MPI.IN_PLACE`` where MPI allows it; a DNDarray stands for its local tensor (as in Heat). A
collective that concatenates or cuts (Allgather, Gather, Scatter, Alltoall and their v-forms)
works on the C order of each buffer viewed with its *axis* in front (Heat's ``axis`` /
``send_axis`` / ``recv_axis`` keywords, default 0): rank i's block is the i-th run of that order.
Counts and displacements of the v-forms count *slices along that axis* (rows of a buffer, as in
Heat; elements of a 1-D buffer); a v-form also takes a plain buffer, cut into equal blocks.

Guarantees (docs/communication.md):

* contiguous buffers are handed to MPI by address and never copied; non-contiguous ones are packed
  and unpacked without touching memory outside the view and without modifying the caller's tensor
  object;
* float16 / bfloat16 reductions give the numeric result with float32 accumulation (``_halfreduce``);
* every non-blocking method returns a :class:`Request` whose every completion path (``Wait``,
  ``wait``, ``Test``, ``test``, :func:`wait_all`) finalizes the result;
* CUDA buffers go to MPI directly when the library is CUDA-aware (``cuda_aware``), otherwise
  through pinned host memory; only the producing (current) stream is synchronized;
* bad arguments raise ``TypeError`` / ``ValueError`` naming the argument before anything is sent.

Methods not defined here (lower-case pickle-based ``bcast``/``allreduce``/..., ``Probe``, ...)
are forwarded to the underlying mpi4py communicator.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import pickle
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from . import _buffers, _launcher, _nodereduce, _requests, _staging
from . import _halfreduce as _half
from . import checks as _checks
from ._buffers import (
    IN_PLACE,
    as_tensor,
    bspec,
    direct,
    overlaps,
    readable,
    spec,
    sync_devices,
    vspec,
    writable,
)
from ._dtypes import _DIRECT as _DIRECT_TYPES
from ._dtypes import (
    HALF_DTYPES,
    direct_reduction_type,
    is_predefined_op,
    mpi_op,
    mpi_type,
    reduction_type,
)
from ._requests import Operation, Request, call, drive, test_all, wait_all
from .chunking import chunk_range, counts_displs

__all__ = [
    "MPICommunication",
    "MPI_WORLD",
    "MPI_SELF",
    "get_comm",
    "use_comm",
    "sanitize_comm",
    "Request",
    "wait_all",
    "test_all",
    "IN_PLACE",
]


# ---------------------------------------------------------------------------- argument checks


def _int_list(values: object, arg: str, size: int) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    elif isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"{arg} must be a sequence of {size} integers")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{arg} must contain integers, got {type(v).__name__}")
        out.append(int(v))
    if len(out) != size:
        raise ValueError(f"{arg} has {len(out)} entries, expected one per rank ({size})")
    return out


def _check_axis(axis: object, arg: str, name: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: {arg} must be an integer axis, got {type(axis).__name__}")
    return int(axis)


def _on_axis(t: torch.Tensor, obj: object, axis: int, arg: str, name: str) -> torch.Tensor:
    """``t`` viewed with ``axis`` swapped to the front (``transpose(0, axis)``, as Heat does): the
    collective cuts or concatenates along it. Only torch tensors and DNDarrays can be viewed
    along another axis than 0 (Heat raises TypeError for other buffers too)."""
    if axis == 0:
        return t
    if not isinstance(obj, torch.Tensor) and _buffers._local_tensor(obj) is None:
        raise TypeError(f"{name}: {arg} of type {type(obj).__name__} supports axis 0 only; pass "
                        "a torch tensor or DNDarray to cut or join along another axis")
    if not -t.dim() <= axis < t.dim():
        raise ValueError(f"{name}: axis {axis} is not an axis of {arg}, which has {t.dim()} "
                         "dimension(s)")
    return t.transpose(0, axis)


def _buffer(obj: object, arg: str, name: str, axis: int = 0, write: bool = False):
    """``(tensor, back)`` of a buffer (``as_tensor``) viewed along ``axis`` (``_on_axis``)."""
    t, back = as_tensor(obj, arg, write)
    return _on_axis(t, obj, axis, arg, name), back


def _row(t: torch.Tensor) -> int:
    """Elements per slice along the first axis (1 for 0-d and 1-d tensors)."""
    return int(np.prod(t.shape[1:], dtype=np.int64)) if t.dim() > 1 else 1


def _vbuffer(obj: object, arg: str, size: int, write: bool, name: str, axis: int = 0):
    """``(tensor, back, counts, displs)`` of a v-collective buffer: ``array`` (cut into ``size``
    equal blocks), ``(array, counts)`` or ``(array, counts, displs)`` with counts and
    displacements in slices along ``axis`` (default displacements: packed in rank order). The
    tensor is viewed along ``axis``; counts and displs are returned in elements of that view."""
    if isinstance(obj, (tuple, list)):
        if len(obj) not in (2, 3):
            raise TypeError(f"{name}: {arg} must be an array, (array, counts) or "
                            "(array, counts, displs)")
        t, back = _buffer(obj[0], arg, name, axis, write)
    else:
        t, back = _buffer(obj, arg, name, axis, write)
        n = t.numel()
        if n % size:
            raise ValueError(f"{name}: {arg} has {n} elements, not a multiple of the "
                             f"communicator size {size}; pass (array, counts, displs)")
        return t, back, [n // size] * size, [i * (n // size) for i in range(size)]
    counts = _int_list(obj[1], f"{arg} counts", size)
    if len(obj) == 3:
        displs = _int_list(obj[2], f"{arg} displs", size)
    else:
        displs = [0, *itertools.accumulate(counts[:-1])]
    rows = t.shape[0] if t.dim() else 1
    for i, (c, d) in enumerate(zip(counts, displs)):
        if c < 0 or d < 0 or d + c > rows:
            raise ValueError(f"{name}: {arg} block {i} (displacement {d}, count {c}) does not "
                             f"fit in a buffer of {rows} slices along its axis")
    row = _row(t)
    return t, back, [c * row for c in counts], [d * row for d in displs]


def _own_part(obj: object, arg: str, rank: int, size: int, write: bool, name: str,
              axis: int = 0) -> tuple[torch.Tensor, Callable | None]:
    """The buffer this rank sends (or receives) on the fixed-size side of a v-collective: the
    whole ``array``, or of ``(array, counts[, displs])`` the ``counts[rank]`` slices at
    ``displs[rank]`` along ``axis``."""
    if not isinstance(obj, (tuple, list)):
        return _buffer(obj, arg, name, axis, write)
    t, back, counts, displs = _vbuffer(obj, arg, size, write, name, axis)
    row = _row(t)
    if t.dim() == 0:
        return t, back
    return t.narrow(0, displs[rank] // row, counts[rank] // row) if row else t, back


def _same_dtype(send: torch.Tensor, recv: torch.Tensor, name: str) -> None:
    if send.dtype != recv.dtype:
        raise TypeError(f"{name}: sendbuf has dtype {send.dtype} but recvbuf has {recv.dtype}")


def _expect_numel(t: torch.Tensor, n: int, arg: str, name: str, why: str) -> None:
    if t.numel() != n:
        raise ValueError(f"{name}: {arg} has {t.numel()} elements, expected {n} ({why})")


def _expect_divisible(t: torch.Tensor, size: int, arg: str, name: str) -> None:
    if t.numel() % size:
        raise ValueError(f"{name}: {arg} has {t.numel()} elements, not a multiple of the "
                         f"communicator size {size}")


def _no_alias(send: torch.Tensor, recv: torch.Tensor, name: str) -> None:
    if send.is_contiguous() and recv.is_contiguous() and overlaps(send, recv):
        raise ValueError(f"{name}: sendbuf and recvbuf overlap; pass MPI.IN_PLACE as sendbuf "
                         "for an in-place operation")


_Tensor = torch.Tensor
_Op = MPI.Op
_fromaddress = MPI.buffer.fromaddress


def _direct_reduction(sendbuf, recvbuf, op: MPI.Op) -> tuple | None:
    """Buffer specs for a reduction whose buffers can go to MPI untouched: plain contiguous CPU
    tensors or C-contiguous numpy arrays of one dtype, a predefined op MPI computes exactly as
    heatlike defines it, no overlap. None sends the call down the general path, which also
    produces every error message. This is the hot path of small all-reduces, written out so that
    it costs about a microsecond."""
    if type(recvbuf) is _Tensor and not _buffers._stage_all:
        if type(op) is not _Op or not recvbuf.is_cpu or not recvbuf.is_contiguous() or \
                recvbuf.is_conj() or recvbuf.is_neg():
            return None
        table = _DIRECT_TYPES.get(op.py2f())
        dtype = recvbuf.dtype
        mtype = table.get(dtype) if table is not None else None
        if mtype is None:
            return None
        n, nbytes, rp = recvbuf.numel(), recvbuf.nbytes, recvbuf.data_ptr()
        if sendbuf is IN_PLACE:
            return IN_PLACE, [_fromaddress(rp, nbytes), n, mtype]
        if (type(sendbuf) is not _Tensor or not sendbuf.is_cpu or sendbuf.dtype is not dtype
                or sendbuf.numel() != n or not sendbuf.is_contiguous() or sendbuf.is_conj()
                or sendbuf.is_neg()):
            return None
        sp = sendbuf.data_ptr()
        if n and sp < rp + nbytes and rp < sp + nbytes:
            return None
        return [_fromaddress(sp, nbytes), n, mtype], [_fromaddress(rp, nbytes), n, mtype]
    r = direct(recvbuf, True)
    if r is None:
        return None
    rmem, n, dtype = r
    mtype = direct_reduction_type(dtype, op)
    if mtype is None:
        return None
    if sendbuf is IN_PLACE:
        return IN_PLACE, [rmem, n, mtype]
    s = direct(sendbuf, False)
    if s is None or s[2] is not dtype or s[1] != n:
        return None
    smem = s[0]
    sa, ra = smem.address, rmem.address
    if n and sa < ra + rmem.nbytes and ra < sa + smem.nbytes:
        return None
    return [smem, n, mtype], [rmem, n, mtype]


def _one_rank_local(comm: MPICommunication, send: torch.Tensor | None, recv: torch.Tensor,
                    back: Callable[[], None] | None) -> bool:
    """A reduction over one rank of buffers that would be staged (device memory without a
    CUDA-aware library) is its input: copied on the device (nothing when in place) instead of
    staged through host memory and handed to MPI. Whether it applies is the same on the rank
    that calls it, the only one. Returns whether it was done."""
    if comm.size != 1 or not (_buffers.staged(recv) or (send is not None and
                                                        _buffers.staged(send))):
        return False
    if send is not None:
        recv.copy_(send)
    if back is not None:
        back()
    return True


def _pipelines(recv: torch.Tensor, send: torch.Tensor | None, op: MPI.Op,
               settled: bool) -> bool:
    """Whether an all-reduce goes through the staging pipeline (``_staging``): staged buffers
    (device memory without a CUDA-aware library, or ``force_staging``) larger than one chunk,
    of a type MPI reduces itself with a predefined op (half types accumulate in float32
    elsewhere), on a call whose later chunks cannot interleave with other operations
    (``settled``: blocking, or a serial communicator). Only what every rank's call has in
    common decides (not a buffer's layout): every rank must stage alike and use the same
    ``HEATLIKE_STAGING_CHUNK_MB``."""
    return (settled and _buffers.staged(recv) and (send is None or _buffers.staged(send))
            and recv.dtype not in HALF_DTYPES and is_predefined_op(op)
            and recv.numel() * recv.element_size() > _staging.chunk_bytes())


def _heat_layout(sendbuf, recvbuf) -> None:
    """Heat's side effect of a reduction whose send and receive buffers are laid out differently
    (strides or storage offsets): a non-contiguous DNDarray buffer is left contiguous, its local
    tensor replaced by a contiguous copy holding the same values. Torch tensors are never modified
    (they are packed and unpacked instead)."""
    if sendbuf is IN_PLACE:
        return
    local = _buffers._local_tensor
    dnds = [b for b in (sendbuf, recvbuf) if local(b) is not None]
    if not dnds:
        return
    try:
        s, r = (as_tensor(b, "buffer")[0] for b in (sendbuf, recvbuf))
    except (TypeError, ValueError):
        return  # the operation itself reports it
    if s.stride() == r.stride() and s.storage_offset() == r.storage_offset():
        return
    for b in dnds:
        if not b.larray.is_contiguous():
            b.larray = b.larray.contiguous()


def _hold(request: MPI.Request, *objects) -> Operation:
    """A one-phase operation keeping ``objects`` (the caller's buffers) alive until done."""
    yield request


def _same_size_send(sendbuf, recv: torch.Tensor, name: str) -> torch.Tensor | None:
    """The send tensor of a collective whose ``sendbuf`` matches ``recvbuf`` element for element,
    or None for ``MPI.IN_PLACE``."""
    if sendbuf is IN_PLACE:
        return None
    send, _ = as_tensor(sendbuf, "sendbuf")
    _same_dtype(send, recv, name)
    _expect_numel(recv, send.numel(), "recvbuf", name, "the size of sendbuf")
    _no_alias(send, recv, name)
    return send


# Communicators whose wrapper the cyclic garbage collector found. The collector runs at an
# arbitrary point of a rank's program (an allocation), at different points on different ranks,
# and MPI_Comm_free may synchronize with the other members (MPICH's does for a communicator that
# used some of its collectives): a rank freeing there can wait for ranks that are waiting for it
# in another collective. So they are not freed there but kept here, and freed together later by
# ``_reclaim``, at the next creation of a communicator over ranks that include all their members,
# once every member has dropped them. A wrapper dropped by reference counting (at the same point
# of every rank's program) or freed explicitly (Free, ``with``) frees its communicator at once.
_UNFREED: list[tuple[str | None, MPI.Comm, object]] = []  # (key, handle, hub)
_collecting = [False]
_deferring = [False]  # dropping objects where freeing is not agreed: queue, as the collector


def _track_collection(phase: str, info: dict) -> None:
    _collecting[0] = phase == "start"


gc.callbacks.append(_track_collection)


def collecting() -> bool:
    """Whether the cyclic garbage collector is running (at an arbitrary point of this rank's
    program, not one every rank shares): finalizers must not communicate then."""
    return _collecting[0]


def _free_handle(handle: MPI.Comm, hub) -> None:
    if not MPI.Is_finalized() and handle != MPI.COMM_NULL:
        _checks.forget(handle)
        if _collecting[0] or _deferring[0]:
            _UNFREED.append((hub.key, handle, hub))
        else:
            handle.Free()


def _reclaim(comm: MPICommunication) -> None:
    """Collective over ``comm``: free the communicators the garbage collector dropped (kept in
    ``_UNFREED``) whose members all belong to ``comm`` and have all dropped them.

    First the ranks say whether any holds something a dropped model left (an all-reduce of two
    bytes; nothing more when none does); then :func:`_collect_dropped_models`, and every rank
    sends the keys of the communicators it holds (an all-gather; neither for a communicator of
    one rank); a communicator is freed where each of its members listed its key, in key order. Every
    member reads the same lists, so its members free it together, in the same order, as an
    explicit ``Free()`` would; one still alive on some member waits for a later call. Only
    communicators heatlike created from the world (or from one it created) have a key: the
    children of a communicator the program made itself are left to MPI_Finalize."""
    held = _held_within(comm)
    if comm.size == 1:  # this rank alone: nothing to agree on, and no other rank to drive
        lists = [set(held)]
    else:
        dropped = bool(held or _checks.ORPHANS or _checks.FINISHED)
        due = dropped and time.monotonic() - _last_collection[0] >= COLLECT_EVERY
        flags = np.array([dropped, due], dtype=np.int8)
        _checks.wait(comm.handle.Iallreduce(MPI.IN_PLACE, [flags, MPI.INT8_T], MPI.MAX),
                     lambda: f"freeing the communicators the garbage collector dropped on "
                             f"{comm!r}")
        if not flags[0]:
            return
        _collect_dropped_models(bool(flags[1]))
        held = _held_within(comm)
        lists = [set(keys) for keys in _checks.gather_objects(
            comm, sorted(held), "freeing the communicators the garbage collector dropped")]
    for key in sorted(held):
        entry, members = held[key]
        if all(key in lists[m] for m in members):
            _UNFREED.remove(entry)
            _, handle, hub = entry
            _release_hub_of(hub, f"freeing the dropped communicator {key}")
            handle.Free()


def _held_within(comm: MPICommunication) -> dict[str, tuple]:
    """The dropped communicators this rank holds whose members all belong to ``comm``: key ->
    (entry, their ranks in ``comm``)."""
    group = comm.handle.Get_group()
    held: dict[str, tuple] = {}
    try:
        for entry in list(_UNFREED):  # the collector may add to it meanwhile
            key, handle, _ = entry
            if key is None or handle == MPI.COMM_NULL:
                continue
            members_group = handle.Get_group()
            members = MPI.Group.Translate_ranks(members_group, list(range(handle.Get_size())),
                                                group)
            members_group.Free()
            if MPI.UNDEFINED not in members:
                held[key] = (entry, members)
    finally:
        group.Free()
    return held


#: at most one collection every that many seconds on a rank that holds something a dropped model
#: left (a full collection of a process that imported torch takes about 0.2 s); the collector's
#: own runs free the rest meanwhile
COLLECT_EVERY = 30.0
_last_collection = [float("-inf")]

#: seconds a creation waits for the exchanges dropped models left in flight before it frees
#: what it can (past it, they wait for the next creation)
ORPHAN_PATIENCE = 10.0


def _collect_dropped_models(collect: bool) -> None:
    """Part of :func:`_reclaim`, where some rank of the communicator holds something a dropped
    model left. With ``collect`` (some rank has not collected for :data:`COLLECT_EVERY`
    seconds: the same on every rank) the garbage collector runs on every rank at this same
    point, so every rank has found the same dropped models (their exchanges in flight adopted,
    their communicators queued), and those exchanges progress on every rank together until they
    complete (within :data:`ORPHAN_PATIENCE`); without, they are tested once. The completed
    ones are dropped where that only queues the communicators they ran on."""
    if collect:
        gc.collect()
        _last_collection[0] = time.monotonic()
        give_up = _last_collection[0] + ORPHAN_PATIENCE
        while _checks.ORPHANS and time.monotonic() < give_up:
            _checks.drive_orphans()
            if _checks.ORPHANS:
                time.sleep(1e-4)
    else:
        _checks.drive_orphans()
    if not _checks.FINISHED:
        return
    _deferring[0] = True
    try:
        _checks.FINISHED.clear()
        gc.collect()  # what the finished operations held in reference cycles
    finally:
        _deferring[0] = False


def _release_hub_of(hub, what: str) -> None:
    """Collective, as freeing the communicator: the node-local reduction's workspaces and the
    board heatlike keeps for it."""
    _nodereduce.release(hub)
    board = hub.board
    if board is not None:
        board.release(what)


def unfreed_communicators() -> int:
    """How many communicators whose last wrapper the cyclic garbage collector, not the program,
    dropped are not freed yet. heatlike frees them at the next creation of a communicator
    (``Dup``, ``Split``, ...) over ranks that include all their members, once every member has
    dropped them; those made from a communicator the program created itself are left to
    MPI_Finalize. ``Free()`` or a ``with`` block frees a communicator at once."""
    return len(_UNFREED)


def _blocks(whole: torch.Tensor | None, size: int) -> list[int] | None:
    """The equal blocks of a root's ``whole`` buffer (None elsewhere), in elements."""
    return None if whole is None else [whole.numel() // size] * size


def _rooted_layout(is_root: bool, own: torch.Tensor | None, whole: torch.Tensor | None,
                   counts: list[int] | None, root: int = 0) -> tuple:
    """``MPICommunication._agreed``'s layout of a rooted collective: ``own`` is the buffer this
    rank sends or receives (None: ``IN_PLACE`` at the root, whose part is ``counts[root]``),
    ``whole`` the root's buffer of every rank's part, ``counts`` (at the root) the element
    count the root's arguments give each rank."""
    if own is None:
        return counts[root], whole.dtype, counts
    return own.numel(), own.dtype, counts if is_root else None


class _Counted:
    """A receive request whose completion keeps its status (how much arrived), whichever
    completion call observes it; a caller's status is filled too."""

    __slots__ = ("req", "status")

    def __init__(self, req: MPI.Request) -> None:
        self.req, self.status = req, MPI.Status()

    def _done(self, status: MPI.Status | None) -> bool:
        if status is not None:
            status.Set_source(self.status.Get_source())
            status.Set_tag(self.status.Get_tag())
            status.Set_error(self.status.Get_error())
            status.Set_elements(MPI.BYTE, self.status.Get_count(MPI.BYTE))
        return True

    def Test(self, status: MPI.Status | None = None) -> bool:
        return self.req.Test(self.status) and self._done(status)

    def Wait(self, status: MPI.Status | None = None) -> None:
        self.req.Wait(self.status)
        self._done(status)

    def Cancel(self) -> None:
        self.req.Cancel()


# ---------------------------------------------------------------------------- method factories


_POINT_TO_POINT = {"Send", "Ssend", "Recv"}
_SAME_COUNT = {"Bcast", "Reduce", "Allreduce", "Scan", "Exscan", "Allgather", "Alltoall",
               "Gather", "Scatter", "Reduce_scatter_block", "Reduce_scatter"}
_SPLITS = {"Allgather", "Gather"}  # IN_PLACE: the whole receive buffer holds P blocks


def _checked(self: MPICommunication, gen: Callable[..., Operation], name: str, blocking: bool,
             args: tuple, kwargs: dict, direct: Callable[..., Operation | None] | None = None):
    """The path of every call while ``heatlike.core.checks`` is active, and of every collective
    on a watched communicator (one a gradient synchronization runs on): record the arrival in
    the communicator's board; on a watched board, called by the program itself (not as a phase
    of another heatlike operation), verify that no rank has ended or runs another training step
    at this position (``Board.verify``: of two ranks about to issue different collectives, at
    least one sees the other); check the signature across ranks in check mode; then run
    non-blocking and wait by polling (deadline, ranks that ended). ``direct`` (optional) starts
    the operation on the fast path, or returns None."""
    label = f"{name} on {self._name}"
    board, seq = None, 0
    if name not in _POINT_TO_POINT:
        board = self._arrival_board(name)
        if board is not None:
            seq = board.arrive(name)
            if self._hub.watched and _requests.depth == 0:
                board.verify(lambda: label)
            if _checks.checking():
                board.check(_signature(self, gen, name, args, kwargs))
                if name == "Alltoallv":
                    board.check_pairs(*_exchange_counts(self, gen, args, kwargs), label)
    op = direct(self, *args) if direct is not None else None
    if op is None:
        op = gen(self, *args, blocking=False, **kwargs)
    settled, _requests.settled = _requests.settled, blocking
    try:
        request = Request(op, label, board, seq)  # runs the operation up to its first phase
    finally:
        _requests.settled = settled
    if not blocking:
        return request
    # a blocking Recv's status is filled by the wait of the non-blocking form run here
    request.Wait(kwargs.get("status", args[3] if name == "Recv" and len(args) > 3 else None))
    return None


def _node_candidate(recvbuf) -> bool:
    """Whether an all-reduce into ``recvbuf`` is large enough that the node-local sum through
    shared memory may take it (``_nodereduce.applies`` decides, on the general path)."""
    return type(recvbuf) is _Tensor and recvbuf.nbytes >= _nodereduce.HOST_MIN_BYTES and \
        _nodereduce.host_enabled()


def _direct_allreduce(self: MPICommunication, sendbuf, recvbuf,
                      op: MPI.Op = MPI.SUM) -> Operation | None:
    if _node_candidate(recvbuf):
        return None
    specs = _direct_reduction(sendbuf, recvbuf, op)
    if specs is None:
        return None
    return _hold(self.handle.Iallreduce(specs[0], specs[1], op), sendbuf, recvbuf)


def _direct_bcast(self: MPICommunication, buf, root: int = 0) -> Operation | None:
    d = direct(buf, True)
    if d is None or type(root) is not int or not 0 <= root < self.size:
        return None
    return _hold(self.handle.Ibcast([d[0], d[1], mpi_type(d[2])], root), buf)


def _signature(self: MPICommunication, gen, name: str, args: tuple, kwargs: dict) -> tuple:
    """(operation, reduction op, root, dtype, element count, counts digest) of a collective
    call; -1 where ranks may legitimately differ. The digest covers the counts every rank must
    pass alike: ``Allgatherv``'s receive counts and displacements, ``Reduce_scatter``'s
    ``recvcounts``."""
    bound = inspect.signature(gen).bind(self, *args, blocking=False, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    op = a.get("op")
    root = a.get("root", -1)
    root = int(root) if isinstance(root, (int, np.integer)) and not isinstance(root, bool) \
        else -1
    data = None
    # off the root, Scatter's send buffer is ignored (a placeholder): sign with the receive one
    keys = ("recvbuf",) if name in ("Scatter", "Scatterv") and root != self.rank else \
        ("sendbuf", "buf", "recvbuf")
    for key in keys:
        value = a.get(key)
        if value is not None and value is not IN_PLACE:
            data, from_recv = value, key == "recvbuf"
            break
    dtype, count = -1, -1
    # an unreadable buffer leaves -1 (not compared): the call itself then raises the clear error
    if data is not None:
        with contextlib.suppress(TypeError, ValueError):
            t, _ = as_tensor(data[0] if isinstance(data, (tuple, list)) else data, "buffer")
            dtype = _checks.dtype_code(t.dtype)
            if name in _SAME_COUNT and not isinstance(data, (tuple, list)):
                count = t.numel()
                if from_recv and a.get("sendbuf") is IN_PLACE and name in _SPLITS:
                    count //= self.size
                if name == "Scatter" and not from_recv:
                    count //= self.size
    if name == "Alltoall" and not (a.get("send_axis") in (0, 1)
                                   and a.get("recv_axis") in (None, 0, 1)):
        count = -1  # sub-arrays of an uneven split: local sizes legitimately differ
    if name in ("Reduce_scatter", "Reduce_scatter_block") and a.get("sendbuf") is IN_PLACE:
        count = -1  # the receive buffer's size is the input size there, not the result's
    counts = None
    if name == "Allgatherv" and isinstance(a.get("recvbuf"), (tuple, list)):
        counts = a["recvbuf"][1:]
    elif name == "Reduce_scatter":
        counts = (a.get("recvcounts"),)
    return (_checks.opcode(name), op.py2f() if isinstance(op, MPI.Op) else 0,
            root if name in ("Bcast", "Reduce", "Gather", "Gatherv", "Scatter", "Scatterv")
            else -1, dtype, count, _digest(counts))


def _exchange_counts(self: MPICommunication, gen, args: tuple,
                     kwargs: dict) -> tuple[list[int] | None, list[int] | None]:
    """``Alltoallv``'s send and receive counts where the call names them (``(array, counts,
    ...)``; an ``IN_PLACE`` send takes the receive layout), None where it does not (equal
    blocks) or they cannot be read (the call itself then raises the clear error)."""
    bound = inspect.signature(gen).bind(self, *args, blocking=False, **kwargs)
    a = bound.arguments

    def counts(buf) -> list[int] | None:
        if not isinstance(buf, (tuple, list)) or len(buf) < 2:
            return None
        try:
            values = [int(c) for c in np.ravel(np.asarray(buf[1]))]
        except (TypeError, ValueError):
            return None
        return values if len(values) == self.size else None

    received = counts(a.get("recvbuf"))
    sendbuf = a.get("sendbuf")
    return (received if sendbuf is IN_PLACE else counts(sendbuf)), received


def _digest(lists) -> int:
    """A checksum of a tuple of integer sequences (or Nones), -1 for nothing or what cannot be
    read (the call itself then raises the clear error)."""
    if lists is None:
        return -1
    try:
        text = repr([None if v is None else [int(x) for x in np.ravel(np.asarray(v))]
                     for v in lists])
    except (TypeError, ValueError):
        return -1
    return zlib.crc32(text.encode())


def _operation(gen: Callable[..., Operation], blocking: bool, name: str, doc: str) -> Callable:
    """Make the public blocking (``name``) or non-blocking (``I``-name) method of an operation."""
    base = name if blocking else name[1].upper() + name[2:]  # "Isend": "Send"
    _checks.opcode(base)  # known by name in every process, for the check mode's messages
    collective = base not in _POINT_TO_POINT
    if blocking:
        def method(self, *args, **kwargs):
            hub = self._hub
            if _checks.active or (collective and hub.watched):
                return _checked(self, gen, base, True, args, kwargs)
            if collective and hub.count is not None:
                hub.count[0] += 1
            drive(gen(self, *args, blocking=True, **kwargs))
    else:
        def method(self, *args, **kwargs):
            hub = self._hub
            if _checks.active or (collective and hub.watched):
                return _checked(self, gen, base, False, args, kwargs)
            if collective and hub.count is not None:
                hub.count[0] += 1
            return Request(gen(self, *args, blocking=False, **kwargs), base)
    sig = inspect.signature(gen)
    params = [p for p in sig.parameters.values()
              if p.name != "blocking" and not p.name.startswith("_")]
    method.__signature__ = sig.replace(
        parameters=params, return_annotation="None" if blocking else "Request")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc if blocking else f"Non-blocking :meth:`{name[1:]}`; returns a Request."
    return method


def _pair(gen: Callable[..., Operation]) -> tuple[Callable, Callable]:
    name = gen.__name__.strip("_")
    public = {"sendrecv": "Sendrecv"}.get(name, name[0].upper() + name[1:])
    iname = "I" + public[0].lower() + public[1:]
    return (_operation(gen, True, public, gen.__doc__),
            _operation(gen, False, iname, gen.__doc__))


# ---------------------------------------------------------------------------- the wrapper


class MPICommunication:
    """A heatlike communicator over an mpi4py intracommunicator ``handle``.

    Communicators returned by :meth:`Split`, :meth:`Split_type`, :meth:`Create_group` and
    :meth:`Dup` are owned by their wrapper: :meth:`Free`, leaving a ``with`` block, or the last
    reference to the wrapper going away frees the MPI communicator. One that only the cyclic
    garbage collector finds is left to MPI_Finalize (:func:`unfreed_communicators`): freeing it
    at the arbitrary point where the collector runs could wait for ranks that wait for this one.
    """

    def __init__(self, handle: MPI.Intracomm = MPI.COMM_WORLD, *, serial: bool = False,
                 _owned: bool = False) -> None:
        if not isinstance(handle, MPI.Intracomm):
            raise TypeError(f"handle must be an mpi4py Intracomm, got {type(handle).__name__}")
        if handle == MPI.COMM_NULL:
            raise ValueError("handle is MPI.COMM_NULL")
        self.handle = handle
        self.serial = serial
        self._hub = _checks.hub(handle)  # board, watch state: shared by wrappers of the handle
        self.rank: int = handle.Get_rank()
        self.size: int = handle.Get_size()
        self._finalizer = weakref.finalize(self, _free_handle, handle, self._hub) \
            if _owned else None

    # -- basics ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"MPICommunication(rank={self.rank}, size={self.size})"

    @property
    def _name(self) -> str:
        """``repr(self)``, made once (it labels every collective on a watched communicator)."""
        name = self.__dict__.get("_repr")
        if name is None:
            name = self.__dict__["_repr"] = repr(self)
        return name

    def __getattr__(self, name: str):
        # only reached for names this class does not define: forward to mpi4py
        if name == "handle":
            raise AttributeError(name)
        return getattr(self.handle, name)

    # -- collectives of Python objects (mpi4py's lowercase calls, under heatlike's checks) -----

    def allgather(self, obj: object) -> list:
        """Collective: every rank's ``obj`` in rank order (mpi4py's ``allgather``). Unlike the
        raw mpi4py call it is watched like heatlike's own collectives: ``HEATLIKE_COMM_TIMEOUT``
        and ranks known to have ended raise instead of blocking, and a rank that meets another
        rank's different call here raises on every rank (:func:`heatlike.core.checks.
        gather_objects`)."""
        return self._objects(obj, "allgather")

    def bcast(self, obj: object = None, root: int = 0) -> object:
        """Collective: ``root``'s ``obj`` on every rank (mpi4py's ``bcast``), watched as
        :meth:`allgather` is: an all-gather in which the other ranks contribute ``None``, so
        ``root``'s object reaches every rank once. A root that is no rank raises ValueError on
        every rank, after the exchange (the root is in the call's label, so ranks that passed
        different roots raise there, on every rank)."""
        root = _checks.as_root(root)
        gathered = self._objects(obj if self.rank == root else None, f"bcast(root={root!r})")
        _checks.check_root(root, self.size)
        return gathered[root]

    def gather(self, obj: object, root: int = 0) -> list | None:
        """Collective: every rank's ``obj`` in rank order on ``root``, None elsewhere (mpi4py's
        ``gather``), watched as :meth:`allgather` is; only ``root`` holds the others' objects
        (:func:`heatlike.core.checks.gather_objects_to`)."""
        root = _checks.as_root(root)
        if self.size == 1:
            _checks.check_root(root, 1)
            return [pickle.loads(pickle.dumps(obj))]
        if _checks.checking():
            self._arrival_board(f"gather(root={root})")
        return _checks.gather_objects_to(self, obj, f"gather(root={root})", root)

    def allreduce(self, obj: object, op: MPI.Op = MPI.SUM) -> object:
        """Collective: ``obj`` combined over the ranks with ``op`` (mpi4py's ``allreduce``),
        watched as :meth:`allgather` is: every rank's object is gathered and combined in rank
        order with ``op`` (Python's arithmetic: ints exact, floats the same bits on every rank,
        any mix of types the ranks pass). A per-step flag is cheaper as an ``Allreduce`` of a
        one-element array."""
        name = _op_name(op)
        gathered = self._objects(obj, f"allreduce({name or 'op'})")
        result = gathered[0]
        for other in gathered[1:]:
            result = op(result, other)
        return result

    def any_rank(self, flag: bool) -> bool:
        """Collective: whether ``flag`` is true on any rank (one checked ``Allreduce`` of an
        int64: the per-step vote of skipping a non-finite step and the like)."""
        if self.size == 1:
            return bool(flag)
        value = np.array([1 if flag else 0], dtype=np.int64)
        self.Allreduce(MPI.IN_PLACE, value, MPI.MAX)
        return bool(value[0])

    def _objects(self, obj: object, what: str) -> list:
        if self.size == 1:  # a copy, as every rank's is (mpi4py's pickled round trip)
            return [pickle.loads(pickle.dumps(obj))]
        if _checks.checking():
            self._arrival_board(what)
        return _checks.gather_objects(self, obj, what)

    def _arrival_board(self, before: str = "a collective") -> _checks.Board | None:
        """The board of this communicator (``heatlike.core.checks``), None with a single rank.
        Collective on first use, before the collective ``before``: set up by the first
        collective called while checks are active, by the first gradient synchronization on it,
        or, for the world, at the start of ``python -m heatlike``."""
        if self.size < 2:
            return None
        hub = self._hub
        if hub.board is None:
            hub.board = _checks.Board(self)
        return hub.board.establish(before)

    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.size > 1

    def chunk(self, shape: Sequence[int], split: int | None, rank: int | None = None,
              w_size: int | None = None) -> tuple[int, tuple[int, ...], tuple[slice, ...]]:
        """Heat's ``chunk``: ``(offset, local_shape, slices)`` of ``rank``'s part of an array of
        global ``shape`` split along ``split`` (None: the whole array); the first
        ``shape[split] % size`` ranks hold one extra row."""
        shape = tuple(int(s) for s in shape)
        if split is None:
            return 0, shape, tuple(slice(0, s) for s in shape)
        if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
            raise TypeError(f"split must be an integer axis or None, got {type(split).__name__}")
        if not -len(shape) <= split < len(shape):
            raise ValueError(f"split {split} is not an axis of a shape of {len(shape)} "
                             "dimension(s)")
        split = int(split) % len(shape)
        for name, value in (("rank", rank), ("w_size", w_size)):
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, np.integer))):
                raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        rank = self.rank if rank is None else int(rank)
        size = self.size if w_size is None else int(w_size)
        start, stop = chunk_range(shape[split], size, rank)
        lshape = shape[:split] + (stop - start,) + shape[split + 1:]
        slices = tuple(slice(start, stop) if i == split else slice(0, s)
                       for i, s in enumerate(shape))
        return start, lshape, slices

    def counts_displs(self, n: int) -> tuple[list[int], list[int]]:
        """Counts and displacements of ``n`` elements distributed over the ranks."""
        return counts_displs(n, self.size)

    def counts_displs_shape(self, shape: Sequence[int], axis: int
                            ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Heat's: ``(counts, displs, output_shape)`` for a variable all-to-all along ``axis``:
        ``shape[axis]`` items spread over the ranks as by :meth:`chunk` (the first
        ``shape[axis] % size`` ranks one more), their displacements, and ``shape`` with
        ``size * counts[rank]`` along ``axis`` (a buffer receiving this rank's count from every
        rank). Local: no communication."""
        shape = tuple(shape)
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0
                   for s in shape):
            raise TypeError(f"shape must be a sequence of non-negative ints, got {shape!r}")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or \
                not -len(shape) <= axis < len(shape):
            raise ValueError(f"axis {axis!r} is not an axis of a shape of {len(shape)} "
                             "dimension(s)")
        counts, displs = counts_displs(int(shape[axis]), self.size)
        output = [int(s) for s in shape]
        output[axis] = self.size * counts[self.rank]
        return tuple(counts), tuple(displs), tuple(output)

    # -- Heat's helpers (kept for programs and tests written for Heat) --------------------------

    #: the largest count MPI's int-count calls take (heatlike itself sends larger buffers through
    #: mpi4py's large-count support and never needs :meth:`_handle_large_count`)
    COUNT_LIMIT = 2 ** 31 - 1

    @classmethod
    def _handle_large_count(cls, mpi_type: MPI.Datatype, elements: int
                            ) -> tuple[MPI.Datatype, int]:
        """Heat's workaround for a count beyond :attr:`COUNT_LIMIT`: ``(datatype, 1)`` where the
        committed derived ``datatype`` covers ``elements`` items of ``mpi_type`` (a vector of
        ``COUNT_LIMIT``-item blocks, and a struct adding the remainder when there is one). The
        caller frees the datatype. ValueError beyond ``COUNT_LIMIT ** 2`` items."""
        limit = cls.COUNT_LIMIT
        blocks, rest = divmod(int(elements), limit)
        if blocks > limit:
            raise ValueError(f"{elements} elements exceed the largest count a derived datatype "
                             f"can describe here ({limit} x {limit})")
        vector = mpi_type.Create_vector(blocks, limit, limit)
        if not rest:
            return vector.Commit(), 1
        extent = mpi_type.Get_extent()[1]
        whole = MPI.Datatype.Create_struct([1, rest], [0, blocks * limit * extent],
                                           [vector, mpi_type])
        vector.Free()
        return whole.Commit(), 1

    def _minmax_op(self, dtype: torch.dtype, total_count: int, shape: Sequence[int],
                   stride: Sequence[int], offset: int = 0) -> MPI.Op:
        """Heat's commutative op combining a packed ``[mins; maxs]`` buffer of ``2 *
        total_count`` elements of ``dtype``: the first half by minimum, the second by maximum.
        ``shape`` must hold ``2 * total_count`` elements; ``stride`` and ``offset`` are accepted
        for Heat's signature but not needed, since heatlike hands MPI packed buffers in C order.
        Free the op with ``op.Free()``."""
        n = int(total_count)
        if int(np.prod(tuple(shape), dtype=np.int64)) != 2 * n:
            raise ValueError(f"shape {tuple(shape)} does not hold 2 x total_count = {2 * n} "
                             "elements")

        # half-precision buffers reach user-defined ops as float32 (docs/communication.md)
        wire = torch.float32 if dtype in HALF_DTYPES else dtype

        def combine(inbuf, inoutbuf, _datatype) -> None:
            a = torch.frombuffer(inbuf, dtype=wire, count=2 * n).view(2, n)
            b = torch.frombuffer(inoutbuf, dtype=wire, count=2 * n).view(2, n)
            torch.minimum(a[0], b[0], out=b[0])
            torch.maximum(a[1], b[1], out=b[1])

        return MPI.Op.Create(combine, commute=True)

    def _check_root(self, root: object) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"root must be an integer rank, got {type(root).__name__}")
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of a communicator of size {self.size}")
        return int(root)

    def _check_peer(self, peer: object, arg: str, any_ok: bool = False) -> int:
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise TypeError(f"{arg} must be an integer rank, got {type(peer).__name__}")
        if peer == MPI.PROC_NULL or (any_ok and peer == MPI.ANY_SOURCE):
            return int(peer)
        if not 0 <= peer < self.size:
            raise ValueError(f"{arg} {peer} is not a rank of a communicator of size {self.size}")
        return int(peer)

    def _rooted_send(self, sendbuf, root: object, name: str, axis: int = 0
                     ) -> tuple[int, bool, torch.Tensor | None]:
        """``(root, is_root, send)`` for a collective whose root may pass ``MPI.IN_PLACE`` as
        ``sendbuf`` (``send`` is then None); ``send`` is viewed along ``axis``."""
        root = self._check_root(root)
        is_root = self.rank == root
        if sendbuf is IN_PLACE:
            if not is_root:
                raise ValueError(f"{name}: MPI.IN_PLACE as sendbuf is only valid at the root")
            return root, True, None
        return root, is_root, _buffer(sendbuf, "sendbuf", name, axis)[0]

    def _rooted_v_buffers(self, name: str, root: object, own: object, own_arg: str,
                          whole: object, whole_arg: str, axis: object,
                          recv_axis: object) -> tuple:
        """The checked arguments of ``Gatherv`` and ``Scatterv``: ``(root, is_root, own part,
        its write-back, whole buffer, its write-back, counts, displs)``. ``own`` is this rank's
        part (Gatherv's ``sendbuf``, Scatterv's ``recvbuf``; ``MPI.IN_PLACE`` at the root
        only), ``whole`` the root's ``(array, counts[, displs])`` (the other ranks' is
        ignored); counts are in slices along ``axis`` (the send side) and ``recv_axis``."""
        at = _check_axis(axis, "axis", name)
        recv_at = at if recv_axis is None else _check_axis(recv_axis, "recv_axis", name)
        own_write = own_arg == "recvbuf"
        own_at, whole_at = (recv_at, at) if own_write else (at, recv_at)
        root = self._check_root(root)
        is_root = self.rank == root
        mine = mine_back = None
        if own is IN_PLACE:
            if not is_root:
                raise ValueError(f"{name}: MPI.IN_PLACE as {own_arg} is only valid at the root")
        else:
            mine, mine_back = _own_part(own, own_arg, self.rank, self.size, own_write, name,
                                        own_at)
        full = full_back = counts = displs = None
        if is_root:
            full, full_back, counts, displs = _vbuffer(whole, whole_arg, self.size,
                                                       not own_write, name, whole_at)
            if mine is not None:
                _same_dtype(*((full, mine) if own_write else (mine, full)), name)
                _expect_numel(mine, counts[root], own_arg, name, f"{whole_arg} counts[root]")
                _no_alias(*((full, mine) if own_write else (mine, full)), name)
        return root, is_root, mine, mine_back, full, full_back, counts, displs

    def _agreed(self, name: str, check: Callable[[], tuple],
                layout: Callable[[tuple], tuple], root: object) -> tuple:
        """``check()``, the argument checks of a rooted collective, with their verdict shared
        before anything is sent. Some of those checks only one rank can make (the root's counts,
        displacements and buffers; a rank's own receive buffer), and whether a rank's buffer
        matches what the root expects of it needs both, so a failure would otherwise raise on
        one rank alone and leave the others waiting in the collective, or move the wrong number
        of elements without an error anywhere (a rank sending fewer than the root's count).

        ``layout(result)`` gives ``(own, dtype, expected)``: the element count this rank sends
        or receives, its dtype, and at the root the count it expects of every rank (None
        elsewhere). With P ranks the ranks sum one vector of 5P integers (a collective of its
        own, waited for at the call even in the non-blocking forms, so every rank issues its
        collectives in the program's order): slot r holds rank r's verdict, P + r its count,
        2P + r its count less the root's expectation, 3P + r its dtype's code less the root's
        and 4P + r one more than the ``root`` it names. A rank whose checks failed raises its
        error, every other rank a ValueError (TypeError, or RuntimeError for any other
        exception, where that was the first failing rank's error) naming the ranks that failed;
        ranks that name different roots (the ranks one names as root would otherwise not send
        or wait as the root, and the sums could still balance) raise ValueError on every rank,
        naming each rank's root; buffers that differ from the root's expectation raise
        ValueError on every rank, naming each such rank and its count."""
        error = None
        try:
            result = check()
            own, dtype, expected = layout(result)
            named = self._check_root(root)
        except Exception as exc:  # whatever it is, every rank must hear of it
            error = exc
        if self.size > 1:
            size, rank = self.size, self.rank
            mine = np.zeros(5 * size, dtype=np.int64)
            mine[rank] = 0 if error is None else 1 if isinstance(error, ValueError) else \
                2 if isinstance(error, TypeError) else 3
            if error is None:
                code = _checks.dtype_code(dtype)
                mine[size + rank] = own
                mine[2 * size + rank] += own
                mine[3 * size + rank] += code
                mine[4 * size + rank] = named + 1
                if expected is not None:
                    mine[2 * size:3 * size] -= np.asarray(expected, dtype=np.int64)
                    mine[3 * size:4 * size] -= code
            total = np.empty_like(mine)
            _checks.wait(self.handle.Iallreduce([mine, MPI.INT64_T], [total, MPI.INT64_T],
                                                MPI.SUM),
                         lambda: f"{name}'s argument check on {self._name}")
            verdicts = total[:size]
            failed = np.flatnonzero(verdicts).tolist()
            if failed and error is None:
                kind = {1: ValueError, 2: TypeError}.get(int(verdicts[failed[0]]), RuntimeError)
                raise kind(f"{name} on {self._name}: the arguments of rank(s) {failed} were "
                           "rejected there (the reason is raised on those ranks); nothing was "
                           "sent")
            if error is None:
                roots = total[4 * size:] - 1
                if (roots != named).any():
                    said = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(roots[:8]))
                    raise ValueError(f"{name} on {self._name}: the ranks name different roots "
                                     f"({said}{' ...' if size > 8 else ''}); nothing was sent")
                counts, gaps, kinds = (total[k * size:(k + 1) * size] for k in (1, 2, 3))
                wrong = np.flatnonzero(gaps).tolist()
                if wrong:
                    said = ", ".join(f"rank {r}: {int(counts[r])} (root expects "
                                     f"{int(counts[r] - gaps[r])})" for r in wrong[:5])
                    raise ValueError(f"{name} on {self._name}: the ranks' buffers do not hold "
                                     f"the element counts the root's arguments give them: "
                                     f"{said}{' ...' if len(wrong) > 5 else ''}; nothing was sent")
                mixed = np.flatnonzero(kinds).tolist()
                if mixed:
                    raise ValueError(f"{name} on {self._name}: rank(s) {mixed[:5]} pass a "
                                     "buffer of another dtype than the root's; nothing was sent")
        if error is not None:
            raise error
        return result

    # -- communicator management -------------------------------------------------------------

    def _owned(self, handle: MPI.Comm, serial: bool = False,
               group: tuple[int, ...] | None = None) -> MPICommunication | None:
        """Wrap ``handle``, just created from this communicator by a call every rank of it
        makes (of ``group`` only, for ``Create_group``), and name it among its members: this
        communicator's key and how many this one made (``Hub.key``; None below a communicator
        the program made itself)."""
        made = self._hub.made
        made[group] = n = made.get(group, 0) + 1
        if handle == MPI.COMM_NULL:
            return None
        wrapper = MPICommunication(handle, serial=serial, _owned=True)
        if self._hub.key is not None:
            where = "" if group is None else "g" + "-".join(map(str, group))
            wrapper._hub.key = f"{self._hub.key}.{where}{n}"
        return wrapper

    def Split(self, color: int = 0, key: int = 0) -> MPICommunication | None:
        """Collective: sub-communicators of ranks with equal ``color`` ordered by ``key``;
        ``color=MPI.UNDEFINED`` returns None."""
        _reclaim(self)
        return self._owned(self.handle.Split(color, key))

    def Split_type(self, split_type: int = MPI.COMM_TYPE_SHARED, key: int = 0,
                   info: MPI.Info = MPI.INFO_NULL) -> MPICommunication | None:
        """Collective: split by ``split_type`` (default: ranks sharing memory, i.e. a node)."""
        _reclaim(self)
        return self._owned(self.handle.Split_type(split_type, key, info))

    def Create_group(self, ranks: Sequence[int] | MPI.Group, tag: int = 0
                     ) -> MPICommunication | None:
        """A communicator of ``ranks`` (of this communicator, in that order).

        Collective over the listed ranks only; a rank not listed gets None without
        communicating.
        """
        if isinstance(ranks, MPI.Group):
            group, free_group = ranks, False
        else:
            members = _int_list(list(ranks), "ranks", len(ranks))
            if len(set(members)) != len(members):
                raise ValueError(f"ranks contains duplicates: {members}")
            for r in members:
                self._check_peer(r, "ranks entry")
            parent = self.handle.Get_group()
            group, free_group = parent.Incl(members), True
            parent.Free()
        try:
            if group.Get_rank() == MPI.UNDEFINED:
                return None
            mine = self.handle.Get_group()
            members = tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                      mine))
            mine.Free()
            return self._owned(self.handle.Create_group(group, tag), group=members)
        finally:
            if free_group:
                group.Free()

    def Create_dist_graph_adjacent(self, sources: Sequence[int], destinations: Sequence[int],
                                   reorder: bool = False) -> MPICommunication:
        """Collective: a distributed-graph communicator where this rank receives from
        ``sources`` and sends to ``destinations`` (for neighborhood collectives)."""
        for r in (*sources, *destinations):
            self._check_peer(r, "neighbor")
        _reclaim(self)
        return self._owned(self.handle.Create_dist_graph_adjacent(
            list(sources), list(destinations), reorder=reorder))

    def Dup(self, serial: bool = False) -> MPICommunication:
        """Collective: a communicator with the same ranks and a separate message space.

        ``serial=True`` promises that at most one non-blocking operation is in flight on it at a
        time and nothing else runs concurrently; then non-blocking half-precision reductions may
        use their multi-phase route (half precision on the wire). On other communicators they use
        a single float32 collective, because the later phases of a multi-phase operation start
        when the rank's progress reaches them, and could otherwise be matched against another
        operation's collectives on the same communicator.

        While a deadline or stall warning is set, or once the communicator has a board
        (``heatlike.core.checks``), the duplicate is made with the non-blocking
        ``MPI_Comm_idup`` and waited for like a collective."""
        _reclaim(self)
        board = self._hub.board
        if self.size > 1 and (_checks.watching() or (board is not None and board.established)):
            # the same choice on every rank: a non-blocking duplicate, waited for like a
            # collective (deadline, ranks known to have ended)
            return self._owned(_checks.private_duplicate(self, "Dup"), serial)
        return self._owned(self.handle.Dup(), serial)

    def Free(self) -> None:
        """Free a communicator this wrapper owns (idempotent; collective, like MPI_Comm_free:
        the board heatlike keeps for it, if any, and the node-local and cross-node communicators
        of its cached topology, are freed too)."""
        if self._finalizer is None:
            raise ValueError("this communicator was not created by heatlike and is not freed "
                             "by it")
        topology = self.__dict__.pop("_topology", None)  # get_topology's, derived from this one
        if topology is not None and self._finalizer.alive:
            topology.free()
        self._release_hub()
        self._finalizer()

    def _release_hub(self) -> None:
        """Collective, as freeing the communicator: the node-local reduction's workspaces and
        the board."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        _release_hub_of(self._hub, f"freeing {self!r}")

    @property
    def freed(self) -> bool:
        return self.handle == MPI.COMM_NULL

    def __enter__(self) -> MPICommunication:
        return self

    def __exit__(self, *exc) -> None:
        if self._finalizer is not None:
            self._release_hub()
            self._finalizer()

    # -- point to point ----------------------------------------------------------------------

    def _send(self, buf, dest: int, tag: int = 0, *, blocking: bool,
              _mode: str = "Send") -> Operation:
        """Send ``buf`` to ``dest``."""
        dest = self._check_peer(dest, "dest")
        t, _ = as_tensor(buf, "buf")
        src = readable(t)
        sync_devices(t)
        yield from call(self.handle, blocking, _mode, spec(src), dest, tag)

    def _ssend(self, buf, dest: int, tag: int = 0, *, blocking: bool) -> Operation:
        """Synchronous send: completes only once the matching receive has started."""
        return self._send(buf, dest, tag, blocking=blocking, _mode="Ssend")

    def _recv(self, buf, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
              status: MPI.Status | None = None, *, blocking: bool) -> Operation:
        """Receive into ``buf`` (for the non-blocking form pass ``status`` to ``Wait``)."""
        source = self._check_peer(source, "source", any_ok=True)
        if status is not None and not blocking and not _requests.settled:
            raise TypeError("Irecv takes no status: pass it to the request's Wait() or Test()")
        t, back = as_tensor(buf, "buf", write=True)
        # a message may be shorter than the buffer: what it does not cover keeps its contents.
        # Device memory staged through the host gets back only what arrived (copying all of it
        # out first would double the staging); a strided buffer starts as a copy of itself.
        counted = back is None and _buffers.staged(t) and t.is_contiguous()
        dst, fin = writable(t, back, keep_contents=not counted)
        sync_devices(t)
        if blocking:
            if counted and status is None:
                status = MPI.Status()
            self.handle.Recv(spec(dst), source, tag, status)
        else:
            request = self.handle.Irecv(spec(dst), source, tag)
            if counted:
                request = _Counted(request)
                status = request.status
            yield request
        if counted:
            n = status.Get_count(MPI.BYTE) // t.element_size()
            t.view(-1)[:n].copy_(dst.view(-1)[:n], non_blocking=dst.is_pinned())
        elif fin is not None:
            fin()

    def Sendrecv(self, sendbuf, dest: int, sendtag: int = 0, recvbuf=None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG,
                 status: MPI.Status | None = None) -> None:
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from ``source`` at once."""
        dest = self._check_peer(dest, "dest")
        source = self._check_peer(source, "source", any_ok=True)
        s, _ = as_tensor(sendbuf, "sendbuf")
        r, back = as_tensor(recvbuf, "recvbuf", write=True)
        _no_alias(s, r, "Sendrecv")
        src = readable(s)
        dst, fin = writable(r, back, keep_contents=True)  # a shorter message: as Recv
        sync_devices(s, r)
        self.handle.Sendrecv(spec(src), dest, sendtag, spec(dst), source, recvtag, status)
        if fin is not None:
            fin()

    # -- collectives -------------------------------------------------------------------------

    def _barrier(self, *, blocking: bool) -> Operation:
        """Block until every rank has called it."""
        yield from call(self.handle, blocking, "Barrier")

    def _bcast(self, buf, root: int = 0, *, blocking: bool) -> Operation:
        """Copy ``buf`` of ``root`` into ``buf`` of every rank."""
        root = self._check_root(root)
        t, back = as_tensor(buf, "buf", write=self.rank != root)
        if self.size == 1 and _buffers.staged(t):
            return  # the root's buffer is the result: nothing to stage
        if self.rank == root:
            b, fin = readable(t), None
        else:
            b, fin = writable(t, back)
        sync_devices(t)
        yield from call(self.handle, blocking, "Bcast", spec(b), root)
        if fin is not None:
            fin()

    def _reduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM, root: int = 0, *,
                blocking: bool, _agree: bool = True) -> Operation:
        """``recvbuf`` at ``root`` = ``op`` over the ``sendbuf`` of every rank (``sendbuf`` may be
        ``MPI.IN_PLACE`` at the root; ``recvbuf`` is ignored elsewhere). ``_agree=False`` (the
        engine's phases, whose arguments are right by construction) skips sharing the verdict
        of the checks."""
        def check() -> tuple:
            _heat_layout(sendbuf, recvbuf)
            root_, is_root_, send_ = self._rooted_send(sendbuf, root, "Reduce")
            recv_ = back_ = None
            if is_root_:
                recv_, back_ = as_tensor(recvbuf, "recvbuf", write=True)
                if send_ is not None:
                    _same_dtype(send_, recv_, "Reduce")
                    _expect_numel(recv_, send_.numel(), "recvbuf", "Reduce",
                                  "the size of sendbuf")
                    _no_alias(send_, recv_, "Reduce")
            reduction_type((recv_ if send_ is None else send_).dtype, op)
            return root_, is_root_, send_, recv_, back_

        def layout(c: tuple) -> tuple:  # every rank sends as many elements as the root receives
            return _rooted_layout(c[1], c[2], c[3], _blocks(c[3], 1) * self.size if c[1] else None)

        root, is_root, send, recv, back = self._agreed("Reduce", check, layout, root) if _agree \
            else check()
        op = mpi_op((recv if send is None else send).dtype, op)
        if _one_rank_local(self, send, recv, back):
            return
        src = None if send is None else readable(send)
        dst = fin = None
        if is_root:
            dst, fin = writable(recv, back, keep_contents=send is None)
        sync_devices(send, recv)
        if (recv if send is None else send).dtype in HALF_DTYPES:
            yield from _half.reduce(self.handle, src, dst, op, root, blocking,
                                    phases=blocking or self.serial)
        else:
            yield from call(self.handle, blocking, "Reduce", IN_PLACE if src is None else spec(src),
                            spec(dst) if is_root else None, op, root)
        if fin is not None:
            fin()

    def _allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM, *,
                   blocking: bool) -> Operation:
        """``recvbuf`` of every rank = ``op`` over the ``sendbuf`` of every rank (``sendbuf`` may
        be ``MPI.IN_PLACE``: the input is then ``recvbuf``). Half types accumulate in float32."""
        _heat_layout(sendbuf, recvbuf)
        recv, back = as_tensor(recvbuf, "recvbuf", write=True)
        reduction_type(recv.dtype, op)
        op = mpi_op(recv.dtype, op)
        send = _same_size_send(sendbuf, recv, "Allreduce")
        if _one_rank_local(self, send, recv, back):
            return
        settled = blocking or self.serial or _requests.settled
        node = _nodereduce.applies(self, recv, send, op, settled)
        if node or _pipelines(recv, send, op, settled):
            # contiguous temporaries for strided views: the choice of path must not depend on a
            # rank's own layout (ranks choosing differently would issue other collectives)
            target = recv if recv.is_contiguous() else recv.contiguous()
            if node:
                phases = _nodereduce.NodeAllreduce(self, target if send is None else send, target)
            else:
                source = target if send is None else send.contiguous()
                chunk = max(1, _staging.chunk_bytes() // recv.element_size())
                phases = _staging.Pipeline(self.handle, source, target, op, mpi_type(recv.dtype),
                                           chunk, blocking=blocking)
            if blocking:
                phases.Wait()
            else:
                yield phases
            if target is not recv:
                recv.copy_(target)
            if back is not None:
                back()
            return
        src = None if send is None else readable(send)
        dst, fin = writable(recv, back, keep_contents=send is None)
        sync_devices(send, recv)
        if recv.dtype in HALF_DTYPES:
            yield from _half.allreduce(self.handle, src, dst, op, blocking,
                                       phases=blocking or self.serial)
        else:
            yield from call(self.handle, blocking, "Allreduce",
                            IN_PLACE if src is None else spec(src), spec(dst), op)
        if fin is not None:
            fin()

    def _scan_like(self, name: str, sendbuf, recvbuf, op: MPI.Op, blocking: bool) -> Operation:
        _heat_layout(sendbuf, recvbuf)
        recv, back = as_tensor(recvbuf, "recvbuf", write=True)
        reduction_type(recv.dtype, op)
        op = mpi_op(recv.dtype, op)
        send = _same_size_send(sendbuf, recv, name)
        src = None if send is None else readable(send)
        dst, fin = writable(recv, back, keep_contents=True)
        sync_devices(send, recv)
        if recv.dtype in HALF_DTYPES:
            yield from _half.scan(self.handle, src, dst, op, name == "Exscan", blocking)
        else:
            yield from call(self.handle, blocking, name, IN_PLACE if src is None else spec(src),
                            spec(dst), op)
        if fin is not None:
            fin()

    def _scan(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM, *, blocking: bool) -> Operation:
        """Inclusive prefix reduction: ``recvbuf`` of rank r = ``op`` over ranks 0..r."""
        return self._scan_like("Scan", sendbuf, recvbuf, op, blocking)

    def _exscan(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM, *, blocking: bool) -> Operation:
        """Exclusive prefix reduction: ``recvbuf`` of rank r = ``op`` over ranks 0..r-1; rank 0's
        ``recvbuf`` is left unchanged (MPI leaves it undefined)."""
        return self._scan_like("Exscan", sendbuf, recvbuf, op, blocking)

    def _reduce_scatter_block(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM, *,
                              blocking: bool) -> Operation:
        """Reduce ``sendbuf`` (P blocks) over ranks and leave block r in ``recvbuf`` of rank r.
        With ``sendbuf=MPI.IN_PLACE`` the input is ``recvbuf`` (P blocks) and block r ends up in
        its first block."""
        return self._reduce_scatter(sendbuf, recvbuf, None, op, blocking=blocking,
                                    _name="Reduce_scatter_block")

    def _reduce_scatter(self, sendbuf, recvbuf, recvcounts: Sequence[int] | None = None,
                        op: MPI.Op = MPI.SUM, *, blocking: bool,
                        _name: str = "Reduce_scatter") -> Operation:
        """Reduce ``sendbuf`` over ranks and scatter it: rank r gets ``recvcounts[r]`` elements
        (default: the balanced split, first ranks one more). With ``sendbuf=MPI.IN_PLACE`` the
        input is ``recvbuf`` and rank r's result is written to its start."""
        size = self.size
        recv, back = as_tensor(recvbuf, "recvbuf", write=True)
        reduction_type(recv.dtype, op)
        op = mpi_op(recv.dtype, op)
        if sendbuf is IN_PLACE:
            send = None
            total = recv.numel()
        else:
            send, _ = as_tensor(sendbuf, "sendbuf")
            _same_dtype(send, recv, _name)
            _no_alias(send, recv, _name)
            total = send.numel()
        if _name == "Reduce_scatter_block":
            _expect_divisible(send if send is not None else recv, size,
                              "sendbuf" if send is not None else "recvbuf", _name)
            counts = [total // size] * size
        elif recvcounts is None:
            counts = counts_displs(total, size)[0]
        else:
            counts = _int_list(recvcounts, "recvcounts", size)
            if any(c < 0 for c in counts) or sum(counts) != total:
                raise ValueError(f"{_name}: recvcounts {counts} must be non-negative and sum "
                                 f"to the {total} input elements")
        mine = counts[self.rank]
        if send is not None:
            _expect_numel(recv, mine, "recvbuf", _name, "this rank's count")
            src = readable(send)
            dst, fin = writable(recv, back)
        else:  # input and output share recvbuf; the result goes to its first elements
            src, fin = writable(recv, back, keep_contents=True)
            dst = src.view(-1)[:mine]
        sync_devices(send, recv)
        if recv.dtype in HALF_DTYPES:
            yield from _half.reduce_scatter(self.handle, src, dst, counts, op, blocking)
        else:
            sendspec = bspec(src, size) if _name == "Reduce_scatter_block" else spec(src)
            if send is None:
                sendspec, recvspec = IN_PLACE, sendspec
            else:
                recvspec = spec(dst)
            extra = () if _name == "Reduce_scatter_block" else (counts,)
            yield from call(self.handle, blocking, _name, sendspec, recvspec, *extra, op)
        if fin is not None:
            fin()

    def _allgather(self, sendbuf, recvbuf, recv_axis: int = 0, *, blocking: bool) -> Operation:
        """``recvbuf`` = the ``sendbuf`` of every rank, concatenated in rank order along
        ``recv_axis`` (``sendbuf`` may be ``MPI.IN_PLACE``: this rank's block is already in place
        in ``recvbuf``)."""
        size = self.size
        axis = _check_axis(recv_axis, "recv_axis", "Allgather")
        recv, back = _buffer(recvbuf, "recvbuf", "Allgather", axis, write=True)
        if sendbuf is IN_PLACE:
            send = None
            _expect_divisible(recv, size, "recvbuf", "Allgather")
        else:
            send, _ = _buffer(sendbuf, "sendbuf", "Allgather", axis)
            _same_dtype(send, recv, "Allgather")
            _expect_numel(recv, size * send.numel(), "recvbuf", "Allgather",
                          "communicator size x size of sendbuf")
            _no_alias(send, recv, "Allgather")
        src = None if send is None else readable(send)
        dst, fin = writable(recv, back, keep_contents=send is None)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Allgather",
                        IN_PLACE if src is None else spec(src), bspec(dst, size))
        if fin is not None:
            fin()

    def _allgatherv(self, sendbuf, recvbuf, recv_axis: int = 0, *, blocking: bool) -> Operation:
        """``recvbuf=(array, counts[, displs])`` (or a plain array: equal blocks): rank i's
        ``sendbuf`` (``counts[i]`` slices along ``recv_axis``) is placed at ``displs[i]`` on
        every rank. ``sendbuf`` may be ``MPI.IN_PLACE``, or ``(array, counts[, displs])`` to
        send this rank's part of it (``counts[rank]`` slices at ``displs[rank]``)."""
        axis = _check_axis(recv_axis, "recv_axis", "Allgatherv")
        recv, back, counts, displs = _vbuffer(recvbuf, "recvbuf", self.size, True, "Allgatherv",
                                              axis)
        send = None
        if sendbuf is not IN_PLACE:
            send, _ = _own_part(sendbuf, "sendbuf", self.rank, self.size, False, "Allgatherv",
                                axis)
            _same_dtype(send, recv, "Allgatherv")
            _expect_numel(send, counts[self.rank], "sendbuf", "Allgatherv",
                          "recvbuf counts[rank]")
            _no_alias(send, recv, "Allgatherv")
        src = None if send is None else readable(send)
        dst, fin = writable(recv, back, keep_contents=True)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Allgatherv",
                        IN_PLACE if src is None else spec(src), vspec(dst, counts, displs))
        if fin is not None:
            fin()

    def _alltoall(self, sendbuf, recvbuf, send_axis: int = 0, recv_axis: int | None = None, *,
                  blocking: bool) -> Operation:
        """Block j of rank i's ``sendbuf`` along ``send_axis`` goes to block i of rank j's
        ``recvbuf`` along ``recv_axis`` (default: ``send_axis``); ``sendbuf`` may be
        ``MPI.IN_PLACE``. With an axis >= 2 the blocks are sub-arrays (as in Heat): see
        :meth:`Alltoallv`."""
        return self._alltoall_like("Alltoall", sendbuf, recvbuf, send_axis, recv_axis, blocking)

    def _alltoallv(self, sendbuf, recvbuf, send_axis: int = 0, recv_axis: int | None = None, *,
                   blocking: bool) -> Operation:
        """``sendbuf=(array, counts[, displs])`` (or a plain array: equal blocks), ``recvbuf``
        likewise, counts in slices along ``send_axis`` / ``recv_axis`` (default: ``send_axis``):
        ``sendcounts[j]`` slices at ``senddispls[j]`` go to rank j, which stores them at its
        ``recvdispls[i]``. ``sendbuf`` may be ``MPI.IN_PLACE`` (the send layout is then the
        receive layout).

        Blocks travel in the C order of each buffer viewed with its axis in front. When an axis
        is >= 2 (Heat's rule), a block is instead the sub-array ``counts[j]`` wide along the
        axis (default: the balanced split), received into the sub-array of the same shape: the
        redistribution of an array from split ``recv_axis`` to split ``send_axis``. There the
        two axes must differ (Heat's restriction)."""
        return self._alltoall_like("Alltoallv", sendbuf, recvbuf, send_axis, recv_axis, blocking)

    def _alltoall_like(self, name: str, sendbuf, recvbuf, send_axis, recv_axis,
                       blocking: bool) -> Operation:
        if send_axis is None:
            raise NotImplementedError(f"{name}: send_axis=None is not supported (as in Heat): "
                                      "name the axis to cut sendbuf along")
        size = self.size
        send_axis = _check_axis(send_axis, "send_axis", name)
        recv_axis = send_axis if recv_axis is None else _check_axis(recv_axis, "recv_axis", name)
        whole = recvbuf[0] if isinstance(recvbuf, (tuple, list)) and recvbuf else recvbuf
        plain = _buffers.as_tensor(whole, "recvbuf", True)[0]
        nd = max(plain.dim(), 1)
        if not -nd <= send_axis < nd or not -nd <= recv_axis < nd:
            raise ValueError(f"{name}: send_axis {send_axis} / recv_axis {recv_axis} are not "
                             f"axes of buffers with {plain.dim()} dimension(s)")
        send_axis, recv_axis = send_axis % nd, recv_axis % nd
        if send_axis >= 2 or recv_axis >= 2:
            if send_axis == recv_axis:
                if size > 1:
                    raise NotImplementedError(
                        f"{name}: send_axis == recv_axis >= 2 is not supported (as in Heat); "
                        "cut and join along different axes")
                warnings.warn(f"{name}: send_axis == recv_axis >= 2 works on one process only "
                              "(as in Heat)", UserWarning, stacklevel=4)
            yield from self._alltoall_blocks(name, sendbuf, recvbuf, send_axis, recv_axis,
                                             blocking)
            return
        variable = name == "Alltoallv"
        if variable:
            recv, back, rcounts, rdispls = _vbuffer(recvbuf, "recvbuf", size, True, name,
                                                    recv_axis)
        else:
            recv, back = _buffer(recvbuf, "recvbuf", name, recv_axis, write=True)
            _expect_divisible(recv, size, "recvbuf", name)
        send = None
        if sendbuf is not IN_PLACE:
            if variable:
                send, _, scounts, sdispls = _vbuffer(sendbuf, "sendbuf", size, False, name,
                                                     send_axis)
                _same_dtype(send, recv, name)
                _no_alias(send, recv, name)
            else:
                send, _ = _buffer(sendbuf, "sendbuf", name, send_axis)
                send = _same_size_send(send, recv, name)
        src = None if send is None else readable(send)
        dst, fin = writable(recv, back, keep_contents=send is None or variable)
        sync_devices(send, recv)
        if variable:
            yield from call(self.handle, blocking, name,
                            IN_PLACE if src is None else vspec(src, scounts, sdispls),
                            vspec(dst, rcounts, rdispls))
        else:
            yield from call(self.handle, blocking, name,
                            IN_PLACE if src is None else bspec(src, size), bspec(dst, size))
        if fin is not None:
            fin()

    def _alltoall_blocks(self, name: str, sendbuf, recvbuf, send_axis: int, recv_axis: int,
                         blocking: bool) -> Operation:
        """The sub-array form of :meth:`Alltoallv` (an axis >= 2)."""
        from .distribution import _recv_side, _send_side

        if sendbuf is IN_PLACE:
            raise ValueError(f"{name}: MPI.IN_PLACE is not supported when an axis is >= 2")
        send, scounts, sdispls = self._blocks_along(sendbuf, "sendbuf", send_axis, name, False)
        recv, rcounts, rdispls = self._blocks_along(recvbuf, "recvbuf", recv_axis, name, True)
        _same_dtype(send, recv, name)
        _no_alias(send, recv, name)
        send_views = [send.narrow(send_axis, d, c) for c, d in zip(scounts, sdispls)]
        recv_views = [recv.narrow(recv_axis, d, c) for c, d in zip(rcounts, rdispls)]
        mine, into = send_views[self.rank], recv_views[self.rank]
        if mine.shape != into.shape:
            raise ValueError(f"{name}: the block this rank keeps has shape {tuple(mine.shape)} "
                             f"in sendbuf but {tuple(into.shape)} in recvbuf")
        sbuf, sc, sd = _send_side(send, send_views)
        rbuf, rc, rd, unpack = _recv_side(recv, recv_views)
        src = readable(sbuf)
        dst, fin = writable(rbuf, keep_contents=True)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Alltoallv", vspec(src, sc, sd),
                        vspec(dst, rc, rd))
        if fin is not None:
            fin()
        if unpack is not None:
            unpack()

    def _blocks_along(self, obj, arg: str, axis: int, name: str, write: bool):
        """``(tensor, counts, displs)`` along ``axis`` of a buffer ``array`` (balanced split) or
        ``(array, counts[, displs])``, in slices."""
        if isinstance(obj, (tuple, list)):
            if len(obj) not in (2, 3):
                raise TypeError(f"{name}: {arg} must be an array, (array, counts) or "
                                "(array, counts, displs)")
            raw = obj[0]
        else:
            raw = obj
        if not isinstance(raw, torch.Tensor) and _buffers._local_tensor(raw) is None:
            raise TypeError(f"{name}: {arg} of type {type(raw).__name__} supports axis 0 only; "
                            "pass a torch tensor or DNDarray to cut or join along another axis")
        if isinstance(obj, (tuple, list)):
            t, _ = _buffer(obj[0], arg, name, 0, write)
            counts = _int_list(obj[1], f"{arg} counts", self.size)
            displs = (_int_list(obj[2], f"{arg} displs", self.size) if len(obj) == 3
                      else [0, *itertools.accumulate(counts[:-1])])
        else:
            t, _ = _buffer(obj, arg, name, 0, write)
            counts, displs = counts_displs(t.shape[axis], self.size)
        for i, (c, d) in enumerate(zip(counts, displs)):
            if c < 0 or d < 0 or d + c > t.shape[axis]:
                raise ValueError(f"{name}: {arg} block {i} (displacement {d}, count {c}) does "
                                 f"not fit in {t.shape[axis]} slices along axis {axis}")
        return t, counts, displs

    def _gather(self, sendbuf, recvbuf, root: int = 0, axis: int = 0,
                recv_axis: int | None = None, *, blocking: bool) -> Operation:
        """``recvbuf`` at ``root`` = every rank's ``sendbuf`` concatenated in rank order along
        ``axis`` of the send buffers and ``recv_axis`` (default: ``axis``) of the receive buffer
        (``sendbuf`` may be ``MPI.IN_PLACE`` at the root; ``recvbuf`` is ignored elsewhere)."""
        size = self.size

        def check() -> tuple:
            at = _check_axis(axis, "axis", "Gather")
            recv_at = at if recv_axis is None else _check_axis(recv_axis, "recv_axis", "Gather")
            root_, is_root_, send_ = self._rooted_send(sendbuf, root, "Gather", at)
            recv_ = back_ = None
            if is_root_:
                recv_, back_ = _buffer(recvbuf, "recvbuf", "Gather", recv_at, write=True)
                if send_ is None:
                    _expect_divisible(recv_, size, "recvbuf", "Gather")
                else:
                    _same_dtype(send_, recv_, "Gather")
                    _expect_numel(recv_, size * send_.numel(), "recvbuf", "Gather",
                                  "communicator size x size of sendbuf")
                    _no_alias(send_, recv_, "Gather")
            return root_, is_root_, send_, recv_, back_

        root, is_root, send, recv, back = self._agreed(
            "Gather", check, lambda c: _rooted_layout(c[1], c[2], c[3], _blocks(c[3], size)),
            root)
        src = None if send is None else readable(send)
        dst = fin = None
        if is_root:
            dst, fin = writable(recv, back, keep_contents=send is None)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Gather", IN_PLACE if src is None else spec(src),
                        bspec(dst, size) if is_root else None, root)
        if fin is not None:
            fin()

    def _gatherv(self, sendbuf, recvbuf, root: int = 0, axis: int = 0,
                 recv_axis: int | None = None, *, blocking: bool) -> Operation:
        """At ``root``, ``recvbuf=(array, counts[, displs])`` (or a plain array: equal blocks)
        receives rank i's ``sendbuf`` at ``displs[i]``, counts in slices along ``recv_axis``
        (default: ``axis``, the axis the send buffers are read along). ``sendbuf`` may be
        ``MPI.IN_PLACE`` at the root, or ``(array, counts[, displs])`` to send this rank's
        part."""
        def check() -> tuple:
            root_, is_root_, send_, _, recv_, back_, counts_, displs_ = self._rooted_v_buffers(
                "Gatherv", root, sendbuf, "sendbuf", recvbuf, "recvbuf", axis, recv_axis)
            return root_, is_root_, send_, recv_, back_, counts_, displs_

        root, is_root, send, recv, back, counts, displs = self._agreed(
            "Gatherv", check, lambda c: _rooted_layout(c[1], c[2], c[3], c[5], c[0]), root)
        src = None if send is None else readable(send)
        dst = fin = None
        if is_root:
            dst, fin = writable(recv, back, keep_contents=True)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Gatherv", IN_PLACE if src is None else spec(src),
                        vspec(dst, counts, displs) if is_root else None, root)
        if fin is not None:
            fin()

    def _scatter(self, sendbuf, recvbuf, root: int = 0, axis: int = 0,
                 recv_axis: int | None = None, *, blocking: bool) -> Operation:
        """Block r of ``sendbuf`` at ``root`` along ``axis`` goes to ``recvbuf`` of rank r, read
        along ``recv_axis`` (default: ``axis``); ``recvbuf`` may be ``MPI.IN_PLACE`` at the root;
        ``sendbuf`` is ignored elsewhere."""
        size = self.size

        def check() -> tuple:
            at = _check_axis(axis, "axis", "Scatter")
            recv_at = at if recv_axis is None else _check_axis(recv_axis, "recv_axis", "Scatter")
            root_ = self._check_root(root)
            is_root_ = self.rank == root_
            send_ = recv_ = back_ = None
            if recvbuf is IN_PLACE:
                if not is_root_:
                    raise ValueError("Scatter: MPI.IN_PLACE as recvbuf is only valid at the root")
            else:
                recv_, back_ = _buffer(recvbuf, "recvbuf", "Scatter", recv_at, write=True)
            if is_root_:
                send_, _ = _buffer(sendbuf, "sendbuf", "Scatter", at)
                if recv_ is None:
                    _expect_divisible(send_, size, "sendbuf", "Scatter")
                else:
                    _same_dtype(send_, recv_, "Scatter")
                    _expect_numel(send_, size * recv_.numel(), "sendbuf", "Scatter",
                                  "communicator size x size of recvbuf")
                    _no_alias(send_, recv_, "Scatter")
            return is_root_, send_, recv_, back_, root_

        is_root, send, recv, back, root = self._agreed(
            "Scatter", check, lambda c: _rooted_layout(c[0], c[2], c[1], _blocks(c[1], size)),
            root)
        src = readable(send) if is_root else None
        dst = fin = None
        if recv is not None:
            dst, fin = writable(recv, back)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Scatter", bspec(src, size) if is_root else None,
                        IN_PLACE if dst is None else spec(dst), root)
        if fin is not None:
            fin()

    def _scatterv(self, sendbuf, recvbuf, root: int = 0, axis: int = 0,
                  recv_axis: int | None = None, *, blocking: bool) -> Operation:
        """At ``root``, ``sendbuf=(array, counts[, displs])`` (or a plain array: equal blocks):
        ``counts[r]`` slices along ``axis`` at ``displs[r]`` go to ``recvbuf`` of rank r, read
        along ``recv_axis`` (default: ``axis``). ``recvbuf`` may be ``MPI.IN_PLACE`` at the
        root, or ``(array, counts[, displs])`` to receive into this rank's part of it."""
        def check() -> tuple:
            root_, is_root_, recv_, back_, send_, _, counts_, displs_ = self._rooted_v_buffers(
                "Scatterv", root, recvbuf, "recvbuf", sendbuf, "sendbuf", axis, recv_axis)
            return root_, is_root_, send_, recv_, back_, counts_, displs_

        root, is_root, send, recv, back, counts, displs = self._agreed(
            "Scatterv", check, lambda c: _rooted_layout(c[1], c[3], c[2], c[5], c[0]), root)
        src = readable(send) if is_root else None
        dst = fin = None
        if recv is not None:
            dst, fin = writable(recv, back)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Scatterv",
                        vspec(src, counts, displs) if is_root else None,
                        IN_PLACE if dst is None else spec(dst), root)
        if fin is not None:
            fin()

    def _neighbor_allgather(self, sendbuf, recvbuf, *, blocking: bool) -> Operation:
        """On a distributed-graph communicator: ``recvbuf`` = the ``sendbuf`` of every source
        neighbor, concatenated in the order the sources were given."""
        if not isinstance(self.handle, MPI.Distgraphcomm):
            raise TypeError("Neighbor_allgather needs a communicator from "
                            "Create_dist_graph_adjacent")
        indegree = self.handle.Get_dist_neighbors_count()[0]
        send, _ = as_tensor(sendbuf, "sendbuf")
        recv, back = as_tensor(recvbuf, "recvbuf", write=True)
        _same_dtype(send, recv, "Neighbor_allgather")
        _expect_numel(recv, indegree * send.numel(), "recvbuf", "Neighbor_allgather",
                      "in-degree x size of sendbuf")
        _no_alias(send, recv, "Neighbor_allgather")
        src = readable(send)
        dst, fin = writable(recv, back)
        sync_devices(send, recv)
        yield from call(self.handle, blocking, "Neighbor_allgather", spec(src),
                        bspec(dst, max(indegree, 1)))
        if fin is not None:
            fin()

    Send, Isend = _pair(_send)
    Ssend, Issend = _pair(_ssend)
    Recv, Irecv = _pair(_recv)
    Bcast, Ibcast = _pair(_bcast)
    Reduce, Ireduce = _pair(_reduce)
    Allreduce, Iallreduce = _pair(_allreduce)
    Scan, Iscan = _pair(_scan)
    Exscan, Iexscan = _pair(_exscan)
    Reduce_scatter, Ireduce_scatter = _pair(_reduce_scatter)
    Reduce_scatter_block, Ireduce_scatter_block = _pair(_reduce_scatter_block)
    Allgather, Iallgather = _pair(_allgather)
    Allgatherv, Iallgatherv = _pair(_allgatherv)
    Alltoall, Ialltoall = _pair(_alltoall)
    Alltoallv, Ialltoallv = _pair(_alltoallv)
    Gather, Igather = _pair(_gather)
    Gatherv, Igatherv = _pair(_gatherv)
    Scatter, Iscatter = _pair(_scatter)
    Scatterv, Iscatterv = _pair(_scatterv)
    Neighbor_allgather, Ineighbor_allgather = _pair(_neighbor_allgather)
    Barrier, Ibarrier = _pair(_barrier)

    # Fast paths for the hottest calls: plain contiguous host buffers go straight to MPI; anything
    # else (and every error) takes the general operation above. Same results either way.

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:  # noqa: F811
        hub = self._hub
        if _checks.active or hub.watched:
            return _checked(self, MPICommunication._allreduce, "Allreduce", True,
                            (sendbuf, recvbuf, op), {}, _direct_allreduce)
        if hub.count is not None:
            hub.count[0] += 1
        specs = None if _node_candidate(recvbuf) else _direct_reduction(sendbuf, recvbuf, op)
        if specs is not None:
            self.handle.Allreduce(specs[0], specs[1], op)
        else:
            drive(self._allreduce(sendbuf, recvbuf, op, blocking=True))

    def Iallreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> Request:  # noqa: F811
        hub = self._hub
        if _checks.active or hub.watched:
            return _checked(self, MPICommunication._allreduce, "Allreduce", False,
                            (sendbuf, recvbuf, op), {}, _direct_allreduce)
        if hub.count is not None:
            hub.count[0] += 1
        specs = None if self.serial and _node_candidate(recvbuf) else \
            _direct_reduction(sendbuf, recvbuf, op)
        if specs is not None:
            return Request(_hold(self.handle.Iallreduce(specs[0], specs[1], op),
                                 sendbuf, recvbuf))
        return Request(self._allreduce(sendbuf, recvbuf, op, blocking=False))

    def Bcast(self, buf, root: int = 0) -> None:  # noqa: F811
        hub = self._hub
        if _checks.active or hub.watched:
            return _checked(self, MPICommunication._bcast, "Bcast", True, (buf, root), {},
                            _direct_bcast)
        if hub.count is not None:
            hub.count[0] += 1
        d = direct(buf, True)
        if d is not None and type(root) is int and 0 <= root < self.size:
            self.handle.Bcast([d[0], d[1], mpi_type(d[2])], root)
        else:
            drive(self._bcast(buf, root, blocking=True))

    def Ibcast(self, buf, root: int = 0) -> Request:  # noqa: F811
        hub = self._hub
        if _checks.active or hub.watched:
            return _checked(self, MPICommunication._bcast, "Bcast", False, (buf, root), {},
                            _direct_bcast)
        if hub.count is not None:
            hub.count[0] += 1
        d = direct(buf, True)
        if d is not None and type(root) is int and 0 <= root < self.size:
            return Request(_hold(self.handle.Ibcast([d[0], d[1], mpi_type(d[2])], root), buf))
        return Request(self._bcast(buf, root, blocking=False))

    for _fast in (Allreduce, Iallreduce, Bcast, Ibcast):
        _fast.__doc__ = (_allreduce if "reduce" in _fast.__name__ else _bcast).__doc__
        if _fast.__name__.startswith("I"):
            _fast.__doc__ = f"Non-blocking :meth:`{_fast.__name__[1:]}`; returns a Request."
    del _fast


def __getattr__(name: str):
    if name == "GPU_AWARE_MPI":  # Heat's flag: whether device buffers go to MPI directly
        from . import cuda_aware

        return bool(cuda_aware.cuda_aware())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# predefined operations, named in the labels of the object collectives
_OBJECT_OPS = [(MPI.SUM, "SUM"), (MPI.PROD, "PROD"), (MPI.MAX, "MAX"), (MPI.MIN, "MIN"),
               (MPI.LOR, "LOR"), (MPI.LAND, "LAND"), (MPI.BOR, "BOR"), (MPI.BAND, "BAND")]


def _op_name(op: MPI.Op) -> str | None:
    """The name of a predefined operation of :data:`_OBJECT_OPS` (None for any other)."""
    return next((name for known, name in _OBJECT_OPS if op == known), None)


_launcher.check_world_size(MPI.COMM_WORLD)
MPI_WORLD = MPICommunication(MPI.COMM_WORLD)
MPI_SELF = MPICommunication(MPI.COMM_SELF)

_default_comm = MPI_WORLD


def get_comm() -> MPICommunication:
    """The default communicator (``MPI_WORLD`` unless changed with :func:`use_comm`)."""
    return _default_comm


def use_comm(comm: MPICommunication | None = None) -> None:
    """Make ``comm`` the default communicator (None: back to ``MPI_WORLD``)."""
    global _default_comm
    _default_comm = sanitize_comm(comm) if comm is not None else MPI_WORLD


def sanitize_comm(comm: MPICommunication | MPI.Intracomm | None) -> MPICommunication:
    """``comm`` as an MPICommunication: None gives the default, an mpi4py communicator is
    wrapped (not owned)."""
    if comm is None:
        return _default_comm
    if isinstance(comm, MPICommunication):
        return comm
    if isinstance(comm, MPI.Intracomm):
        return MPICommunication(comm)
    raise TypeError(f"comm must be an MPICommunication or mpi4py Intracomm, "
                    f"got {type(comm).__name__}")
