"""Figures from benchmark results: ``--plot DIR`` on ``python -m heatlike.bench``, or from a saved
``--json`` file with ``python -m heatlike.bench.plot RESULTS.json DIR``.

Every figure is drawn from the records alone, so any subset of suites gives the figures its
records allow (the others are skipped):

* ``algorithms_step_time.png``, ``algorithms_bytes.png`` (algorithms suite): median step time
  and payload bytes per rank per step of every algorithm, on the digits MLP and the larger MLP;
* ``accuracy_vs_time.png`` (algorithms and tta suites): test accuracy after each epoch against
  the training wall time so far, one panel per task, the target as a dashed line;
* ``time_to_accuracy.png`` (tta suite): seconds to the target per algorithm and task;
* ``allreduce_bus_bandwidth.png`` (comm suite): all-reduce bus bandwidth
  ``S * 2(P-1)/P / t`` against the message size S, with the measured point-to-point
  bandwidth of the slowest link for reference (a ring of ``Sendrecv`` of 16 MiB; a link given
  with ``--links`` is drawn too): a ring all-reduce cannot exceed it, but MPI may choose another
  algorithm, or shared memory within a node, and exceed it at some sizes;
* ``costmodel.png`` (costmodel suite): the model's step time against the number of ranks per
  algorithm (lines, a model) and the step times measured at the size run (markers).

Drawn with matplotlib's Agg canvas (no display, no global pyplot state); only rank 0 calls this.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

from ._common import Record, Results

__all__ = ["plot_results", "plot_cluster", "main"]


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, outdir: str, name: str) -> str:
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=110)
    return path


def _style(i: int) -> dict:
    """Distinct color, marker and line style for the i-th series."""
    from matplotlib import colormaps

    colors = colormaps["tab20"].colors
    return {"color": colors[(2 * i) % 20 + (i // 10) % 2], "marker": "os^Dv<>p*hX"[i % 11],
            "linestyle": ("-", "--", ":", "-.")[(i // 11) % 4]}


def _latest(records: list[Record]) -> dict[str, Record]:
    """case -> its last record (a rerun in the same file overrides)."""
    out: dict[str, Record] = {}
    for r in records:
        out[r.case] = r
    return out


def _title(records: list[Record]) -> str:
    sizes = sorted({r.world_size for r in records})
    layouts = sorted({r.topology for r in records})
    return f"{', '.join(map(str, sizes))} ranks ({'; '.join(layouts)})"


def _bars(results: Results, outdir: str, name: str, panels: list[tuple[str, str, bool]],
          xlabel: str) -> str | None:
    data = [(title, _latest(results.find("algorithms", metric)), log)
            for metric, title, log in panels]
    data = [d for d in data if d[1]]
    if not data:
        return None
    order = list(dict.fromkeys(c for _, found, _ in data for c in found))
    fig = _figure(5.0 * len(data), 0.32 * len(order) + 1.6)
    axes = fig.subplots(1, len(data), sharey=True, squeeze=False)[0]
    for ax, (title, found, log) in zip(axes, data):
        values = [found[c].value if c in found else float("nan") for c in order]
        ax.barh(range(len(order)), values, color=[_style(i)["color"] for i in range(len(order))])
        ax.set_yticks(range(len(order)), order)
        if ax is axes[0]:  # shared: inverting every axis would undo it
            ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{name}: {_title([r for _, f, _ in data for r in f.values()])}",
                 fontsize=10)
    return _save(fig, outdir, f"{name}.png")


def _curves(results: Results) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """task -> algorithm -> [(seconds, accuracy)] by epoch; the tta suite's curve wins over the
    algorithms suite's for the same task and algorithm."""
    points: dict = defaultdict(dict)  # (suite, task, case) -> epoch -> [time, accuracy]
    for r in results.records:
        if r.suite not in ("algorithms", "tta") or "epoch" not in r.params:
            continue
        task = r.params.get("task", "digits")
        key = (r.suite, task, r.case)
        slot = points[key].setdefault(int(r.params["epoch"]), [None, None])
        if r.metric.endswith("epoch time"):
            slot[0] = r.value
        elif r.metric.endswith("epoch accuracy"):
            slot[1] = r.value
    out: dict = defaultdict(dict)
    for suite in ("algorithms", "tta"):  # tta last: it overrides
        for (s, task, case), by_epoch in points.items():
            if s != suite:
                continue
            series = [(t, a) for _, (t, a) in sorted(by_epoch.items())
                      if t is not None and a is not None]
            if series:
                out[task][case] = series
    return out


def _accuracy_vs_time(results: Results, outdir: str) -> str | None:
    curves = _curves(results)
    if not curves:
        return None
    targets = {}
    for r in results.find("tta"):
        if "target" in r.params:
            targets[r.params.get("task")] = r.params["target"]
    tasks = sorted(curves)
    fig = _figure(6.0 * len(tasks), 4.8)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    order = list(dict.fromkeys(c for t in tasks for c in curves[t]))
    for ax, task in zip(axes, tasks):
        for case, series in curves[task].items():
            style = _style(order.index(case))
            ax.plot([t for t, _ in series], [a for _, a in series], label=case, markersize=4,
                    **style)
        if task in targets:
            ax.axhline(targets[task], color="black", linestyle="--", linewidth=1,
                       label=f"target {targets[task]:.2f}")
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="lower right")
    fig.suptitle(f"accuracy against wall time per algorithm: {_title(results.records)}",
                 fontsize=10)
    return _save(fig, outdir, "accuracy_vs_time.png")


def _time_to_accuracy(results: Results, outdir: str) -> str | None:
    reached = [r for r in results.find("tta") if r.metric.endswith("reached target")]
    if not reached:
        return None
    tasks = sorted({r.params.get("task", "?") for r in reached})
    fig = _figure(5.0 * len(tasks), 0.32 * len({r.case for r in reached}) + 1.6)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        flags = _latest([r for r in reached if r.params.get("task") == task])
        times = _latest(results.find("tta", f"{task} time to accuracy"))
        epochs = _latest(results.find("tta", f"{task} epochs to accuracy"))
        order = list(flags)
        values = [times[c].value if flags[c].value and c in times else 0.0 for c in order]
        ax.barh(range(len(order)), values, color=[_style(i)["color"] for i in range(len(order))])
        top = max(values + [1e-9])
        for i, c in enumerate(order):
            text = f"{int(epochs[c].value)} ep" if flags[c].value and c in epochs else \
                "not reached"
            ax.text(values[i] + 0.01 * top, i, text, va="center", fontsize=7)
        ax.set_yticks(range(len(order)), order)
        ax.invert_yaxis()
        target = flags[order[0]].params.get("target")
        ax.set_title(f"{task}: seconds to test accuracy >= {target}", fontsize=10)
        ax.set_xlabel("training wall time (s)")
        ax.set_xlim(0, top * 1.25)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"time to accuracy: {_title(reached)}", fontsize=10)
    return _save(fig, outdir, "time_to_accuracy.png")


def _bus_bandwidth(results: Results, outdir: str) -> str | None:
    series: dict[str, dict[float, float]] = defaultdict(dict)
    for r in results.find("comm"):
        if r.metric.endswith(" bus bandwidth") and "size_bytes" in r.params:
            series[r.metric[:-len(" bus bandwidth")]][float(r.params["size_bytes"])] = r.value
    if not series:
        return None
    fig = _figure(6.5, 4.5)
    ax = fig.subplots()
    names = {"heatlike": "heatlike fp32 (torch)", "raw": "mpi4py fp32",
             "heatlike-numpy": "heatlike fp32 (numpy)", "raw-numpy": "mpi4py fp32 (numpy)",
             "bf16": "heatlike bf16", "fp16": "heatlike fp16"}
    for i, (variant, points) in enumerate(sorted(series.items())):
        sizes = sorted(points)
        ax.plot(sizes, [points[s] for s in sizes], label=names.get(variant, variant),
                markersize=4, **_style(i))
    bounds = []
    cross = results.value("comm", "p2p cross-node", "bandwidth")
    local = results.value("comm", "p2p node-local", "bandwidth")
    if cross is not None:
        bounds.append((cross, "cross-node p2p bandwidth at 16 MiB (measured)"))
    elif local is not None:
        bounds.append((local, "node-local p2p bandwidth at 16 MiB (measured)"))
    given = [r for r in results.find("costmodel", case="links")
             if r.params.get("source", "").startswith("given")]
    for r in given:
        if r.metric == "cross bandwidth":
            bounds.append((r.value, "given cross-node link"))
    for j, (value, label) in enumerate(bounds):
        ax.axhline(value, color="black", linestyle=("--", ":")[j % 2], linewidth=1.2,
                   label=f"{label}, {value:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s) = S 2(P-1)/P / t")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"all-reduce bus bandwidth: {_title(results.find('comm'))}", fontsize=10)
    return _save(fig, outdir, "allreduce_bus_bandwidth.png")


def _costmodel(results: Results, outdir: str) -> str | None:
    model: dict[str, dict[int, float]] = defaultdict(dict)
    for r in results.find("costmodel", "model step time"):
        if "ranks" in r.params and r.params.get("at") != "size run":
            model[r.case][int(r.params["ranks"])] = r.value
    if not model:
        return None
    measured = {r.case: r for r in results.find("algorithms", "large step time")}
    measured.update({r.case: r for r in results.find("costmodel", "measured step time")})
    at_run = {r.case: r for r in results.find("costmodel", "model step time")
              if r.params.get("at") == "size run"}
    per_node = next((r.params.get("ranks_per_node") for r in results.find(
        "costmodel", "model step time") if r.params.get("at") != "size run"), "?")
    fig = _figure(7.5, 5.0)
    ax = fig.subplots()
    for i, (case, row) in enumerate(model.items()):
        style = _style(i)
        ranks = sorted(row)
        ax.plot(ranks, [row[p] for p in ranks], label=case, markersize=3, **style)
        if case in measured:
            m = measured[case]
            ax.plot([m.params.get("ranks", m.world_size)], [m.value], marker=style["marker"],
                    color=style["color"], markersize=8, markeredgecolor="black", linestyle="")
        if case in at_run:  # the model for the layout actually run
            m = at_run[case]
            ax.plot([m.params["ranks"]], [m.value], marker="x", color=style["color"],
                    markersize=7, linestyle="")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"ranks ({per_node} per node)")
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("alpha-beta MODEL of the step time (lines; x: model of the layout run); "
                 "measured (outlined)", fontsize=9)
    return _save(fig, outdir, "costmodel.png")


def plot_results(results: Results | list[dict] | str, outdir: str) -> list[str]:
    """Write every figure the records allow into ``outdir``; returns the paths written."""
    if isinstance(results, str):
        results = Results.read_json(results)
    elif not isinstance(results, Results):
        results = Results.from_list(results)
    os.makedirs(outdir, exist_ok=True)
    made = [
        _bars(results, outdir, "algorithms_step_time",
              [("digits step time", "digits MLP (17K parameters)", False),
               ("large step time", "MLP 784-1024-1024-10 (1.9M parameters)", False)],
              "median step time (ms), slowest rank"),
        _bars(results, outdir, "algorithms_bytes",
              [("digits bytes per step", "digits MLP (17K parameters)", True),
               ("large bytes per step", "MLP 784-1024-1024-10 (1.9M parameters)", True)],
              "payload bytes per rank per step"),
        _accuracy_vs_time(results, outdir),
        _time_to_accuracy(results, outdir),
        _bus_bandwidth(results, outdir),
        _costmodel(results, outdir),
    ]
    return [m for m in made if m is not None]


def _grouped_bars(rows: list[dict], value, xlabel: str, outdir: str, name: str,
                  title: str, log: bool = False) -> str:
    """One panel per model; in each, one group of bars per algorithm, one bar per link rate."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    order = list(dict.fromkeys(r["algorithm"] for r in rows))
    height = 0.8 / max(1, len(rates))
    fig = _figure(5.0 * len(models), 0.4 * len(order) * max(1, len(rates)) / 2 + 1.8)
    axes = fig.subplots(1, len(models), sharey=True, squeeze=False)[0]
    for ax, model in zip(axes, models):
        for j, rate in enumerate(rates):
            found = {r["algorithm"]: r for r in rows if r["model"] == model and r["rate"] == rate}
            values = [value(found[a]) if a in found else None for a in order]
            ys = [i + (j - (len(rates) - 1) / 2) * height for i in range(len(order))]
            ax.barh(ys, [float("nan") if v is None else v for v in values], height=height,
                    color=_style(j)["color"], label=rate)
            for y, v in zip(ys, values):
                if v is None:
                    ax.text(0, y, " never", va="center", fontsize=7)
        ax.set_yticks(range(len(order)), order)
        if ax is axes[0]:
            ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        ax.set_title(model, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, title="link rate", title_fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, outdir, f"{name}.png")


def plot_cluster(rows: list[dict], outdir: str) -> list[str]:
    """The figures of ``python -m heatlike.bench cluster`` (one dict per job, as its --json
    writes them): time to accuracy, and step time with the bytes on the links."""
    if not rows:
        return []
    os.makedirs(outdir, exist_ok=True)
    where = f"ranks per node {rows[0]['nodes']}"
    made = [_grouped_bars(rows, lambda r: r.get("tta_s"),
                          "training time to blocking DataParallel's accuracy - 1 point (s)",
                          outdir, "cluster_time_to_accuracy", f"time to accuracy, {where}")]
    made.append(_grouped_bars(rows, lambda r: r["step_s"] * 1e3, "median step time (ms)",
                              outdir, "cluster_step_time", f"step time, {where}"))
    made.append(_grouped_bars(rows, lambda r: r["link_bytes"] / 1e6,
                              "MB the nodes sent each other (interface counters)", outdir,
                              "cluster_link_bytes", f"bytes on the links, {where}", log=True))
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m heatlike.bench.plot",
                                description="Figures from a --json file of python -m "
                                            "heatlike.bench.")
    p.add_argument("results", help="the JSON written by --json")
    p.add_argument("outdir", help="directory for the PNG files")
    args = p.parse_args(argv)
    for path in plot_results(args.results, args.outdir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
