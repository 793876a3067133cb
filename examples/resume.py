"""Checkpoint and resume: train the digits MLP with any heatlike algorithm, saving a checkpoint
every few steps; started again, it continues from the last complete checkpoint exactly.

    mpiexec -n 4 python -m heatlike examples/resume.py --algorithm powersgd-2 \\
        --checkpoint digits.ckpt --save-every 20

Run it, stop it (``--stop-after N`` stops after step N as a preempted job would; SIGUSR1 or
SIGTERM to the launcher makes every rank save after the same step and exit with status 75; or
kill it), run the same command again: it prints where it resumed and ends with the same
parameters (``final parameters sha256``) as a run that was never interrupted. Under SLURM this
is the payload of ``scripts/slurm/requeue.sbatch``: warned before its time limit, the job saves,
requeues itself and the next run resumes. ``--device auto`` (the default) trains on each rank's
GPU (its local rank's) when every rank has one, else on the CPU. ``--algorithm`` takes every
algorithm of ``heatlike.recipes`` (DataParallel, DASO, the mlbench and SINGA optimizers; listed
below)."""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import sys
import textwrap
from pathlib import Path

import torch

import heatlike as hl
from heatlike.recipes import ALGORITHMS, evaluate, load_digits_split, make_runner, mlp
from heatlike.utils import (
    DEVICE_CHOICES,
    StopOnSignal,
    checkpoint,
    configure_threads,
    select_device,
)
from heatlike.utils.data import DataLoader, Dataset


def parameters_digest(model: torch.nn.Module, comm) -> str:
    """sha256 of every rank's parameters, in rank order (equal replicas give equal parts)."""
    mine = b"".join(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    for p in model.parameters())
    return hashlib.sha256(b"".join(comm.handle.allgather(mine))).hexdigest()


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def learning_rate(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    names = textwrap.fill(", ".join(sorted(ALGORITHMS)), 96, break_on_hyphens=False,
                          initial_indent="  ", subsequent_indent="  ")
    parser = argparse.ArgumentParser(description=__doc__, epilog=f"algorithms:\n{names}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="allreduce", choices=sorted(ALGORITHMS),
                        metavar="NAME",
                        help="the algorithm to train with (default allreduce; see below)")
    parser.add_argument("--epochs", type=non_negative, default=3, help="epochs in all (default 3)")
    parser.add_argument("--batch-size", type=positive, default=16,
                        help="samples per rank and step (default 16)")
    parser.add_argument("--lr", type=learning_rate, default=0.05,
                        help="learning rate (default 0.05)")
    parser.add_argument("--checkpoint", type=Path, default=Path("digits.ckpt"),
                        help="the checkpoint file, resumed from when it exists "
                             "(default digits.ckpt)")
    parser.add_argument("--save-every", type=non_negative, default=0,
                        help="save every this many steps (default 0: only at the end)")
    parser.add_argument("--stop-after", type=non_negative, default=0,
                        help="save and stop after this step, as a preempted job (default 0: "
                             "never)")
    parser.add_argument("--kill-at", type=non_negative, default=0,
                        help="SIGKILL the last rank at this step, a crash between two saves "
                             "(default 0: never; leave it out of the command that resumes)")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="cuda: each rank's GPU (by local rank); auto: cuda when every rank "
                             "has a GPU, else cpu (default auto)")
    args = parser.parse_args(argv)

    configure_threads()
    comm = hl.MPI_WORLD
    device = select_device(args.device, comm)
    x_train, y_train, x_test, y_test = load_digits_split()
    net = mlp([64, 128, 64, 10]).to(device)
    runner = make_runner(args.algorithm, net, comm, args.lr, epochs=args.epochs)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=args.batch_size, seed=0)
    step, losses = 0, []
    if args.checkpoint.exists():
        state = checkpoint.load(args.checkpoint, runner.model, runner.optimizer, loader=loader)
        step, losses = state["step"], list(state.get("epoch_losses", []))
        if comm.rank == 0:
            print(f"resumed from {args.checkpoint} at step {step} (epoch {loader.epoch})",
                  flush=True)

    def save() -> None:
        checkpoint.save(args.checkpoint, runner.model, runner.optimizer, loader=loader,
                        step=step, epoch_losses=losses)

    # SIGUSR1 / SIGTERM (a scheduler's warning) on any rank: every rank saves after the same step
    with StopOnSignal(comm) as stop:
        while loader.epoch < args.epochs:
            runner.start_epoch(len(loader))
            for xb, yb in loader:
                losses.append(runner.train_step(xb.to(device), yb.to(device)))
                step += 1
                if args.kill_at and step == args.kill_at and comm.rank == comm.size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.save_every and step % args.save_every == 0:
                    save()
                if step == args.stop_after:
                    save()
                    if comm.rank == 0:
                        print(f"stopped after step {step}; checkpoint in {args.checkpoint}")
                    return
                if stop():
                    save()
                    if comm.rank == 0:
                        print(f"{stop.signal}: saved after step {step} in {args.checkpoint}; "
                              f"run again to continue (exit status {stop.EXIT_STATUS})",
                              flush=True)
                    sys.exit(stop.EXIT_STATUS)
            # no loss of this epoch here when it ended before a resume at another world size
            # (the per-rank losses were not loaded)
            runner.end_epoch(sum(losses) / len(losses) if losses else math.nan)
            if comm.rank == 0:
                print(f"epoch {loader.epoch}/{args.epochs} done at step {step}", flush=True)
            losses = []
    save()
    accuracy = evaluate(runner.eval_model(), x_test, y_test, comm)
    digest = parameters_digest(net, comm)
    if comm.rank == 0:
        print(f"test accuracy: {accuracy:.4f}")
        print(f"final parameters sha256: {digest}")


if __name__ == "__main__":
    main()
