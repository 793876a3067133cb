"""Is the loaded MPI library CUDA-aware?

Asked of the library itself, never guessed from environment variables:

1. ``HEATLIKE_CUDA_AWARE_MPI=1`` or ``=0`` (or another flag word: true/false, on/off, yes/no)
   overrides everything (for libraries that do not export a query function, or to force host
   staging when a library's GPU path misbehaves).
2. Otherwise the symbols of the libmpi already loaded by mpi4py are looked up through ctypes:
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH >= 4) and then
   ``MPIX_Query_cuda_support()`` (Open MPI, older MPICH). A library that exports neither is treated
   as not CUDA-aware.

When the answer is "no", device buffers are staged through pinned host memory, and one log line
says so the first time it happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

from mpi4py import MPI

from .env import env_flag

__all__ = ["cuda_aware", "query_library", "refresh", "assumed", "loaded_libraries"]

_MPIX_GPU_SUPPORT_CUDA = 0
_cached: bool | None = None


def loaded_libraries(prefix: str) -> list[str]:
    """Paths of the shared libraries whose names start with ``prefix`` (``"libmpi"``,
    ``"libcudart"``) mapped into this process."""
    paths: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:  # no /proc: none found
        for line in f:
            path = line.rsplit(" ", 1)[-1].strip()
            name = os.path.basename(path)
            if name.startswith(prefix) and ".so" in name and path not in paths:
                paths.append(path)
    return paths


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the shared libraries named libmpi* mapped into this process."""
    return loaded_libraries("libmpi")


def _handles() -> list[ctypes.CDLL]:
    handles = []
    for path in [MPI.__file__, *_loaded_mpi_libraries()]:
        try:
            handles.append(ctypes.CDLL(path))
        except OSError:
            continue
    return handles


def query_library() -> bool | None:
    """Ask the loaded MPI library whether it supports CUDA buffers.

    Returns True or False from the library's own query function, or None if it exports none.
    """
    for lib in _handles():
        fn = getattr(lib, "MPIX_GPU_query_support", None)
        if fn is not None:
            flag = ctypes.c_int(0)
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            fn.restype = ctypes.c_int
            if fn(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
                return bool(flag.value)
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.argtypes = []
            fn.restype = ctypes.c_int
            return bool(fn())
    return None


def _from_environment() -> bool | None:
    return env_flag("HEATLIKE_CUDA_AWARE_MPI", None)


def cuda_aware() -> bool:
    """Whether device buffers are handed to MPI directly (True) or staged through host memory."""
    global _cached
    if _cached is None:
        forced = _from_environment()
        _cached = forced if forced is not None else bool(query_library())
    return _cached


@contextlib.contextmanager
def assumed(aware: bool) -> Iterator[None]:
    """Inside the block, hand device buffers to MPI directly (``True``) or stage them through
    host memory (``False``), whatever the library says (benchmarks: direct against staged)."""
    global _cached
    previous = cuda_aware()
    _cached = bool(aware)
    try:
        yield
    finally:
        _cached = previous


def refresh() -> bool:
    """Forget the cached answer (after changing ``HEATLIKE_CUDA_AWARE_MPI``) and ask again."""
    global _cached
    _cached = None
    return cuda_aware()
