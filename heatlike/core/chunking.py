"""How n items are split over P parts: the first ``n % P`` parts get one extra item (Heat's rule).

Used for DNDarray distribution, for the chunks of the half-precision reductions and for default
``Reduce_scatter`` counts, so all of them agree.
"""

from __future__ import annotations

__all__ = ["counts_displs", "chunk_range"]


def counts_displs(n: int, parts: int) -> tuple[list[int], list[int]]:
    """Counts and displacements of ``n`` items over ``parts`` parts.

    >>> counts_displs(10, 4)
    ([3, 3, 2, 2], [0, 3, 6, 8])
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    base, extra = divmod(n, parts)
    counts = [base + 1 if i < extra else base for i in range(parts)]
    displs = [0] * parts
    for i in range(1, parts):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` of ``n`` items over ``parts`` parts."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
