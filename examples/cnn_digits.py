"""A conv net with batch normalization on scikit-learn's digits, the way a torch DDP user writes it.

    mpiexec -n 4 python -m heatlike examples/cnn_digits.py [--epochs 10] [--batch-size 8]
        [--lr 0.003] [--optimizer adam|sgd] [--no-sync-bn] [--zero] [--seed 0] [--progress]
        [--device auto|cpu|cuda]

Two 3x3 convolutions with BatchNorm2d over the 8x8 images, then a linear classifier.
heatlike.nn.DataParallel (without ``optimizer=``) leaves the gradients averaged over the ranks
in ``.grad`` when ``backward()`` returns, and a torch optimizer steps, as under DDP. By default
the batch norms are converted to heatlike.nn.SyncBatchNorm, whose statistics are those of every
rank's batch together, so the run is single-process training with a batch of ranks x
batch-size samples also through the batch norms (``--no-sync-bn`` keeps per-rank statistics).
``--zero`` shards the optimizer state over the ranks with
heatlike.optim.ZeroRedundancyOptimizer (same model, each rank holding the state of its share of
the parameters). Rank 0 prints the loss and test accuracy of every epoch, what each rank holds
of the optimizer state, and finally ``test accuracy: 0.XXXX``.
"""

from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel, SyncBatchNorm
from heatlike.optim import ZeroRedundancyOptimizer
from heatlike.recipes import evaluate, load_digits_split
from heatlike.utils import DEVICE_CHOICES, configure_threads, select_device
from heatlike.utils.data import DataLoader, Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=10, help="epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="samples per rank and step (default 8)")
    p.add_argument("--lr", type=float, default=0.003, help="learning rate (default 0.003)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="Adam, or SGD with momentum 0.9 (default adam)")
    p.add_argument("--no-sync-bn", dest="sync_bn", action="store_false",
                   help="keep per-rank BatchNorm statistics (default: SyncBatchNorm)")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state over the ranks (ZeroRedundancyOptimizer)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the data split, the model and the batch order (default 0)")
    p.add_argument("--progress", action="store_true", help="tqdm bar per epoch on rank 0")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="cuda: each rank's GPU (by local rank); auto: cuda when every rank "
                        "has a GPU, else cpu (default auto)")
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or not args.lr > 0:
        p.error("--epochs must be >= 0, --batch-size >= 1 and --lr > 0")
    return args


def build_model(seed: int, channels: int = 16) -> nn.Module:
    """64 features as a 1x8x8 image, two conv + BatchNorm2d + ReLU blocks, a linear layer."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(channels * 4 * 4, 10))


def build_optimizer(name: str, params, lr: float, zero: bool) -> torch.optim.Optimizer:
    cls, options = (torch.optim.Adam, {}) if name == "adam" else \
        (torch.optim.SGD, {"momentum": 0.9})
    if zero:
        return ZeroRedundancyOptimizer(params, cls, lr=lr, **options)
    return cls(params, lr=lr, **options)


def state_mib(optimizer: torch.optim.Optimizer) -> float:
    """MiB of optimizer state this rank holds."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor)) / 2**20


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    comm = hl.MPI_WORLD
    configure_threads()
    device = select_device(args.device, comm)
    log = hl.get_logger("cnn_digits")
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    net = build_model(args.seed)
    if args.sync_bn:
        net = SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(device)
    model = DataParallel(net, comm)  # averages in .grad at the end of every backward()
    optimizer = build_optimizer(args.optimizer, net.parameters(), args.lr, args.zero)
    loader = DataLoader(Dataset(x_train, y_train), batch_size=args.batch_size, seed=args.seed,
                        progress=args.progress)
    loss_fn = nn.CrossEntropyLoss()
    log.info("%d ranks x batch %d = global batch %d, %s batch norm, %s%s, %d epochs, on %s",
             comm.size, args.batch_size, comm.size * args.batch_size,
             "synchronized" if args.sync_bn else "per-rank", args.optimizer,
             " with sharded state" if args.zero else "", args.epochs, device.type)
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
    held = comm.allgather(round(state_mib(optimizer), 3))
    log.info("trained in %.1f s; optimizer state per rank (MiB): %s", time.perf_counter() - start,
             held)
    if comm.rank == 0:
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
