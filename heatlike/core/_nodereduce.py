"""Node-local all-reduce through the peers' memory: device buffers summed on the device, host
buffers through a shared-memory window.

Without a CUDA-aware MPI library a device buffer is staged: copied to host memory, reduced by
MPI there, copied back. When every rank of the communicator shares one node and one GPU, each
rank can instead map its peers' device memory (CUDA IPC) and the sum needs neither host memory
nor MPI data transfers: MPI carries only one or two barriers.

Every rank keeps a *workspace* of two slots in its own device memory, mapped once into every
peer (handles exchanged with an all-gather; the workspace grows, collectively, to the largest
buffer seen). Protocol of the communicator's k-th such all-reduce of n elements over P ranks,
slot s = k mod 2:

1. rank r copies its input into slot s of its workspace, W_r[s], and waits for the copy (an
   event on the current stream, which produced the input);
2. barrier: every input is in place;
3. *one shot* (when it reads at most :data:`ONE_SHOT_BYTES` of the peers' memory, n (P-1)
   elements): rank r sums all of ``W_0[s] + W_1[s] + ...`` in rank order into its output (float32
   accumulation for float16/bfloat16, one rounding at the end, as the staged half-type
   reduction); the operation is complete when that is. One barrier, one wait for the device.

   *Two shots* (larger sums: each rank reads about 2n elements instead of P n): rank r sums only
   shard r (n/P elements, :func:`~heatlike.core.chunking.counts_displs`) in rank order and writes
   it into ``W_r[s][shard r]``, a range no other rank reads in this phase, and waits for it;
   barrier: every shard is summed; rank r copies shard q of W_q[s] into its output for every q.

Every rank gets bitwise the same result: the same rank-order sum of every element, computed by
one rank (two shots) or by every rank with the same operations (one shot). No barrier closes the
operation: reduction k+1 writes the other slot, and before any rank writes slot s again
(reduction k+2) it has passed the first barrier of reduction k+1, which every rank enters only
after its copy for k+1 is complete, queued on its stream after its reads of reduction k.

The sums of one communicator run one after the other on every rank (a new sum first completes
the one before it), and their barriers, the workspace's growth and its release run on a private
duplicate of the communicator: they never interleave with the communicator's other collectives,
even where the engine keeps a small all-reduce (a bucket's use counters) in flight during an
exchange. The slot counter, the workspace size, one shot or two, and the decision to use the
path are the same on every rank: they depend only on what every rank's call shares (size,
dtype, op, device kind) and on collective agreement at set-up. Like pipelined staging, the path
is taken in blocking calls and on serial communicators (the engine's private channels), where
no other multi-phase operation can be waiting for this rank's progress.

Where it applies (:func:`applies`): MPI.SUM of a staged buffer (device memory without a
CUDA-aware library) of a numeric dtype and at least :data:`MIN_BYTES`, on a communicator of
several ranks that share one node (``MPI_Comm_split_type(SHARED)``) and one GPU, with the CUDA
runtime found in the process. Ranks on different GPUs of a node are staged: reading a peer GPU
through torch would open a context on it in every process, and that path is not verified. A
set-up failure on any rank (a handle that does not open, a mapping torch does not take as it is)
turns the path off on every rank, agreed, and is logged. ``HEATLIKE_NODE_REDUCE=0`` or
:func:`enabled` (False) turn it off. Other ops, dtypes and sizes are staged as before.

Host buffers take the same protocol with ``HEATLIKE_NODE_REDUCE_HOST=1`` (off by default:
against MPICH's own all-reduce it won at three ranks and at 64 MiB and lost at several sizes at
two and four ranks; docs/communication.md has the figures), their workspaces an MPI shared-memory
window, always in two shots: ``MPI.SUM`` of at least :data:`HOST_MIN_BYTES` over a communicator
whose ranks share one node, real and emulated (:func:`one_node`). A buffer larger than
:data:`HOST_CHUNK_BYTES` is summed chunk by chunk, each chunk a reduction of its own in the next
slot (so the slots, and the shared memory, stay two chunks per rank). Before a window is made the
ranks agree that ``/dev/shm`` has room for it: a full tmpfs kills the process that touches it
instead of failing the allocation. Under ``force_staging`` with :func:`host_mode` host tensors
stand in for device buffers (the device path's one or two shots), which is how the suite tests
that protocol without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
from collections.abc import Iterator

import torch
from mpi4py import MPI

from . import _buffers
from .chunking import counts_displs
from .cuda_aware import loaded_libraries
from .env import env_flag
from .log import get_logger

__all__ = ["applies", "possible", "possible_for", "one_node", "enabled", "host_enabled",
           "host_mode",
           "NodeAllreduce", "release", "ONE_SHOT_BYTES", "MIN_BYTES", "HOST_MIN_BYTES",
           "HOST_CHUNK_BYTES", "HOST_ONE_SHOT_BYTES"]

_SUM = MPI.SUM.py2f()
_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                     torch.int16, torch.int32, torch.int64, torch.uint8, torch.complex64,
                     torch.complex128})
_HALF = (torch.float16, torch.bfloat16)
_ALIGN = 1 << 21  # workspace slots grow in 2 MiB steps
_SEVERAL_NODES = "the ranks are on several nodes"

#: a sum that reads at most this many bytes of the peers' workspaces is done in one shot
ONE_SHOT_BYTES = 16 << 20
#: smaller buffers are staged: with ranks sharing a GPU, each wait for the device waits for
#: the other processes' time slices (about 0.4 ms at 2 ranks on an H100), which a staged copy
#: through the copy engine does not
MIN_BYTES = 1 << 20
#: host buffers from this size on are summed through a shared-memory window where the ranks
#: share a node (smaller ones: MPI's all-reduce, which wins on latency)
HOST_MIN_BYTES = 1 << 20
#: larger host sums run chunk by chunk through two slots of this size per rank (the shared memory
#: a communicator keeps: ``/dev/shm`` on Linux, often small in containers)
HOST_CHUNK_BYTES = 4 << 20
#: host sums read at most this many bytes of the peers' workspaces in one shot: none (reading
#: every peer's whole buffer costs more memory bandwidth than the second barrier saves)
HOST_ONE_SHOT_BYTES = 0

_log = get_logger("heatlike.communication")
_override: bool | None = None
_host = False


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Inside the block, use the node-local path where it applies (``True``) or never
    (``False``), whatever ``HEATLIKE_NODE_REDUCE`` says (benchmarks: against staging)."""
    global _override
    old, _override = _override, bool(on)
    try:
        yield
    finally:
        _override = old


@contextlib.contextmanager
def host_mode() -> Iterator[None]:
    """Test aid: inside the block (with ``force_staging``) host tensors take the node-local path,
    their workspaces in an MPI shared-memory window instead of device memory."""
    global _host
    old, _host = _host, True
    try:
        yield
    finally:
        _host = old


def _on() -> bool:
    if _override is not None:
        return _override
    return bool(env_flag("HEATLIKE_NODE_REDUCE", True))


def possible(t: torch.Tensor) -> bool:
    """Whether reductions of ``t``'s kind may take the node-local path (what every rank's call
    shares; the communicator is checked by :func:`applies`): see :func:`possible_for`."""
    return possible_for(t.numel() * t.element_size(), t.dtype, t.device, _buffers.staged(t))


def possible_for(nbytes: int, dtype: torch.dtype, device: torch.device, staged: bool) -> bool:
    """Whether sums of ``nbytes`` of ``dtype`` on ``device`` may take the node-local path: a
    staged device buffer (or, under :func:`host_mode`, a staged host buffer) of at least
    :data:`MIN_BYTES`, or a host buffer of at least :data:`HOST_MIN_BYTES`."""
    if dtype not in _DTYPES or not _on():
        return False
    if device.type == "cuda":
        return nbytes >= MIN_BYTES and staged
    if device.type != "cpu":
        return False
    if staged:
        return _host and nbytes >= MIN_BYTES
    return nbytes >= HOST_MIN_BYTES and host_enabled()


def host_enabled() -> bool:
    """Whether host buffers may take the node-local path: ``HEATLIKE_NODE_REDUCE_HOST=1`` (off
    by default: whether it beats the MPI library's own all-reduce depends on the library, the
    size and the ranks per node; see docs/communication.md), or inside ``enabled(True)``."""
    if _override is not None:
        return _override
    return bool(env_flag("HEATLIKE_NODE_REDUCE_HOST", False))


def one_node(comm) -> bool:
    """Collective the first time on a communicator (cached there): whether all its ranks share
    one node's memory and no emulated layout (``HEATLIKE_NODE_IDS``,
    ``HEATLIKE_RANKS_PER_NODE``, read for the world: :func:`_one_emulated_node`) puts them on
    several."""
    hub = comm._hub
    if hub.one_node is None:
        shared = comm.handle.Split_type(MPI.COMM_TYPE_SHARED)
        together = shared.Get_size() == comm.size
        shared.Free()
        hub.one_node = together and _one_emulated_node(comm.handle)
    return hub.one_node


def _one_emulated_node(handle: MPI.Intracomm) -> bool:
    """Whether the emulated layout, if any, puts every rank of ``handle`` on one node (local:
    the same on every rank, which sees the same environment). The layout is read for the world
    (``HEATLIKE_NODE_IDS`` lists one node per rank of ``MPI.COMM_WORLD``) and ``handle``'s ranks
    are looked up in it; a layout that does not describe the world counts as several nodes."""
    from .topology import _env_node_ids

    world = MPI.COMM_WORLD
    try:
        ids = _env_node_ids(world.Get_size())
    except ValueError:
        return False
    if ids is None:
        return True
    group, world_group = handle.Get_group(), world.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(handle.Get_size())), world_group)
    finally:
        group.Free()
        world_group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        return False
    return len({ids[r] for r in ranks}) == 1


def applies(comm, recv: torch.Tensor, send: torch.Tensor | None, op: MPI.Op,
            settled: bool) -> bool:
    """Whether this all-reduce takes the node-local path. Collective the first time it says yes
    on a communicator (the set-up: where the ranks are, the devices, the runtime)."""
    if not settled or comm.size < 2 or op.py2f() != _SUM or not possible(recv):
        return False
    if send is not None and (send.dtype is not recv.dtype or send.device != recv.device or
                             _buffers.staged(send) != _buffers.staged(recv)):
        return False
    host = not recv.is_cuda and not _buffers.staged(recv)
    if host and not one_node(comm):
        return False
    node = _node(comm, recv)
    if node.cuda != recv.is_cuda:  # the communicator's workspaces are of the other kind
        return False
    n = min(recv.numel(), _host_chunk(recv.element_size())) if host else recv.numel()
    return node.usable and node.ensure(n * recv.element_size())


def _host_chunk(itemsize: int) -> int:
    """Elements per chunk of a host sum (:data:`HOST_CHUNK_BYTES`, at least one)."""
    return max(1, HOST_CHUNK_BYTES // itemsize)


# ---------------------------------------------------------------------------- CUDA runtime


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Runtime:
    """The few CUDA runtime calls torch does not expose: device memory of our own and its IPC
    handles (the runtime torch loaded, found in the process's mappings)."""

    def __init__(self) -> None:
        lib = None
        for path in loaded_libraries("libcudart") + [ctypes.util.find_library("cudart")]:
            if path:
                with contextlib.suppress(OSError):
                    lib = ctypes.CDLL(path)
                    break
        if lib is None:
            raise OSError("the CUDA runtime library (libcudart) is not loaded in this process")
        self.lib = lib
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle,
                                             ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        for name in ("cudaMalloc", "cudaFree", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle",
                     "cudaIpcCloseMemHandle"):
            getattr(lib, name).restype = ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.cudaGetErrorString(rc).decode()} ({rc})")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def handle(self, ptr: int) -> bytes:
        h = _IpcHandle()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)),
                    "cudaIpcGetMemHandle")
        return bytes(h)

    def open(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        h = _IpcHandle.from_buffer_copy(handle)
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, 1),  # lazy peer access
                    "cudaIpcOpenMemHandle")
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


_runtime: _Runtime | None = None


def _cudart() -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime()
    return _runtime


class _DeviceMemory:
    """``nbytes`` of device memory at ``ptr`` as seen by torch (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def _wrap(ptr: int, nbytes: int) -> torch.Tensor:
    t = torch.as_tensor(_DeviceMemory(ptr, nbytes))
    if t.data_ptr() != ptr or not t.is_cuda:
        raise RuntimeError("torch copied the mapped memory instead of viewing it")
    return t


# ---------------------------------------------------------------------------- workspaces


class _Node:
    """The node-local set-up of one communicator: whether the path is usable (agreed by every
    rank) and the workspaces (this rank's and views of its peers', two slots each)."""

    def __init__(self, comm, device: torch.device) -> None:
        self.handle: MPI.Intracomm = comm.handle
        self.rank, self.size = comm.rank, comm.size
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_bytes = 0
        self.count = 0  # reductions so far: slot = count % 2
        self.views: list[torch.Tensor] = []  # rank order; views[rank] is this rank's workspace
        self._own_ptr: int | None = None
        self._peer_ptrs: list[int] = []
        self._win: MPI.Win | None = None
        self.last = None  # event after this rank's last reads of the workspaces (device)
        self.current: NodeAllreduce | None = None  # this rank's latest sum on this node
        self.barriers: MPI.Intracomm | None = None
        self._scratch = torch.empty(0, dtype=torch.uint8)  # host accumulators (_reduce)
        reason, uuid = "", ""
        try:  # local facts first: every rank then enters the same collectives
            if self.cuda:
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                _cudart()
        except Exception as exc:  # noqa: BLE001 - any failure turns the path off, agreed below
            reason = f"{type(exc).__name__}: {exc}"
        shared = self.handle.Split_type(MPI.COMM_TYPE_SHARED)
        one_node = shared.Get_size() == self.size
        shared.Free()
        uuids = self.handle.allgather(uuid) if self.cuda else []
        if not one_node:
            reason = reason or _SEVERAL_NODES
        elif len(set(uuids)) > 1:
            reason = reason or "the ranks use different GPUs (sums between GPUs are staged)"
        self.usable = self._agree(reason, self.handle)
        if self.usable:  # the sums' barriers never interleave with the communicator's others
            self.barriers = self.handle.Dup()

    def _agree(self, reason: str, comm: MPI.Intracomm) -> bool:
        """Collective over ``comm``: True where every rank's reason is empty (a reason other than
        the ranks' being on several nodes is logged)."""
        self.reason = reason
        if reason and reason != _SEVERAL_NODES:
            _log.info(f"node-local sums off on this communicator: {reason}")
        return bool(comm.allreduce(0 if reason else 1, op=MPI.MIN))

    def ensure(self, nbytes: int) -> bool:
        """Collective (every rank asks for the same size): slots of at least ``nbytes``. Returns
        whether the path is (still) usable."""
        if nbytes <= self.slot_bytes or not self.usable:
            return self.usable
        slot = -(-nbytes // _ALIGN) * _ALIGN
        if self.current is not None and not self.current.finished:
            self.current.Wait()
        self._settle()  # this rank's reads of the peers' old workspaces are over
        old = (self._own_ptr, self._peer_ptrs, self._win)
        if not self.cuda and not self._agree(_shm_shortfall(2 * slot * self.size),
                                             self.barriers):
            self._free(*old)  # every rank has settled: no one reads them any more
            self._own_ptr, self._peer_ptrs, self._win, self.views = None, [], None, []
            self.usable = False
            return False
        reason = ""
        try:
            self._allocate(slot)
        except Exception as exc:  # noqa: BLE001 - turns the path off, agreed below
            reason = f"{type(exc).__name__}: {exc}"
        # every rank has passed the all-gather (or window allocation) inside _allocate, after
        # settling: no one reads the old workspaces any more
        self._free(*old)
        if not self._agree(reason, self.barriers):
            self._free(self._own_ptr, self._peer_ptrs, self._win)
            self._own_ptr, self._peer_ptrs, self._win, self.views = None, [], None, []
            self.usable = False
            return False
        self.slot_bytes = slot
        return True

    def _settle(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
            if self.last is not None:
                self.last.synchronize()

    def _allocate(self, slot: int) -> None:
        total = 2 * slot
        self.views, self._peer_ptrs, self._own_ptr, self._win = [], [], None, None
        if not self.cuda:
            self._win = MPI.Win.Allocate_shared(total, 1, comm=self.barriers)
            for q in range(self.size):
                memory, _ = self._win.Shared_query(q)
                self.views.append(torch.frombuffer(memory, dtype=torch.uint8, count=total))
            # tmpfs counts pages once written: touched now, the next window's check sees them
            self.views[self.rank].zero_()
            return
        rt = _cudart()
        handle = b""
        with torch.cuda.device(self.device):
            try:
                self._own_ptr = rt.malloc(total)
                handle = rt.handle(self._own_ptr)
            finally:
                handles = self.barriers.allgather(handle)  # always entered: no rank left in it
            if not all(handles):
                raise RuntimeError("a rank could not allocate its workspace")
            for q, h in enumerate(handles):
                if q == self.rank:
                    self.views.append(_wrap(self._own_ptr, total))
                else:
                    ptr = rt.open(h)
                    self._peer_ptrs.append(ptr)
                    self.views.append(_wrap(ptr, total))

    def _free(self, own: int | None, peers: list[int], win: MPI.Win | None) -> None:
        """Free what ``_allocate`` made (the caller has made sure no rank reads it)."""
        if win is not None:
            win.Free()
        if self.cuda and (own is not None or peers):
            rt = _cudart()
            with torch.cuda.device(self.device):
                for ptr in peers:
                    rt.close(ptr)
                if own is not None:
                    rt.free(own)

    def scratch(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``n`` elements of ``dtype`` of host memory kept for this communicator's sums (a new
        temporary per sum costs page faults on every call: large allocations are fresh pages)."""
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype)

    def slot_views(self, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's current slot as ``n`` elements of ``dtype`` (rank order); advances the
        slot counter."""
        offset = (self.count % 2) * self.slot_bytes
        self.count += 1
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        return [v[offset:offset + nbytes].view(dtype) for v in self.views]

    def close(self) -> None:
        """Collective: free the workspaces (once every rank's reads of them are over)."""
        if self.current is not None and not self.current.finished:
            self.current.Wait()
        if self.views or self._win is not None:
            self._settle()
            self.barriers.Barrier()
            self.views = []
            self._free(self._own_ptr, self._peer_ptrs, self._win)
            self._own_ptr, self._peer_ptrs, self._win = None, [], None
        if self.barriers is not None:
            self.barriers.Free()
            self.barriers = None
        self.usable = False


def _shm_shortfall(nbytes: int) -> str:
    """Why a shared-memory window of ``nbytes`` should not be made on this node: ``/dev/shm``
    (where MPI libraries map such windows on Linux; often 64 MiB in containers) has less than
    twice that free. Touching pages beyond a full tmpfs kills the process (SIGBUS) instead of
    failing the allocation."""
    path = "/dev/shm"
    if not os.path.isdir(path):
        return ""
    free = shutil.disk_usage(path).free
    if free >= 2 * nbytes:
        return ""
    return (f"{path} has {free >> 20} MiB free, the node's workspaces need {nbytes >> 20} MiB "
            f"(twice that is asked for)")


def _node(comm, t: torch.Tensor) -> _Node:
    hub = comm._hub
    node = hub.node
    if node is None:
        device = t.device
        if t.is_cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        node = hub.node = _Node(comm, device)
    return node


def release(hub) -> None:
    """Collective: free a communicator's workspaces (when it is freed)."""
    node, hub.node = hub.node, None
    if node is not None:
        node.close()


# ---------------------------------------------------------------------------- the operation


class NodeAllreduce:
    """One node-local sum of ``src`` into ``dst`` (contiguous, same dtype and size; ``src is
    dst`` in place) over ``comm``: a request-like phase (``Test`` advances it, ``Wait`` drives it
    to the end), its first copy queued at construction. Collective: every rank constructs it
    for the same reduction."""

    def __init__(self, comm, src: torch.Tensor, dst: torch.Tensor) -> None:
        node = comm._hub.node
        if node.current is not None and not node.current.finished:
            node.current.Wait()  # sums on a node run one after the other, on every rank alike
        node.current = self
        self.node, self.src, self.whole = node, src.reshape(-1), dst.view(-1)
        n = self.whole.numel()
        self.finished = n == 0
        if self.finished:
            return
        staged = _buffers.staged(dst)
        self.limit = ONE_SHOT_BYTES if node.cuda or staged else HOST_ONE_SHOT_BYTES
        self.chunk = n if node.cuda or staged else _host_chunk(dst.element_size())
        self.stream = torch.cuda.current_stream(node.device) if node.cuda else None
        self.request: MPI.Request | None = None
        self.event = None
        if self.stream is not None and node.last is not None:
            self.stream.wait_event(node.last)  # reads of the last sum come before this copy
        self.hi = 0
        self._next_chunk()

    def _next_chunk(self) -> None:
        """Start the sum of the next ``chunk`` elements: a reduction of its own in the next slot
        (the two slots' argument holds chunk by chunk), its first copy queued."""
        node, lo = self.node, self.hi
        self.hi = min(lo + self.chunk, self.whole.numel())
        m = self.hi - lo
        self.dst = self.whole[lo:self.hi]
        self.views = node.slot_views(m, self.dst.dtype)
        self.one_shot = m * self.dst.element_size() * (node.size - 1) <= self.limit
        self.counts, self.displs = counts_displs(m, node.size)
        self.stage = 0
        part = self.src[lo:self.hi]
        self._queue(lambda: self.views[node.rank].copy_(part))

    def _queue(self, work) -> None:
        if self.stream is None:
            work()
            self.event = None
            return
        with torch.cuda.stream(self.stream):  # every phase on the caller's stream at the call
            work()
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def _shard(self, v: torch.Tensor, q: int) -> torch.Tensor:
        lo = self.displs[q]
        return v[lo:lo + self.counts[q]]

    @staticmethod
    def _rank_order_sum(parts: list[torch.Tensor], acc: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """``parts[0] + parts[1] + ...`` in rank order, float16/bfloat16 accumulated in float32,
        into ``acc`` (of the accumulating dtype) or a new tensor."""
        first = parts[0]
        if acc is None:
            acc = first.float() if first.dtype in _HALF else first.clone()
        else:
            acc.copy_(first)
        for p in parts[1:]:
            acc.add_(p)
        return acc

    def _reduce(self) -> None:
        r = self.node.rank
        parts = [self._shard(v, r) for v in self.views]
        own = parts[r]
        half = own.dtype in _HALF
        if self.node.cuda:  # the caching allocator's temporary, on the caller's stream
            own.copy_(self._rank_order_sum(parts))
        elif r <= 1 and not half:  # the sum written where it belongs, read before it is written
            torch.add(parts[0], parts[1], out=own)
            for p in parts[2:]:
                own.add_(p)
        else:  # in memory the communicator keeps (a new temporary faults its pages in each time)
            acc = self.node.scratch(own.numel(), torch.float32 if half else own.dtype)
            own.copy_(self._rank_order_sum(parts, acc))

    def _sum_all(self) -> None:
        self.dst.copy_(self._rank_order_sum(self.views))

    def _gather(self) -> None:
        for q, v in enumerate(self.views):
            self._shard(self.dst, q).copy_(self._shard(v, q))

    def _done(self) -> bool:
        return self.event is None or self.event.query()

    def _advance(self) -> None:
        while not self.finished:
            stage = self.stage
            if stage in (0, 2):
                if not self._done():
                    return
                self.request = self.node.barriers.Ibarrier()
            elif stage in (1, 3):
                if not self.request.Test():
                    return
                self.request = None
                if self.one_shot:
                    self._queue(self._sum_all)
                    self.stage = 4
                    continue
                self._queue(self._reduce if stage == 1 else self._gather)
            else:  # 4: the gather is queued: work queued after this sees the result
                if self.hi < self.whole.numel():
                    self._next_chunk()
                    continue
                self.node.last = self.event
                if self.event is not None:
                    torch.cuda.current_stream(self.node.device).wait_event(self.event)
                self.finished = True
                self.views = []
                return
            self.stage += 1

    def Test(self, status: MPI.Status | None = None) -> bool:
        self._advance()
        return self.finished

    def Wait(self, status: MPI.Status | None = None) -> None:
        while not self.Test():
            if self.stage in (0, 2) and self.event is not None:
                self.event.synchronize()
            elif self.stage in (1, 3):
                self.request.Wait()

    def Cancel(self) -> None:
        """Collectives cannot be cancelled: nothing to do (as for MPI)."""

    wait, test = Wait, Test
