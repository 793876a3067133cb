"""Shape and layout manipulations: resplit, reshape, transpose, concatenate, stack, squeeze,
expand_dims, flatten, balance.

Communication per operation (``distribution.move`` does the moving):

* ``resplit(x, k)``: one ``Alltoallv`` (each element moves at most once); ``resplit(x, None)``: one
  ``Allgatherv``; from a replicated array: none.
* ``transpose``, ``expand_dims``, ``squeeze`` (of axes other than the split axis): none.
* ``reshape``: none when every rank's run of the C-order flattening stays the same (e.g. only axes
  after the first change), else up to three ``Alltoallv``: to split 0, flat runs to their new
  owners, and to the requested split.
* ``concatenate`` along a non-split axis: operands are brought to the first split operand's layout
  (``Alltoallv`` only for operands laid out differently); along the split axis: one ``Alltoallv``
  per operand into a balanced result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import distribution
from .arithmetics import _as_replicated, _common_comm
from .dndarray import DNDarray, _normalize_split
from .reductions import _axis_index

__all__ = ["resplit", "reshape", "transpose", "swapaxes", "concatenate", "stack", "squeeze",
           "expand_dims", "flatten", "ravel", "balance"]


def _check(x: object, name: str) -> DNDarray:
    if not isinstance(x, DNDarray):
        raise TypeError(f"{name}: expected a DNDarray, got {type(x).__name__}")
    return x


def _src(x: DNDarray) -> tuple[int | None, list | None]:
    return x.split, None if x.split is None else x._ranges()


def resplit(x: DNDarray, axis: int | None = None) -> DNDarray:
    """A copy of ``x`` distributed along ``axis`` with the balanced layout (None: replicated on
    every rank). One ``Alltoallv`` in which every element moves at most once (``Allgatherv`` for
    None; no communication from a replicated array)."""
    x = _check(x, "resplit")
    axis = _normalize_split(axis, x.ndim)
    comm = x.comm
    if axis is None:
        local = distribution.move(x.larray, x.gshape, *_src(x), None, None, comm)
        return DNDarray._make(local, x.gshape, None, None, comm)
    counts = distribution.balanced_counts(x.gshape[axis], comm.size)
    local = distribution.move(x.larray, x.gshape, *_src(x), axis, distribution.ranges(counts),
                              comm)
    return DNDarray._make(local, x.gshape, axis, counts, comm)


def balance(x: DNDarray, copy: bool = False) -> DNDarray:
    """``x`` balanced (Heat's function): in place by default, a balanced copy with
    ``copy=True`` (one ``Alltoallv`` unless already balanced)."""
    x = _check(x, "balance")
    if not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be a bool, got {type(copy).__name__}")
    return x.copy().balance_() if copy else x.balance_()


def _target_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
    dims = []
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"reshape: shape entries must be integers, got {type(s).__name__}")
        dims.append(int(s))
    unknown = [i for i, s in enumerate(dims) if s == -1]
    if len(unknown) > 1:
        raise ValueError("can only specify one unknown dimension")
    if any(s < -1 for s in dims):
        raise ValueError(f"negative dimensions not allowed: {tuple(dims)}")
    known = int(np.prod([s for s in dims if s != -1], dtype=np.int64))
    if unknown:
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape array of size {size} into shape {tuple(shape)}")
        dims[unknown[0]] = size // known
    if int(np.prod(dims, dtype=np.int64)) != size:
        raise ValueError(f"cannot reshape array of size {size} into shape {tuple(shape)}")
    return tuple(dims)


def reshape(x: DNDarray, shape: Sequence[int] | int, new_split: int | None = None,
            dtype: object = None) -> DNDarray:
    """``x`` with global shape ``shape`` (C order, one entry may be -1), distributed along
    ``new_split`` (default, as in Heat: ``x``'s split axis, or the new last axis if the new shape
    has fewer; a replicated ``x`` stays replicated). Shares memory with ``x`` where no data
    moves, like numpy's views."""
    x = _check(x, "reshape")
    if dtype is not None:
        x = x.astype(dtype, copy=False)
    if isinstance(shape, DNDarray):
        shape = shape.tolist()
    elif isinstance(shape, (np.ndarray, torch.Tensor)):
        shape = shape.tolist()
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = _target_shape(shape, x.size)
    comm = x.comm
    if not shape:
        split = None
    elif new_split is None:
        split = None if x.split is None else min(x.split, len(shape) - 1)
    else:
        split = _normalize_split(new_split, len(shape))
    if x.split is None:
        local = DNDarray._make(x.larray.reshape(shape), shape, None, None, comm)
        return local if split is None else resplit(local, split)
    src = x if x.split == 0 else resplit(x, 0)
    row = int(np.prod(src.gshape[1:], dtype=np.int64))
    if split is None:
        full = src.to_torch()
        return DNDarray._make(full.reshape(shape), shape, None, None, comm)
    if shape[0] == src.gshape[0] and src.gshape[0] > 0:
        counts = src.counts
    else:
        counts = distribution.balanced_counts(shape[0], comm.size)
    new_row = int(np.prod(shape[1:], dtype=np.int64))
    src_flat = [(lo * row, hi * row) for lo, hi in src._ranges()]
    dst_flat = [(lo * new_row, hi * new_row) for lo, hi in distribution.ranges(counts)]
    lshape = (counts[comm.rank], *shape[1:])
    if src_flat == dst_flat:
        local = src.larray.reshape(lshape)
    else:
        flat = distribution.move(src.larray.reshape(-1), (x.size,), 0, src_flat, 0, dst_flat,
                                 comm)
        local = flat.reshape(lshape)
    out = DNDarray._make(local, shape, 0, counts, comm)
    return out if split == 0 else resplit(out, split)


def flatten(x: DNDarray) -> DNDarray:
    """A 1-D copy of ``x`` in C order (split along 0 unless ``x`` is replicated)."""
    x = _check(x, "flatten")
    return reshape(x, (x.size,))


ravel = flatten


def transpose(x: DNDarray, axes: Sequence[int] | None = None) -> DNDarray:
    """``x`` with its axes permuted (reversed by default); the split axis follows its data. A
    local view, no communication."""
    x = _check(x, "transpose")
    if axes is None:
        perm = tuple(reversed(range(x.ndim)))
    else:
        perm = tuple(_axis_index(a, x.ndim) for a in axes)
        if sorted(perm) != list(range(x.ndim)):
            raise ValueError("axes don't match array")
    shape = tuple(x.gshape[p] for p in perm)
    split = None if x.split is None else perm.index(x.split)
    return DNDarray._make(x.larray.permute(perm), shape, split, x.counts, x.comm)


def swapaxes(x: DNDarray, axis1: int, axis2: int) -> DNDarray:
    """``x`` with two axes interchanged (a view)."""
    x = _check(x, "swapaxes")
    a, b = _axis_index(axis1, x.ndim), _axis_index(axis2, x.ndim)
    perm = list(range(x.ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def expand_dims(x: DNDarray, axis: int | Sequence[int]) -> DNDarray:
    """``x`` with new axes of length one inserted at ``axis`` (positions in the result)."""
    x = _check(x, "expand_dims")
    items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    nd = x.ndim + len(items)
    positions = sorted(_axis_index(a, nd) for a in items)
    if len(set(positions)) != len(positions):
        raise ValueError("repeated axis")
    local, split = x.larray, x.split
    shape = list(x.gshape)
    for p in positions:
        local = local.unsqueeze(p)
        shape.insert(p, 1)
        if split is not None and p <= split:
            split += 1
    return DNDarray._make(local, tuple(shape), split, x.counts, x.comm)


def squeeze(x: DNDarray, axis: int | Sequence[int] | None = None) -> DNDarray:
    """``x`` without the given axes of length one (all of them by default). Squeezing the split
    axis replicates the array (``Allgatherv`` of its single index)."""
    x = _check(x, "squeeze")
    if axis is None:
        axes = tuple(i for i, s in enumerate(x.gshape) if s == 1)
    else:
        items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
        axes = tuple(sorted({_axis_index(a, x.ndim) for a in items}))
        if any(x.gshape[a] != 1 for a in axes):
            raise ValueError("cannot select an axis to squeeze out which has size not equal "
                             "to one")
    if x.split is not None and x.split in axes:
        x = resplit(x, None)
    shape = tuple(s for i, s in enumerate(x.gshape) if i not in axes)
    local = x.larray.reshape([s for i, s in enumerate(x.larray.shape) if i not in axes])
    split = x.split
    if split is not None:
        split -= sum(1 for a in axes if a < split)
    return DNDarray._make(local, shape, split, x.counts, x.comm)


def _operands(arrays: Sequence[object], name: str) -> list[DNDarray]:
    if isinstance(arrays, DNDarray) or not isinstance(arrays, (list, tuple)) or not arrays:
        raise TypeError(f"{name}: expected a non-empty sequence of arrays")
    first = next((a for a in arrays if isinstance(a, DNDarray)), None)
    ops = []
    for a in arrays:
        if not isinstance(a, DNDarray):
            a = _as_replicated(a)
            if first is not None:
                a = DNDarray._make(a.larray.to(first.larray.device), a.gshape, None, None,
                                   first.comm)
        ops.append(a)
    _common_comm(ops)
    return ops


def concatenate(arrays: Sequence[DNDarray], axis: int = 0) -> DNDarray:
    """The arrays joined along ``axis``; they must agree in every other dimension. The result
    takes the layout of the first split operand (see the module docstring for what moves)."""
    ops = _operands(arrays, "concatenate")
    nd = ops[0].ndim
    if nd == 0:
        raise ValueError("zero-dimensional arrays cannot be concatenated")
    for i, a in enumerate(ops):
        if a.ndim != nd:
            raise ValueError(f"all the input arrays must have same number of dimensions, but "
                             f"the array at index 0 has {nd} dimension(s) and the array at "
                             f"index {i} has {a.ndim} dimension(s)")
    axis = _axis_index(axis, nd)
    for i, a in enumerate(ops):
        for d in range(nd):
            if d != axis and a.gshape[d] != ops[0].gshape[d]:
                raise ValueError(
                    "all the input array dimensions except for the concatenation axis must "
                    f"match exactly, but along dimension {d}, the array at index 0 has size "
                    f"{ops[0].gshape[d]} and the array at index {i} has size {a.gshape[d]}")
    dtype = ops[0].dtype
    for a in ops[1:]:
        dtype = torch.promote_types(dtype, a.dtype)
    comm = ops[0].comm
    shape = list(ops[0].gshape)
    shape[axis] = sum(a.gshape[axis] for a in ops)
    shape = tuple(shape)
    leader = next((a for a in ops if a.split is not None), None)
    if leader is None:
        local = torch.cat([a.larray.to(dtype) for a in ops], dim=axis)
        return DNDarray._make(local, shape, None, None, comm)
    split = leader.split
    if split != axis:
        pieces = []
        for a in ops:
            t = a.larray.to(dtype)
            if a.split == split and a.counts == leader.counts:
                pieces.append(t)
            else:
                pieces.append(distribution.move(t, a.gshape, *_src(a), split, leader._ranges(),
                                                comm))
        local = torch.cat(pieces, dim=axis)
        return DNDarray._make(local, shape, split, leader.counts, comm)
    counts = distribution.balanced_counts(shape[axis], comm.size)
    targets = distribution.ranges(counts)
    lo_me = targets[comm.rank][0]
    local = torch.empty(distribution.local_shape(shape, axis, counts[comm.rank]), dtype=dtype,
                        device=leader.larray.device)
    start = 0
    for a in ops:
        n = a.gshape[axis]
        dst = []
        for lo, hi in targets:
            lo, hi = max(lo, start), min(hi, start + n)
            dst.append((lo - start, hi - start) if hi > lo else (0, 0))
        mine = dst[comm.rank]
        view = local.narrow(axis, mine[0] + start - lo_me if mine[1] > mine[0] else 0,
                            mine[1] - mine[0])
        distribution.move(a.larray.to(dtype), a.gshape, *_src(a), axis, dst, comm, out=view)
        start += n
    return DNDarray._make(local, shape, axis, counts, comm)


def stack(arrays: Sequence[DNDarray], axis: int = 0, out: DNDarray | None = None) -> DNDarray:
    """The arrays (all of one shape) joined along a new axis ``axis`` (written into ``out``
    when given)."""
    if out is not None:
        from .arithmetics import _check_out, _store

        _check_out(out)
        res = stack(arrays, axis)
        if tuple(out.shape) != tuple(res.shape):
            raise ValueError(f"stack: out has shape {tuple(out.shape)}, the result "
                             f"{tuple(res.shape)}")
        return _store(res, out, True, "stack")
    ops = _operands(arrays, "stack")
    shapes = {a.gshape for a in ops}
    if len(shapes) != 1:
        raise ValueError("all input arrays must have the same shape")
    axis = _axis_index(axis, ops[0].ndim + 1)
    return concatenate([expand_dims(a, axis) for a in ops], axis=axis)
