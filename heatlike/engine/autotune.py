"""Choose the bucket size (and, when allowed, the wire format) for a model from a measurement
of the communicator, once, at start-up.

The measurement times all-reduces on ``comm`` and fits the alpha-beta model of one all-reduce
of ``n`` bytes::

    t(n) = alpha + beta * n

from two sizes (each time the median over rounds of the slowest rank's time, so every rank gets
the same numbers). The choice:

* **bucket size**: a bucket of ``s`` bytes spends ``alpha / (alpha + beta * s)`` of its
  all-reduce time on latency. The smallest ``s`` that keeps that share at most ``overhead``
  (10% by default) is ``s = alpha * (1 - overhead) / (overhead * beta)``; it is clamped to
  [256 KiB, 64 MiB] and to the model's gradient size. Smaller buckets start their all-reduce
  earlier in the backward pass (more overlap); the rule keeps them as small as the link allows.
  The first bucket is a quarter of that (at most 1 MiB), so the first all-reduce starts early.
* **wire format** (only with ``allow_lossy=True``): the gradients' all-reduce is timed in
  float32 and in bfloat16 at the model's gradient size (at most 16 MiB); bfloat16 is chosen when
  it is at least 10% faster. bfloat16 changes the result (each rank's contribution is rounded
  once, the sum is accumulated in float32), so it is never chosen silently.

The choice and the reason are logged on rank 0 and returned, and are identical on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..core.communication import MPICommunication, sanitize_comm
from ..core.log import get_logger
from .codecs import Cast, Codec

__all__ = ["LinkFit", "Choice", "measure_allreduce", "choose_bucket_bytes", "autotune"]

KiB, MiB = 1 << 10, 1 << 20
MIN_BUCKET, MAX_BUCKET = 256 * KiB, 64 * MiB


@dataclass(frozen=True)
class LinkFit:
    """``t(n) = alpha + beta * n`` seconds for an all-reduce of ``n`` bytes on a communicator."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the all-reduce's bandwidth term (1 / beta)."""
        return 1.0 / self.beta


@dataclass(frozen=True)
class Choice:
    """What :func:`autotune` chose, and why."""

    bucket_cap_mb: float
    first_bucket_mb: float
    codec: Codec | None
    link: LinkFit
    reason: str


def _time_allreduce(comm: MPICommunication, buf: torch.Tensor, rounds: int) -> float:
    """Median over ``rounds`` of the slowest rank's time of one all-reduce of ``buf``."""
    comm.Allreduce(MPI.IN_PLACE, buf)  # warm-up (buffers, protocol)
    times = []
    for _ in range(rounds):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        times.append(time.perf_counter() - start)
    slowest = np.array(times)
    comm.handle.Allreduce(MPI.IN_PLACE, slowest, MPI.MAX)
    return float(np.median(slowest))


def measure_allreduce(comm: MPICommunication | None = None, small: int = 4 * KiB,
                      large: int = 4 * MiB, rounds: int = 5) -> LinkFit:
    """Collective: fit ``t(n) = alpha + beta * n`` to float32 all-reduces of ``small`` and
    ``large`` bytes on ``comm`` (the same fit on every rank). One rank: alpha = beta = 0 would
    make every choice degenerate, so a tiny positive fit is returned."""
    comm = sanitize_comm(comm)
    if comm.size == 1:
        return LinkFit(alpha=1e-9, beta=1e-15)
    t_small = _time_allreduce(comm, torch.zeros(small // 4), rounds)
    t_large = _time_allreduce(comm, torch.zeros(large // 4), rounds)
    beta = max((t_large - t_small) / (large - small), 1e-15)
    alpha = max(t_small - beta * small, 1e-9)
    return LinkFit(alpha=alpha, beta=beta)


def choose_bucket_bytes(link: LinkFit, total_bytes: int, overhead: float = 0.1) -> int:
    """The smallest bucket whose all-reduce spends at most ``overhead`` of its time on latency,
    ``alpha (1 - overhead) / (overhead beta)``, clamped to [256 KiB, 64 MiB] and to
    ``total_bytes`` (module docstring)."""
    if not 0 < overhead < 1:
        raise ValueError(f"overhead must be in (0, 1), got {overhead!r}")
    wanted = link.alpha * (1 - overhead) / (overhead * link.beta)
    size = min(max(wanted, MIN_BUCKET), MAX_BUCKET)
    return int(max(min(size, total_bytes), 1))


def autotune(model: torch.nn.Module, comm: MPICommunication | None = None, *,
             allow_lossy: bool = False, overhead: float = 0.1, rounds: int = 5) -> Choice:
    """Collective: measure ``comm`` and choose the bucket size (and, with ``allow_lossy``, the
    wire format) for ``model``'s trainable parameters; log the choice and the reason on rank 0.
    """
    comm = sanitize_comm(comm)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in params)
    link = measure_allreduce(comm, rounds=rounds)
    bucket = choose_bucket_bytes(link, max(total, 1), overhead)
    first = min(bucket // 4, MiB) or bucket
    latency_share = link.alpha / link.time(bucket)
    reason = (f"all-reduce on {comm.size} ranks: latency {link.alpha * 1e6:.0f} us, bandwidth "
              f"{link.bandwidth / 1e9:.2f} GB/s; a {bucket / MiB:.2f} MiB bucket spends "
              f"{latency_share:.0%} of its time on latency (target {overhead:.0%}); "
              f"gradients: {total / MiB:.2f} MiB")
    codec = None
    if allow_lossy and comm.size > 1 and total:
        n = min(total, 16 * MiB) // 4
        t32 = _time_allreduce(comm, torch.zeros(n), rounds)
        t16 = _time_allreduce(comm, torch.zeros(n, dtype=torch.bfloat16), rounds)
        if t16 < 0.9 * t32:
            codec = Cast(torch.bfloat16)
        reason += (f"; bfloat16 all-reduce {t16 * 1e3:.2f} ms vs float32 {t32 * 1e3:.2f} ms at "
                   f"{n * 4 / MiB:.2f} MiB: {'bfloat16' if codec else 'float32'} on the wire")
    choice = Choice(bucket_cap_mb=bucket / MiB, first_bucket_mb=first / MiB, codec=codec,
                    link=link, reason=reason)
    if comm.rank == 0:
        get_logger().info("autotune: bucket %.2f MiB, first %.2f MiB, %s (%s)",
                          choice.bucket_cap_mb, choice.first_bucket_mb,
                          "bfloat16 gradients" if codec else "float32 gradients", reason)
    return choice
