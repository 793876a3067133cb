"""Data-parallel training of an MLP on scikit-learn's bundled digits (8x8 images, 10 classes).

    mpiexec -n 4 python -m heatlike examples/digits.py [--epochs 30] [--batch-size 16]
        [--lr 0.05] [--blocking] [--optimizer sgd|adam] [--seed 0] [--progress]
        [--device auto|cpu|cuda]

Every rank trains the same model on its slice of each global batch (``--batch-size`` samples per
rank); heatlike.nn.DataParallel averages the gradients, so the run follows single-process training
with a batch of ranks x batch-size samples. ``--algorithm NAME`` trains with any other algorithm
of heatlike (PowerSGD, top-k, sign, gossip, ...; see ``--help``) instead. The test set is
evaluated in shards, one per rank, combined with an all-reduce. ``--device auto`` (the default)
trains on each rank's GPU (its local rank's) when every rank has one, else on the CPU. Rank 0
prints the loss and test accuracy of every epoch and finally ``test accuracy: 0.XXXX``.
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time

import torch
from mpi4py import MPI
from torch import nn

import heatlike as hl
from heatlike.core.topology import get_topology
from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer
from heatlike.recipes import ALGORITHMS, evaluate, load_digits_split, mlp, train_digits
from heatlike.utils import DEVICE_CHOICES, configure_threads, select_device
from heatlike.utils.data import DataLoader, Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = textwrap.fill(", ".join(sorted(ALGORITHMS)), 96, break_on_hyphens=False,
                          initial_indent="  ", subsequent_indent="  ")
    p = argparse.ArgumentParser(description=__doc__, epilog=f"algorithms of --algorithm:\n{names}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=30, help="epochs (default 30)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="samples per rank and step (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--optimizer", choices=["sgd", "adam"],
                   help="the local optimizer: SGD with momentum 0.9 or Adam (default sgd; "
                        "not with --algorithm, which brings its own)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--blocking", dest="blocking", action="store_true",
                      help="update in step() (default: deferred to the next forward; "
                        "not with --algorithm)")
    mode.add_argument("--non-blocking", dest="blocking", action="store_false",
                      help="apply each update at the next forward, overlapping the gradient "
                           "all-reduces with computation (the default)")
    p.set_defaults(blocking=None)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the data split, the model and the batch order (default 0)")
    p.add_argument("--progress", action="store_true", help="tqdm bar per epoch on rank 0")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="cuda: each rank's GPU (by local rank); auto: cuda when every rank "
                        "has a GPU, else cpu (default auto)")
    p.add_argument("--algorithm", choices=sorted(ALGORITHMS), metavar="NAME",
                   help="train with this algorithm of heatlike.recipes instead (see "
                        "below), e.g. powersgd-2, topk-1%%, decentralized")
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or not (math.isfinite(args.lr) and args.lr > 0):
        p.error("--epochs must be >= 0, --batch-size >= 1 and --lr > 0")
    if args.algorithm and (args.optimizer is not None or args.blocking is not None):
        p.error("--optimizer, --blocking and --non-blocking choose DataParallel's local "
                f"optimizer and mode; --algorithm {args.algorithm} brings its own (drop them, "
                "or drop --algorithm)")
    if args.optimizer is None:
        args.optimizer = "sgd"
    if args.blocking is None:
        args.blocking = False
    return args


def load_data(seed: int):
    """Standardized train/test split of the digits, identical on every rank."""
    return load_digits_split(seed)


def build_model(seed: int, hidden: tuple[int, int] = (128, 64)) -> nn.Module:
    return mlp([64, *hidden, 10], seed)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    comm = hl.MPI_WORLD
    configure_threads()
    device = select_device(args.device, comm)
    log = hl.get_logger("digits")
    nodes = get_topology(comm).num_nodes
    if args.algorithm:
        log.info("%d ranks on %d node(s) x batch %d, %s: %s, %d epochs, on %s", comm.size,
                 nodes, args.batch_size, args.algorithm, ALGORITHMS[args.algorithm][1],
                 args.epochs, device.type)
        def report(point, loss: float) -> None:
            log.info("epoch %2d/%d  loss %.4f  test accuracy %.4f", point.epoch, args.epochs,
                     loss, point.accuracy)

        result = train_digits(args.algorithm, comm, epochs=args.epochs,
                              batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                              device=device, on_epoch=report, progress=args.progress)
        if comm.rank == 0:
            print(f"test accuracy: {result.accuracy:.4f}", flush=True)
        return result.accuracy
    x_train, y_train, x_test, y_test = load_data(args.seed)
    net = build_model(args.seed).to(device)
    if args.optimizer == "sgd":
        inner = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    else:
        inner = torch.optim.Adam(net.parameters(), lr=args.lr)
    optimizer = DataParallelOptimizer(inner, blocking=args.blocking)
    model = DataParallel(net, comm, optimizer=optimizer)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=args.batch_size, seed=args.seed,
                        progress=args.progress)
    loss_fn = nn.CrossEntropyLoss()
    mode = "blocking" if args.blocking else "non-blocking"
    log.info("%d ranks on %d node(s) x batch %d = global batch %d, %s %s, %d epochs, on %s",
             comm.size, nodes, args.batch_size, comm.size * args.batch_size, mode,
             args.optimizer, args.epochs, device.type)
    start = time.perf_counter()
    accuracy = evaluate(model.eval(), x_test, y_test, comm) if args.epochs == 0 else 0.0
    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros(2, dtype=torch.float64)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)], dtype=torch.float64)
        comm.Allreduce(hl.IN_PLACE, total, MPI.SUM)
        model.eval()
        accuracy = evaluate(model, x_test, y_test, comm)
        log.info("epoch %2d/%d  loss %.4f  test accuracy %.4f", epoch + 1, args.epochs,
                 total[0] / total[1], accuracy)
    log.info("trained in %.1f s", time.perf_counter() - start)
    if comm.rank == 0:
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
