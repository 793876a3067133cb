"""Training on uneven data: every rank holds a shard of its own size, and heatlike.nn.Join keeps
the ranks that run out of batches answering the others' gradient averages.

    mpiexec -n 4 python -m heatlike examples/uneven.py [--epochs 5] [--batch-size 16]
        [--lr 0.05] [--skew 1.0] [--check] [--device auto|cpu|cuda]

Rank r holds a share of scikit-learn's digits proportional to 1 + skew * r (``--skew 0``: equal
shards), so the ranks run different numbers of batches per epoch. Inside ``Join([model,
optimizer])`` a rank that runs out keeps standing in for the others' iterations; while A ranks
still train, gradients are averaged over those A (the gradient of their combined batch), and the
replicas stay equal. Without Join the ranks with more batches would wait forever for the others
(heatlike raises instead: "the ranks ran different numbers of batches").

``--check`` replays the run in one process on rank 0 (at each step, the combined batch of the
ranks still training) and prints the largest difference between its parameters and the
distributed model's: the run is that single process's, to float rounding. Rank 0 prints every
epoch's batches per rank and test accuracy, and finally ``test accuracy: 0.XXXX``. ``--device
auto`` (the default) trains on each rank's GPU (its local rank's) when every rank has one, else on
the CPU.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel, Join
from heatlike.recipes import evaluate, load_digits_split, mlp
from heatlike.utils import DEVICE_CHOICES, configure_threads, select_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="samples per rank and step (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--skew", type=float, default=1.0,
                   help="rank r's share of the data is proportional to 1 + skew * r "
                        "(default 1.0; 0: equal shards)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the data split, the model and the batch order (default 0)")
    p.add_argument("--check", action="store_true",
                   help="replay the run in one process on rank 0 and print the largest "
                        "parameter difference")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="cuda: each rank's GPU (by local rank); auto: cuda when every rank "
                        "has a GPU, else cpu (default auto)")
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or args.skew < 0 or \
            not (math.isfinite(args.lr) and args.lr > 0):
        p.error("--epochs must be >= 0, --batch-size >= 1, --skew >= 0 and --lr > 0")
    return args


def shard_bounds(n: int, size: int, skew: float) -> list[int]:
    """Where each rank's shard of ``n`` samples starts (and, last, where the last one ends):
    shares proportional to ``1 + skew * r``."""
    weights = np.array([1.0 + skew * r for r in range(size)])
    return [int(round(b)) for b in np.concatenate([[0.0], np.cumsum(weights)]) * n
            / weights.sum()]


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int, epoch: int):
    """The shard's batches of one epoch, in an order drawn from ``seed`` and ``epoch``."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [(x[i], y[i]) for i in order.split(batch_size)]


def replay(shards, args) -> nn.Module:
    """The single process: at each step, the combined batch of the ranks that still have one."""
    net = mlp([64, 128, 64, 10], args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        per_rank = [batches(x, y, args.batch_size, args.seed + r, epoch)
                    for r, (x, y) in enumerate(shards)]
        for step in range(max(len(b) for b in per_rank)):
            active = [b[step] for b in per_rank if step < len(b)]
            # each rank's loss is the mean over its batch; DataParallel averages the ranks'
            # gradients, so the combined objective weighs each rank's batch equally
            opt.zero_grad()
            loss = sum(nn.functional.cross_entropy(net(xb), yb) for xb, yb in active)
            (loss / len(active)).backward()
            opt.step()
    return net


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    comm = hl.MPI_WORLD
    configure_threads()
    log = hl.get_logger("uneven")
    device = select_device(args.device, comm)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    bounds = shard_bounds(len(y_train), comm.size, args.skew)
    shards = [(x_train[a:b], y_train[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    x, y = shards[comm.rank]
    net = mlp([64, 128, 64, 10], args.seed).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    model = DataParallel(net, comm)
    log.info("%d ranks, shards of %s samples, batch %d per rank, %d epochs, on %s", comm.size,
             [b - a for a, b in zip(bounds[:-1], bounds[1:])], args.batch_size, args.epochs,
             device.type)
    accuracy = evaluate(model.eval(), x_test, y_test, comm)
    for epoch in range(args.epochs):
        model.train()
        mine = batches(x, y, args.batch_size, args.seed + comm.rank, epoch)
        with Join([model, optimizer]):
            for xb, yb in mine:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
                optimizer.step()
        counts = comm.handle.allgather(len(mine))
        accuracy = evaluate(model.eval(), x_test, y_test, comm)
        log.info("epoch %d/%d  batches per rank %s  test accuracy %.4f", epoch + 1, args.epochs,
                 counts, accuracy)
    hl.nn.verify_replicas(net, comm)
    if args.check and comm.rank == 0:
        reference = replay(shards, args)
        difference = max(float((p.cpu() - q).detach().abs().max())
                         for p, q in zip(net.parameters(), reference.parameters()))
        print(f"largest difference from one process with the combined batches: "
              f"{difference:.2e}", flush=True)
    if comm.rank == 0:
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
