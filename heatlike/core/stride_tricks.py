"""Shape helpers (Heat's ``heat.core.stride_tricks``): broadcasting and axis checks on shapes,
with no data and no communication."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["broadcast_shape", "broadcast_shapes", "sanitize_axis", "sanitize_shape"]


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy's broadcast shape of ``shapes``; ``ValueError`` when they do not broadcast."""
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*(tuple(s) for s in shapes)))
    except ValueError:
        raise ValueError("operands could not be broadcast together with shapes "
                         + " ".join(str(tuple(s)) for s in shapes)) from None


def broadcast_shape(shape_a: Sequence[int], shape_b: Sequence[int]) -> tuple[int, ...]:
    """The broadcast shape of two shapes (Heat's name)."""
    return broadcast_shapes(shape_a, shape_b)


def sanitize_axis(shape: Sequence[int], axis: object) -> int | tuple[int, ...] | None:
    """``axis`` (None, an integer or a sequence of integers) as non-negative axes of an array of
    ``shape``: ``TypeError`` for non-integers, ``ValueError`` when out of range."""
    from .reductions import _axis_index

    if axis is None:
        return None
    nd = len(tuple(shape))
    if isinstance(axis, (tuple, list)):
        return tuple(_axis_index(a, max(nd, 1) if nd else 1) for a in axis)
    if nd == 0 and axis in (0, -1):
        return 0
    return _axis_index(axis, nd)


def sanitize_shape(shape: object, lval: int = 0) -> tuple[int, ...]:
    """``shape`` (an integer or a sequence of integers) as a tuple; ``TypeError`` for
    non-integers, ``ValueError`` for entries below ``lval``."""
    items = (shape,) if isinstance(shape, (int, np.integer)) else shape
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"expected a sequence of integers, got {type(shape).__name__}")
    out = []
    for s in items:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"expected integers, got {type(s).__name__}")
        if s < lval:
            raise ValueError(f"negative dimensions are not allowed: {tuple(items)}")
        out.append(int(s))
    return tuple(out)
