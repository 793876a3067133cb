"""``python -m heatlike.bench tta``: time to accuracy, the way mlbench reports it.

For each algorithm (:func:`heatlike.bench.algorithms.choose_algorithms`: all, or one per
communication pattern with ``--quick``) and each task, train until the test accuracy measured at
the end of an epoch first reaches the target, or for at most ``max_epochs`` epochs:

* ``digits``: the digits MLP (64-128-64-10), target ``--target`` (default 0.95);
* ``synthetic``: 3,000 samples of scikit-learn's ``make_classification`` with 128 features and
  10 classes (fixed seed), MLP 128-256-128-10, batch 32 per rank, target ``--target-synthetic``
  (default 0.90).

Time to accuracy = the training wall time up to the end of that epoch: the sum over epochs of the
slowest rank's time from a barrier to the end of the epoch; evaluations are not counted. The
result is (epochs, seconds), or "not reached" with the best accuracy seen. A run of the
``algorithms`` suite earlier in the same invocation has already trained digits with the same
settings and evaluated every epoch; its curves are reused when they cover the target or as many
epochs as this suite would run (the records then say ``source: algorithms``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI

from ..core.communication import MPI_WORLD, MPICommunication
from ..recipes import EpochPoint, Task, digits_task, synthetic_task, train_task
from ..utils.launch import configure_threads
from ._common import Results, describe_environment, progress, say
from .algorithms import choose_algorithms, record_curve

__all__ = ["TimeToAccuracy", "time_to_accuracy", "measure", "run"]


@dataclass
class TimeToAccuracy:
    """Epochs and training seconds to reach ``target`` (None: not reached within the epochs
    run), with the best accuracy seen and the whole curve."""

    target: float
    epochs: int | None
    seconds: float | None
    best: float
    epochs_run: int
    curve: list[EpochPoint] = field(default_factory=list)

    @property
    def reached(self) -> bool:
        return self.epochs is not None

    def describe(self) -> str:
        if not self.reached:
            return f"not reached (best {self.best:.4f} in {self.epochs_run} epochs)"
        return f"{self.epochs} epochs, {self.seconds:.2f} s"


def time_to_accuracy(curve: list[EpochPoint], target: float) -> TimeToAccuracy:
    """The first point of ``curve`` with accuracy >= ``target``."""
    hit = next((p for p in curve if p.accuracy >= target), None)
    best = max((p.accuracy for p in curve), default=0.0)
    return TimeToAccuracy(target, hit.epoch if hit else None, hit.seconds if hit else None,
                          best, len(curve), list(curve))


def measure(name: str, task: Task, target: float, max_epochs: int,
            comm: MPICommunication = MPI_WORLD) -> TimeToAccuracy:
    """Collective: train ``task`` with algorithm ``name`` until ``target`` or ``max_epochs``."""
    result = train_task(name, comm, task, max_epochs, curve=True, target=target)
    return time_to_accuracy(result.curve, target)


def _reusable(cached: dict | None, target: float, max_epochs: int) -> bool:
    if cached is None:
        return False
    tta = time_to_accuracy(cached["result"].curve, target)
    return tta.reached or cached["epochs"] >= max_epochs


def run(results: Results, quick: bool = False, algorithms: str | None = None,
        target: float = 0.95, target_synthetic: float = 0.90,
        max_epochs: int | None = None) -> dict:
    """Run the suite; returns ``{(task, algorithm): TimeToAccuracy}``."""
    comm = MPI.COMM_WORLD
    configure_threads(comm)
    names = choose_algorithms(algorithms, quick)
    epochs = max_epochs if max_epochs is not None else (3 if quick else 10)
    tasks = [(digits_task(), target), (synthetic_task(), target_synthetic)]
    say(f"# tta: time to accuracy, at most {epochs} epochs; training wall time (slowest rank, "
        f"evaluations excluded) to the first epoch whose test accuracy reaches the target; "
        f"{describe_environment(comm)}")
    out: dict = {}
    jobs = [(task, goal, name) for task, goal in tasks for name in names]
    for task, goal, name in progress(jobs, "time to accuracy"):
        cached = results.curves.get((task.name, name))
        if _reusable(cached, goal, epochs):
            tta = time_to_accuracy(cached["result"].curve[:epochs], goal)
            source = cached["suite"]
        else:
            tta = measure(name, task, goal, epochs)
            record_curve(results, "tta", task.name, name, tta.curve)
            source = "tta"
        out[(task.name, name)] = tta
        params = {"task": task.name, "target": goal, "source": source}
        results.add("tta", name, f"{task.name} reached target", float(tta.reached), "bool",
                    **params)
        results.add("tta", name, f"{task.name} best accuracy", tta.best, "fraction",
                    epochs_run=tta.epochs_run, **params)
        if tta.reached:
            results.add("tta", name, f"{task.name} time to accuracy", tta.seconds, "s", **params)
            results.add("tta", name, f"{task.name} epochs to accuracy", tta.epochs, "epochs",
                        **params)
    _table(out, names, tasks)
    return out


def _table(out: dict, names: list[str], tasks: list) -> None:
    head = f"{'algorithm':>22}"
    sub = f"{'':>22}"
    for task, goal in tasks:
        head += f"  {task.name + ' >= ' + format(goal, '.2f'):>26}"
        sub += f"  {'seconds':>11} {'epochs':>6} {'best':>7}"
    say(head)
    say(sub)
    for name in names:
        line = f"{name:>22}"
        for task, _ in tasks:
            tta = out[(task.name, name)]
            if tta.reached:
                line += f"  {tta.seconds:11.2f} {tta.epochs:6d} {tta.best:7.4f}"
            else:
                line += f"  {'not reached':>11} {'>' + str(tta.epochs_run):>6} {tta.best:7.4f}"
        say(line)
