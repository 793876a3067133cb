"""``python -m heatlike.bench SUITE [SUITE ...] [--quick] [--json PATH]`` under mpiexec / srun.

Suites: comm (MPICommunication overhead and half-type all-reduce), dndarray (DNDarray reductions,
elementwise operations, resplit and matmul against numpy on one process), dp (DataParallel against
PyTorch DDP), daso (DASO against blocking DataParallel on two emulated nodes), algorithms (every
distributed optimizer: bytes, step time, accuracy). ``all`` runs every suite.
Figures are medians over interleaved rounds, each round timed by its slowest rank.
"""

from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

from . import algorithms, comm, daso, dndarray, dp
from ._common import Results

SUITES = {"comm": comm.run, "dndarray": dndarray.run, "dp": dp.run, "daso": daso.run,
          "algorithms": algorithms.run}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m heatlike.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="+", choices=[*SUITES, "all"])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON records")
    p.add_argument("--slow-link", metavar="LATENCY_US:MBPS",
                   help="daso: simulate a slower cross-node link (labelled in the output)")
    args = p.parse_args(argv)
    names = list(SUITES) if "all" in args.suites else list(dict.fromkeys(args.suites))
    results = Results()
    for name in names:
        if name == "daso":
            SUITES[name](results, quick=args.quick, slow_link=args.slow_link)
        else:
            SUITES[name](results, quick=args.quick)
    if args.json and MPI.COMM_WORLD.Get_rank() == 0:
        results.write_json(args.json)
        print(f"# wrote {len(results.records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
