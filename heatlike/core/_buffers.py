"""User arrays -> memory MPI can read or write, and back.

Rules (docs/communication.md, "Buffer rules"):

* A user array (torch tensor, numpy array, cupy array; a DNDarray stands for its local tensor
  ``larray``) is first seen as a torch tensor over the same
  memory (``torch.from_numpy`` / ``torch.from_dlpack``; no copy). Arrays torch cannot view (numpy
  with negative strides) are copied and written back through their own library.
* A contiguous tensor in memory MPI can access is handed to MPI by address, storage offset
  included: **never copied**.
* A non-contiguous tensor is packed into a contiguous temporary for reading; for writing, MPI
  writes a contiguous temporary which is then copied into the view element by element
  (``Tensor.copy_``), so memory the view does not own (gaps between strided elements) is never
  touched, and the caller's tensor object is never modified in place (no ``set_``).
* A CUDA tensor goes to MPI directly when the library is CUDA-aware (after synchronizing the
  current stream of its device, which produced it); otherwise it is staged through pinned host
  memory and copied back on the same stream.

Every writer returns a *finalizer* (or None when MPI wrote the user's memory directly); the
operation runs it after its last MPI phase has completed, on every completion path.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch
from mpi4py import MPI

from . import cuda_aware as _cuda
from ._dtypes import mpi_type, torch_dtype_of_numpy
from .log import get_logger

__all__ = [
    "IN_PLACE",
    "as_tensor",
    "readable",
    "writable",
    "spec",
    "bspec",
    "vspec",
    "force_staging",
    "staged",
    "direct",
    "sync_devices",
]

IN_PLACE = MPI.IN_PLACE
_fromaddress = MPI.buffer.fromaddress
_log = get_logger("heatlike.communication")

Finalizer = Callable[[], None] | None

# set by force_staging(): stage every buffer through a separate host copy, as for CUDA without a
# CUDA-aware MPI; lets the copy-back paths be tested on machines without a GPU
_stage_all = False
_warned_staging = False


@contextlib.contextmanager
def force_staging(enabled: bool = True) -> Iterator[None]:
    """Stage every buffer through a separate host tensor (testing aid for the CUDA fallback)."""
    global _stage_all
    old, _stage_all = _stage_all, enabled
    try:
        yield
    finally:
        _stage_all = old


def _is_cupy(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "cupy"


def as_tensor(obj: object, arg: str, write: bool = False) -> tuple[torch.Tensor, Finalizer]:
    """View ``obj`` as a torch tensor over the same memory.

    Returns ``(tensor, back)``; ``back`` is None when the tensor shares ``obj``'s memory, otherwise
    a callable copying the tensor's contents into ``obj`` (for arrays torch cannot view).
    Raises TypeError for objects that are not arrays and ValueError for receive buffers that
    cannot be written.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach() if obj.requires_grad else obj
        if write:
            _check_writable_strides(t, arg)
        if t.is_conj() or t.is_neg():  # a lazy view: its memory holds other values than it shows
            plain = t.resolve_conj().resolve_neg()
            return plain, ((lambda: t.copy_(plain)) if write else None)
        return t, None
    if isinstance(obj, np.ndarray):
        return _numpy_as_tensor(obj, arg, write)
    if _is_cupy(obj):
        return _cupy_as_tensor(obj, arg, write)
    local = _local_tensor(obj)
    if local is not None:
        return as_tensor(local, arg, write)
    if obj is None:
        raise TypeError(f"{arg} is None; pass a numpy array, torch tensor, cupy array or "
                        "DNDarray")
    raise TypeError(f"{arg} must be a numpy array, torch tensor, cupy array or DNDarray, "
                    f"got {type(obj).__module__}.{type(obj).__name__}")


def _local_tensor(obj: object) -> torch.Tensor | None:
    """A DNDarray's local tensor (its ``larray``: as in Heat, a DNDarray buffer is this rank's
    part), or None for anything else."""
    from .dndarray import DNDarray  # dndarray imports this module

    return obj.larray if isinstance(obj, DNDarray) else None


def _check_writable_strides(t: torch.Tensor, arg: str) -> None:
    if t.numel() == 0:  # nothing to write (numpy's empty arrays come with zero strides)
        return
    for size, stride in zip(t.shape, t.stride()):
        if size > 1 and stride == 0:
            raise ValueError(f"{arg} has overlapping elements (a broadcast/expanded view); "
                             "receive into a tensor that owns its elements")


def _numpy_as_tensor(a: np.ndarray, arg: str, write: bool) -> tuple[torch.Tensor, Finalizer]:
    dtype = torch_dtype_of_numpy(a.dtype)
    if dtype is None:
        raise TypeError(f"{arg}: numpy dtype {a.dtype} is not supported")
    if write and not a.flags.writeable:
        raise ValueError(f"{arg} is a read-only numpy array")
    viewable = all(s >= 0 and s % a.itemsize == 0 for s in a.strides)
    if viewable:
        if a.flags.writeable:
            t = torch.from_numpy(a)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.from_numpy(a)
        if write:
            _check_writable_strides(t, arg)
        return t, None
    # a copy always: ascontiguousarray returns an array whose only odd stride is on a length-1
    # axis as it is (numpy calls it contiguous), which torch still refuses
    t = torch.from_numpy(np.array(a, order="C", copy=True))
    if not write:
        return t, None
    if a.size and any(size > 1 and stride == 0 for size, stride in zip(a.shape, a.strides)):
        raise ValueError(f"{arg} has overlapping elements; receive into an array that owns them")
    return t, lambda: np.copyto(a, t.numpy())


def _cupy_as_tensor(a: object, arg: str, write: bool) -> tuple[torch.Tensor, Finalizer]:
    try:
        t = torch.from_dlpack(a)
    except (BufferError, RuntimeError, TypeError):
        # e.g. negative strides, which torch does not represent
        import cupy

        t = torch.from_dlpack(cupy.array(a, order="C", copy=True))
        if not write:
            return t, None
        return t, lambda: a.__setitem__(Ellipsis, cupy.from_dlpack(t))
    if write:
        _check_writable_strides(t, arg)
    return t, None


def staged(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to MPI through a host copy (device memory without a CUDA-aware
    library, or any buffer under :func:`force_staging`)."""
    return _stage_all or (t.is_cuda and not _cuda.cuda_aware())


def _host_like(t: torch.Tensor) -> torch.Tensor:
    global _warned_staging
    if t.is_cuda:
        if not _warned_staging:
            _log.info("MPI library is not CUDA-aware (or HEATLIKE_CUDA_AWARE_MPI=0): "
                      "staging device buffers through pinned host memory")
            _warned_staging = True
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty(t.shape, dtype=t.dtype)


def readable(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor in MPI-accessible memory with the contents of ``t`` (``t`` itself if
    it already is one)."""
    if staged(t):
        host = _host_like(t)
        host.copy_(t, non_blocking=t.is_cuda)
        return host
    if t.is_contiguous():
        return t
    return t.contiguous()


def writable(t: torch.Tensor, back: Finalizer = None,
             keep_contents: bool = False) -> tuple[torch.Tensor, Finalizer]:
    """A contiguous tensor MPI may write, and the finalizer that moves its contents into ``t``.

    With ``keep_contents`` the temporary starts with ``t``'s contents (for ``MPI.IN_PLACE`` and
    for buffers a collective both reads and writes).
    """
    if staged(t):
        buf = _host_like(t)
        if keep_contents:
            buf.copy_(t, non_blocking=t.is_cuda)
    elif t.is_contiguous():
        return t, back
    else:
        buf = t.contiguous() if keep_contents else torch.empty(t.shape, dtype=t.dtype,
                                                               device=t.device)

    def finalize() -> None:
        t.copy_(buf, non_blocking=buf.is_pinned())
        if back is not None:
            back()

    return buf, finalize


def sync_devices(*tensors: torch.Tensor | None) -> None:
    """Wait for the current stream of every CUDA device among ``tensors``: the work that produced
    them (and any staging copy just enqueued) is complete before MPI touches the memory.
    Synchronizes streams, never the whole device."""
    seen = set()
    for t in tensors:
        if t is not None and t.is_cuda and t.device not in seen:
            seen.add(t.device)
            torch.cuda.current_stream(t.device).synchronize()


def spec(t: torch.Tensor) -> list:
    """mpi4py buffer spec ``[buffer, count, datatype]`` for a contiguous tensor, by address."""
    n = t.numel()
    return [_fromaddress(t.data_ptr(), n * t.element_size()), n, mpi_type(t.dtype)]


def vspec(t: torch.Tensor, counts, displs) -> list:
    """mpi4py buffer spec ``[buffer, counts, displs, datatype]`` for a contiguous tensor."""
    return [_fromaddress(t.data_ptr(), t.numel() * t.element_size()), counts, displs,
            mpi_type(t.dtype)]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two contiguous tensors intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def bspec(t: torch.Tensor, blocks: int) -> list:
    """mpi4py spec for a buffer that a collective splits into ``blocks`` equal blocks (Allgather
    and Gather receive, Scatter send, Alltoall): mpi4py reads an explicit count as the count of
    one block."""
    n = t.numel()
    return [_fromaddress(t.data_ptr(), n * t.element_size()), n // blocks, mpi_type(t.dtype)]


_Tensor = torch.Tensor
_ndarray = np.ndarray
_MPI_buffer = MPI.buffer


def direct(obj: object, write: bool) -> tuple[MPI.buffer, int, torch.dtype] | None:
    """``(memory, element count, torch dtype)`` when ``obj`` can go to MPI exactly as it is: a plain
    contiguous CPU tensor or a C-contiguous numpy array (writeable, for ``write``). None means
    "take the general path" (which also produces the error messages)."""
    tp = type(obj)
    if tp is _Tensor:
        if _stage_all or obj.is_cuda or not obj.is_contiguous() or obj.is_conj() or \
                obj.is_neg():
            return None
        return _fromaddress(obj.data_ptr(), obj.nbytes), obj.numel(), obj.dtype
    if tp is _ndarray:
        dtype = torch_dtype_of_numpy(obj.dtype)
        if (dtype is None or _stage_all or not obj.flags.c_contiguous
                or (write and not obj.flags.writeable)):
            return None
        return _MPI_buffer(obj), obj.size, dtype
    return None
