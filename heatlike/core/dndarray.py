"""DNDarray: one logical n-dimensional array split along one axis over the ranks of a
communicator, one torch tensor (``larray``) per rank.

Distribution model (docs/tensor.md):

* ``split=None``: every rank holds the whole array (replicated);
* ``split=k``: rank r holds the indices ``[displs[r], displs[r] + counts[r])`` of axis k and all of
  every other axis, in rank order. ``counts`` is known on every rank (``lshape_map`` is derived
  from it without communication); the *balanced* layout gives the first ``n % P`` ranks one extra
  index (Heat's ``chunk``). Operations accept unbalanced arrays; some (slicing, masks) produce them.

Every rank keeps the same global metadata (``gshape``, ``split``, ``counts``, ``dtype``,
``device``), so argument checks raise the same error on every rank before anything is sent.
Every operation is collective: all ranks of ``comm`` call it in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from . import distribution
from .agreement import gather_or_raise
from .communication import MPICommunication, sanitize_comm
from .devices import device_name, sanitize_device, torch_device
from .types import canonical_dtype

__all__ = ["DNDarray", "ScalarConversionError"]

_HALO_TAG = 23291


class ScalarConversionError(TypeError, ValueError):
    """``bool(x)``, ``int(x)``, ``float(x)``, ``complex(x)`` of an array whose size is not 1:
    both a ``TypeError`` (Heat's and numpy's for int/float) and a ``ValueError`` (numpy's for
    bool), so either ``except`` clause catches it."""


def _identity(x: object) -> object:
    return x


class _LocalIndexer:
    """``x.lloc``: indexing of a DNDarray's local tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __getitem__(self, key: object) -> torch.Tensor:
        return self._t[key]

    def __setitem__(self, key: object, value: object) -> None:
        self._t[key] = value


def _int_table(x: object, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, (np.ndarray, list, tuple)):
        t = torch.as_tensor(np.asarray(x))
    else:
        raise TypeError(f"{name} must be a torch.Tensor, numpy array or sequence, got "
                        f"{type(x).__name__}")
    if t.dtype.is_floating_point and not bool((t == t.round()).all()) or t.dtype.is_complex:
        raise TypeError(f"{name} must hold integers")
    return t.to(torch.int64).cpu()


def _normalize_split(split: object, ndim: int) -> int | None:
    if split is None:
        return None
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"split must be None or an integer axis, got {type(split).__name__}")
    s = int(split)
    if not -ndim <= s < ndim:
        raise ValueError(f"split axis {s} is out of range for an array of {ndim} dimension(s)")
    return s % ndim


class DNDarray:
    """A distributed n-dimensional array: one torch tensor per rank plus shared global metadata.

    Build DNDarrays with the factories (:func:`heatlike.array`, :func:`heatlike.zeros`, ...).
    The constructor wraps existing local tensors: ``larray`` is this rank's part of an array of
    global shape ``gshape`` split along ``split``. Without ``counts`` (every rank's extent along
    ``split``) the ranks exchange their local shapes (a small collective).
    """

    def __init__(self, larray: torch.Tensor, gshape: Sequence[int] | None = None,
                 split: int | None = None, comm: MPICommunication | None = None,
                 counts: Sequence[int] | None = None) -> None:
        if not isinstance(larray, torch.Tensor):
            raise TypeError(f"larray must be a torch.Tensor, got {type(larray).__name__}")
        comm = sanitize_comm(comm)
        requested, error = split, None
        try:
            canonical_dtype(larray.dtype)
            split = _normalize_split(split, larray.ndim)
        except (TypeError, ValueError) as bad:
            error = bad
        if error is not None:
            if requested is not None and counts is None:  # the others exchange shapes now
                gather_or_raise(None, error, comm, "DNDarray: the local shapes")
            raise error
        if split is None:
            gshape = tuple(larray.shape) if gshape is None else tuple(int(s) for s in gshape)
            if gshape != tuple(larray.shape):
                raise ValueError(f"a replicated array's larray has shape {tuple(larray.shape)}, "
                                 f"not the global shape {gshape}")
            counts_t = None
        else:
            if counts is None:
                shapes = gather_or_raise(tuple(larray.shape), None, comm,
                                         "DNDarray: the local shapes")
                counts = [s[split] for s in shapes]
                others = {s[:split] + s[split + 1:] for s in shapes}
                if len(others) != 1:
                    raise ValueError(f"local shapes {shapes} differ outside the split axis "
                                     f"{split}")
            counts_t = tuple(int(c) for c in counts)
            if len(counts_t) != comm.size:
                raise ValueError(f"counts has {len(counts_t)} entries for {comm.size} ranks")
            expect = list(larray.shape)
            expect[split] = sum(counts_t)
            if gshape is None:
                gshape = tuple(expect)
            gshape = tuple(int(s) for s in gshape)
            if gshape != tuple(expect) or larray.shape[split] != counts_t[comm.rank]:
                raise ValueError(f"larray of shape {tuple(larray.shape)} with counts {counts_t} "
                                 f"does not fit the global shape {gshape}")
        self._init(larray, gshape, split, counts_t, comm)

    def _init(self, larray: torch.Tensor, gshape: tuple[int, ...], split: int | None,
              counts: tuple[int, ...] | None, comm: MPICommunication) -> None:
        self.__array = larray
        self.__gshape = gshape
        self.__split = split
        self.__counts = counts
        self.__comm = comm
        self.__halo_prev: torch.Tensor | None = None
        self.__halo_next: torch.Tensor | None = None
        self.__partitions_dict__: dict | None = None

    @classmethod
    def _make(cls, larray: torch.Tensor, gshape: Sequence[int], split: int | None,
              counts: Sequence[int] | None, comm: MPICommunication) -> DNDarray:
        """Wrap without checks or communication (internal: the caller guarantees consistency)."""
        obj = cls.__new__(cls)
        obj._init(larray, tuple(gshape), split,
                  None if split is None else tuple(counts), comm)  # type: ignore[arg-type]
        return obj

    def _rewrap(self, larray: torch.Tensor) -> DNDarray:
        """A DNDarray with this one's layout around a new local tensor of the same shape."""
        return DNDarray._make(larray, self.__gshape, self.__split, self.__counts, self.__comm)

    # -- metadata ----------------------------------------------------------------------------

    @property
    def larray(self) -> torch.Tensor:
        """This rank's local tensor."""
        return self.__array

    @larray.setter
    def larray(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"larray must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != self.lshape:
            raise ValueError(f"the new larray has shape {tuple(value.shape)}, not this rank's "
                             f"local shape {self.lshape}; build a new DNDarray with "
                             "heatlike.array(..., is_split=...) to change the layout")
        canonical_dtype(value.dtype)
        self.__array = value
        self.__partitions_dict__ = None
        self.__halo_prev = self.__halo_next = None

    @property
    def gshape(self) -> tuple[int, ...]:
        """The global shape."""
        return self.__gshape

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape (numpy's name)."""
        return self.__gshape

    @property
    def lshape(self) -> tuple[int, ...]:
        """The shape of this rank's local tensor."""
        return tuple(self.__array.shape)

    @property
    def split(self) -> int | None:
        """The axis the array is distributed along, or None when every rank holds all of it."""
        return self.__split

    @property
    def comm(self) -> MPICommunication:
        return self.__comm

    @property
    def dtype(self) -> torch.dtype:
        return self.__array.dtype

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"gpu"``."""
        return device_name(self.__array)

    @property
    def ndim(self) -> int:
        return len(self.__gshape)

    @property
    def size(self) -> int:
        """The number of elements of the global array."""
        return int(np.prod(self.__gshape, dtype=np.int64))

    gnumel = size

    @property
    def lnumel(self) -> int:
        return self.__array.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the global array."""
        return self.size * self.__array.element_size()

    gnbytes = nbytes

    @property
    def lnbytes(self) -> int:
        return self.lnumel * self.__array.element_size()

    @property
    def counts(self) -> tuple[int, ...] | None:
        """Every rank's extent along ``split`` (None for a replicated array)."""
        return self.__counts

    @property
    def displs(self) -> tuple[int, ...] | None:
        """Where every rank's part starts along ``split`` (None for a replicated array)."""
        return None if self.__counts is None else distribution.offsets(self.__counts)

    def counts_displs(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(counts, displs)`` along the split axis (Heat's method)."""
        if self.__counts is None:
            raise ValueError("a replicated array (split=None) has no counts")
        return self.__counts, distribution.offsets(self.__counts)

    @property
    def lshape_map(self) -> torch.Tensor:
        """``(P, ndim)`` int64 tensor of every rank's local shape (no communication)."""
        rows = [distribution.local_shape(self.__gshape, self.__split,
                                         0 if self.__counts is None else self.__counts[r])
                for r in range(self.__comm.size)]
        return torch.tensor(rows, dtype=torch.int64).reshape(self.__comm.size, self.ndim)

    def create_lshape_map(self, force_check: bool = False) -> torch.Tensor:
        """Heat's spelling of :attr:`lshape_map`; ``force_check`` re-reads the local shapes of
        all ranks with a collective."""
        if force_check:
            shapes = self.__comm.allgather(self.lshape)
            return torch.tensor(shapes, dtype=torch.int64).reshape(self.__comm.size, self.ndim)
        return self.lshape_map

    def _ranges(self) -> list[tuple[int, int]]:
        return distribution.ranges(self.__counts)  # type: ignore[arg-type]

    @property
    def balanced(self) -> bool:
        """Whether the layout is the balanced one (replicated arrays are balanced)."""
        if self.__split is None:
            return True
        n = self.__gshape[self.__split]
        return self.__counts == distribution.balanced_counts(n, self.__comm.size)

    def is_balanced(self, force_check: bool = False) -> bool:
        """Whether the layout is balanced (every rank knows all counts: no communication)."""
        return self.balanced

    def is_distributed(self) -> bool:
        """Whether the data is spread over more than one rank."""
        return self.__split is not None and self.__comm.size > 1

    def balance_(self) -> DNDarray:
        """Redistribute in place to the balanced layout (one ``Alltoallv``; nothing if balanced)."""
        if not self.balanced:
            n = self.__gshape[self.__split]  # type: ignore[index]
            self.redistribute_(distribution.balanced_counts(n, self.__comm.size))
        return self

    def balance(self, copy: bool = False) -> DNDarray:
        """Heat's ``x.balance()``: :func:`heatlike.balance` (in place unless ``copy``)."""
        return manipulations.balance(self, copy=copy)

    def redistribute_(self, lshape_map: object = None, target_map: object = None) -> DNDarray:
        """Move data in place so that every rank holds the given extent of the split axis (one
        ``Alltoallv``).

        ``target_map`` (Heat's spelling): a ``(P, ndim)`` array of the local shapes wanted, of
        which only the split column is used. heatlike's spelling passes the counts per rank
        as the first argument (``x.redistribute_(counts)``). A ``(P, ndim)`` first argument is
        Heat's ``lshape_map`` (the current local shapes): it is checked for its shape and not
        needed otherwise (every rank knows the layout). Nothing happens to a replicated array.
        The counts must be non-negative and sum to the length of the split axis."""
        counts = None
        if lshape_map is not None:
            m = _int_table(lshape_map, "lshape_map")
            if m.ndim == 1 and target_map is None:
                counts = tuple(int(c) for c in m.tolist())
            elif m.shape != (self.__comm.size, self.ndim):
                raise ValueError(f"lshape_map must have shape ({self.__comm.size}, {self.ndim}), "
                                 f"got {tuple(m.shape)}")
        if target_map is not None:
            m = _int_table(target_map, "target_map")
            if m.ndim != 2 or m.shape != (self.__comm.size, self.ndim):
                raise ValueError(f"target_map must have shape ({self.__comm.size}, {self.ndim}), "
                                 f"got {tuple(m.shape)}")
            if self.__split is None:
                return self
            counts = tuple(int(c) for c in m[:, self.__split].tolist())
        if counts is None:
            if lshape_map is not None:
                return self
            raise TypeError("redistribute_ needs the counts per rank (or target_map)")
        if self.__split is None:
            raise ValueError("redistribute_ needs a split array")
        if len(counts) != self.__comm.size or any(c < 0 for c in counts) \
                or sum(counts) != self.__gshape[self.__split]:
            raise ValueError(f"counts {counts} must hold one non-negative entry per rank and sum "
                             f"to {self.__gshape[self.__split]}")
        if counts != self.__counts:
            self.__array = distribution.move(
                self.__array, self.__gshape, self.__split, self._ranges(), self.__split,
                distribution.ranges(counts), self.__comm)
            self.__counts = counts
            self.__partitions_dict__ = None
            self.__halo_prev = self.__halo_next = None
        return self

    def collect_(self, target_rank: int = 0) -> DNDarray:
        """Move all data of a split array to ``target_rank`` in place (the others keep empty
        parts; one ``Alltoallv``). Nothing happens to a replicated array."""
        if isinstance(target_rank, bool) or not isinstance(target_rank, (int, np.integer)):
            raise TypeError(f"target_rank must be an integer, got {type(target_rank).__name__}")
        if not 0 <= int(target_rank) < self.__comm.size:
            raise ValueError(f"target_rank {target_rank} is out of range for "
                             f"{self.__comm.size} ranks")
        if self.__split is None:
            return self
        counts = [0] * self.__comm.size
        counts[int(target_rank)] = self.__gshape[self.__split]
        return self.redistribute_(counts)

    # -- halos (Heat) ------------------------------------------------------------------------

    def get_halo(self, halo_size: int, prev: bool = True, next: bool = True) -> None:  # noqa: A002
        """Fetch ``halo_size`` slabs of the split axis from the neighbouring ranks that hold
        data: ``halo_prev`` gets the last ones of the previous rank, ``halo_next`` the first ones
        of the next (``prev`` / ``next`` select which). Ranks with empty parts are skipped.
        ``ValueError`` on every rank when ``halo_size`` exceeds a non-empty part. Point-to-point
        ``Isend``/``Irecv`` between neighbours; a no-op for arrays that are not distributed."""
        if isinstance(halo_size, bool) or not isinstance(halo_size, (int, np.integer)):
            raise TypeError(f"halo_size must be an integer, got {type(halo_size).__name__}")
        if halo_size < 0:
            raise ValueError(f"halo_size must be non-negative, got {halo_size}")
        self.__halo_prev = self.__halo_next = None
        if not self.is_distributed() or halo_size == 0:
            return
        counts = self.__counts
        populated = [r for r, c in enumerate(counts) if c]  # type: ignore[union-attr]
        if any(counts[r] < halo_size for r in populated):  # type: ignore[index]
            raise ValueError(f"halo_size {halo_size} is larger than a rank's part "
                             f"(counts {counts})")
        rank = self.__comm.rank
        if rank not in populated:
            return
        i = populated.index(rank)
        before = populated[i - 1] if i > 0 else None
        after = populated[i + 1] if i + 1 < len(populated) else None
        s, t = self.__split, self.__array
        n = t.shape[s]
        reqs = []
        recv_prev = recv_next = None
        shape = list(t.shape)
        shape[s] = halo_size
        if prev:
            if after is not None:
                reqs.append(self.__comm.Isend(t.narrow(s, n - halo_size, halo_size).contiguous(),
                                              dest=after, tag=_HALO_TAG))
            if before is not None:
                recv_prev = torch.empty(shape, dtype=t.dtype, device=t.device)
                reqs.append(self.__comm.Irecv(recv_prev, source=before, tag=_HALO_TAG))
        if next:
            if before is not None:
                reqs.append(self.__comm.Isend(t.narrow(s, 0, halo_size).contiguous(),
                                              dest=before, tag=_HALO_TAG + 1))
            if after is not None:
                recv_next = torch.empty(shape, dtype=t.dtype, device=t.device)
                reqs.append(self.__comm.Irecv(recv_next, source=after, tag=_HALO_TAG + 1))
        for req in reqs:
            req.Wait()
        self.__halo_prev, self.__halo_next = recv_prev, recv_next

    @property
    def halo_prev(self) -> torch.Tensor | None:
        """The slabs fetched from the previous rank by :meth:`get_halo` (or None)."""
        return self.__halo_prev

    @property
    def halo_next(self) -> torch.Tensor | None:
        """The slabs fetched from the next rank by :meth:`get_halo` (or None)."""
        return self.__halo_next

    @property
    def array_with_halos(self) -> torch.Tensor:
        """The local tensor with the fetched halos joined along the split axis."""
        parts = [p for p in (self.__halo_prev, self.__array, self.__halo_next) if p is not None]
        if len(parts) == 1:
            return self.__array
        return torch.cat(parts, dim=self.__split)

    def __len__(self) -> int:
        if not self.__gshape:
            raise TypeError("len() of a 0-d array")
        return self.__gshape[0]

    def __iter__(self) -> Iterator[DNDarray]:
        if not self.__gshape:
            raise TypeError("iteration over a 0-d array")
        for i in range(self.__gshape[0]):
            yield self[i]

    # -- conversion --------------------------------------------------------------------------

    def to_torch(self) -> torch.Tensor:
        """The whole array as one torch tensor on every rank (``Allgatherv`` along ``split``),
        on this array's device; a copy."""
        if self.__split is None:
            return self.__array.clone(memory_format=torch.contiguous_format)
        return distribution.move(self.__array, self.__gshape, self.__split, self._ranges(), None,
                                 None, self.__comm)

    def numpy(self) -> np.ndarray:
        """The whole array as a numpy array on every rank (bfloat16 becomes float32)."""
        t = self.to_torch().cpu()
        if t.dtype is torch.bfloat16:
            t = t.float()
        return t.numpy()

    def __array__(self, dtype: object = None, copy: bool | None = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def tolist(self, keepsplit: bool = False) -> object:
        """The array as nested Python lists on every rank; ``keepsplit=True``: this rank's part
        only (no communication)."""
        if keepsplit:
            t = self.__array.cpu()
            return (t.float() if t.dtype is torch.bfloat16 else t).tolist()
        return self.numpy().tolist()

    def item(self) -> bool | int | float | complex:
        """The single element as a Python scalar on every rank."""
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.to_torch().item()

    def _scalar(self, what: str) -> bool | int | float | complex:
        if self.size != 1:
            if what == "bool":
                raise ScalarConversionError(
                    f"The truth value of an array of shape {self.__gshape} is ambiguous (only "
                    "size-1 arrays have one). Use a.any() or a.all()")
            raise ScalarConversionError(f"only arrays of size 1 can be converted to a Python "
                                        f"{what}; this one has shape {self.__gshape}")
        return self.item()

    def __bool__(self) -> bool:
        return bool(self._scalar("bool"))

    def __int__(self) -> int:
        return int(self._scalar("int"))  # type: ignore[arg-type]

    def __float__(self) -> float:
        return float(self._scalar("float"))  # type: ignore[arg-type]

    def __complex__(self) -> complex:
        return complex(self._scalar("complex"))

    def __round__(self, ndigits: int | None = None) -> object:
        """``round(x)``: a Python number for a one-element array, else the rounded array."""
        if self.size == 1:
            return round(self.item(), ndigits)  # type: ignore[arg-type]
        return arithmetics.round(self, ndigits or 0)

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.dtype.is_complex or self.dtype is torch.bool:
            raise TypeError("only integer arrays of size 1 can be converted to an index")
        return int(self.item())  # type: ignore[arg-type]

    def astype(self, dtype: object, copy: bool = True) -> DNDarray:
        """The array converted to ``dtype`` (no communication)."""
        dtype = canonical_dtype(dtype)
        if dtype is self.dtype and not copy:
            return self
        return self._rewrap(self.__array.to(dtype, copy=True))

    def copy(self) -> DNDarray:
        return self._rewrap(self.__array.clone())

    def to(self, device: object) -> DNDarray:
        """The array on ``device`` (``"cpu"`` / ``"gpu"``); ``self`` if it is there already."""
        name = sanitize_device(device)
        if name == self.device:
            return self
        return self._rewrap(self.__array.to(torch_device(name)))

    def to_device(self, device: object, stream: object = None) -> DNDarray:
        """The array API's spelling of :meth:`to` (``stream`` is not supported: ValueError)."""
        if stream is not None:
            raise ValueError("to_device: streams are not supported; pass stream=None")
        return self.to(device)

    # -- protocols: DLPack, __partitioned__ --------------------------------------------------

    def __dlpack__(self, **kwargs: object) -> object:
        """The DLPack capsule of the array's memory. Only an array that is not distributed has
        one buffer (``BufferError`` otherwise; use ``x.larray.__dlpack__()`` for the local part
        or :func:`heatlike.from_dlpack` with ``is_split``)."""
        if self.is_distributed():
            raise BufferError("a distributed DNDarray has no single buffer: export its local "
                              "part (x.larray) or replicate it first (x.resplit(None))")
        return self.__array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.__array.__dlpack_device__()

    @property
    def __partitioned__(self) -> dict:
        """The ``__partitioned__`` protocol (zero-copy exchange with other distributed array
        libraries): ``shape``, ``partition_tiling`` (``P`` along the split axis, 1 elsewhere),
        ``partitions`` (``{tile index: {"start", "shape", "data", "location", "dtype",
        "device"}}``: ``data`` is the local tensor for this rank's tile and None for the others;
        a replicated array has one tile located on every rank), ``locals`` (this rank's tile
        indices) and ``get`` (identity: local data are the tensors themselves). No communication;
        the dictionary is cached until the layout changes."""
        if self.__partitions_dict__ is None:
            self.__partitions_dict__ = self._partition_interface()
        return self.__partitions_dict__

    def _partition_interface(self) -> dict:
        nd, size, rank = self.ndim, self.__comm.size, self.__comm.rank
        dtype = self.dtype
        dev = str(self.__array.device)
        if self.__split is None:
            key = (0,) * nd
            parts = {key: {"start": (0,) * nd, "shape": self.__gshape, "data": self.__array,
                           "location": list(range(size)), "dtype": dtype, "device": dev}}
            tiling = (1,) * nd
            mine = [key]
        else:
            parts = {}
            for r, (lo, hi) in enumerate(self._ranges()):
                key = tuple(r if d == self.__split else 0 for d in range(nd))
                start = tuple(lo if d == self.__split else 0 for d in range(nd))
                shape = distribution.local_shape(self.__gshape, self.__split, hi - lo)
                parts[key] = {"start": start, "shape": shape,
                              "data": self.__array if r == rank else None, "location": [r],
                              "dtype": dtype, "device": dev}
            tiling = tuple(size if d == self.__split else 1 for d in range(nd))
            mine = [tuple(rank if d == self.__split else 0 for d in range(nd))]
        return {"shape": self.__gshape, "partition_tiling": tiling, "partitions": parts,
                "locals": mine, "get": _identity}

    # -- Heat's local helpers ----------------------------------------------------------------

    @property
    def lloc(self) -> _LocalIndexer:
        """Indexing of the local tensor: ``x.lloc[key]`` is ``x.larray[key]`` and
        ``x.lloc[key] = v`` writes into it (no communication)."""
        return _LocalIndexer(self.__array)

    def stride(self, dim: int | None = None) -> tuple[int, ...] | int:
        """The local tensor's strides in elements (torch's ``stride()``)."""
        return self.__array.stride() if dim is None else self.__array.stride(dim)

    @property
    def strides(self) -> tuple[int, ...]:
        """The local tensor's strides in bytes (numpy's ``strides``)."""
        size = self.__array.element_size()
        return tuple(st * size for st in self.__array.stride())

    def fill_diagonal(self, value: float) -> DNDarray:
        """Write ``value`` on the main diagonal of a 2-D array, in place (each rank writes the
        entries it holds)."""
        if self.ndim != 2:
            raise ValueError(f"fill_diagonal needs a 2-D array, got {self.ndim} dimensions")
        n = min(self.__gshape)
        lo = 0 if self.__split is None else self._ranges()[self.__comm.rank][0]
        hi = lo + (self.__array.shape[self.__split] if self.__split is not None else n)
        idx = torch.arange(lo, max(lo, min(hi, n)), device=self.__array.device)
        if idx.numel():
            if self.__split == 0:
                self.__array[idx - lo, idx] = value
            elif self.__split == 1:
                self.__array[idx, idx - lo] = value
            else:
                self.__array[idx, idx] = value
        return self

    def cpu(self) -> DNDarray:
        return self.to("cpu")

    def gpu(self) -> DNDarray:
        return self.to("gpu")

    def __repr__(self) -> str:
        """A local representation: no communication, so any one rank may take it (debuggers,
        test reports, logging). An array that is not distributed shows all its values; a
        distributed one shows this rank's part and where it lies. ``str(x)`` / ``print(x)``
        gather a preview of the whole array instead (collective)."""
        meta = (f"shape={self.__gshape}, dtype={str(self.dtype).removeprefix('torch.')}, "
                f"split={self.__split}, device={self.device}")
        t = self.__array.detach().cpu()
        arr = (t.float() if t.dtype is torch.bfloat16 else t).numpy()
        if not self.is_distributed():
            body = np.array2string(arr, separator=", ", prefix="DNDarray(", threshold=1000,
                                   edgeitems=3)
            return f"DNDarray({body}, {meta})"
        lo, hi = self._ranges()[self.__comm.rank]
        body = np.array2string(arr, separator=", ", prefix="  ", threshold=1000, edgeitems=3)
        return (f"DNDarray({meta}, rank {self.__comm.rank} of {self.__comm.size} holds "
                f"[{lo}:{hi}] of axis {self.__split}:\n  {body})")

    def __str__(self) -> str:
        """A preview of the whole array, gathered on rank 0 (collective: every rank calls it,
        e.g. ``print(x)`` on all ranks; see :mod:`heatlike.core.printing`)."""
        return printing.dndarray_repr(self)

    # -- layout ------------------------------------------------------------------------------

    def resplit(self, axis: int | None = None) -> DNDarray:
        """A copy distributed along ``axis`` (None: replicated), balanced (one ``Alltoallv``;
        ``Allgatherv`` for None)."""
        return manipulations.resplit(self, axis)

    def resplit_(self, axis: int | None = None) -> DNDarray:
        """In-place :meth:`resplit`."""
        new = manipulations.resplit(self, axis)
        self._init(new.larray, new.gshape, new.split, new.counts, new.comm)
        return self

    def reshape(self, *shape: int | Sequence[int], new_split: int | None = None,
                dtype: object = None) -> DNDarray:
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]  # type: ignore[assignment]
        return manipulations.reshape(self, shape, new_split=new_split,  # type: ignore[arg-type]
                                     dtype=dtype)

    def transpose(self, *axes: int | Sequence[int]) -> DNDarray:
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])  # type: ignore[arg-type]
        return manipulations.transpose(self, axes or None)  # type: ignore[arg-type]

    @property
    def T(self) -> DNDarray:
        return manipulations.transpose(self)

    def squeeze(self, axis: int | Sequence[int] | None = None) -> DNDarray:
        return manipulations.squeeze(self, axis)

    def expand_dims(self, axis: int) -> DNDarray:
        return manipulations.expand_dims(self, axis)

    def flatten(self) -> DNDarray:
        return manipulations.flatten(self)

    def swapaxes(self, axis1: int, axis2: int) -> DNDarray:
        return manipulations.swapaxes(self, axis1, axis2)

    def moveaxis(self, source, destination) -> DNDarray:
        return manipulations_more.moveaxis(self, source, destination)

    def tril(self, k: int = 0) -> DNDarray:
        return manipulations_more.tril(self, k)

    def triu(self, k: int = 0) -> DNDarray:
        return manipulations_more.triu(self, k)

    def unique(self, sorted: bool = False, return_inverse: bool = False, axis=None):  # noqa: A002
        return manipulations_more.unique(self, sorted=sorted, return_inverse=return_inverse,
                                         axis=axis)

    def flip(self, axis=None) -> DNDarray:
        return manipulations_more.flip(self, axis)

    def roll(self, shift, axis=None) -> DNDarray:
        return manipulations_more.roll(self, shift, axis)

    def sort(self, axis: int = -1, descending: bool = False):
        return manipulations_more.sort(self, axis, descending=descending)

    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> DNDarray:
        return manipulations_more.diagonal(self, offset, dim1, dim2)

    def collect(self, target_rank: int = 0) -> DNDarray:
        return manipulations_more.collect(self, target_rank)

    ravel = flatten

    # -- reductions --------------------------------------------------------------------------

    def sum(self, axis=None, keepdims: bool = False, dtype=None, out=None) -> DNDarray:
        return reductions.sum(self, axis, keepdims=keepdims, dtype=dtype, out=out)

    def prod(self, axis=None, keepdims: bool = False, dtype=None, out=None) -> DNDarray:
        return reductions.prod(self, axis, keepdims=keepdims, dtype=dtype, out=out)

    def mean(self, axis=None, keepdims: bool = False) -> DNDarray:
        return reductions.mean(self, axis, keepdims=keepdims)

    def var(self, axis=None, ddof: int = 0, keepdims: bool = False, bessel=None) -> DNDarray:
        return reductions.var(self, axis, ddof=ddof, keepdims=keepdims, bessel=bessel)

    def std(self, axis=None, ddof: int = 0, keepdims: bool = False, bessel=None) -> DNDarray:
        return reductions.std(self, axis, ddof=ddof, keepdims=keepdims, bessel=bessel)

    def min(self, axis=None, keepdims: bool = False, out=None) -> DNDarray:
        return reductions.min(self, axis, keepdims=keepdims, out=out)

    def max(self, axis=None, keepdims: bool = False, out=None) -> DNDarray:
        return reductions.max(self, axis, keepdims=keepdims, out=out)

    def argmin(self, axis: int | None = None, keepdims: bool = False, out=None) -> DNDarray:
        return reductions.argmin(self, axis, keepdims=keepdims, out=out)

    def argmax(self, axis: int | None = None, keepdims: bool = False, out=None) -> DNDarray:
        return reductions.argmax(self, axis, keepdims=keepdims, out=out)

    def average(self, axis=None, weights=None, returned: bool = False):
        return statistics.average(self, axis=axis, weights=weights, returned=returned)

    def kurtosis(self, axis=None, unbiased: bool = True, Fischer: bool = True) -> DNDarray:  # noqa: N803
        return statistics.kurtosis(self, axis, unbiased=unbiased, Fischer=Fischer)

    def skew(self, axis=None, unbiased: bool = True) -> DNDarray:
        return statistics.skew(self, axis, unbiased=unbiased)

    def ptp(self, axis=None, out=None, keepdims: bool = False) -> DNDarray:
        return statistics.ptp(self, axis, out=out, keepdims=keepdims)

    def percentile(self, q, axis=None, out=None, interpolation: str = "linear",
                   keepdims: bool = False) -> DNDarray:
        return statistics.percentile(self, q, axis=axis, out=out, interpolation=interpolation,
                                     keepdims=keepdims)

    def median(self, axis=None, keepdims: bool = False) -> DNDarray:
        return statistics.median(self, axis=axis, keepdims=keepdims)

    def all(self, axis=None, keepdims: bool = False, out=None) -> DNDarray:
        return reductions.all(self, axis, keepdims=keepdims, out=out)

    def any(self, axis=None, keepdims: bool = False, out=None) -> DNDarray:
        return reductions.any(self, axis, keepdims=keepdims, out=out)

    # -- elementwise -------------------------------------------------------------------------

    def __add__(self, other): return arithmetics.binary_operator("add", self, other)
    def __radd__(self, other): return arithmetics.binary_operator("add", other, self)
    def __iadd__(self, other): return arithmetics.inplace("add", self, other)
    def __sub__(self, other): return arithmetics.binary_operator("subtract", self, other)
    def __rsub__(self, other): return arithmetics.binary_operator("subtract", other, self)
    def __isub__(self, other): return arithmetics.inplace("subtract", self, other)
    def __mul__(self, other): return arithmetics.binary_operator("multiply", self, other)
    def __rmul__(self, other): return arithmetics.binary_operator("multiply", other, self)
    def __imul__(self, other): return arithmetics.inplace("multiply", self, other)
    def __truediv__(self, other): return arithmetics.binary_operator("divide", self, other)
    def __rtruediv__(self, other): return arithmetics.binary_operator("divide", other, self)
    def __itruediv__(self, other): return arithmetics.inplace("divide", self, other)
    def __floordiv__(self, other):
        return arithmetics.binary_operator("floor_divide", self, other)
    def __rfloordiv__(self, other):
        return arithmetics.binary_operator("floor_divide", other, self)
    def __ifloordiv__(self, other): return arithmetics.inplace("floor_divide", self, other)
    def __mod__(self, other): return arithmetics.binary_operator("remainder", self, other)
    def __rmod__(self, other): return arithmetics.binary_operator("remainder", other, self)
    def __imod__(self, other): return arithmetics.inplace("remainder", self, other)
    def __divmod__(self, other): return _divmod_operator(self, other)
    def __rdivmod__(self, other): return _divmod_operator(other, self)
    def __pow__(self, other): return arithmetics.binary_operator("power", self, other)
    def __rpow__(self, other): return arithmetics.binary_operator("power", other, self)
    def __ipow__(self, other): return arithmetics.inplace("power", self, other)
    def __and__(self, other): return arithmetics.binary_operator("bitwise_and", self, other)
    def __rand__(self, other): return arithmetics.binary_operator("bitwise_and", other, self)
    def __iand__(self, other): return arithmetics.inplace("bitwise_and", self, other)
    def __or__(self, other): return arithmetics.binary_operator("bitwise_or", self, other)
    def __ror__(self, other): return arithmetics.binary_operator("bitwise_or", other, self)
    def __ior__(self, other): return arithmetics.inplace("bitwise_or", self, other)
    def __xor__(self, other): return arithmetics.binary_operator("bitwise_xor", self, other)
    def __rxor__(self, other): return arithmetics.binary_operator("bitwise_xor", other, self)
    def __ixor__(self, other): return arithmetics.inplace("bitwise_xor", self, other)
    def __lshift__(self, other): return arithmetics.binary_operator("left_shift", self, other)
    def __rlshift__(self, other): return arithmetics.binary_operator("left_shift", other, self)
    def __ilshift__(self, other): return arithmetics.inplace("left_shift", self, other)
    def __rshift__(self, other): return arithmetics.binary_operator("right_shift", self, other)
    def __rrshift__(self, other): return arithmetics.binary_operator("right_shift", other, self)
    def __irshift__(self, other): return arithmetics.inplace("right_shift", self, other)
    def __eq__(self, other): return arithmetics.binary_operator("eq", self, other)  # type: ignore[override]
    def __ne__(self, other): return arithmetics.binary_operator("not_equal", self, other)  # type: ignore[override]
    def __lt__(self, other): return arithmetics.binary_operator("less", self, other)
    def __le__(self, other): return arithmetics.binary_operator("less_equal", self, other)
    def __gt__(self, other): return arithmetics.binary_operator("greater", self, other)
    def __ge__(self, other): return arithmetics.binary_operator("greater_equal", self, other)
    def __neg__(self): return arithmetics.negative(self)
    def __pos__(self): return arithmetics.positive(self)
    def __abs__(self): return arithmetics.absolute(self)
    def __invert__(self): return arithmetics.invert(self)

    __hash__ = None  # type: ignore[assignment]

    def __matmul__(self, other): return linalg.matmul(self, other)
    def __rmatmul__(self, other): return linalg.matmul(other, self)

    # Heat's in-place methods: x.add_(y) is x += y (see heatlike.core.arithmetics.inplace)
    def add_(self, other): return arithmetics.inplace_method("add", self, other)
    def sub_(self, other): return arithmetics.inplace_method("subtract", self, other)
    subtract_ = sub_
    def mul_(self, other): return arithmetics.inplace_method("multiply", self, other)
    multiply_ = mul_
    def div_(self, other): return arithmetics.inplace_method("divide", self, other)
    divide_ = true_divide_ = div_
    def floordiv_(self, other): return arithmetics.inplace_method("floor_divide", self, other)
    floor_divide_ = floordiv_
    def remainder_(self, other): return arithmetics.inplace_method("remainder", self, other)
    mod_ = remainder_
    def fmod_(self, other): return arithmetics.inplace_method("fmod", self, other)
    def pow_(self, other): return arithmetics.inplace_method("power", self, other)
    power_ = pow_
    def bitwise_and_(self, other): return arithmetics.inplace_method("bitwise_and", self, other)
    def bitwise_or_(self, other): return arithmetics.inplace_method("bitwise_or", self, other)
    def bitwise_xor_(self, other): return arithmetics.inplace_method("bitwise_xor", self, other)
    def left_shift_(self, other): return arithmetics.inplace_method("left_shift", self, other)
    def right_shift_(self, other): return arithmetics.inplace_method("right_shift", self, other)
    def copysign_(self, other): return arithmetics.inplace_method("copysign", self, other)
    def hypot_(self, other): return arithmetics.inplace_method("hypot", self, other)
    def gcd_(self, other): return arithmetics.inplace_method("gcd", self, other)
    def lcm_(self, other): return arithmetics.inplace_method("lcm", self, other)

    def neg_(self) -> DNDarray:
        """In-place negation."""
        return arithmetics.inplace_unary(self, torch.neg, "negative")

    negative_ = neg_

    def pos_(self) -> DNDarray:
        """In-place ``+x`` (nothing changes)."""
        return self

    positive_ = pos_

    def invert_(self) -> DNDarray:
        """In-place bitwise (logical for bool) not."""
        arithmetics._probe(torch.bitwise_not, "invert", [self.larray])
        return arithmetics.inplace_unary(self, torch.bitwise_not, "invert")

    bitwise_not_ = invert_

    def abs_(self) -> DNDarray:
        return arithmetics.inplace_unary(self, torch.abs, "absolute")

    def nan_to_num_(self, nan: float = 0.0, posinf: float | None = None,
                    neginf: float | None = None) -> DNDarray:
        """In-place :func:`heatlike.nan_to_num`."""
        return arithmetics.inplace_unary(
            self, lambda t: torch.nan_to_num(t, nan=nan, posinf=posinf, neginf=neginf),
            "nan_to_num")

    def cumsum(self, axis: int, dtype: object = None, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.cumsum(self, axis, dtype=dtype, out=out)

    def cumprod(self, axis: int, dtype: object = None, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.cumprod(self, axis, dtype=dtype, out=out)

    def cumsum_(self, axis: int) -> DNDarray:
        """In-place cumulative sum along ``axis`` (kept in ``x``'s dtype)."""
        return self._overwrite(arithmetics.cumsum(self, _int_axis(axis)), "cumsum")

    def cumprod_(self, axis: int) -> DNDarray:
        """In-place cumulative product along ``axis`` (kept in ``x``'s dtype)."""
        return self._overwrite(arithmetics.cumprod(self, _int_axis(axis)), "cumprod")

    cumproduct_ = cumprod_

    def _overwrite(self, res: DNDarray, name: str) -> DNDarray:
        if not torch.can_cast(res.dtype, self.dtype):
            raise TypeError(f"Cannot cast ufunc '{name}' output from {res.dtype} to "
                            f"{self.dtype} with casting rule 'same_kind'")
        self.__array.copy_(res.larray)
        return self

    def abs(self, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.absolute(self, out=out)

    absolute = abs

    def sqrt(self, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.sqrt(self, out=out)

    def exp(self, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.exp(self, out=out)

    def log(self, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.log(self, out=out)

    def clip(self, min=None, max=None, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.clip(self, min, max, out=out)

    def round(self, decimals: int = 0, out: DNDarray | None = None, dtype=None) -> DNDarray:
        return arithmetics.round(self, decimals, out=out, dtype=dtype)

    def nan_to_num(self, nan: float = 0.0, posinf: float | None = None,
                   neginf: float | None = None, out: DNDarray | None = None) -> DNDarray:
        return arithmetics.nan_to_num(self, nan=nan, posinf=posinf, neginf=neginf, out=out)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: object,
                        **kwargs: object) -> object:
        """numpy ufuncs on DNDarrays give DNDarrays: ``np.add(x, 1)`` is ``heatlike.add(x, 1)``.
        Only plain calls of the ufuncs heatlike implements are handled (``out=`` one DNDarray);
        anything else (``np.add.reduce``, unknown ufuncs) is a ``TypeError`` from numpy."""
        return interop.array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: object, types: tuple, args: tuple,
                           kwargs: dict) -> object:
        """numpy functions on DNDarrays call heatlike's function of the same name
        (``np.concatenate``, ``np.sum``, ...); a function heatlike lacks is a ``TypeError``."""
        return interop.array_function(func, types, args, kwargs)

    @classmethod
    def __torch_function__(cls, func: object, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        """torch functions on DNDarrays call heatlike's function of the same name
        (``torch.sum``, ``torch.concatenate``); others are a ``TypeError`` from torch."""
        return interop.torch_function(func, types, args, kwargs or {})

    def __torch_proxy__(self) -> torch.Tensor:
        """A tensor of the global shape backed by one byte (zero strides), for torch's shape
        logic."""
        return torch.zeros((), dtype=torch.uint8, device=self.__array.device).expand(
            self.__gshape)

    # -- indexing ----------------------------------------------------------------------------

    def __getitem__(self, key: object) -> DNDarray:
        return indexing.getitem(self, key)

    def __setitem__(self, key: object, value: object) -> None:
        indexing.setitem(self, key, value)

    # -- io ----------------------------------------------------------------------------------

    def save(self, path: str, *args, **kwargs) -> None:
        """Write to ``.npy`` or HDF5 (``.h5``/``.hdf5``, ``dataset`` argument); see
        :func:`heatlike.save`."""
        io.save(self, path, *args, **kwargs)


def _int_axis(axis: object) -> int:
    if axis is None:
        raise NotImplementedError("an in-place cumulative operation needs an axis")
    if isinstance(axis, (tuple, list)):
        raise ValueError(f"an in-place cumulative operation takes one axis, got {axis!r}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an integer, got {type(axis).__name__}")
    return int(axis)


def _divmod_operator(x1: object, x2: object) -> object:
    if not all(isinstance(v, (DNDarray, int, float, bool, np.number, np.ndarray, torch.Tensor))
               for v in (x1, x2)):
        return NotImplemented
    return arithmetics.divmod(x1, x2)


# the operation modules import DNDarray from here; imported last to close the cycle
from . import (  # noqa: E402
    arithmetics,
    indexing,
    interop,
    io,
    linalg,
    manipulations,
    manipulations_more,
    printing,
    reductions,
    statistics,
)
