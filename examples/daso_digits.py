"""DASO on the digits data set: node-local gradient averaging every batch or few, parameter
averaging between nodes every few batches in bfloat16, merged when it arrives.

    mpiexec -n 4 env HEATLIKE_RANKS_PER_NODE=2 python -m heatlike examples/daso_digits.py \\
        [--epochs 16] [--warmup 2] [--cooldown 2] [--batch-size 16] [--lr 0.05] [--verbose]
        [--device auto|cpu|cuda]

On a cluster the nodes are found by themselves (``srun --ntasks-per-node=4 ...``); on one machine
``HEATLIKE_RANKS_PER_NODE`` emulates them. ``--device auto`` (the default) trains on each rank's
GPU (its local rank's) when every rank has one, else on the CPU. Rank 0 prints each epoch's
loss, accuracy and DASO's schedule, then ``test accuracy: 0.XXXX``.
"""

from __future__ import annotations

import argparse
import math

import torch
from mpi4py import MPI
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallelMultiGPU
from heatlike.optim import DASO
from heatlike.recipes import evaluate, load_digits_split, mlp
from heatlike.utils import DEVICE_CHOICES, configure_threads, select_device
from heatlike.utils.data import DataLoader, Dataset


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=16, help="epochs (default 16)")
    p.add_argument("--warmup", type=int, default=2,
                   help="first epochs with a global synchronization every batch (default 2)")
    p.add_argument("--cooldown", type=int, default=2,
                   help="last epochs with a global synchronization every batch (default 2)")
    p.add_argument("--warmup-sync", choices=("gradients", "parameters"), default="gradients",
                   help="how the warmup synchronizes on several nodes: average the gradients "
                        "over every rank, or the parameters after each step as Heat does "
                        "(default gradients)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="samples per rank and step (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the data split, the model and the batch order (default 0)")
    p.add_argument("--verbose", action="store_true", help="print DASO's schedule decisions")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="cuda: each rank's GPU (by local rank); auto: cuda when every rank "
                        "has a GPU, else cpu (default auto)")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.cooldown < 0 or args.epochs <= args.warmup + args.cooldown:
        p.error(f"--epochs ({args.epochs}) must exceed --warmup + --cooldown ({args.warmup} + "
                f"{args.cooldown}), each >= 0: DASO needs epochs between them")
    if args.batch_size < 1 or not (math.isfinite(args.lr) and args.lr > 0):
        p.error("--batch-size must be >= 1 and --lr a number > 0")
    comm = hl.MPI_WORLD
    configure_threads()
    device = select_device(args.device, comm)
    log = hl.get_logger("daso-digits")
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    net = mlp([64, 128, 64, 10], args.seed).to(device)
    local = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    daso = DASO(local, total_epochs=args.epochs, comm=comm, warmup_epochs=args.warmup,
                cooldown_epochs=args.cooldown, verbose=args.verbose,
                warmup_sync=args.warmup_sync)
    model = DataParallelMultiGPU(net, daso)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=args.batch_size, seed=args.seed)
    daso.last_batch = len(loader)
    topo = daso.topology
    log.info("%d ranks on %d node(s) of %s ranks, on %s", comm.size, topo.num_nodes,
             list(topo.local_sizes), device.type)
    loss_fn = nn.CrossEntropyLoss()
    accuracy = 0.0
    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros(2, dtype=torch.float64)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            daso.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            daso.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)], dtype=torch.float64)
        comm.Allreduce(hl.IN_PLACE, total, MPI.SUM)
        epoch_loss = float(total[0] / total[1])
        daso.epoch_loss_logic(epoch_loss, loss_globally_averaged=True)
        model.eval()
        accuracy = evaluate(model, x_test, y_test, comm)
        log.info("epoch %2d/%d  loss %.4f  test accuracy %.4f  (global_skip %d, local_skip %d, "
                 "batches_to_wait %d next)", epoch + 1, args.epochs, epoch_loss, accuracy,
                 daso.global_skip, daso.local_skip, daso.batches_to_wait)
    if comm.rank == 0:
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
