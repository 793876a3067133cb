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
from .communication import MPICommunication, sanitize_comm
from .devices import device_name, sanitize_device, torch_device
from .types import canonical_dtype

__all__ = ["DNDarray"]


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

    # numpy defers binary operators on DNDarray operands to DNDarray's reflected methods
    __array_ufunc__ = None

    def __init__(self, larray: torch.Tensor, gshape: Sequence[int] | None = None,
                 split: int | None = None, comm: MPICommunication | None = None,
                 counts: Sequence[int] | None = None) -> None:
        if not isinstance(larray, torch.Tensor):
            raise TypeError(f"larray must be a torch.Tensor, got {type(larray).__name__}")
        canonical_dtype(larray.dtype)
        comm = sanitize_comm(comm)
        split = _normalize_split(split, larray.ndim)
        if split is None:
            gshape = tuple(larray.shape) if gshape is None else tuple(int(s) for s in gshape)
            if gshape != tuple(larray.shape):
                raise ValueError(f"a replicated array's larray has shape {tuple(larray.shape)}, "
                                 f"not the global shape {gshape}")
            counts_t = None
        else:
            if counts is None:
                shapes = comm.allgather(tuple(larray.shape))
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

    def redistribute_(self, counts: Sequence[int]) -> DNDarray:
        """Move data in place so that rank r holds ``counts[r]`` indices of the split axis
        (one ``Alltoallv``)."""
        if self.__split is None:
            raise ValueError("redistribute_ needs a split array")
        counts = tuple(int(c) for c in counts)
        if len(counts) != self.__comm.size or any(c < 0 for c in counts) \
                or sum(counts) != self.__gshape[self.__split]:
            raise ValueError(f"counts {counts} must hold one non-negative entry per rank and sum "
                             f"to {self.__gshape[self.__split]}")
        if counts != self.__counts:
            self.__array = distribution.move(
                self.__array, self.__gshape, self.__split, self._ranges(), self.__split,
                distribution.ranges(counts), self.__comm)
            self.__counts = counts
        return self

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

    def tolist(self) -> object:
        return self.numpy().tolist()

    def item(self) -> bool | int | float | complex:
        """The single element as a Python scalar on every rank."""
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.to_torch().item()

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())  # type: ignore[arg-type]

    def __float__(self) -> float:
        return float(self.item())  # type: ignore[arg-type]

    def __complex__(self) -> complex:
        return complex(self.item())

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
        """The array on ``device`` (``"cpu"`` / ``"gpu"``)."""
        name = sanitize_device(device)
        if name == self.device:
            return self
        return self._rewrap(self.__array.to(torch_device(name)))

    def cpu(self) -> DNDarray:
        return self.to("cpu")

    def gpu(self) -> DNDarray:
        return self.to("gpu")

    def __repr__(self) -> str:
        return printing.dndarray_repr(self)

    __str__ = __repr__

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

    def reshape(self, *shape: int | Sequence[int], new_split: int | None = None) -> DNDarray:
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])  # type: ignore[arg-type]
        return manipulations.reshape(self, shape, new_split=new_split)  # type: ignore[arg-type]

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

    ravel = flatten

    # -- reductions --------------------------------------------------------------------------

    def sum(self, axis=None, keepdims: bool = False, dtype=None) -> DNDarray:
        return reductions.sum(self, axis, keepdims=keepdims, dtype=dtype)

    def prod(self, axis=None, keepdims: bool = False, dtype=None) -> DNDarray:
        return reductions.prod(self, axis, keepdims=keepdims, dtype=dtype)

    def mean(self, axis=None, keepdims: bool = False) -> DNDarray:
        return reductions.mean(self, axis, keepdims=keepdims)

    def var(self, axis=None, ddof: int = 0, keepdims: bool = False) -> DNDarray:
        return reductions.var(self, axis, ddof=ddof, keepdims=keepdims)

    def std(self, axis=None, ddof: int = 0, keepdims: bool = False) -> DNDarray:
        return reductions.std(self, axis, ddof=ddof, keepdims=keepdims)

    def min(self, axis=None, keepdims: bool = False) -> DNDarray:
        return reductions.min(self, axis, keepdims=keepdims)

    def max(self, axis=None, keepdims: bool = False) -> DNDarray:
        return reductions.max(self, axis, keepdims=keepdims)

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> DNDarray:
        return reductions.argmin(self, axis, keepdims=keepdims)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> DNDarray:
        return reductions.argmax(self, axis, keepdims=keepdims)

    def all(self, axis=None, keepdims: bool = False) -> DNDarray:
        return reductions.all(self, axis, keepdims=keepdims)

    def any(self, axis=None, keepdims: bool = False) -> DNDarray:
        return reductions.any(self, axis, keepdims=keepdims)

    # -- elementwise -------------------------------------------------------------------------

    def __add__(self, other): return arithmetics.add(self, other)
    def __radd__(self, other): return arithmetics.add(other, self)
    def __iadd__(self, other): return arithmetics.inplace("add", self, other)
    def __sub__(self, other): return arithmetics.subtract(self, other)
    def __rsub__(self, other): return arithmetics.subtract(other, self)
    def __isub__(self, other): return arithmetics.inplace("subtract", self, other)
    def __mul__(self, other): return arithmetics.multiply(self, other)
    def __rmul__(self, other): return arithmetics.multiply(other, self)
    def __imul__(self, other): return arithmetics.inplace("multiply", self, other)
    def __truediv__(self, other): return arithmetics.divide(self, other)
    def __rtruediv__(self, other): return arithmetics.divide(other, self)
    def __itruediv__(self, other): return arithmetics.inplace("divide", self, other)
    def __floordiv__(self, other): return arithmetics.floor_divide(self, other)
    def __rfloordiv__(self, other): return arithmetics.floor_divide(other, self)
    def __ifloordiv__(self, other): return arithmetics.inplace("floor_divide", self, other)
    def __mod__(self, other): return arithmetics.remainder(self, other)
    def __rmod__(self, other): return arithmetics.remainder(other, self)
    def __imod__(self, other): return arithmetics.inplace("remainder", self, other)
    def __pow__(self, other): return arithmetics.power(self, other)
    def __rpow__(self, other): return arithmetics.power(other, self)
    def __ipow__(self, other): return arithmetics.inplace("power", self, other)
    def __and__(self, other): return arithmetics.bitwise_and(self, other)
    def __rand__(self, other): return arithmetics.bitwise_and(other, self)
    def __iand__(self, other): return arithmetics.inplace("bitwise_and", self, other)
    def __or__(self, other): return arithmetics.bitwise_or(self, other)
    def __ror__(self, other): return arithmetics.bitwise_or(other, self)
    def __ior__(self, other): return arithmetics.inplace("bitwise_or", self, other)
    def __xor__(self, other): return arithmetics.bitwise_xor(self, other)
    def __rxor__(self, other): return arithmetics.bitwise_xor(other, self)
    def __ixor__(self, other): return arithmetics.inplace("bitwise_xor", self, other)
    def __lshift__(self, other): return arithmetics.left_shift(self, other)
    def __rlshift__(self, other): return arithmetics.left_shift(other, self)
    def __rshift__(self, other): return arithmetics.right_shift(self, other)
    def __rrshift__(self, other): return arithmetics.right_shift(other, self)
    def __eq__(self, other): return arithmetics.equal(self, other)  # type: ignore[override]
    def __ne__(self, other): return arithmetics.not_equal(self, other)  # type: ignore[override]
    def __lt__(self, other): return arithmetics.less(self, other)
    def __le__(self, other): return arithmetics.less_equal(self, other)
    def __gt__(self, other): return arithmetics.greater(self, other)
    def __ge__(self, other): return arithmetics.greater_equal(self, other)
    def __neg__(self): return arithmetics.negative(self)
    def __pos__(self): return arithmetics.positive(self)
    def __abs__(self): return arithmetics.absolute(self)
    def __invert__(self): return arithmetics.invert(self)

    __hash__ = None  # type: ignore[assignment]

    def __matmul__(self, other): return linalg.matmul(self, other)
    def __rmatmul__(self, other): return linalg.matmul(other, self)

    def abs(self) -> DNDarray:
        return arithmetics.absolute(self)

    def sqrt(self) -> DNDarray:
        return arithmetics.sqrt(self)

    def exp(self) -> DNDarray:
        return arithmetics.exp(self)

    def log(self) -> DNDarray:
        return arithmetics.log(self)

    def clip(self, min=None, max=None) -> DNDarray:
        return arithmetics.clip(self, min, max)

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


# the operation modules import DNDarray from here; imported last to close the cycle
from . import (  # noqa: E402
    arithmetics,
    indexing,
    io,
    linalg,
    manipulations,
    printing,
    reductions,
)
