"""``python -m heatlike.bench SUITE [SUITE ...] [--quick] [--json PATH]`` under mpiexec / srun.

Suites: comm (MPICommunication overhead and half-type all-reduce), dp (DataParallel against
PyTorch DDP). ``all`` runs every suite.
Figures are medians over interleaved rounds, each round timed by its slowest rank.
"""

from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

from . import comm, dp
from ._common import Results

SUITES = {"comm": comm.run, "dp": dp.run}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m heatlike.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="+", choices=[*SUITES, "all"])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON records")
    args = p.parse_args(argv)
    names = list(SUITES) if "all" in args.suites else list(dict.fromkeys(args.suites))
    results = Results()
    for name in names:
        SUITES[name](results, quick=args.quick)
    if args.json and MPI.COMM_WORLD.Get_rank() == 0:
        results.write_json(args.json)
        print(f"# wrote {len(results.records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
