"""Checkpoints that resume a distributed run exactly, written atomically and read safely.

:func:`save` and :func:`load` are collective over the model's communicator. What is saved, as one
tree of sections:

``model``     the bare module's ``state_dict()`` (a DataParallel wrapper is unwrapped, so the file
              also loads into a plain module)
``wrapper``   the wrapper's distributed state (bucket plan, counters, codec state), if wrapped
``optimizer`` ``optimizer.state_dict()``: the torch optimizer's state and, for heatlike's
              optimizers, the engine's state under the key ``"engine"``
``rng``       the torch (and CUDA), numpy, Python and ``heatlike.random`` generator states
``states``    ``state_dict()`` of every keyword argument that has one (a DataLoader, an LR
              scheduler, a GradScaler)
``extra``     every other keyword argument as it is (epoch numbers, metrics, tensors)

**Per-rank state.** Every rank hashes each leaf of its tree; leaves equal on all ranks are stored
once, the others (error-feedback residuals, decentralized replicas, per-rank RNG streams) once
per rank. A section whose *structure* differs between ranks is stored whole per rank.

**File format.** ``MAGIC``, then the segments (``torch.save`` payloads: the shared tree, then one
per rank), then a JSON index (offset, length and SHA-256 of every segment, the world size),
its length, its SHA-256 and ``END``. Rank 0 writes it to a temporary file in the same directory,
fsyncs it, renames it over ``path`` and fsyncs the directory, so ``path`` always holds either
the previous complete checkpoint or the new one. :func:`load` verifies every hash and reads with
``torch.load(weights_only=True)``: a checkpoint file cannot run code.

**Resuming.** At the same world size every rank gets back exactly what it saved, so the run
continues bitwise as if uninterrupted (CPU; the optimizer and data loader must be built the same
way). At a different world size, per-rank leaves cannot be given back: floating-point tensors of
the model and of the torch optimizer state are replaced by their average over the saved ranks,
and per-rank engine state (under ``"engine"``), RNG states and other leaves are reset to the
value the freshly built objects have. :func:`load` returns what it did in ``.averaged`` and
``.reset`` and logs it on rank 0.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..core.agreement import agree_on, raise_together
from ..core.communication import MPI_WORLD, MPICommunication, sanitize_comm
from ..core.log import get_logger

__all__ = ["save", "load", "verify", "CheckpointError", "Loaded"]

MAGIC = b"HEATLIKE-CHECKPOINT\x00\x01"
END = b"\x00HEATLIKE-END"
FORMAT = 1
_TRAILER = 8 + 32 + len(END)
_RESET_KEYS = ("engine",)  # per-rank state below these keys is reset at another world size
_AVERAGED_SECTIONS = ("model", "optimizer")
_DROP = object()

Path_ = tuple  # a leaf's position in the tree: the keys and list indices leading to it


class CheckpointError(ValueError):
    """The checkpoint file is not a complete heatlike checkpoint, or does not fit the objects."""


class Loaded(dict):
    """What :func:`load` returns: the ``extra`` values saved (a dict), and

    * ``world_size``: the world size the checkpoint was saved at
    * ``averaged``: per-rank leaves replaced by their average over the saved ranks (paths)
    * ``reset``: per-rank leaves left at the value the freshly built objects have (paths)
    """

    world_size: int
    averaged: list[str]
    reset: list[str]


# -------------------------------------------------------------------------------- the state tree


def _unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(bare module, wrapper or None): heatlike's wrappers hold the module in ``.module`` and
    their distributed state in ``get_extra_state``."""
    from ..nn.data_parallel import DataParallel, DataParallelMultiGPU

    if isinstance(model, (DataParallel, DataParallelMultiGPU)):
        return model.module, model
    return model, None


def _stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def rng_state() -> dict:
    """The global generators' states (torch, CUDA when present, numpy, Python, heatlike)."""
    from .. import random as hl_random

    name, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002 (global state)
    state = {"torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(cached)),
             "python": random.getstate(),
             "heatlike": hl_random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    from .. import random as hl_random

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))  # noqa: NPY002
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    hl_random.set_state(tuple(state["heatlike"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tree(model, optimizer, rng: bool, extra: dict) -> dict:
    bare, wrapper = _unwrap(model)
    return {"model": bare.state_dict(),
            "wrapper": wrapper.get_extra_state() if wrapper is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": rng_state() if rng else None,
            "states": {k: v.state_dict() for k, v in extra.items() if _stateful(v)},
            "extra": {k: v for k, v in extra.items() if not _stateful(v)}}


def _is_container(x) -> bool:
    return isinstance(x, dict) or type(x) in (list, tuple)


def _leaves(tree, path: Path_ = ()):
    """(path, leaf) pairs in a fixed order; dicts, lists and plain tuples are containers."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif type(tree) in (list, tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _structure(tree) -> str:
    """A digest of the tree's shape (container types and keys, not leaf values)."""
    h = hashlib.blake2b(digest_size=16)

    def walk(x):
        if isinstance(x, dict):
            h.update(f"{{{type(x).__name__}:{len(x)}".encode())
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif type(x) in (list, tuple):
            h.update(f"[{type(x).__name__}:{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(b".")
    walk(tree)
    return h.hexdigest()


def _digest(leaf) -> str:
    h = hashlib.blake2b(digest_size=16)
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif leaf is None or isinstance(leaf, (bool, int, float, str, bytes)):
        h.update(f"{type(leaf).__name__} {leaf!r}".encode())
    else:
        h.update(pickle.dumps(leaf))
    return h.hexdigest()


def _rebuild(tree, fn: Callable, replace: dict | None = None, path: Path_ = ()):
    """A copy of ``tree`` with each leaf replaced by ``fn(path, leaf)`` and each subtree at a
    path of ``replace`` by its value there (``_DROP`` removes the item)."""
    if replace and path in replace:
        return replace[path]
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) is not dict else {}
        if type(tree) is not dict:
            out.__dict__.update(getattr(tree, "__dict__", {}))  # state_dict()'s _metadata
        for k, v in tree.items():
            new = _rebuild(v, fn, replace, (*path, k))
            if new is not _DROP:
                out[k] = new
        return out
    if type(tree) in (list, tuple):
        items = (_rebuild(v, fn, replace, (*path, i)) for i, v in enumerate(tree))
        return type(tree)(v for v in items if v is not _DROP)
    return fn(path, tree)


def _get(tree, path: Path_):
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif type(tree) in (list, tuple) and isinstance(key, int) and 0 <= key < len(tree):
            tree = tree[key]
        else:
            return _DROP
    return tree


def _name(path: Path_) -> str:
    return ".".join(str(k) for k in path)


# -------------------------------------------------------------------------------- bytes and files


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _bcast_bytes(comm: MPICommunication, data: bytes | None) -> bytes:
    n = np.array([len(data) if comm.rank == 0 else 0], dtype=np.int64)
    comm.handle.Bcast(n, root=0)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if comm.rank == 0 else \
        np.empty(int(n[0]), dtype=np.uint8)
    if n[0]:
        comm.handle.Bcast(buf, root=0)
    return buf.tobytes()


def _send_bytes(comm: MPICommunication, data: bytes, dest: int) -> None:
    comm.handle.Send(np.array([len(data)], dtype=np.int64), dest, tag=71)
    if data:
        comm.handle.Send(np.frombuffer(data, dtype=np.uint8), dest, tag=72)


def _recv_bytes(comm: MPICommunication, source: int) -> bytes:
    n = np.empty(1, dtype=np.int64)
    comm.handle.Recv(n, source, tag=71)
    buf = np.empty(int(n[0]), dtype=np.uint8)
    if n[0]:
        comm.handle.Recv(buf, source, tag=72)
    return buf.tobytes()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform can open a directory
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: str | os.PathLike) -> dict:
    """Check the file's structure and every hash (local, no communication); return its index
    (world size, segments, heatlike version, creation time). Raises CheckpointError."""
    index, _ = _read(Path(path))
    return index


def _read(path: Path) -> tuple[dict, dict[str, bytes]]:
    """The index and the verified segments of the checkpoint at ``path``."""
    data = path.read_bytes()
    what = f"{path} is not a complete heatlike checkpoint"
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{what}: it does not start with the heatlike checkpoint header")
    if len(data) < len(MAGIC) + _TRAILER or not data.endswith(END):
        raise CheckpointError(f"{what}: the end marker is missing (truncated, {len(data)} bytes)")
    tail = data[-_TRAILER:]
    size = int.from_bytes(tail[:8], "little")
    digest = tail[8:40]
    start = len(data) - _TRAILER - size
    if size <= 0 or start < len(MAGIC):
        raise CheckpointError(f"{what}: its index is damaged")
    raw = data[start:start + size]
    if hashlib.sha256(raw).digest() != digest:
        raise CheckpointError(f"{what}: its index does not match its checksum (corrupted)")
    index = json.loads(raw)
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {index.get('format')}, this "
                              f"heatlike reads format {FORMAT}")
    segments = {}
    for name, (offset, length, sha) in index["segments"].items():
        segment = data[offset:offset + length]
        if len(segment) != length or offset + length > start:
            raise CheckpointError(f"{what}: segment {name!r} is cut short (truncated)")
        if hashlib.sha256(segment).hexdigest() != sha:
            raise CheckpointError(f"{what}: segment {name!r} does not match its checksum "
                                  "(corrupted)")
        segments[name] = segment
    return index, segments


# -------------------------------------------------------------------------------- save


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
         comm: MPICommunication | None = None, rng: bool = True, **extra) -> None:
    """Collective: write a checkpoint of ``model`` (bare or wrapped), ``optimizer`` and
    ``extra`` to ``path`` (see the module docstring). ``extra`` values with
    ``state_dict``/``load_state_dict`` (data loader, scheduler) are saved by their state.

    In-flight communication of the optimizer and wrapper is completed first (pending updates of
    the non-blocking modes are applied; DASO keeps its in-flight averages for the batch it
    merges them in). An error on any rank (including rank 0 failing to write) is raised on every
    rank, and ``path`` then still holds the previous checkpoint.
    """
    comm = _comm_of(model, optimizer, comm)
    error, tree = None, None
    try:
        _check_model(model)
        tree = _tree(model, optimizer, rng, extra)
        sections = {name: _structure(section) for name, section in tree.items()}
        digests = {path: _digest(leaf) for path, leaf in _leaves(tree)}
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = e
    raise_together(error, comm, (CheckpointError,))
    agree_on({"path": os.fspath(path)}, comm, "checkpoint.save")

    everyone = comm.handle.gather((sections, digests), root=0)
    if comm.rank == 0:
        split = _per_rank_parts(everyone)
    split = comm.handle.bcast(split if comm.rank == 0 else None, root=0)
    whole, leaves = split
    mine = {"sections": {name: tree[name] for name in whole},
            "leaves": {p: leaf for p, leaf in _leaves(tree)
                       if p in leaves and p[0] not in whole}}

    error = None
    if comm.rank != 0:
        try:
            blob = _dumps(mine)
        except Exception as e:  # noqa: BLE001
            blob, error = b"", e
        _send_bytes(comm, blob, 0)
    else:
        error = _write(Path(path), comm, tree, whole, leaves, mine)
    raise_together(error, comm, (CheckpointError,))


def _per_rank_parts(everyone: list) -> tuple[set, set]:
    """Rank 0: the sections stored whole per rank (their structure differs between ranks) and
    the leaves stored per rank (their values differ)."""
    first_sections, first_digests = everyone[0]
    whole = {name for name in first_sections
             if any(s.get(name) != first_sections[name] for s, _ in everyone)}
    leaves = set()
    for path, digest in first_digests.items():
        if path[0] in whole:
            continue
        if any(d.get(path) != digest for _, d in everyone[1:]):
            leaves.add(path)
    return whole, leaves


def _write(path: Path, comm: MPICommunication, tree: dict, whole: set, leaves: set,
           mine: dict) -> Exception | None:
    """Rank 0: write the file atomically, receiving the other ranks' parts one after another
    (always all of them, even after an error, so no rank is left waiting)."""
    error = None
    handle = tmp = None
    segments: dict[str, list] = {}

    def write(name: str, blob: bytes) -> None:
        offset = handle.tell()
        handle.write(blob)
        segments[name] = [offset, len(blob), hashlib.sha256(blob).hexdigest()]

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        handle = os.fdopen(fd, "wb")
        handle.write(MAGIC)
        shared = _rebuild({k: (None if k in whole else v) for k, v in tree.items()},
                          lambda p, leaf: None if p in leaves else leaf)
        write("shared", _dumps(shared))
        write("rank0", _dumps(mine))
    except Exception as e:  # noqa: BLE001
        error = e
    for source in range(1, comm.size):
        blob = _recv_bytes(comm, source)
        if error is None:
            try:
                if not blob:
                    raise RuntimeError(f"rank {source} could not serialize its state")
                write(f"rank{source}", blob)
            except Exception as e:  # noqa: BLE001
                error = e
    if error is None:
        try:
            index = json.dumps({
                "format": FORMAT, "world_size": comm.size, "segments": segments,
                "per_rank_sections": sorted(whole), "per_rank_leaves": len(leaves),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "heatlike": _version()}).encode()
            handle.write(index)
            handle.write(len(index).to_bytes(8, "little"))
            handle.write(hashlib.sha256(index).digest())
            handle.write(END)
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            handle = None
            os.replace(tmp, path)
            tmp = None
            _fsync_dir(path.parent)
        except Exception as e:  # noqa: BLE001
            error = e
    if handle is not None:
        handle.close()
    if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)
    if error is not None:
        return RuntimeError(f"writing checkpoint {path} failed ({type(error).__name__}: "
                            f"{error}); the previous checkpoint there is unchanged")
    return None


# -------------------------------------------------------------------------------- load


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
         comm: MPICommunication | None = None, rng: bool = True, strict: bool = True,
         **stateful) -> Loaded:
    """Collective: restore ``model`` (bare or wrapped), ``optimizer`` and every keyword object's
    state (same names as in :func:`save`) from ``path``; return the plain ``extra`` values.

    Rank 0 reads and verifies the file and sends every rank its part. A missing, truncated or
    corrupted file raises (FileNotFoundError, :class:`CheckpointError`) on every rank before any
    object is changed; so does a checkpoint that does not fit the objects.
    """
    comm = _comm_of(model, optimizer, comm)
    try:
        _check_model(model)
        error = None
    except TypeError as e:
        error = e
    raise_together(error, comm, (CheckpointError,))
    agree_on({"path": os.fspath(path)}, comm, "checkpoint.load")
    path = Path(path)
    error, index, segments = None, None, None
    if comm.rank == 0:
        try:
            if not path.exists():
                raise FileNotFoundError(f"no checkpoint at {path}")
            index, segments = _read(path)
        except (OSError, CheckpointError, ValueError) as e:
            error = e
    _raise_from_root(error, comm)
    index = comm.handle.bcast(index, root=0)
    saved_size = int(index["world_size"])
    whole = set(index["per_rank_sections"])
    shared = _bcast_bytes(comm, segments["shared"] if comm.rank == 0 else None)

    if saved_size == comm.size:
        if comm.rank == 0:
            for dest in range(1, comm.size):
                _send_bytes(comm, segments[f"rank{dest}"], dest)
            mine_blob = segments["rank0"]
        else:
            mine_blob = _recv_bytes(comm, 0)
        resized = None
    else:
        resized = None
        if comm.rank == 0:
            try:
                resized = _dumps(_merge_ranks([_loads(segments[f"rank{r}"])
                                               for r in range(saved_size)]))
            except Exception as e:  # noqa: BLE001
                resized, error = b"", e
        _raise_from_root(error, comm)
        mine_blob = _bcast_bytes(comm, resized)
    del segments

    error, result = None, None
    try:
        tree = _loads(shared)
        mine = _loads(mine_blob)
        result = _restore(tree, mine, whole, saved_size, comm, model, optimizer, rng, strict,
                          stateful)
    except Exception as e:  # noqa: BLE001
        error = e
    raise_together(error, comm, (CheckpointError,))
    if result.averaged or result.reset:
        get_logger().warning(
            "checkpoint %s was saved at %d ranks, loaded at %d: per-rank state averaged over "
            "the saved ranks: %s; reset: %s", path, saved_size, comm.size,
            _shorten(result.averaged), _shorten(result.reset))
    return result


def _shorten(names: list[str], most: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _raise_from_root(error: Exception | None, comm: MPICommunication) -> None:
    """Collective: raise rank 0's error (same type where possible) on every rank."""
    verdict = comm.handle.bcast(None if error is None else (type(error).__name__, str(error)),
                                root=0)
    if verdict is not None:
        kind, message = verdict
        cls = {"FileNotFoundError": FileNotFoundError,
               "PermissionError": PermissionError}.get(kind, CheckpointError)
        raise cls(message) from error


def _reset_unit(path: Path_) -> Path_:
    """What is reset together with a per-rank leaf: everything below ``engine``, the whole RNG
    and wrapper sections, a whole keyword argument, otherwise the leaf alone."""
    for i, key in enumerate(path):
        if isinstance(key, str) and key in _RESET_KEYS:
            return path[:i + 1]
    if path[0] in ("rng", "wrapper"):
        return path[:1]
    return path[:2] if path[0] in ("states", "extra") else path


def _merge_ranks(parts: list[dict]) -> dict:
    """Rank 0, loading at another world size: per-rank leaves become the average over the saved
    ranks (floating-point tensors of the model and optimizer, outside ``engine``) or are marked
    to be reset (:func:`_reset_unit`); per-rank sections are reset."""
    merged: dict = {"sections": {}, "leaves": {}, "averaged": [],
                    "reset": [(name,) for name in parts[0]["sections"]]}
    for path, leaf in parts[0]["leaves"].items():
        values = [p["leaves"].get(path) for p in parts]
        unit = _reset_unit(path)
        averageable = (path[0] in _AVERAGED_SECTIONS and unit == path
                       and all(isinstance(v, torch.Tensor) and v.is_floating_point()
                               and v.shape == leaf.shape for v in values))
        if averageable:
            stacked = torch.stack([v.double() for v in values])
            merged["leaves"][path] = stacked.mean(0).to(leaf.dtype)
            merged["averaged"].append(path)
        elif unit not in merged["reset"]:
            merged["reset"].append(unit)
    return merged


def _restore(tree: dict, mine: dict, whole: set, saved_size: int, comm: MPICommunication,
             model, optimizer, rng: bool, strict: bool, stateful: dict) -> Loaded:
    for name, section in mine["sections"].items():
        tree[name] = section
    reset = mine.get("reset", [])
    replace = {}
    if reset:
        current = _tree(model, optimizer, rng, stateful)
        replace = {unit: _get(current, unit) for unit in reset}
    tree = _rebuild(tree, lambda path, leaf: mine["leaves"].get(path, leaf), replace)

    for name in stateful:
        if name not in tree["states"]:
            raise CheckpointError(f"the checkpoint has no state for {name!r} (it has "
                                  f"{sorted(tree['states']) or 'none'})")
    if optimizer is not None and tree["optimizer"] is None:
        raise CheckpointError("the checkpoint has no optimizer state")
    bare, wrapper = _unwrap(model)
    _check_fits(bare.state_dict(), tree["model"], strict)
    bare.load_state_dict(tree["model"], strict=strict)
    if wrapper is not None and tree["wrapper"] is not None:
        wrapper.set_extra_state(tree["wrapper"])
    if optimizer is not None:
        optimizer.load_state_dict(tree["optimizer"])
    for name, obj in stateful.items():
        obj.load_state_dict(tree["states"][name])
    if rng and tree["rng"] is not None:
        set_rng_state(tree["rng"])
    result = Loaded(tree["extra"])
    result.world_size = saved_size
    result.averaged = [_name(p) for p in mine.get("averaged", [])]
    result.reset = [_name(p) for p in reset]
    return result


# -------------------------------------------------------------------------------- helpers


def _check_fits(current: dict, saved: dict, strict: bool) -> None:
    """Raise CheckpointError (before anything is changed) unless ``saved`` fits the model."""
    problems = []
    if strict:
        missing = [k for k in current if k not in saved]
        unexpected = [k for k in saved if k not in current]
        if missing:
            problems.append(f"missing {missing[:5]}")
        if unexpected:
            problems.append(f"unexpected {unexpected[:5]}")
    for key, value in saved.items():
        here = current.get(key)
        if isinstance(value, torch.Tensor) and isinstance(here, torch.Tensor) and \
                value.shape != here.shape:
            problems.append(f"{key} has shape {tuple(value.shape)} in the checkpoint, "
                            f"{tuple(here.shape)} in the model")
    if problems:
        raise CheckpointError("the checkpoint does not fit the model: " + "; ".join(problems))


def _comm_of(model, optimizer, comm: MPICommunication | None) -> MPICommunication:
    if comm is not None:
        return sanitize_comm(comm)
    for owner in (model, optimizer):
        found = getattr(owner, "comm", None)
        if isinstance(found, MPICommunication):
            return found
    return MPI_WORLD


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (bare or wrapped), got "
                        f"{type(model).__name__}")


def _version() -> str:
    from .._version import __version__

    return __version__
