"""``python -m heatlike.bench SUITE [SUITE ...] [options]`` under mpiexec / srun.

Suites:
  comm        MPICommunication against raw mpi4py, half-type all-reduce, all-reduce bus
              bandwidth from 4 KiB to 16 MiB, point-to-point latency and bandwidth of the links
  dndarray    DNDarray reductions, elementwise operations, resplit and matmul against numpy
  dp          DataParallel against PyTorch DDP (gloo)
  daso        DASO against blocking DataParallel on two (emulated) nodes
  algorithms  every distributed optimizer: accuracy per epoch, step time, bytes per step
  tta         time to accuracy (mlbench's metric) on digits and on a synthetic task
  mlbench     each mlbench-core port against the original (when mlbench-core 3.0.0 is
              installed): step time side by side
  costmodel   alpha-beta model of every algorithm's step time at 8 .. 4096 ranks (a model, not a
              measurement) next to the step times measured here
  gpu         CUDA tensors: staged (or direct) against host all-reduce by size, DataParallel
              against DDP on the GPU (skipped unless every rank sees a GPU)
  all         every suite above, in this order
  cluster     run alone, as root, not under mpiexec: the algorithms on a virtual cluster of two
              nodes whose traffic crosses rate-limited links (1 and 10 Gbit/s): step time,
              bytes on the links, time to accuracy (`python -m heatlike.bench cluster --help`)

Figures are medians over interleaved rounds, each round timed by its slowest rank. --quick is a
smoke run (fewer sizes, repetitions and epochs; one algorithm per communication pattern): under
two minutes for `all` at 4 ranks on 2 cores. Tables go to stdout, on rank 0 only; progress bars
go to rank 0's stderr when stdout and stderr are terminals (under mpiexec they are pipes: pass
--progress for bars, which then share the output with the tables).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mpi4py import MPI

from . import algorithms, comm, costmodel, daso, dndarray, dp, gpu, mlbench, tta
from ._common import Results, detect_layout, say, set_progress

SUITES = {"comm": comm.run, "dndarray": dndarray.run, "dp": dp.run, "daso": daso.run,
          "algorithms": algorithms.run, "mlbench": mlbench.run, "tta": tta.run,
          "costmodel": costmodel.run, "gpu": gpu.run}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m heatlike.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="*", choices=[*SUITES, "all"], metavar="SUITE",
                   help=f"one or more of {', '.join([*SUITES, 'all'])}")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: fewer sizes, repetitions, epochs and algorithms")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every measurement as JSON records")
    out.add_argument("--plot", metavar="DIR", help="write PNG figures of the results to DIR")
    out.add_argument("--trace", metavar="PATH",
                     help="write a Chrome trace (JSON) of a few training steps to PATH")
    out.add_argument("--trace-algorithm", default="allreduce", metavar="NAME",
                     help="the algorithm traced by --trace (default: allreduce, i.e. "
                          "DataParallel with blocking updates)")
    out.add_argument("--trace-steps", type=int, default=5, metavar="N",
                     help="steps traced by --trace (default 5)")
    bars = out.add_mutually_exclusive_group()
    bars.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="progress bars on rank 0's stderr even when the output is not a "
                           "terminal (default: only on a terminal)")
    bars.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bars")
    train = p.add_argument_group("algorithms, tta, costmodel")
    train.add_argument("--algorithms", metavar="A,B,...",
                       help="comma-separated algorithms of heatlike.recipes.ALGORITHMS, "
                            "or 'all' (default: all; with --quick one per pattern)")
    train.add_argument("--target", type=float, default=0.95, metavar="ACC",
                       help="tta: target test accuracy on digits (default 0.95)")
    train.add_argument("--target-synthetic", type=float, default=0.90, metavar="ACC",
                       help="tta: target test accuracy on the synthetic task (default 0.90)")
    train.add_argument("--max-epochs", type=int, default=None, metavar="N",
                       help="tta: give up after this many epochs (default 10, 3 with --quick)")
    model = p.add_argument_group("costmodel")
    model.add_argument("--links", metavar="LOCAL_US:LOCAL_GBPS,CROSS_US:CROSS_GBPS",
                       help="link latency and bandwidth for the model (default: measured by "
                            "the comm suite, or now)")
    model.add_argument("--ranks-per-node", type=int, default=4, metavar="K",
                       help="ranks per node of the predicted layouts (default 4)")
    tensor = p.add_argument_group("dndarray")
    tensor.add_argument("--against", choices=["heat"], default=None,
                        help="dndarray: also run every operation, and a DataParallel step, "
                             "through Heat in the same process (when Heat is importable)")
    other = p.add_argument_group("daso")
    other.add_argument("--slow-link", metavar="LATENCY_US:MBPS",
                       help="daso: simulate a slower cross-node link (labelled in the output)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cluster"]:  # a driver of its own: it launches the jobs
        from .cluster import run as run_cluster

        return run_cluster(argv[1:])
    p = _parser()
    args = p.parse_args(argv)
    if not args.suites and not args.trace:
        p.error("name at least one suite (or --trace PATH)")
    if args.links:
        try:
            costmodel.parse_links(args.links)  # fail before running anything
        except ValueError as error:
            p.error(str(error))
    if args.ranks_per_node < 1:
        p.error("--ranks-per-node must be >= 1")
    try:
        algorithms.choose_algorithms(args.algorithms, args.quick)
        algorithms.choose_algorithms(args.trace_algorithm, False)
    except ValueError as error:
        p.error(str(error))
    names = list(SUITES) if "all" in args.suites else list(dict.fromkeys(args.suites))
    set_progress(args.progress)
    world = MPI.COMM_WORLD
    detect_layout(world)
    options = {
        "daso": {"slow_link": args.slow_link},
        "dndarray": {"against": args.against},
        "algorithms": {"algorithms": args.algorithms},
        "tta": {"algorithms": args.algorithms, "target": args.target,
                "target_synthetic": args.target_synthetic, "max_epochs": args.max_epochs},
        "costmodel": {"algorithms": args.algorithms, "links": args.links,
                      "ranks_per_node": args.ranks_per_node},
    }
    results = Results()
    started = time.perf_counter()
    for name in names:
        start = time.perf_counter()
        SUITES[name](results, quick=args.quick, **options.get(name, {}))
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        results.add("bench", name, "suite wall time", elapsed, "s", quick=args.quick)
        say(f"# {name}: {elapsed:.1f} s\n")
    if args.trace:
        from .trace import run_trace

        if world.Get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
        run_trace(args.trace, results, args.trace_algorithm, steps=args.trace_steps)
    if world.Get_rank() == 0:
        if args.json:
            results.write_json(args.json)
            say(f"# wrote {len(results.records)} records to {args.json}")
        if args.plot:
            from .plot import plot_results

            for path in plot_results(results, args.plot):
                say(f"# wrote {path}")
    say(f"# total: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
