"""``python -m heatlike.bench dndarray``: DNDarray operations at the running world size against
numpy on one process with the same data.

Cases, on float32 arrays of ``4096 x 4096`` (64 MiB; ``--quick`` runs fewer rounds on
``2048 x 2048``) split along axis 0:

* ``sum(axis=0)``: local column sums and one ``Allreduce`` of 4096 values;
* ``a + b``: elementwise, both operands with the same layout, local;
* ``resplit(0 -> 1)``: one ``Alltoallv`` moving the (P-1)/P of the elements that change owner;
  numpy's reference is a copy of the array (the memory traffic of moving every element once),
  and the achieved rate is reported in GB/s of data that changed rank;
* ``a @ w``: a (0, None) matmul with ``w`` of ``4096 x 256`` replicated, local.

With ``--against heat`` (when Heat is importable; skipped with the reason otherwise) the same
operations also run through Heat in the same process, interleaved with heatlike's: random
generation of the array, ``sum(axis=0)``, ``mean(axis=0)``, ``argmax(axis=0)``, ``a + b``,
``resplit`` and the matmul, and a DataParallel training step (an MLP 256-1024-1024-10, batch 32
per rank, blocking updates, SGD) through each library's ``DataParallel`` and
``DataParallelOptimizer`` with Heat's signatures, timed in rounds of its own (25 rounds of 20
steps each side). Each figure is the median of the slowest
rank's time; the ratio is heatlike / Heat (targets: every operation <= 1.0, their geometric mean
<= 0.8, DataParallel <= 0.9).

The same data for numpy come from :mod:`heatlike.random` on rank 0 alone (values do not depend on
the number of ranks). Fresh torch results are page-faulted in 4 KiB pages unless
``THP_MEM_ALLOC_ENABLE=1`` is set (numpy uses transparent huge pages by itself), which dominates
``a + b`` and ``resplit``; the header says which applies. Distributed timings are medians over
interleaved rounds, each the slowest rank's time; numpy runs on rank 0 while the other ranks
sleep (not spin in MPI), so it has the machine to itself.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from .. import random as hrandom
from ..core.communication import MPI_SELF, MPI_WORLD
from ..utils.launch import configure_threads
from ._common import Results, describe_environment, say, timed_rounds

ROWS = COLS = 4096
QUICK_ROWS = 2048
INNER = 256
_TAG = 5731


def _numpy_times(variants: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant on rank 0; the other ranks sleep meanwhile."""
    comm = MPI_WORLD
    out: dict[str, float] = {}
    comm.Barrier()
    if comm.rank == 0:
        for name, fn in variants.items():
            fn()
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            out[name] = statistics.median(samples)
        for r in range(1, comm.size):
            comm.handle.send(out, dest=r, tag=_TAG)
    else:
        while not comm.handle.Iprobe(source=0, tag=_TAG):
            time.sleep(0.005)
        out = comm.handle.recv(source=0, tag=_TAG)
    return out


def run(results: Results, quick: bool = False, against: str | None = None) -> None:
    comm = MPI_WORLD
    configure_threads(comm.handle)  # torch gets this rank's cores, as numpy's BLAS does
    rank0 = comm.rank == 0
    rounds = 3 if quick else 7
    rows = cols = QUICK_ROWS if quick else ROWS
    hrandom.seed(2024)
    a = hrandom.rand(rows, cols, split=0)
    b = hrandom.rand(rows, cols, split=0)
    w = hrandom.rand(cols, INNER)
    mib = a.nbytes / 2 ** 20
    if rank0:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"
        print(f"# dndarray: float32 {rows} x {cols} ({mib:.0f} MiB) split=0, "
              f"{describe_environment(comm.handle)}, torch threads {torch.get_num_threads()}, "
              f"torch huge pages {'on' if thp else 'off (THP_MEM_ALLOC_ENABLE=1 turns them on)'}")
        print(f"{'case':<18} {'heatlike ms':>11} {'numpy ms':>9} {'numpy/heatlike':>14}  note",
              flush=True)
    distributed = {
        "sum(axis=0)": lambda: a.sum(axis=0),
        "a + b": lambda: a + b,
        "resplit(0 -> 1)": lambda: a.resplit(1),
        "a @ w (0,None)": lambda: a @ w,
    }
    med = timed_rounds(distributed, 1, rounds, comm.handle)
    references = {}
    if rank0:
        hrandom.seed(2024)
        na = hrandom.rand(rows, cols, comm=MPI_SELF).numpy()
        nb = hrandom.rand(rows, cols, comm=MPI_SELF).numpy()
        nw = hrandom.rand(cols, INNER, comm=MPI_SELF).numpy()
        references = {
            "sum(axis=0)": lambda: na.sum(axis=0),
            "a + b": lambda: na + nb,
            "resplit(0 -> 1)": lambda: na.copy(),
            "a @ w (0,None)": lambda: na @ nw,
        }
        np.testing.assert_allclose((a @ w).numpy()[:4], na[:4] @ nw, rtol=1e-4)
    else:
        (a @ w).numpy()
    ref = _numpy_times(references if rank0 else {}, rounds)
    moved = a.nbytes * (comm.size - 1) / comm.size
    for name, seconds in med.items():
        ratio = ref[name] / seconds
        note = ""
        if name.startswith("resplit"):
            rate = moved / seconds / 1e9
            note = f"{rate:.2f} GB/s changed rank; numpy: a copy"
            results.add("dndarray", name, "moved rate", rate, "GB/s")
        results.add("dndarray", name, "heatlike time", seconds * 1e3, "ms")
        results.add("dndarray", name, "numpy time", ref[name] * 1e3, "ms")
        results.add("dndarray", name, "numpy/heatlike", ratio, "ratio")
        if rank0:
            print(f"{name:<18} {seconds * 1e3:11.2f} {ref[name] * 1e3:9.2f} {ratio:14.2f}  {note}",
                  flush=True)
    if against == "heat":
        run_against_heat(results, quick)


def import_heat():
    """Heat, or ImportError with the reason (import errors of Heat's own dependencies
    included)."""
    try:
        import heat
    except Exception as error:  # noqa: BLE001 - any failure to import means "not available"
        raise ImportError(f"Heat cannot be imported: {type(error).__name__}: {error}") from error
    return heat


DP_WIDTHS = [256, 1024, 1024, 10]
DP_STEPS, DP_ROUNDS = 20, 25  # per round; rounds (the step's figure is the median round)


def _dp_steps(ht):
    """One blocking DataParallel training step for heatlike and for Heat, same model and data."""
    from .. import nn as hnn
    from .. import optim as hoptim
    from ..recipes import mlp

    g = torch.Generator().manual_seed(MPI_WORLD.rank)
    x = torch.randn(32, DP_WIDTHS[0], generator=g)
    y = torch.randint(0, DP_WIDTHS[-1], (32,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def make(nn_mod, optim_mod, comm):
        torch.manual_seed(0)
        net = mlp(DP_WIDTHS)
        opt = optim_mod.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                              blocking=True)
        model = nn_mod.DataParallel(net, comm, opt, blocking_parameter_updates=True)

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return step

    return make(hnn, hoptim, MPI_WORLD), make(ht.nn, ht.optim, ht.MPI_WORLD)


def run_against_heat(results: Results, quick: bool = False) -> None:
    """heatlike against Heat, operation by operation, in one process (module docstring)."""
    comm = MPI_WORLD
    try:
        ht = import_heat()
    except ImportError as error:
        say(f"# dndarray --against heat: skipped: {error}")
        return
    rounds = 3 if quick else 9
    rows = cols = QUICK_ROWS if quick else ROWS
    say(f"# dndarray against Heat {ht.__version__}: float32 {rows} x {cols} split=0, "
        f"{describe_environment(comm.handle)}")
    say(f"{'case':<22} {'heatlike ms':>11} {'Heat ms':>9} {'heatlike/Heat':>13}")
    hrandom.seed(7)
    a, b = hrandom.rand(rows, cols, split=0), hrandom.rand(rows, cols, split=0)
    w = hrandom.rand(cols, INNER)
    ht.random.seed(7)
    ha = ht.random.rand(rows, cols, split=0, dtype=ht.float32)
    hb = ht.random.rand(rows, cols, split=0, dtype=ht.float32)
    hw = ht.random.rand(cols, INNER, dtype=ht.float32)
    ours_dp, heat_dp = _dp_steps(ht)
    cases = {
        "random rand": (lambda: hrandom.rand(rows, cols, split=0),
                        lambda: ht.random.rand(rows, cols, split=0, dtype=ht.float32)),
        "sum(axis=0)": (lambda: a.sum(axis=0), lambda: ha.sum(axis=0)),
        "mean(axis=0)": (lambda: a.mean(axis=0), lambda: ht.mean(ha, axis=0)),
        "argmax(axis=0)": (lambda: a.argmax(axis=0), lambda: ht.argmax(ha, axis=0)),
        "a + b": (lambda: a + b, lambda: ha + hb),
        "resplit(0 -> 1)": (lambda: a.resplit(1), lambda: ht.resplit(ha, 1)),
        "a @ w (0,None)": (lambda: a @ w, lambda: ht.matmul(ha, hw)),
    }
    variants = {}
    for name, (ours, theirs) in cases.items():
        variants[f"{name}|heatlike"] = ours
        variants[f"{name}|heat"] = theirs
    med = timed_rounds(variants, 3 if quick else 5, rounds, comm.handle)
    # a training step takes milliseconds, not tens of them: more steps and rounds of its own
    cases["DataParallel step"] = (ours_dp, heat_dp)
    med.update(timed_rounds({"DataParallel step|heatlike": ours_dp,
                             "DataParallel step|heat": heat_dp},
                            3 if quick else DP_STEPS, rounds if quick else DP_ROUNDS,
                            comm.handle))
    ratios = []
    for name in cases:
        mine, heat = med[f"{name}|heatlike"], med[f"{name}|heat"]
        ratio = mine / heat
        if name != "DataParallel step":
            ratios.append(ratio)
        results.add("dndarray-heat", name, "heatlike time", mine * 1e3, "ms")
        results.add("dndarray-heat", name, "heat time", heat * 1e3, "ms")
        results.add("dndarray-heat", name, "heatlike/heat", ratio, "ratio")
        say(f"{name:<22} {mine * 1e3:11.2f} {heat * 1e3:9.2f} {ratio:13.2f}")
    geomean = float(np.exp(np.mean(np.log(ratios))))
    results.add("dndarray-heat", "operations", "geometric mean heatlike/heat", geomean, "ratio")
    say(f"{'geometric mean (ops)':<22} {'':>11} {'':>9} {geomean:13.2f}")

