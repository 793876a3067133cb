"""More shape manipulations, with Heat's names and numpy's meanings: broadcasting, stacking,
splitting, flipping, rolling, padding, tiling, repeating, sorting, ``topk``, ``unique``,
``diag`` / ``diagonal``, ``tril`` / ``triu``, ``unfold``, ``collect``.

Layouts and communication (``k``: the split axis of the input):

* ``broadcast_to``, ``moveaxis``, ``tril``, ``triu``, ``pad`` / ``roll`` / ``flip`` of axes other
  than ``k``, ``sort`` / ``topk`` / ``unfold`` along axes other than ``k``: local, no
  communication; the result keeps ``k`` (renumbered where axes move).
* ``flip`` / ``roll`` along ``k``: negative-step slicing and joining (``Alltoallv``).
* ``pad`` along ``k``: the pad blocks are joined with ``concatenate`` (balanced result).
* ``sort`` / ``topk`` along ``k``: resplit to another axis (``Alltoallv``), local work, resplit
  back; a 1-D array is gathered (``Allgatherv``) and each rank keeps its balanced part.
* ``hstack`` / ``vstack`` / ``column_stack`` / ``row_stack``: :func:`heatlike.concatenate`.
* ``split`` and friends: slicing (local; the pieces keep each rank's share).
* ``tile``, ``repeat``, ``unique``, ``diag`` of a vector, ``unfold`` along ``k``: the input is
  gathered (``Allgatherv``), the result computed on every rank and each rank keeps its balanced
  part of it: simple and exact, at the cost of holding the whole input once per rank.
* ``diagonal`` with ``k`` among its axes: each rank takes the diagonal entries in its block
  (local); the result is split along its last axis (unbalanced).
* ``collect``: one ``Alltoallv`` moving everything to one rank.

Argument checks use only metadata every rank shares: bad input raises on every rank.
"""

from __future__ import annotations

import builtins
import warnings
from collections import namedtuple
from collections.abc import Sequence

import numpy as np
import torch

from . import distribution
from .arithmetics import _as_replicated, _broadcast_shape, _check_out, _store
from .dndarray import DNDarray
from .manipulations import (
    _operands,
    concatenate,
    expand_dims,
    reshape,
    resplit,
    transpose,
)
from .reductions import _axis_index

__all__ = ["broadcast_to", "broadcast_arrays", "collect", "column_stack", "row_stack",
           "vstack", "hstack", "dstack", "split", "hsplit", "vsplit", "dsplit", "flip",
           "fliplr", "flipud", "moveaxis", "roll", "rot90", "pad", "tile", "repeat", "sort",
           "topk", "unique", "unique_inverse", "unique_values", "UniqueInverseResult",
           "diag", "diagonal", "tril", "triu", "unfold", "shape"]

UniqueInverseResult = namedtuple("UniqueInverseResult", ["values", "inverse_indices"])


def _check(x: object, name: str) -> DNDarray:
    if not isinstance(x, DNDarray):
        raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
    return x


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
    return int(v)


def _gathered(x: DNDarray) -> torch.Tensor:
    """The whole array on every rank (``Allgatherv`` for a split array)."""
    return x.larray if x.split is None else x.resplit(None).larray


def _scatter(t: torch.Tensor, split: int | None, like: DNDarray,
             counts: tuple[int, ...] | None = None) -> DNDarray:
    """A DNDarray of the whole tensor ``t`` (the same on every rank) with each rank keeping its
    part along ``split``: ``counts`` per rank, balanced by default (no communication)."""
    comm = like.comm
    if split is None or t.ndim == 0:
        return DNDarray._make(t, tuple(t.shape), None, None, comm)
    split = split % t.ndim
    if counts is None:
        counts = distribution.balanced_counts(t.shape[split], comm.size)
    lo, hi = distribution.ranges(counts)[comm.rank]
    local = t.narrow(split, lo, hi - lo).clone()
    return DNDarray._make(local, tuple(t.shape), split, counts, comm)


# -- shape ----------------------------------------------------------------------------------


def shape(a: DNDarray) -> tuple[int, ...]:
    """The global shape of ``a``."""
    return _check(a, "shape").gshape


def moveaxis(x: DNDarray, source: int | Sequence[int],
             destination: int | Sequence[int]) -> DNDarray:
    """``x`` with the axes ``source`` moved to ``destination`` (numpy's ``moveaxis``; a view)."""
    x = _check(x, "moveaxis")
    src = [source] if not isinstance(source, (tuple, list)) else list(source)
    dst = [destination] if not isinstance(destination, (tuple, list)) else list(destination)
    src = [_axis_index(a, x.ndim) for a in src]
    dst = [_axis_index(a, x.ndim) for a in dst]
    if len(src) != len(dst):
        raise ValueError("moveaxis: source and destination must have the same number of "
                         "elements")
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ValueError("moveaxis: repeated axis")
    order = [a for a in range(x.ndim) if a not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return transpose(x, order)


def broadcast_to(x: DNDarray, shape: Sequence[int]) -> DNDarray:
    """``x`` broadcast to ``shape`` (a view with zero strides, like numpy's; read it, do not
    write it). The split axis is kept (renumbered) unless it is broadcast, which replicates
    ``x`` first."""
    x = _check(x, "broadcast_to")
    shape = tuple(int(s) for s in shape)
    if _broadcast_shape([x.gshape, shape]) != shape:
        raise ValueError(f"cannot broadcast an array of shape {x.gshape} to {shape}")
    off = len(shape) - x.ndim
    if x.split is not None and x.gshape[x.split] != shape[x.split + off]:
        x = resplit(x, None)
    t = x.larray.reshape((1,) * off + tuple(x.larray.shape))
    if x.split is None:
        return DNDarray._make(t.expand(shape), shape, None, None, x.comm)
    s = x.split + off
    lshape = list(shape)
    lshape[s] = x.lshape[x.split]
    return DNDarray._make(t.expand(lshape), shape, s, x.counts, x.comm)


def broadcast_arrays(*arrays: DNDarray) -> list[DNDarray]:
    """The arrays broadcast against each other (numpy's ``broadcast_arrays``). They take the
    layout of the first one whose split axis is not broadcast (the others are moved to it,
    like elementwise operands)."""
    from .arithmetics import align

    for a in arrays:
        _check(a, "broadcast_arrays")
    if not arrays:
        return []
    al = align(list(arrays))
    out = []
    for t in al.tensors:
        lshape = list(al.shape)
        if al.split is not None:
            lo, hi = distribution.ranges(al.counts)[al.comm.rank]
            lshape[al.split] = hi - lo
        t = t.reshape((1,) * (len(al.shape) - t.ndim) + tuple(t.shape))
        out.append(DNDarray._make(t.expand(lshape), al.shape, al.split, al.counts, al.comm))
    return out


def collect(arr: DNDarray, target_rank: int = 0) -> DNDarray:
    """A copy of ``arr`` with all its data on ``target_rank`` (see :meth:`DNDarray.collect_`)."""
    arr = _check(arr, "collect")
    return arr.copy().collect_(target_rank)


# -- stacking -------------------------------------------------------------------------------


def _stack_2d(arrays: Sequence[DNDarray], axis: int, name: str) -> DNDarray:
    """Arrays joined along ``axis``; 1-D ones first get a new axis there (as columns for axis 1,
    as rows for axis 0), 0-D ones become ``(1, 1)``, others stay as they are (numpy)."""
    parts = []
    for a in _operands(arrays, name):
        if a.ndim == 0:
            a = a.reshape((1,))
        parts.append(expand_dims(a, axis) if a.ndim < 2 else a)
    return concatenate(parts, axis=axis)


def column_stack(arrays: Sequence[DNDarray]) -> DNDarray:
    """1-D arrays as columns, others as they are (0-D as ``(1, 1)``), joined along axis 1."""
    return _stack_2d(arrays, 1, "column_stack")


def row_stack(arrays: Sequence[DNDarray]) -> DNDarray:
    """1-D arrays as rows, others as they are (0-D as ``(1, 1)``), joined along axis 0."""
    return _stack_2d(arrays, 0, "row_stack")


vstack = row_stack


def hstack(arrays: Sequence[DNDarray]) -> DNDarray:
    """Join along axis 1 (axis 0 for 1-D arrays; 0-D ones count as 1-D, as numpy's)."""
    ops = [a.reshape((1,)) if a.ndim == 0 else a for a in _operands(arrays, "hstack")]
    return concatenate(ops, axis=0 if ops[0].ndim == 1 else 1)


def dstack(arrays: Sequence[DNDarray]) -> DNDarray:
    """Join along axis 2 (0-D arrays become ``(1, 1, 1)``, 1-D ``(1, n, 1)``, 2-D
    ``(m, n, 1)``)."""
    ops = _operands(arrays, "dstack")
    out = []
    for a in ops:
        if a.ndim == 0:
            a = a.reshape((1, 1, 1))
        elif a.ndim == 1:
            a = expand_dims(expand_dims(a, 0), 2)
        elif a.ndim == 2:
            a = expand_dims(a, 2)
        out.append(a)
    return concatenate(out, axis=2)


# -- splitting ------------------------------------------------------------------------------


def split(x: DNDarray, indices_or_sections: object, axis: int = 0) -> list[DNDarray]:
    """``x`` cut along ``axis`` into equal sections (an integer that divides the axis) or at the
    given indices (numpy's ``split``). The pieces are slices: each rank keeps its share."""
    x = _check(x, "split")
    if x.ndim == 0:
        raise ValueError("split: a 0-d array cannot be split")
    ax = _axis_index(axis, x.ndim)
    n = x.gshape[ax]
    ios = indices_or_sections
    if isinstance(ios, DNDarray):
        if ios.split is not None:
            warnings.warn("split: the indices are a distributed DNDarray; they are gathered "
                          "first", stacklevel=2)
        ios = _gathered(ios).tolist() if ios.ndim else int(ios.item())
    elif isinstance(ios, (torch.Tensor, np.ndarray)):
        ios = ios.tolist()
    if isinstance(ios, (int, np.integer)) and not isinstance(ios, bool):
        sections = int(ios)
        if sections <= 0:
            raise ValueError("split: the number of sections must be positive")
        if n % sections:
            raise ValueError(f"split: array split does not result in an equal division "
                             f"({n} by {sections})")
        bounds = [i * (n // sections) for i in range(1, sections)]
    elif isinstance(ios, (list, tuple)):
        for i in ios:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"split: indices must be integers, got {type(i).__name__}")
        bounds = [int(i) for i in ios]
    else:
        raise TypeError(f"split: indices_or_sections must be an integer or a sequence of "
                        f"integers, got {type(ios).__name__}")
    edges = [0, *bounds, n]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        key = [slice(None)] * x.ndim
        key[ax] = slice(lo, hi)  # numpy's a[lo:hi]: negative ends count from the end
        out.append(x[tuple(key)])
    return out


def hsplit(x: DNDarray, indices_or_sections: object) -> list[DNDarray]:
    """:func:`split` along axis 1 (axis 0 for 1-D arrays)."""
    x = _check(x, "hsplit")
    if x.ndim == 0:
        raise ValueError("hsplit only works on arrays of 1 or more dimensions")
    return split(x, indices_or_sections, axis=1 if x.ndim > 1 else 0)


def vsplit(x: DNDarray, indices_or_sections: object) -> list[DNDarray]:
    """:func:`split` along axis 0 (arrays of 2 or more dimensions)."""
    x = _check(x, "vsplit")
    if x.ndim < 2:
        raise ValueError("vsplit only works on arrays of 2 or more dimensions")
    return split(x, indices_or_sections, axis=0)


def dsplit(x: DNDarray, indices_or_sections: object) -> list[DNDarray]:
    """:func:`split` along axis 2 (arrays of 3 or more dimensions)."""
    x = _check(x, "dsplit")
    if x.ndim < 3:
        raise ValueError("dsplit only works on arrays of 3 or more dimensions")
    return split(x, indices_or_sections, axis=2)


# -- flipping, rolling, rotating ------------------------------------------------------------


def _axes(axis: object, ndim: int) -> list[int]:
    if axis is None:
        return list(range(ndim))
    items = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    return [_axis_index(a, ndim) for a in items]


def flip(a: DNDarray, axis: int | Sequence[int] | None = None) -> DNDarray:
    """``a`` with the order of elements reversed along ``axis`` (all axes by default)."""
    a = _check(a, "flip")
    key = [slice(None)] * a.ndim
    for ax in _axes(axis, a.ndim):
        key[ax] = slice(None, None, -1)
    return a[tuple(key)].copy() if a.ndim else a.copy()


def fliplr(a: DNDarray) -> DNDarray:
    """Flip along axis 1 (arrays of 2 or more dimensions)."""
    a = _check(a, "fliplr")
    if a.ndim < 2:
        raise ValueError("fliplr: the array must have at least 2 dimensions")
    return flip(a, 1)


def flipud(a: DNDarray) -> DNDarray:
    """Flip along axis 0."""
    a = _check(a, "flipud")
    if a.ndim < 1:
        raise ValueError("flipud: the array must have at least 1 dimension")
    return flip(a, 0)


def roll(x: DNDarray, shift: int | Sequence[int], axis: int | Sequence[int] | None = None
         ) -> DNDarray:
    """Elements shifted by ``shift`` along ``axis`` with wrap-around (numpy's ``roll``; the
    flattened array when ``axis`` is None)."""
    x = _check(x, "roll")
    if axis is None:
        if not isinstance(shift, (int, np.integer)) or isinstance(shift, bool):
            raise TypeError("roll: with axis=None, shift must be an integer")
        flat = x.flatten() if x.ndim != 1 else x
        out = roll(flat, shift, 0)
        return reshape(out, x.gshape, new_split=x.split) if x.ndim != 1 else out
    shifts = list(shift) if isinstance(shift, (tuple, list)) else [shift]
    axes = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    for s in shifts:
        _int(s, "roll: shift")
    axes = [_axis_index(a, x.ndim) for a in axes]
    if len(shifts) == 1 and len(axes) > 1:
        shifts = shifts * len(axes)
    if len(axes) == 1 and len(shifts) > 1:
        axes = axes * len(shifts)
    if len(shifts) != len(axes):
        raise ValueError("roll: shift and axis must have the same length")
    out = x
    for s, ax in zip(shifts, axes):
        n = out.gshape[ax]
        if n == 0:
            continue
        s = int(s) % n
        if s == 0:
            out = out.copy() if out is x else out
            continue
        if out.split != ax:
            out = out._rewrap(torch.roll(out.larray, s, ax))
            continue
        k1 = [slice(None)] * out.ndim
        k2 = [slice(None)] * out.ndim
        k1[ax], k2[ax] = slice(n - s, n), slice(0, n - s)
        out = concatenate([out[tuple(k1)], out[tuple(k2)]], axis=ax)
    return out


def rot90(m: DNDarray, k: int = 1, axes: Sequence[int] = (0, 1)) -> DNDarray:
    """``m`` rotated by 90 degrees ``k`` times in the plane of ``axes`` (numpy's ``rot90``)."""
    m = _check(m, "rot90")
    k = _int(k, "rot90: k")
    if not isinstance(axes, (tuple, list)) or len(axes) != 2:
        raise ValueError("rot90: axes must hold two axes")
    a0, a1 = (_axis_index(a, m.ndim) for a in axes)
    if a0 == a1:
        raise ValueError("rot90: the axes must differ")
    k %= 4
    if k == 0:
        return m.copy()
    if k == 2:
        return flip(flip(m, a0), a1)
    perm = list(range(m.ndim))
    perm[a0], perm[a1] = perm[a1], perm[a0]
    if k == 1:
        return transpose(flip(m, a1), perm)
    return flip(transpose(m, perm), a1)


# -- padding, tiling, repeating -------------------------------------------------------------


def _pairs(spec: object, nd: int, name: str, numbers: bool) -> list[tuple]:
    """numpy's pad-width / constant-value spellings as ``nd`` pairs."""
    def ok(v: object) -> bool:
        if numbers:  # constant values: booleans too, as in numpy
            return isinstance(v, (int, float, np.integer, np.floating, np.bool_))
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    if ok(spec):
        return [(spec, spec)] * nd
    if not isinstance(spec, (tuple, list)):
        raise TypeError(f"pad: {name} must be a number or a sequence, got {type(spec).__name__}")
    if all(ok(v) for v in spec):
        if len(spec) == 1:
            return [(spec[0], spec[0])] * nd
        if len(spec) == 2:
            return [(spec[0], spec[1])] * nd
        raise ValueError(f"pad: {name} must hold one or two values per axis")
    for item in spec:
        if not isinstance(item, (tuple, list)):
            raise TypeError(f"pad: {name} mixes numbers and sequences")
        if not all(ok(v) for v in item):
            raise TypeError(f"pad: {name} must hold numbers")
        if len(item) not in (1, 2):
            raise ValueError(f"pad: {name} must hold one or two values per axis")
    pairs = [(it[0], it[-1]) for it in spec]
    if len(pairs) == 1:
        return pairs * nd
    if len(pairs) > nd:
        raise ValueError(f"pad: {name} has {len(pairs)} entries for {nd} axes")
    # fewer pairs than axes: they apply to the last axes (Heat's convention)
    return [(0, 0) if numbers is False else pairs[0]] * (nd - len(pairs)) + pairs


def pad(array: DNDarray, pad_width: object, mode: str = "constant",
        constant_values: object = 0) -> DNDarray:
    """``array`` padded with constants (numpy's ``pad`` with ``mode="constant"``):
    ``pad_width`` is an integer, ``(before, after)``, or one pair per axis; ``constant_values``
    likewise. Axes other than the split axis are padded locally; along it, the pad blocks are
    joined with ``concatenate``."""
    x = _check(array, "pad")
    if not isinstance(mode, str):
        raise TypeError(f"pad: mode must be a string, got {type(mode).__name__}")
    if mode != "constant":
        raise NotImplementedError(f"pad: mode {mode!r} is not supported (only 'constant')")
    widths = _pairs(pad_width, x.ndim, "pad_width", numbers=False)
    if any(b < 0 or a < 0 for b, a in widths):
        raise ValueError("pad: widths must be non-negative")
    values = _pairs(constant_values, x.ndim, "constant_values", numbers=True)
    from .factories import full

    out = x
    for ax in range(x.ndim):
        before, after = (int(v) for v in widths[ax])
        if before == after == 0:
            continue
        vb, va = values[ax]
        if out.split != ax:
            t = out.larray
            parts = []
            if before:
                shape = list(t.shape)
                shape[ax] = before
                parts.append(torch.full(shape, vb, dtype=t.dtype, device=t.device))
            parts.append(t)
            if after:
                shape = list(t.shape)
                shape[ax] = after
                parts.append(torch.full(shape, va, dtype=t.dtype, device=t.device))
            gshape = list(out.gshape)
            gshape[ax] += before + after
            out = DNDarray._make(torch.cat(parts, dim=ax), tuple(gshape), out.split, out.counts,
                                 out.comm)
        else:
            pieces = []
            for width, value in ((before, vb), (after, va)):
                shape = list(out.gshape)
                shape[ax] = width
                pieces.append(full(tuple(shape), value, dtype=out.dtype, split=None,
                                   device=out.device, comm=out.comm) if width else None)
            ops = [p for p in (pieces[0], out, pieces[1]) if p is not None]
            out = concatenate(ops, axis=ax)
    return out if out is not x else x.copy()


def tile(x: DNDarray, reps: int | Sequence[int]) -> DNDarray:
    """``x`` repeated ``reps`` times along each axis (numpy's ``tile``). The input is gathered;
    the result is split along the input's split axis (renumbered), balanced."""
    if not isinstance(x, DNDarray):
        x = _as_replicated(x)
    r = [reps] if not isinstance(reps, (tuple, list)) else list(reps)
    for v in r:
        if _int(v, "tile: reps") < 0:
            raise ValueError("tile: reps must be non-negative")
    t = _gathered(x)
    res = torch.tile(t, tuple(int(v) for v in r)) if t.ndim or r else t
    split = None if x.split is None else x.split + builtins.max(0, len(r) - x.ndim)
    return _scatter(res, split, x)


def repeat(a: object, repeats: object, axis: int | None = None) -> DNDarray:
    """Each element repeated ``repeats`` times (an integer, or one count per element along
    ``axis``), numpy's ``repeat``; the flattened array when ``axis`` is None. The input is
    gathered; the result keeps the input's split axis (0 for a flattened split input)."""
    if isinstance(a, (str, bytes)):
        raise TypeError("repeat: a must be an array or a number")
    if not isinstance(a, DNDarray):
        a = _as_replicated(a)
    if axis is not None:
        axis = _axis_index(axis, builtins.max(a.ndim, 1))
    if isinstance(repeats, DNDarray):
        if repeats.split is not None:
            warnings.warn("repeat: repeats is a distributed DNDarray; it is gathered first",
                          stacklevel=2)
        r = _gathered(repeats)
    elif isinstance(repeats, (list, tuple, np.ndarray, torch.Tensor)):
        r = torch.as_tensor(np.asarray(repeats)) if not isinstance(repeats, torch.Tensor) \
            else repeats
        if not r.numel():  # numpy reads an empty list as float64: no count is not a float
            r = r.to(torch.int64)
    elif isinstance(repeats, (int, np.integer)) and not isinstance(repeats, bool):
        r = int(repeats)
    else:
        raise TypeError(f"repeat: repeats must be an integer or an array of integers, got "
                        f"{type(repeats).__name__}")
    if isinstance(r, torch.Tensor):
        if r.dtype.is_floating_point or r.dtype.is_complex or r.dtype is torch.bool:
            raise TypeError("repeat: repeats must hold integers")
        if r.ndim > 1:
            raise ValueError("repeat: repeats must be 0- or 1-D")
        if r.numel() == 1:
            r = int(r.reshape(()).item())
    if isinstance(r, int) and r < 0 or isinstance(r, torch.Tensor) and bool((r < 0).any()):
        raise ValueError("repeat: repeats must be non-negative")
    t = _gathered(a)
    if axis is None or t.ndim == 0:  # a 0-D array along axis 0 is one element (numpy)
        t = t.reshape(-1)
        ax = 0
    else:
        ax = axis
    if isinstance(r, torch.Tensor) and r.numel() != (t.shape[ax] if t.ndim else 1):
        raise ValueError(f"repeat: {r.numel()} repeats for an axis of length "
                         f"{t.shape[ax] if t.ndim else 1}")
    res = torch.repeat_interleave(t, r.to(t.device) if isinstance(r, torch.Tensor) else r,
                                  dim=ax)
    split = None if a.split is None else (0 if axis is None else a.split)
    return _scatter(res, split, a)


# -- sorting and selection ------------------------------------------------------------------


def _along(x: DNDarray, ax: int, fn) -> tuple[torch.Tensor, ...]:
    """Apply ``fn(local_tensor)`` (returning tensors with ``ax`` changed in length only) with
    the whole of axis ``ax`` local; results in ``x``'s layout (split axis kept, balanced)."""
    if x.split != ax or x.comm.size == 1:
        return fn(x.larray), x
    other = next((d for d in range(x.ndim) if d != ax), None)
    work = resplit(x, other) if other is not None else resplit(x, None)
    return fn(work.larray), work


def sort(a: DNDarray, axis: int = -1, descending: bool = False, out: DNDarray | None = None,
         return_sort_indices: bool = True) -> object:
    """``a`` sorted along ``axis`` and the indices that sort it (Heat's ``sort`` returns both;
    ``return_sort_indices=False``: the values only). The result keeps ``a``'s layout."""
    a = _check(a, "sort")
    if a.ndim == 0:
        return (a.copy(), a._rewrap(torch.zeros((), dtype=torch.int64))) \
            if return_sort_indices else a.copy()
    ax = _axis_index(axis, a.ndim)
    (vals, idx), work = _along(a, ax, lambda t: torch.sort(t, dim=ax, descending=descending,
                                                             stable=True))
    v = work._rewrap(vals)
    i = work._rewrap(idx)
    if work is not a:  # back to a's split axis and counts
        if a.split is None or a.ndim == 1:
            v, i = _scatter(vals, a.split, a, a.counts), _scatter(idx, a.split, a, a.counts)
        else:
            v, i = resplit(v, a.split), resplit(i, a.split)
            v.redistribute_(a.counts)
            i.redistribute_(a.counts)
    if out is not None:
        _check_out(out)
        _store(v, out, True, "sort")
        v = out
    return (v, i) if return_sort_indices else v


def topk(a: DNDarray, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,  # noqa: A002
         out: tuple[DNDarray, DNDarray] | None = None) -> tuple[DNDarray, DNDarray]:
    """The ``k`` largest (smallest) values along ``dim`` and their indices (torch's ``topk``).
    The results keep ``a``'s split axis (balanced)."""
    a = _check(a, "topk")
    k = _int(k, "topk: k")
    ax = _axis_index(dim, a.ndim)
    if not 0 <= k <= a.gshape[ax]:
        raise ValueError(f"topk: k={k} is out of range for an axis of length {a.gshape[ax]}")
    (vals, idx), work = _along(a, ax, lambda t: torch.topk(t, k, dim=ax, largest=largest,
                                                             sorted=sorted))
    shape = list(a.gshape)
    shape[ax] = k
    if work.split is None:
        v = _scatter(vals, a.split, a)
        i = _scatter(idx, a.split, a)
    else:
        counts = (k,) if work.split == ax else work.counts  # ax split only at one rank
        v = DNDarray._make(vals, tuple(shape), work.split, counts, a.comm)
        i = DNDarray._make(idx, tuple(shape), work.split, counts, a.comm)
        if work is not a:
            v, i = resplit(v, a.split), resplit(i, a.split)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("topk: out must be a pair of DNDarrays")
        _store(v, out[0], True, "topk")
        _store(i, out[1], True, "topk")
        return out[0], out[1]
    return v, i


def unique(a: DNDarray, sorted: bool = False, return_inverse: bool = False,  # noqa: A002
           axis: int | None = None) -> object:
    """The unique elements (or unique slices along ``axis``) of ``a``, sorted (numpy's
    ``unique``; ``sorted`` is accepted, the result is always sorted), and with
    ``return_inverse`` the indices that rebuild ``a``. The input is gathered. The result keeps
    ``a``'s split axis when ``axis`` is another axis; the flattened result is split along 0 when
    ``a`` is split along 0, replicated otherwise."""
    a = _check(a, "unique")
    t = _gathered(a)
    if axis is None:
        res = _one_nan(torch.unique(t, sorted=True, return_inverse=True), return_inverse)
        split = 0 if a.split == 0 else None
    else:
        ax = _axis_index(axis, a.ndim)
        if t.numel() and (t.is_floating_point() or t.is_complex()) and bool(t.isnan().any()):
            res = _unique_slices_with_nans(t, ax, return_inverse)
        elif t.numel():
            res = torch.unique(t, sorted=True, return_inverse=return_inverse, dim=ax)
        else:  # every slice along ax is the same empty slice: one of them (numpy)
            first = t.narrow(ax, 0, builtins.min(1, t.shape[ax]))
            inv = torch.zeros(t.shape[ax], dtype=torch.int64, device=t.device)
            res = (first, inv) if return_inverse else first
        split = a.split
    if return_inverse:
        values, inv = res
        return _scatter(values, split, a), _scatter(inv, None if axis is None else None, a)
    return _scatter(res, split, a)


def _unique_slices_with_nans(t: torch.Tensor, ax: int, return_inverse: bool) -> object:
    """numpy's unique slices of ``t`` along ``ax`` (torch's order puts slices with a NaN first;
    numpy's lexicographic order puts NaN last): through numpy, on the host."""
    host = t.detach().cpu()
    wide = host.to(torch.float32) if host.dtype is torch.bfloat16 else host
    found = np.unique(wide.numpy(), axis=ax, return_inverse=return_inverse)
    values, inverse = found if return_inverse else (found, None)
    values = torch.from_numpy(np.ascontiguousarray(values)).to(t.dtype).to(t.device)
    if not return_inverse:
        return values
    return values, torch.from_numpy(inverse.reshape(-1).astype(np.int64)).to(t.device)


def _one_nan(res: tuple[torch.Tensor, torch.Tensor], return_inverse: bool) -> object:
    """torch's sorted unique values (NaNs last, each NaN its own value) with the NaNs merged
    into one, as numpy's ``equal_nan=True``; the inverse indices of every NaN point at it."""
    values, inverse = res
    if values.is_floating_point() or values.is_complex():
        nan = torch.isnan(values)
        first = int(nan.to(torch.int8).argmax()) if bool(nan.any()) else values.numel()
        if values.numel() - first > 1:
            values = values[:first + 1]
            inverse = inverse.clamp(max=first)
    return (values, inverse) if return_inverse else values


def unique_inverse(x: DNDarray) -> UniqueInverseResult:
    """The array API's ``unique_inverse``: ``(values, inverse_indices)``, the indices of
    ``x``'s shape."""
    values, inv = unique(x, return_inverse=True)
    return UniqueInverseResult(values, inv)


def unique_values(x: DNDarray) -> DNDarray:
    """The array API's ``unique_values``: the sorted unique elements of ``x``."""
    return unique(x)


# -- diagonals and triangles ----------------------------------------------------------------


def diag(a: DNDarray, offset: int = 0) -> DNDarray:
    """numpy's ``diag``: a 1-D array gives the square matrix with it on the ``offset``-th
    diagonal (split along 0 when ``a`` is split, balanced; ``a`` is gathered); a 2-D or larger
    array gives :func:`diagonal`."""
    a = _check(a, "diag")
    if offset is None or isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise ValueError(f"diag: offset must be an integer, got {offset!r}")
    if a.ndim == 0:
        raise ValueError("diag: the input must have at least one dimension")
    if a.ndim >= 2:
        return diagonal(a, offset)
    v = _gathered(a)
    n = v.shape[0] + abs(int(offset))
    comm = a.comm
    if a.split is None:
        return DNDarray._make(torch.diag(v, int(offset)), (n, n), None, None, comm)
    counts = distribution.balanced_counts(n, comm.size)
    lo, hi = distribution.ranges(counts)[comm.rank]
    local = torch.zeros((hi - lo, n), dtype=v.dtype, device=v.device)
    rows = torch.arange(lo, hi, device=v.device)
    idx = rows if offset >= 0 else rows + int(offset)
    cols = rows + int(offset)
    ok = (idx >= 0) & (idx < v.shape[0]) & (cols >= 0) & (cols < n)
    local[(rows - lo)[ok], cols[ok]] = v[idx[ok]]
    return DNDarray._make(local, (n, n), 0, counts, comm)


def diagonal(a: DNDarray, offset: int = 0, dim1: int = 0, dim2: int = 1) -> DNDarray:
    """The ``offset``-th diagonal of the planes spanned by ``dim1`` and ``dim2``, as the last
    axis of the result (numpy's ``diagonal``). When the split axis is one of them, each rank takes
    the entries of its block and the result is split along its last axis (unbalanced);
    otherwise it is local."""
    a = _check(a, "diagonal")
    if a.ndim < 2:
        raise ValueError("diagonal: the array must have at least 2 dimensions")
    if offset is None or isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise ValueError(f"diagonal: offset must be an integer, got {offset!r}")
    offset = int(offset)
    d1, d2 = _axis_index(dim1, a.ndim), _axis_index(dim2, a.ndim)
    if d1 == d2:
        raise ValueError("diagonal: dim1 and dim2 must differ")
    n1, n2 = a.gshape[d1], a.gshape[d2]
    length = builtins.max(0, builtins.min(n1, n2 - offset) if offset >= 0
                          else builtins.min(n1 + offset, n2))
    rest = [d for d in range(a.ndim) if d not in (d1, d2)]
    gshape = tuple(a.gshape[d] for d in rest) + (length,)
    t = a.larray
    if a.split not in (d1, d2):
        local = torch.diagonal(t, offset, d1, d2)
        split = None if a.split is None else rest.index(a.split)
        return DNDarray._make(local, gshape, split, a.counts, a.comm)
    lo = a._ranges()[a.comm.rank][0]
    local_off = offset + lo if a.split == d1 else offset - lo
    local = torch.diagonal(t, local_off, d1, d2)
    counts = []
    for rlo, rhi in a._ranges():
        if a.split == d1:
            rows = range(rlo, rhi)
            c = sum(1 for i in rows if 0 <= i + offset < n2)
        else:
            c = sum(1 for j in range(rlo, rhi) if 0 <= j - offset < n1)
        counts.append(c)
    return DNDarray._make(local, gshape, len(gshape) - 1, tuple(counts), a.comm)


def _tri(m: DNDarray, k: int, upper: bool) -> DNDarray:
    m = _check(m, "triu" if upper else "tril")
    k = _int(k, "k")
    if m.ndim < 1:
        raise ValueError("tril/triu need at least one dimension")
    if m.ndim == 1:
        from .factories import array

        rows = array(m.larray.new_ones((m.gshape[0], 1)), comm=m.comm) * m
        return _tri(rows, k, upper)
    t = m.larray
    r0 = c0 = 0
    if m.split is not None and m.split >= m.ndim - 2:
        lo = m._ranges()[m.comm.rank][0]
        if m.split == m.ndim - 2:
            r0 = lo
        else:
            c0 = lo
    rows = torch.arange(r0, r0 + t.shape[-2], device=t.device)[:, None]
    cols = torch.arange(c0, c0 + t.shape[-1], device=t.device)[None, :]
    keep = (cols - rows >= k) if upper else (cols - rows <= k)
    return m._rewrap(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)))


def tril(m: DNDarray, k: int = 0) -> DNDarray:
    """The lower triangle (entries with ``col - row <= k``) of the last two axes; others 0."""
    return _tri(m, k, upper=False)


def triu(m: DNDarray, k: int = 0) -> DNDarray:
    """The upper triangle (entries with ``col - row >= k``) of the last two axes; others 0."""
    return _tri(m, k, upper=True)


# -- sliding windows ------------------------------------------------------------------------


def unfold(a: DNDarray, dimension: int, size: int, step: int = 1) -> DNDarray:
    """torch's ``Tensor.unfold``: the windows of length ``size`` taken every ``step`` elements
    along ``dimension``, as a new last axis. Local unless ``dimension`` is the split axis (then
    the input is gathered and the windows split along ``dimension``, balanced)."""
    a = _check(a, "unfold")
    ax = _axis_index(dimension, builtins.max(a.ndim, 1))
    size, step = _int(size, "unfold: size"), _int(step, "unfold: step")
    if size < 1:
        raise ValueError(f"unfold: size must be positive, got {size}")
    if step < 1:
        raise ValueError(f"unfold: step must be positive, got {step}")
    n = a.gshape[ax] if a.ndim else 1
    if size > n:
        raise ValueError(f"unfold: size {size} exceeds the length {n} of axis {ax}")
    if a.split != ax:
        local = a.larray.unfold(ax, size, step)
        gshape = list(a.gshape)
        gshape[ax] = (n - size) // step + 1
        return DNDarray._make(local, (*gshape, size), a.split, a.counts, a.comm)
    res = _gathered(a).unfold(ax, size, step)
    return _scatter(res, ax, a)
