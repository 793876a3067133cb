"""Reused communication buffers.

A buffer of several megabytes allocated for every exchange costs its page faults (and, for
page-locked host memory, a ``cudaHostAlloc``) each time. :data:`pool` keeps the buffers of
finished exchanges for the next one of the same size: :meth:`BufferPool.take` hands out a free
one or allocates, :meth:`BufferPool.give` returns it. A buffer is taken by one exchange at a
time, so exchanges in flight together never share one. Used by the staged pipeline's chunks
(``heatlike.core._staging``) and gossip's receive buffers (``heatlike.engine.reducers``).
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool", "pool"]


class BufferPool:
    """Free flat ``uint8`` buffers by (bytes, device, page-locked); at most ``keep`` of each kind
    are kept, the rest are left to the allocator."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._free: dict[tuple[int, torch.device, bool], list[torch.Tensor]] = {}

    def take(self, nbytes: int, device: torch.device | str = "cpu",
             pinned: bool = False) -> torch.Tensor:
        """A buffer of ``nbytes`` bytes on ``device`` (page-locked host memory with ``pinned``);
        view it with ``.view(dtype)``."""
        device = torch.device(device)
        free = self._free.get((nbytes, device, pinned))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)

    def give(self, buf: torch.Tensor, pinned: bool = False) -> None:
        """Return a buffer :meth:`take` handed out (the caller no longer uses it)."""
        free = self._free.setdefault((buf.numel(), buf.device, pinned), [])
        if len(free) < self.keep:
            free.append(buf)

    def clear(self) -> None:
        self._free.clear()


#: the process's pool (a pipeline keeps up to ``2 * _staging.DEPTH`` chunks of one size)
pool = BufferPool()
