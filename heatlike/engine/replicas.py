"""Making the replicas of a module equal on every rank.

:func:`check_replicas` verifies that every rank built the same module (names, shapes, dtypes,
``requires_grad`` of parameters and buffers) and raises ValueError on every rank, naming the first
difference, otherwise. :func:`verify_replicas` checks that the *values* are equal (bit for bit),
by comparing one hash per rank. :func:`broadcast_module` copies rank 0's parameters and buffers
to every rank with one flat broadcast per dtype (or averages floating-point buffers): the way every
heatlike wrapper and optimizer starts, instead of reseeding the global RNG (Heat) or leaving the
replicas unequal (mlbench's gradient mode).
"""

from __future__ import annotations

import hashlib

import torch
from mpi4py import MPI

from ..core.agreement import raise_together
from ..core.communication import MPICommunication, sanitize_comm
from .buckets import pack, unpack
from .reducers import divide

__all__ = ["check_replicas", "broadcast_module", "verify_replicas"]


def _signature(module: torch.nn.Module) -> list[tuple]:
    params = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad)
              for n, p in module.named_parameters()]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype), False)
               for n, b in module.named_buffers()]
    return params + buffers


def check_replicas(module: torch.nn.Module, comm: MPICommunication | None = None) -> None:
    """Collective. Raise ValueError on every rank unless ``module`` has the same parameters and
    buffers (names, shapes, dtypes, requires_grad) on every rank."""
    comm = sanitize_comm(comm)
    mine = _signature(module)
    digest = hashlib.sha1(repr(mine).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) == 1:
        return
    signatures = comm.allgather(mine)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    a, b = signatures[0], signatures[other]
    detail = f"rank 0 has {len(a)} parameters and buffers, rank {other} has {len(b)}"
    for x, y in zip(a, b):
        if x != y:
            detail = (f"{x[0]} {x[1]!r} has shape {x[2]}, {x[3]}, requires_grad={x[4]} on "
                      f"rank 0 but {y[0]} {y[1]!r} has shape {y[2]}, {y[3]}, "
                      f"requires_grad={y[4]} on rank {other}")
            break
    raise ValueError(f"the module differs between ranks: {detail}")


def no_trainable_parameters(module: torch.nn.Module, who: str) -> ValueError | None:
    """The error for a module with nothing to train (None when it has a trainable parameter),
    or for one holding torch's ``SyncBatchNorm`` that cannot synchronize."""
    if not any(p.requires_grad for p in module.parameters()):
        return ValueError(f"{who} got a module with no trainable parameters (none, or all with "
                          "requires_grad=False): there is nothing to synchronize")
    return torch_sync_batchnorm_error(module)


def torch_sync_batchnorm_error(module: torch.nn.Module) -> ValueError | None:
    """torch's ``SyncBatchNorm`` (or a subclass) without a ``torch.distributed`` process group
    normalizes each rank's batch alone, silently: refused, naming heatlike's conversion."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    names = [n or "the module" for n, m in module.named_modules()
             if isinstance(m, torch.nn.SyncBatchNorm)]
    if not names:
        return None
    return ValueError(
        f"{names[:3]} {'is' if len(names) == 1 else 'are'} torch.nn.SyncBatchNorm, which without "
        "a torch.distributed process group normalizes each rank's batch alone: convert the "
        "model with heatlike.nn.SyncBatchNorm.convert_sync_batchnorm(module) (statistics over "
        "MPI), or use BatchNorm for per-rank statistics")


def _by_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, comm: MPICommunication | None = None,
                     root: int = 0, buffers_op: str = "broadcast", check: bool = True) -> None:
    """Collective. Make every rank's parameters and buffers equal to ``root``'s (one broadcast per
    dtype); with ``buffers_op="average"``, floating-point buffers are averaged instead.

    With ``check`` (the default), :func:`check_replicas` runs first, so modules built differently
    on some rank raise ValueError everywhere instead of broadcasting mismatched buffers."""
    comm = sanitize_comm(comm)
    if check:
        check_replicas(module, comm)
    params = [p.data for p in module.parameters()]
    floats = [b for b in module.buffers() if b.is_floating_point()]
    others = [b for b in module.buffers() if not b.is_floating_point()]
    broadcast_tensors(params + others + (floats if buffers_op == "broadcast" else []), comm,
                      root)
    if buffers_op == "average":
        average_tensors(floats, comm)


#: contiguous tensors of at least this many bytes are broadcast where they are, not packed
DIRECT_BROADCAST_BYTES = 1 << 18


def _direct(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.numel() * t.element_size() >= DIRECT_BROADCAST_BYTES


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], comm: MPICommunication,
                      root: int = 0) -> None:
    """Collective: replace every tensor of ``tensors`` by ``root``'s: contiguous tensors of at
    least :data:`DIRECT_BROADCAST_BYTES` where they are (no copy), the others packed, one
    broadcast per dtype and device (none on a one-rank communicator: nothing is packed or
    sent). Every rank must pass tensors of the same shapes, dtypes and layouts."""
    if comm.size == 1 and root == 0:
        return
    tensors = [t for t in tensors if t.numel()]
    for t in tensors:
        if _direct(t):
            comm.Bcast(t, root=root)
    for group in _by_dtype([t for t in tensors if not _direct(t)]).values():
        flat = pack(group)
        comm.Bcast(flat, root=root)
        unpack(flat, group)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, comm: MPICommunication,
                              root: int = 0) -> None:
    """Collective: give ``optimizer`` the state and parameter-group settings ``root``'s has (its
    ``state_dict()``: per parameter, a dict of tensors and numbers). Where every rank holds the
    same tensors (names, shapes, dtypes), they are broadcast in place and the numbers and group
    settings sent as one Python object; otherwise ``root``'s whole state dict is."""
    mine = optimizer.state_dict()
    entries = [(i, k, v) for i, per in mine["state"].items() for k, v in per.items()]
    layout = [(i, k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (i, k)
              for i, k, v in entries]
    if any(other != layout for other in comm.allgather(layout)):
        optimizer.load_state_dict(comm.bcast(mine if comm.rank == root else None, root=root))
        return
    broadcast_tensors([v for _, _, v in entries if isinstance(v, torch.Tensor)], comm, root)
    numbers = [(i, k, v) for i, k, v in entries if not isinstance(v, torch.Tensor)]
    numbers, mine["param_groups"] = comm.bcast(
        (numbers, mine["param_groups"]) if comm.rank == root else None, root=root)
    for i, k, v in numbers:
        mine["state"][i][k] = v
    optimizer.load_state_dict(mine)


@torch.no_grad()
def average_tensors(tensors: list[torch.Tensor], comm: MPICommunication) -> None:
    """Collective: replace every tensor of ``tensors`` (floating point) by its average over the
    ranks of ``comm``, one all-reduce per dtype and device, in the tensors' own dtype (none on a
    one-rank communicator)."""
    if comm.size == 1:
        return
    for group in _by_dtype([t for t in tensors if t.numel()]).values():
        flat = pack(group)
        comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
        divide(flat, comm.size)
        unpack(flat, group)


def _digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach()
        h.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def verify_replicas(model: torch.nn.Module, comm: MPICommunication | None = None,
                    buffers: bool = True) -> None:
    """Collective. Raise ValueError on every rank unless the parameters (and, with ``buffers``,
    the buffers) of ``model`` are bitwise equal on all ranks; the message names the ranks that
    differ from rank 0 and the first tensors that do.

    Costs one hash of the model per rank and one all-gather of 16-byte digests (a second,
    per-tensor one only when they differ). A DataParallel wrapper is checked by its module.
    """
    comm = sanitize_comm(comm if comm is not None else getattr(model, "comm", None))
    module = getattr(model, "module", model)
    raise_together(None if isinstance(module, torch.nn.Module) else TypeError(
        f"verify_replicas needs a torch.nn.Module, got {type(model).__name__}"), comm)
    named = list(module.named_parameters()) + (list(module.named_buffers()) if buffers else [])
    digests = comm.allgather(_digest(t for _, t in named))
    if len(set(digests)) == 1:
        return
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    per_tensor = comm.allgather([_digest([t]) for _, t in named])
    names = [n for i, (n, _) in enumerate(named)
             if any(per_tensor[r][i] != per_tensor[0][i] for r in differ)]
    raise ValueError(f"the replicas differ: ranks {differ} have other values than rank 0 in "
                     f"{names[:5]}{' ...' if len(names) > 5 else ''}")
