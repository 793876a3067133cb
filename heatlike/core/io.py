"""Saving and loading DNDarrays: numpy ``.npy`` files and HDF5 datasets (``h5py``).

Loading: every rank reads the header / dataset shape, the ranks agree on it (one ``allgather``),
and each rank reads only its own slab of the balanced layout (a memory map of the ``.npy`` file,
an HDF5 hyperslab selection). Saving: rank 0 creates the file (header / dataset), then every rank
writes only its own slab: ``.npy`` slabs with positional writes (``os.pwrite``) of their
contiguous runs, concurrently; HDF5 slabs one rank after the other (h5py without parallel HDF5
cannot write one file from several processes at once). Nothing is gathered on one rank. A failure
on any rank (missing file, permissions, missing dataset) raises the same ``OSError`` /
``KeyError`` / ``ValueError`` / ``TypeError`` on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from . import distribution
from .communication import MPICommunication, sanitize_comm
from .devices import sanitize_device, torch_device
from .dndarray import DNDarray, _normalize_split
from .types import canonical_dtype, numpy_dtype

__all__ = ["save", "load", "save_npy", "load_npy", "save_hdf5", "load_hdf5"]

_HDF5 = (".h5", ".hdf5", ".hdf")
_RAISABLE = (OSError, KeyError, ValueError, TypeError, PermissionError, FileNotFoundError,
             FileExistsError, IsADirectoryError, NotADirectoryError)


def _capture(fn: Callable[[], object]) -> tuple[object, tuple | None]:
    try:
        return fn(), None
    except Exception as exc:  # re-raised on every rank by _agree
        kind = type(exc) if isinstance(exc, _RAISABLE) else RuntimeError
        return None, (kind, str(exc))


def _raise(comm: MPICommunication, errors: list) -> None:
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        r, (kind, msg) = bad[0]
        raise kind(f"{msg} (on rank {r} of {comm.size})" if comm.size > 1 else msg)


def _agree(comm: MPICommunication, fn: Callable[[], object]) -> object:
    """Run ``fn`` on every rank; if it failed anywhere, raise the first failure on every rank."""
    result, err = _capture(fn)
    errors = comm.allgather(err)
    _raise(comm, errors)
    return result


def _on_root(comm: MPICommunication, fn: Callable[[], object]) -> object:
    """Run ``fn`` on rank 0 and broadcast its result, or its failure to every rank."""
    result, err = _capture(fn) if comm.rank == 0 else (None, None)
    result, err = comm.bcast((result, err), root=0)
    _raise(comm, [err])
    return result


def _check_x(x: object) -> DNDarray:
    if not isinstance(x, DNDarray):
        raise TypeError(f"expected a DNDarray, got {type(x).__name__}")
    if x.dtype is torch.bfloat16:
        raise TypeError("bfloat16 has no numpy / HDF5 equivalent; cast with astype first")
    return x


def _local_numpy(x: DNDarray) -> np.ndarray:
    return np.require(x.larray.detach().cpu().numpy(), requirements="C")


def _slab(shape: tuple[int, ...], split: int | None, comm: MPICommunication
          ) -> tuple[tuple[int, ...] | None, tuple[slice, ...]]:
    """``(counts, slices)`` of this rank's part of the balanced layout."""
    if split is None:
        return None, tuple(slice(0, n) for n in shape)
    counts = distribution.balanced_counts(shape[split], comm.size)
    lo, hi = distribution.ranges(counts)[comm.rank]
    return counts, tuple(slice(lo, hi) if d == split else slice(0, n)
                         for d, n in enumerate(shape))


def _wrap(local: np.ndarray, shape: tuple[int, ...], split: int | None, counts, dtype: object,
          device: object, comm: MPICommunication) -> DNDarray:
    if not local.dtype.isnative:  # a big-endian file on a little-endian machine, or the reverse
        local = local.astype(local.dtype.newbyteorder("="))
    t = torch.from_numpy(np.require(local, requirements=["C", "W"]))
    t = t.to(device=torch_device(sanitize_device(device)),
             dtype=canonical_dtype(dtype) if dtype is not None else canonical_dtype(local.dtype))
    return DNDarray._make(t, shape, split, counts, comm)


# -------------------------------------------------------------------------------------- npy


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """Write all of ``data``'s bytes at ``offset``: ``os.pwrite`` may write fewer (Linux: at
    most 2 GiB - 4 KiB per call)."""
    view = memoryview(data.reshape(-1)).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def save_npy(x: DNDarray, path: str | os.PathLike) -> None:
    """Write ``x`` to a ``.npy`` file: rank 0 writes the header, every rank its own slab."""
    x = _check_x(x)
    comm, path = x.comm, os.fspath(path)
    npd = numpy_dtype(x.dtype)
    header = {"descr": np.lib.format.dtype_to_descr(npd), "fortran_order": False,
              "shape": x.gshape}

    def create() -> int:
        with open(path, "wb") as f:
            np.lib.format.write_array_header_2_0(f, header) if len(repr(header)) > 60000 \
                else np.lib.format.write_array_header_1_0(f, header)
            offset = f.tell()
            f.truncate(offset + x.size * npd.itemsize)
        return offset

    offset = _on_root(comm, create)
    data = _local_numpy(x)

    def write() -> None:
        if x.split is None and comm.rank != 0:
            return
        if data.size == 0:
            return
        fd = os.open(path, os.O_WRONLY)
        try:
            if x.split is None:
                _pwrite_all(fd, data, offset)
                return
            s = x.split
            outer = int(np.prod(x.gshape[:s], dtype=np.int64))
            inner = int(np.prod(x.gshape[s + 1:], dtype=np.int64))
            runs = data.reshape(outer, -1)
            lo = x.displs[comm.rank]  # type: ignore[index]
            for i in range(outer):
                elem = (i * x.gshape[s] + lo) * inner
                _pwrite_all(fd, runs[i], offset + elem * npd.itemsize)
        finally:
            os.close(fd)

    _agree(comm, write)


def _npy_header(path: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major == 1:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        if dtype.hasobject:
            raise TypeError(f"{path}: object arrays cannot be loaded into a DNDarray")
        canonical_dtype(dtype)
        return tuple(shape), bool(fortran), dtype, f.tell()


def load_npy(path: str | os.PathLike, split: int | None = None, dtype: object = None,
             device: object = None, comm: MPICommunication | None = None) -> DNDarray:
    """Read a ``.npy`` file; each rank reads only its slab of the balanced layout along
    ``split`` (None: every rank reads the whole file)."""
    comm, path = sanitize_comm(comm), os.fspath(path)
    headers = comm.allgather(_capture(lambda: _npy_header(path)))
    _raise(comm, [e for _, e in headers])
    if len({h for h, _ in headers}) != 1:
        raise OSError(f"{path}: the ranks read different headers (is the file being written?)")
    shape, fortran, npd, offset = headers[0][0]  # type: ignore[misc]
    s = _normalize_split(split, len(shape))
    counts, slices = _slab(shape, s, comm)
    local_shape = tuple(sl.stop - sl.start for sl in slices)

    def read() -> np.ndarray:
        if 0 in shape:
            return np.empty(local_shape, dtype=npd)
        mm = np.memmap(path, dtype=npd, mode="r", offset=offset, shape=shape,
                       order="F" if fortran else "C")
        out = np.array(mm[slices], order="C")
        del mm
        return out

    local = _agree(comm, read)
    return _wrap(local, shape, s, counts, dtype, device, comm)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- hdf5


def _h5py():
    import h5py

    return h5py


def save_hdf5(x: DNDarray, path: str | os.PathLike, dataset: str, mode: str = "w",
              **dataset_kwargs: object) -> None:
    """Write ``x`` to ``dataset`` of the HDF5 file ``path`` (``mode`` ``"w"``: new file, ``"a"``:
    add to an existing one). Rank 0 creates the dataset; the ranks then write their slabs in turn.
    ``dataset_kwargs`` go to ``h5py.Group.create_dataset`` (compression, chunks, ...)."""
    x = _check_x(x)
    h5py = _h5py()
    comm, path = x.comm, os.fspath(path)
    if mode not in ("w", "a", "r+", "w-", "x"):
        raise ValueError(f"mode must be 'w', 'a', 'r+', 'w-' or 'x', got {mode!r}")
    npd = numpy_dtype(x.dtype)

    def create() -> None:
        with h5py.File(path, mode) as f:
            f.create_dataset(dataset, shape=x.gshape, dtype=npd, **dataset_kwargs)

    _on_root(comm, create)
    data = _local_numpy(x)
    if x.split is None:
        slices = tuple(slice(0, n) for n in x.gshape)
    else:
        lo, hi = x._ranges()[comm.rank]
        slices = tuple(slice(lo, hi) if d == x.split else slice(0, n)
                       for d, n in enumerate(x.gshape))

    def write() -> None:
        with h5py.File(path, "r+") as f:
            f[dataset][slices] = data

    writers = [0] if x.split is None else [r for r, c in enumerate(x.counts) if c > 0]
    for r in writers:
        result, err = (_capture(write) if comm.rank == r else (None, None))
        _raise(comm, [comm.bcast(err, root=r)])


def load_hdf5(path: str | os.PathLike, dataset: str, split: int | None = None,
              dtype: object = None, device: object = None,
              comm: MPICommunication | None = None) -> DNDarray:
    """Read ``dataset`` of the HDF5 file ``path``; each rank reads only its hyperslab of the
    balanced layout along ``split``."""
    h5py = _h5py()
    comm, path = sanitize_comm(comm), os.fspath(path)

    def meta() -> tuple[tuple[int, ...], str]:
        with h5py.File(path, "r") as f:
            if dataset not in f:
                raise KeyError(f"{path}: no dataset {dataset!r}")
            d = f[dataset]
            canonical_dtype(d.dtype)
            return tuple(d.shape), d.dtype.str

    metas = comm.allgather(_capture(meta))
    _raise(comm, [e for _, e in metas])
    shape, dstr = metas[0][0]  # type: ignore[misc]
    s = _normalize_split(split, len(shape))
    counts, slices = _slab(shape, s, comm)
    local_shape = tuple(sl.stop - sl.start for sl in slices)

    def read() -> np.ndarray:
        if 0 in local_shape:
            return np.empty(local_shape, dtype=np.dtype(dstr))
        with h5py.File(path, "r") as f:
            return np.asarray(f[dataset][slices])

    local = _agree(comm, read)
    return _wrap(local, shape, s, counts, dtype, device, comm)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- generic


def _kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        return "npy"
    if ext in _HDF5:
        return "hdf5"
    raise ValueError(f"unsupported file type {ext!r}: use .npy or .h5/.hdf5")


def save(x: DNDarray, path: str | os.PathLike, dataset: str | None = None, mode: str = "w",
         **kwargs: object) -> None:
    """Save to ``.npy`` or HDF5 (``.h5``, ``.hdf5``, ``.hdf``; ``dataset`` required)."""
    path = os.fspath(path)
    if _kind(path) == "npy":
        save_npy(x, path)
    else:
        if dataset is None:
            raise ValueError("saving to HDF5 needs a dataset name")
        save_hdf5(x, path, dataset, mode=mode, **kwargs)


def load(path: str | os.PathLike, dataset: str | None = None, split: int | None = None,
         dtype: object = None, device: object = None,
         comm: MPICommunication | None = None) -> DNDarray:
    """Load a ``.npy`` file or an HDF5 dataset (``dataset`` required), split along ``split``."""
    path = os.fspath(path)
    if _kind(path) == "npy":
        return load_npy(path, split=split, dtype=dtype, device=device, comm=comm)
    if dataset is None:
        raise ValueError("loading from HDF5 needs a dataset name")
    return load_hdf5(path, dataset, split=split, dtype=dtype, device=device, comm=comm)
