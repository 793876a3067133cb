"""A tour of MPICommunication: run with ``mpiexec -n 4 python -m heatlike
examples/communication_tour.py``.

Shows the buffer kinds heatlike accepts, in-place and strided buffers, half-precision sums with
float32 accumulation, non-blocking requests, and node-local / cross-node communicators. Rank 0 logs
what it sees (``HEATLIKE_LOG_RANKS=all`` shows every rank's lines);
``HEATLIKE_RANKS_PER_NODE=2`` emulates nodes of two ranks on one machine.
"""

import argparse

import numpy as np
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core.topology import get_topology


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return p.parse_args(argv)


def main() -> None:
    comm = hl.MPI_WORLD
    rank, size = comm.rank, comm.size
    log = hl.get_logger("tour")

    # torch tensors and numpy arrays, straight to MPI (no copies for contiguous buffers)
    x = torch.arange(4, dtype=torch.float32) + rank
    total = torch.empty_like(x)
    comm.Allreduce(x, total, MPI.SUM)
    counts = np.zeros(size, dtype=np.int64)
    comm.Allgather(np.array([rank * 10], dtype=np.int64), counts)
    log.info("sum of arange(4) + rank over %d ranks: %s; gathered: %s", size, total.tolist(),
             counts.tolist())

    # a strided column, reduced in place: the other columns are not touched
    table = torch.zeros(3, 4)
    table[:, 2] = rank + 1.0
    comm.Allreduce(hl.IN_PLACE, table[:, 2])
    log.info("column 2 after the in-place sum: %s (column 1 still %s)", table[:, 2].tolist(),
             table[:, 1].tolist())

    # bfloat16: summed in float32 and rounded once (pairwise bf16 rounding would give 256)
    half = torch.full((8,), 256.0 if rank == 0 else 1.0, dtype=torch.bfloat16)
    comm.Allreduce(hl.IN_PLACE, half)
    log.info("bf16 256 + %d x 1.0 = %s", size - 1, half[0].item())

    # non-blocking: start, do something else, complete
    big = torch.ones(1 << 16)
    req = comm.Iallreduce(hl.IN_PLACE, big)
    busy = sum(range(1000))
    req.Wait()
    log.info("non-blocking all-reduce done (%d) -> %s", busy, big[0].item())

    # topology: who shares a node (HEATLIKE_RANKS_PER_NODE=2 emulates nodes of 2 ranks)
    topo = get_topology(comm)
    log.info("%d node(s) of sizes %s; cross-node groups: %s", topo.num_nodes,
             list(topo.local_sizes), [list(topo.cross_ranks(i))
                                      for i in range(topo.num_cross_groups)])


if __name__ == "__main__":
    parse_args()
    main()
