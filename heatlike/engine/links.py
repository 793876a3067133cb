"""A simulated slower link, for measuring what communication-avoiding algorithms save.

:class:`SimulatedLink` models a link of given latency and bandwidth on top of the real transport:
a transfer of n bytes started at time t is not considered complete before
``t + latency + n / bandwidth``. Code that waits for the transfer sleeps until then, so
computation between start and wait still hides the delay, as it would on a real link. Results are
unchanged; only time is added. :class:`SlowLinkAllReduce` applies it to the engine's
all-reduce.
"""

from __future__ import annotations

import time

import torch

from .reducers import AllReduce

__all__ = ["SimulatedLink", "SlowLinkAllReduce"]


class SimulatedLink:
    """Opt-in model of a slower link: a transfer of n bytes started at time t is not complete
    before ``t + latency + n / bandwidth``. Waiting sleeps until then, so computation between
    start and wait still hides it, as on a real link. Only for measuring; results are unchanged."""

    def __init__(self, latency_s: float, bandwidth_bytes_per_s: float) -> None:
        if latency_s < 0 or bandwidth_bytes_per_s <= 0:
            raise ValueError("latency must be >= 0 and bandwidth > 0")
        self.latency = latency_s
        self.bandwidth = bandwidth_bytes_per_s

    def ready_at(self, nbytes: int) -> float:
        return time.perf_counter() + self.latency + nbytes / self.bandwidth

    @staticmethod
    def wait_until(t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def __repr__(self) -> str:
        return (f"SimulatedLink(latency={self.latency * 1e6:.0f} us, "
                f"bandwidth={self.bandwidth / 1e6:.0f} MB/s)")


class SlowLinkAllReduce(AllReduce):
    """:class:`~heatlike.engine.reducers.AllReduce` whose every round waits out a
    :class:`SimulatedLink` when it completes (for a flat data-parallel baseline whose
    all-reduces cross nodes)."""

    def __init__(self, link: SimulatedLink, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.link = link

    def combine(self, t: torch.Tensor, channel=None):
        ready = self.link.ready_at(t.numel() * t.element_size())
        yield from super().combine(t, channel=channel)
        self.link.wait_until(ready)
