"""``python -m heatlike.bench comm``: the cost of MPICommunication over raw mpi4py, and half-type
all-reduce against float32.

For fp32 all-reduces from 4 KiB to 16 MiB (4 KiB, 64 KiB, 1 MiB, 16 MiB with ``--quick``, also
256 KiB and 4 MiB without) it times MPICommunication on torch tensors and on numpy arrays, each
against raw mpi4py on the *same memory* (``[array, MPI.FLOAT]`` specs, mpi4py's fastest form; for
tensors through ``tensor.numpy()`` views). Same memory matters: numpy advises transparent huge
pages for large arrays and torch does not, which alone changes a 16 MiB all-reduce by about 20% on
shared memory. It also times bfloat16 and float16 tensors holding the same number of elements
(half the bytes). Targets: wrapper/raw <= 1.05 at >= 1 MiB and <= 1.3 at 4 KiB; bf16 no slower
than fp32 at 16 MiB.

Bus bandwidth (the nccl-tests convention): an all-reduce of S bytes in t seconds on P ranks has
bus bandwidth ``S * 2(P-1)/P / t``, the rate at which each rank's link carries data in a ring
all-reduce, so it can be compared with the link itself: a ring all-reduce cannot exceed the
point-to-point bandwidth of the slowest link it crosses. Links (:func:`measure_links`): every
rank of a node sends to the next and receives from the previous one at once (``Sendrecv`` in a
ring, the traffic pattern of a ring all-reduce), 8 bytes for the latency alpha and 16 MiB for the
bandwidth (beta = (t(16 MiB) - alpha) / 16 MiB); cross-node, local rank 0 of every node does the
same over the nodes (one stream per node, as in a ring ordered by node). On one node the
cross-node link is not measured. These alpha-beta pairs feed the cost model
(``heatlike.bench.costmodel``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..core.communication import MPI_WORLD
from ._common import (
    Results,
    describe_environment,
    oversubscription_note,
    progress,
    say,
    timed_rounds,
)

SIZES = [("4 KiB", 4 << 10), ("64 KiB", 64 << 10), ("256 KiB", 256 << 10), ("1 MiB", 1 << 20),
         ("4 MiB", 4 << 20), ("16 MiB", 16 << 20)]
QUICK_SIZES = ("4 KiB", "64 KiB", "1 MiB", "16 MiB")
LATENCY_BYTES, BANDWIDTH_BYTES = 8, 16 << 20


def bus_bandwidth(nbytes: float, seconds: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in bytes/s: ``nbytes * 2(P-1)/P / seconds``."""
    return nbytes * 2 * (ranks - 1) / ranks / seconds if ranks > 1 else 0.0


@dataclass
class LinkMeasurement:
    """A measured link: latency (s) and bandwidth (bytes/s) of a ring of ``Sendrecv``."""

    alpha: float
    bandwidth: float
    beta: float
    ranks: int


def _ring_shift_time(comm: MPI.Intracomm | None, nbytes: int, iters: int, rounds: int,
                     world: MPI.Intracomm) -> float:
    """Median seconds of one ring ``Sendrecv`` of ``nbytes`` on ``comm`` (None: this rank only
    waits), each round timed by the slowest rank of ``world``."""
    send = np.ones(max(1, nbytes), np.uint8)
    recv = np.empty_like(send)
    samples = []
    active = comm is not None and comm.Get_size() > 1
    if active:
        r, m = comm.Get_rank(), comm.Get_size()
        right, left = (r + 1) % m, (r - 1) % m
    for i in range(rounds + 1):
        world.Barrier()
        start = time.perf_counter()
        if active:
            for _ in range(iters):
                comm.Sendrecv([send, MPI.BYTE], right, 11, [recv, MPI.BYTE], left, 11)
        elapsed = world.allreduce(time.perf_counter() - start if active else 0.0, op=MPI.MAX)
        if i:  # the first round warms up
            samples.append(elapsed / iters)
    return statistics.median(samples)


def measure_links(quick: bool = False) -> dict[str, LinkMeasurement | None]:
    """Collective over the world: alpha-beta of the node-local and the cross-node link (module
    docstring); None for a link this layout does not have."""
    from ..core.topology import Topology

    world = MPI.COMM_WORLD
    topo = Topology(MPI_WORLD)
    rounds = 3 if quick else 7
    out: dict[str, LinkMeasurement | None] = {}
    try:
        for name, comm, members in (
                ("local", topo.node_comm.handle, max(topo.local_sizes)),
                ("cross", topo.cross_comm.handle if topo.local_rank == 0 else None,
                 topo.num_nodes)):
            if members < 2:
                out[name] = None
                continue
            small = _ring_shift_time(comm, LATENCY_BYTES, 20 if quick else 200, rounds, world)
            large = _ring_shift_time(comm, BANDWIDTH_BYTES, 2 if quick else 5, rounds, world)
            beta = max(large - small, 1e-12) / BANDWIDTH_BYTES
            out[name] = LinkMeasurement(small, BANDWIDTH_BYTES / large, beta, members)
    finally:
        topo.free()
    return out


def record_links(results: Results, links: dict[str, LinkMeasurement | None]) -> None:
    for name, link in links.items():
        if link is None:
            continue
        case = f"p2p {'node-local' if name == 'local' else 'cross-node'}"
        results.add("comm", case, "latency", link.alpha * 1e6, "us", link=name,
                    size_bytes=LATENCY_BYTES, ranks=link.ranks)
        results.add("comm", case, "bandwidth", link.bandwidth / 1e9, "GB/s", link=name,
                    size_bytes=BANDWIDTH_BYTES, ranks=link.ranks)


def _plan(nbytes: int, quick: bool) -> tuple[int, int]:
    """(iterations per timed block, rounds) for a message size."""
    if nbytes <= 4 << 10:
        return (20, 3) if quick else (300, 15)
    if nbytes <= 64 << 10:
        return (10, 3) if quick else (100, 15)
    if nbytes <= 2 << 20:
        return (3, 3) if quick else (30, 11)
    return (1, 3) if quick else (4, 9)


def _variants(n: int) -> dict:
    """The all-reduces compared, each on its own buffers of n elements."""
    comm, w = MPI.COMM_WORLD, MPI_WORLD
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    t, u = torch.ones(n), torch.empty(n)
    tn, un = t.numpy(), u.numpy()
    h, hh = torch.ones(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    f, ff = torch.ones(n, dtype=torch.float16), torch.empty(n, dtype=torch.float16)
    return {
        "raw": lambda: comm.Allreduce([tn, MPI.FLOAT], [un, MPI.FLOAT], MPI.SUM),
        "heatlike": lambda: w.Allreduce(t, u, MPI.SUM),
        "raw-numpy": lambda: comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT], MPI.SUM),
        "heatlike-numpy": lambda: w.Allreduce(a, b, MPI.SUM),
        "bf16": lambda: w.Allreduce(h, hh, MPI.SUM),
        "fp16": lambda: w.Allreduce(f, ff, MPI.SUM),
    }


def run(results: Results, quick: bool = False) -> None:
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    say(f"# comm: fp32 all-reduce, {describe_environment(comm)}")
    say("#        ---- torch tensors ----  ---- numpy arrays -----  -- same n, half types -"
        "  bus GB/s")
    say(f"{'size':>7} {'mpi4py':>7} {'heatlike':>8} {'ratio':>6} {'mpi4py':>7} "
        f"{'heatlike':>8} {'ratio':>6} {'bf16':>7} {'/fp32':>5} {'fp16':>7} {'/fp32':>5} "
        f"{'heatlike':>9}   (times in us)")
    sizes = [s for s in SIZES if not quick or s[0] in QUICK_SIZES]
    for label, nbytes in progress(sizes, "comm all-reduce"):
        iters, rounds = _plan(nbytes, quick)
        med = timed_rounds(_variants(nbytes // 4), iters, rounds, comm)
        ratio = med["heatlike"] / med["raw"]
        case = f"allreduce {label}"
        for name, value in med.items():
            wire = nbytes // 2 if name in ("bf16", "fp16") else nbytes
            results.add("comm", case, f"{name} time", value * 1e6, "us", size_bytes=wire,
                        elements=nbytes // 4)
            if size > 1:
                results.add("comm", case, f"{name} bus bandwidth",
                            bus_bandwidth(wire, value, size) / 1e9, "GB/s", size_bytes=wire,
                            elements=nbytes // 4)
        results.add("comm", case, "heatlike/mpi4py", ratio, "ratio", size_bytes=nbytes)
        results.add("comm", case, "numpy heatlike/mpi4py",
                    med["heatlike-numpy"] / med["raw-numpy"], "ratio", size_bytes=nbytes)
        results.add("comm", case, "bf16/fp32", med["bf16"] / med["heatlike"], "ratio",
                    size_bytes=nbytes)
        results.add("comm", case, "fp16/fp32", med["fp16"] / med["heatlike"], "ratio",
                    size_bytes=nbytes)
        us = {k: v * 1e6 for k, v in med.items()}
        say(f"{label:>7} {us['raw']:7.1f} {us['heatlike']:8.1f} {ratio:6.2f} "
            f"{us['raw-numpy']:7.1f} {us['heatlike-numpy']:8.1f} "
            f"{med['heatlike-numpy'] / med['raw-numpy']:6.2f} "
            f"{us['bf16']:7.1f} {med['bf16'] / med['heatlike']:5.2f} "
            f"{us['fp16']:7.1f} {med['fp16'] / med['heatlike']:5.2f} "
            f"{bus_bandwidth(nbytes, med['heatlike'], size) / 1e9:9.2f}")
    links = measure_links(quick)
    record_links(results, links)
    note = oversubscription_note(comm)
    say("# links: ring Sendrecv, alpha = 8 B time, bandwidth at 16 MiB"
        + (f"; {note}" if note else ""))
    for name, link in links.items():
        if link is None:
            where = "on one node" if name == "local" else "on different nodes"
            say(f"{name:>7}: not measured (no two ranks {where})")
        else:
            say(f"{name:>7}: alpha {link.alpha * 1e6:7.2f} us, {link.bandwidth / 1e9:6.2f} GB/s "
                f"({link.ranks} ranks in the ring)")
