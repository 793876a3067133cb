"""Checkpoints that resume a distributed run exactly, written atomically and read safely.

:func:`save` and :func:`load` are collective over the model's communicator. What is saved, as one
tree of sections:

``model``     the bare module's ``state_dict()`` (a DataParallel wrapper is unwrapped, so the file
              also loads into a plain module)
``wrapper``   the wrapper's distributed state (bucket plan, counters, codec state), if wrapped
``optimizer`` ``optimizer.state_dict()``: the torch optimizer's state and, for heatlike's
              optimizers, the engine's state under the key ``"engine"`` (a
              ``ZeroRedundancyOptimizer``'s whole state, its shards gathered on every rank)
``classes``   the class of the torch optimizer doing the update (checked by :func:`load`)
``rng``       the torch (and CUDA), numpy, Python and ``heatlike.random`` generator states
``states``    ``state_dict()`` of every keyword argument that has one (a DataLoader, an LR
              scheduler, a GradScaler)
``extra``     every other keyword argument (epoch numbers, metrics, tensors, settings)

**Pending updates.** Both functions first apply every pending deferred update of a non-blocking
:class:`heatlike.optim.DataParallelOptimizer`, whichever objects are passed (the DataParallel
model, its bare module, the wrapper optimizer or the torch optimizer inside it): a checkpoint
never misses an update that ``step()`` has scheduled, and a loaded state is never overwritten by
one.

**What can be stored.** A checkpoint holds tensors and plain values only (``None``, bools,
numbers, strings, bytes, lists, tuples, dicts, sets, torch dtypes, devices and sizes), so that
loading it cannot run code. In ``extra`` and in the keyword objects' states, these are stored too
and given back as they were saved: numpy arrays and numpy scalars (numeric, bool, datetime
dtypes; as their raw bytes and dtype, bit for bit), ``pathlib`` paths (as their string and
class) and ``argparse.Namespace`` (as the dict of its attributes, each converted the same way).
Anything else (a custom class, a function, a ``collections.defaultdict``) makes :func:`save`
raise :class:`CheckpointError` on every rank naming the value, before anything is written.

**Per-rank state.** Every rank hashes each leaf of its tree; leaves equal on all ranks are stored
once, the others (error-feedback residuals, decentralized replicas, per-rank RNG streams) once
per rank. A section whose *structure* differs between ranks is stored whole per rank.

**File format.** ``MAGIC``, then the segments (``torch.save`` payloads: the shared tree, then one
per rank), then a JSON index (offset, length and SHA-256 of every segment, the world size),
its length, its SHA-256 and ``END``. Rank 0 writes it to a temporary file
(``.<name>.<random>.tmp``) in the same directory, fsyncs it, renames it over ``path`` and fsyncs
the directory, so ``path`` always holds either the previous complete checkpoint or the new one.
The temporary file is removed when the write fails, and when SIGTERM, SIGINT or SIGHUP arrives
during it (the signal then takes its usual effect: a default SIGTERM still ends the process, a
handler of the program still runs, once the part of a rank being received has arrived; an
exception it raises, ``sys.exit`` in a handler, ends the save on every rank and is raised again
on its own rank); a temporary file left by a process killed outright (SIGKILL) is removed by the
next save to the same path. :func:`load` verifies every hash and reads with
``torch.load(weights_only=True)``: a checkpoint file cannot run code, and one holding a pickled
object raises :class:`CheckpointError`.

**All or nothing.** :func:`load` reads, verifies and checks everything against the objects first
(file, model keys and shapes, optimizer class, parameter groups and state shapes, engine bucket
plan and wire format, keyword objects, stored values) and raises :class:`CheckpointError` on
every rank before changing anything. Only then does it restore the objects; if restoring still
fails on any rank (a keyword object's ``load_state_dict`` refuses its state, for example), every
rank puts every object back as it was (model parameters and buffers, optimizer and engine state,
keyword objects, RNG states) from a copy taken just before, and raises the error on every rank.
That copy costs one copy of the objects' current state while loading (the model's in host
memory).

**Resuming.** At the same world size every rank gets back exactly what it saved, so the run
continues bitwise as if uninterrupted (CPU; the optimizer and data loader must be built the same
way). At a different world size, per-rank leaves cannot be given back: floating-point tensors of
the model and of the torch optimizer state are replaced by their average over the saved ranks,
and per-rank engine state (under ``"engine"``), RNG states and other leaves are reset to the
value the freshly built objects have. :func:`load` returns what it did in ``.averaged`` and
``.reset`` and logs it on rank 0. A DASO saved in the middle of an epoch continues at the
position of the data loader passed with it (see :func:`load`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import re
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..core.agreement import agree_on, raise_together
from ..core.communication import MPI_WORLD, MPICommunication, sanitize_comm
from ..core.log import get_logger
from ._signals import Signalled, unwinding

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
    """The checkpoint file is not a complete heatlike checkpoint, does not fit the objects, or
    a value cannot be stored in one."""


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


def _tree(model, optimizer, rng: bool, extra: dict, encode: bool = True) -> dict:
    """The state of every object, as saved (``encode``: extras and keyword objects' states in
    their stored form, see :func:`_encode`)."""
    bare, wrapper = _unwrap(model)
    stored = _encode if encode else (lambda value, path: value)
    return {"model": bare.state_dict(),
            "wrapper": wrapper.get_extra_state() if wrapper is not None else None,
            "optimizer": _optimizer_state(optimizer),
            "classes": {"optimizer": _torch_class(optimizer)},
            "rng": rng_state() if rng else None,
            "states": {k: stored(v.state_dict(), ("states", k))
                       for k, v in extra.items() if _stateful(v)},
            "extra": {k: stored(v, ("extra", k)) for k, v in extra.items() if not _stateful(v)}}


def _optimizer_state(optimizer) -> dict | None:
    """``optimizer.state_dict()``; a :class:`heatlike.optim.ZeroRedundancyOptimizer` first
    gathers its shards' states on every rank (collective, as save and load are; its
    ``state_dict()`` then gives the whole state without communicating until the next step)."""
    if optimizer is None:
        return None
    if getattr(optimizer, "_synchronizes_itself", False) and \
            hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=None)
    return optimizer.state_dict()


def _torch_class(optimizer) -> str | None:
    """The class name of the torch optimizer that computes the update: ``optimizer`` itself, or
    the one a heatlike optimizer drives (``torch_optimizer``, ``local_optimizer``, ``optimizer``,
    ``opt`` or ``optim``, followed down)."""
    if optimizer is None:
        return None
    seen = {id(optimizer)}
    while True:
        inner = None
        for attr in ("torch_optimizer", "local_optimizer", "optimizer", "opt", "optim"):
            candidate = getattr(optimizer, attr, None)
            if isinstance(candidate, torch.optim.Optimizer) and id(candidate) not in seen:
                inner = candidate
                break
        if inner is None:
            return type(optimizer).__qualname__
        seen.add(id(inner))
        optimizer = inner


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
        t = leaf.detach().cpu()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}".encode())
        if t.numel():  # (an empty tensor may have stride 0: nothing to read)
            flat = t.contiguous().reshape(-1)
            if flat.stride(-1) != 1:  # one element, expanded: contiguous() keeps stride 0
                flat = flat.clone(memory_format=torch.contiguous_format)
            h.update(flat.view(torch.uint8).numpy().tobytes())
    elif leaf is None or isinstance(leaf, (bool, int, float, str, bytes)):
        h.update(f"{type(leaf).__name__} {leaf!r}".encode())
    elif isinstance(leaf, (set, frozenset)):  # iteration order follows each process's hash seed
        h.update(type(leaf).__name__.encode())
        for item in sorted(_digest(x) for x in leaf):
            h.update(item.encode())
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


# -------------------------------------------------------------------------------- stored values

_TAG = "__heatlike_type__"  # marks a value stored in another form (see _encode)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype,
          torch.device, torch.Size)
_PATHS = {cls.__name__: cls for cls in (pathlib.PurePath, pathlib.PurePosixPath,
                                        pathlib.PureWindowsPath, pathlib.Path,
                                        pathlib.PosixPath, pathlib.WindowsPath)}
_NUMPY_KINDS = "biufcmM"  # bool, int, uint, float, complex, datetime, timedelta


def _where(path: Path_) -> str:
    """How an error names the value at ``path``."""
    section, rest = path[0], path[1:]
    inside = f" (at {_name(rest[1:])})" if len(rest) > 1 else ""
    if section == "extra" and rest:
        return f"the extra value {rest[0]!r}{inside}"
    if section == "states" and rest:
        return f"the state_dict() of {rest[0]!r}{inside}"
    return f"the {section} state" + (f" (at {_name(rest)})" if rest else "")


def _encode(value, path: Path_):
    """``value`` with numpy arrays and scalars, pathlib paths and argparse namespaces replaced by
    tagged dicts of plain values (inside dicts, lists and tuples), which :func:`_decode` turns
    back into equal objects."""
    if type(value) is np.ndarray or isinstance(value, np.generic):
        array = np.asarray(value)
        if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
            raise CheckpointError(
                f"{_where(path)} is a numpy {'array' if type(value) is np.ndarray else 'scalar'}"
                f" of dtype {array.dtype}, which a checkpoint cannot store (numeric, bool and "
                "datetime dtypes can): convert it to a list or a tensor")
        raw = np.frombuffer(np.ascontiguousarray(array).tobytes(), dtype=np.uint8).copy()
        return {_TAG: "numpy", "dtype": array.dtype.str, "shape": list(array.shape),
                "scalar": isinstance(value, np.generic), "data": torch.from_numpy(raw)}
    if isinstance(value, pathlib.PurePath):
        return {_TAG: "path", "class": type(value).__name__, "path": str(value)}
    if type(value) is argparse.Namespace:
        return {_TAG: "namespace", "items": _encode(dict(vars(value)), path)}
    if isinstance(value, dict) and type(value) in (dict, OrderedDict):
        if _TAG in value:
            raise CheckpointError(f"{_where(path)} is a dict with the key {_TAG!r}, which "
                                  "heatlike's checkpoints reserve: rename it")
        out = type(value)()
        if type(value) is not dict:
            out.__dict__.update(getattr(value, "__dict__", {}))
        for k, v in value.items():
            out[k] = _encode(v, (*path, k))
        return out
    if type(value) in (list, tuple):
        return type(value)(_encode(v, (*path, i)) for i, v in enumerate(value))
    return value


def _decode(value):
    """Undo :func:`_encode`."""
    if isinstance(value, dict) and _TAG in value:
        kind = value[_TAG]
        try:
            if kind == "numpy":
                array = np.frombuffer(value["data"].numpy().tobytes(),
                                      dtype=np.dtype(value["dtype"]))
                array = array.reshape(value["shape"]).copy()
                return array[()] if value["scalar"] else array
            if kind == "path":
                cls = _PATHS.get(value["class"], pathlib.PurePath)
                try:
                    return cls(value["path"])
                except (NotImplementedError, OSError):  # a concrete path of another system
                    return pathlib.PurePath(value["path"])
            if kind == "namespace":
                return argparse.Namespace(**_decode(value["items"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"a stored {kind!r} value is damaged ({e})") from None
        raise CheckpointError(f"the checkpoint stores a value of unknown kind {kind!r} (written "
                              "by a newer heatlike?)")
    if isinstance(value, dict):
        out = type(value)()
        if type(value) is not dict:
            out.__dict__.update(getattr(value, "__dict__", {}))
        for k, v in value.items():
            out[k] = _decode(v)
        return out
    if type(value) in (list, tuple):
        return type(value)(_decode(v) for v in value)
    return value


def _check_storable(tree: dict) -> None:
    """Raise CheckpointError naming the first value of ``tree`` that ``torch.load(...,
    weights_only=True)`` would refuse to read back (a custom class, a function, a dict subclass
    other than OrderedDict...)."""

    def refuse(path: Path_, value, why: str = "") -> CheckpointError:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        return CheckpointError(
            f"checkpoint.save: {_where(path)} is a {kind}{why}, which a checkpoint cannot store "
            "(loading a checkpoint never unpickles arbitrary objects): store tensors, numbers, "
            "strings, lists, tuples and dicts of them (numpy arrays, pathlib paths and "
            "argparse.Namespace are converted), or pass an object with "
            "state_dict()/load_state_dict()")

    def plain_key(key) -> bool:
        return type(key) in _PLAIN or (type(key) is tuple and all(map(plain_key, key)))

    def walk(value, path: Path_) -> None:
        if type(value) in (dict, OrderedDict):
            for k, v in value.items():
                if not plain_key(k):
                    raise refuse((*path, k), k, " used as a dict key")
                walk(v, (*path, k))
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                walk(v, (*path, i))
        elif type(value) in (set,):
            for v in value:
                walk(v, path)
        elif type(value) is torch.Tensor:
            if value.layout is not torch.strided or value.is_meta:
                raise refuse(path, value, f" with layout {value.layout} on {value.device} "
                             "(store .to_dense(), or a tensor with values)")
            for name, attribute in vars(value).items():  # torch.save pickles them too
                walk(attribute, (*path, name))
        elif type(value) in _PLAIN:
            return
        else:  # rare: ask the safe loader itself
            try:
                _loads(_dumps(value))
            except Exception:  # noqa: BLE001 - any failure means it cannot be stored
                raise refuse(path, value) from None

    for section, value in tree.items():
        walk(value, (section,))


# -------------------------------------------------------------------------------- pending updates


def _data_parallels(objects) -> list:
    """The DataParallel wrappers behind ``objects``: a DataParallel itself, the bare module it
    wraps (found through the hooks it registered), a DataParallelOptimizer attached to it."""
    from ..nn.data_parallel import DataParallel
    from ..nn.hooks import WrapperHook

    found: list = []

    def add(candidate) -> None:
        if isinstance(candidate, DataParallel) and not any(candidate is f for f in found):
            found.append(candidate)

    for obj in objects:
        add(obj)
        if isinstance(obj, torch.nn.Module):
            for hooks in (obj._forward_pre_hooks, obj._forward_hooks):
                for hook in list(hooks.values()):
                    fn = hook.fn if isinstance(hook, WrapperHook) else hook
                    add(getattr(fn, "__self__", None))
        add(getattr(obj, "__dict__", {}).get("_model"))
    return found


def _flush_pending(*objects) -> None:
    """Apply every pending deferred update (non-blocking DataParallelOptimizer) of a
    DataParallel found among ``objects``. Same objects on every rank: waits only for reductions
    every rank has started."""
    for model in _data_parallels(objects):
        model.flush()


# -------------------------------------------------------------------------------- bytes and files


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes, what: str = "the checkpoint"):
    """``torch.load(weights_only=True)``; a pickled object (a ``__reduce__`` payload) raises
    CheckpointError and is never run."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        name = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{what} holds a pickled Python object{name} that a safe load refuses to create; "
            "heatlike's checkpoints hold tensors and plain values only, so this file was not "
            "written by checkpoint.save or was altered; it is not loaded") from None


def _wait(request) -> None:
    """Wait for an MPI request in short sleeps instead of one blocking call, so that Python runs
    signal handlers (a blocking MPI call delays them until it returns)."""
    delay = 1e-5
    while not request.Test():
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)


def _bcast_bytes(comm: MPICommunication, data: bytes | None) -> bytes:
    n = np.array([len(data) if comm.rank == 0 else 0], dtype=np.int64)
    comm.Bcast(n, root=0)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if comm.rank == 0 else \
        np.empty(int(n[0]), dtype=np.uint8)
    if n[0]:
        comm.Bcast(buf, root=0)
    return buf.tobytes()


def _send_bytes(comm: MPICommunication, data: bytes, dest: int) -> None:
    comm.handle.Send(np.array([len(data)], dtype=np.int64), dest, tag=71)
    if data:
        comm.handle.Send(np.frombuffer(data, dtype=np.uint8), dest, tag=72)


def _recv_bytes(comm: MPICommunication, source: int) -> bytes:
    n = np.empty(1, dtype=np.int64)
    _wait(comm.handle.Irecv(n, source, tag=71))
    buf = np.empty(int(n[0]), dtype=np.uint8)
    if n[0]:
        _wait(comm.handle.Irecv(buf, source, tag=72))
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


def _remove_stale(path: Path) -> None:
    """Remove temporary files of earlier saves to ``path`` that were killed before they could
    (``.<name>.<8 random characters>.tmp``, :func:`tempfile.mkstemp`'s names)."""
    prefix = f".{path.name}."
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            name = entry.name
            if name.startswith(prefix) and name.endswith(".tmp") and \
                    len(name) == len(prefix) + 8 + 4 and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


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
    try:  # a checksum that matches an index of another shape: a file written by something else
        index = json.loads(raw)
        fmt = index.get("format")
        entries = [(str(name), int(offset), int(length), str(sha))
                   for name, (offset, length, sha) in index["segments"].items()]
        int(index["world_size"])
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{what}: its index is malformed ({type(e).__name__}: {e})") from e
    if fmt != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {fmt}, this heatlike reads format "
                              f"{FORMAT}")
    segments = {}
    for name, offset, length, sha in entries:
        segment = data[offset:offset + length]
        if len(segment) != length or offset + length > start:
            raise CheckpointError(f"{what}: segment {name!r} is cut short (truncated)")
        if hashlib.sha256(segment).hexdigest() != sha:
            raise CheckpointError(f"{what}: segment {name!r} does not match its checksum "
                                  "(corrupted)")
        segments[name] = segment
    expected = {"shared", *(f"rank{r}" for r in range(int(index["world_size"])))}
    if set(segments) != expected:
        missing = sorted(expected - set(segments))
        extra = sorted(set(segments) - expected)
        raise CheckpointError(f"{what}: its segments do not match its {index['world_size']} "
                              f"rank(s) (missing {missing[:4]}, unexpected {extra[:4]})")
    return index, segments


def _file_mode(path: Path) -> int:
    """The permissions a new checkpoint gets: the file's it replaces, else those of a file
    created as usual (0o666 less the umask; :func:`tempfile.mkstemp` makes its files 0o600)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (setting it to read
    it back would briefly change it for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -------------------------------------------------------------------------------- save


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
         comm: MPICommunication | None = None, rng: bool = True, **extra) -> None:
    """Collective: write a checkpoint of ``model`` (bare or wrapped), ``optimizer`` and
    ``extra`` to ``path`` (see the module docstring). ``extra`` values with
    ``state_dict``/``load_state_dict`` (data loader, scheduler) are saved by their state.

    In-flight communication of the optimizer and wrapper is completed first: pending updates of
    a non-blocking DataParallelOptimizer are applied (whether the DataParallel model, its bare
    module, the wrapper or the torch optimizer inside is passed); DASO keeps its in-flight
    averages for the batch it merges them in. A value that cannot be stored raises
    :class:`CheckpointError` naming it, before anything is written. An error on any rank
    (including rank 0 failing to write) is raised on every rank, and ``path`` then still holds
    the previous checkpoint.
    """
    comm = _comm_of(model, optimizer, comm)
    error = None
    try:
        _check_model(model)
        _check_flags(rng=rng)
    except TypeError as e:
        error = e
    raise_together(error, comm, (CheckpointError,))
    agree_on({"path": os.fspath(path)}, comm, "checkpoint.save")

    error, tree = None, None
    try:
        _flush_pending(model, optimizer, *extra.values())
        tree = _tree(model, optimizer, rng, extra)
        release = getattr(optimizer, "release_state_dict", None)
        if release is not None:  # a ZeroRedundancyOptimizer: every rank held every shard's
            release()
        _check_storable(tree)
        sections = {name: _structure(section) for name, section in tree.items()}
        digests = {path: _digest(leaf) for path, leaf in _leaves(tree)}
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = e
    raise_together(error, comm, (CheckpointError,))

    everyone = comm.gather((sections, digests), root=0)
    if comm.rank == 0:
        split = _per_rank_parts(everyone)
    split = comm.bcast(split if comm.rank == 0 else None, root=0)
    whole, leaves = split
    mine = {"sections": {name: tree[name] for name in whole},
            "leaves": {p: leaf for p, leaf in _leaves(tree)
                       if p in leaves and p[0] not in whole}}

    if comm.rank != 0:
        error, interrupt = _send_part(comm, mine)
    else:
        error, interrupt = _write(Path(path), comm, tree, whole, leaves, mine)
    if interrupt is None:
        raise_together(error, comm, (CheckpointError,))
        return
    with contextlib.suppress(Exception):  # the others learn of it; here the handler's exit wins
        raise_together(error, comm, (CheckpointError,))
    raise interrupt


def _send_part(comm: MPICommunication, mine: dict
               ) -> tuple[Exception | None, BaseException | None]:
    """A rank other than 0: send its part to rank 0, always (empty when it cannot be
    serialized), even when a signal handler raises meanwhile. Returns (error, the handler's
    exception) as :func:`_write` does."""
    error: BaseException | None = None
    with unwinding() as guard:
        try:
            blob = _dumps(mine)
        except (Signalled, KeyboardInterrupt):  # the job ends
            raise
        except BaseException as e:  # noqa: BLE001 - rank 0 waits for a part: send one
            blob, error = b"", e
        try:
            with guard.held():
                _send_bytes(comm, blob, 0)
        except (Signalled, KeyboardInterrupt):  # the job ends
            raise
        except BaseException as e:  # noqa: BLE001 - a held-back handler's, once sent
            error = error or e
    if error is None or isinstance(error, Exception):
        return error, None
    return RuntimeError(f"rank {comm.rank} was interrupted ({type(error).__name__})"), error


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
           mine: dict) -> tuple[Exception | None, BaseException | None]:
    """Rank 0: write the file atomically, receiving the other ranks' parts one after another
    (always all of them, even after an error or an exception from a signal handler, so no rank
    is left waiting). The temporary file is removed on every way out: an error, or a signal
    (:mod:`heatlike.utils._signals`). Returns the error to raise on every rank and the
    handler's exception (SystemExit, KeyboardInterrupt) to raise here after that."""
    error: BaseException | None = None
    handle = tmp = None
    segments: dict[str, list] = {}

    def write(name: str, blob: bytes) -> None:
        offset = handle.tell()
        handle.write(blob)
        segments[name] = [offset, len(blob), hashlib.sha256(blob).hexdigest()]

    with unwinding() as guard:
        try:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                _remove_stale(path)
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                           dir=path.parent)
                handle = os.fdopen(fd, "wb")
                os.fchmod(fd, _file_mode(path))
                handle.write(MAGIC)
                shared = _rebuild({k: (None if k in whole else v) for k, v in tree.items()},
                                  lambda p, leaf: None if p in leaves else leaf)
                write("shared", _dumps(shared))
                write("rank0", _dumps(mine))
            except (Signalled, KeyboardInterrupt):  # the job ends
                raise
            except BaseException as e:  # noqa: BLE001 - the others' parts are received first
                error = e
            for source in range(1, comm.size):
                try:
                    with guard.held():
                        blob = _recv_bytes(comm, source)
                except (Signalled, KeyboardInterrupt):  # the job ends
                    raise
                except BaseException as e:  # noqa: BLE001 - a held-back handler's, once received
                    error = error or e
                    continue
                if error is None:
                    try:
                        if not blob:
                            raise RuntimeError(f"rank {source} could not serialize its state")
                        write(f"rank{source}", blob)
                    except (Signalled, KeyboardInterrupt):  # the job ends
                        raise
                    except BaseException as e:  # noqa: BLE001
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
                except (Signalled, KeyboardInterrupt):  # the job ends
                    raise
                except BaseException as e:  # noqa: BLE001
                    error = e
        finally:
            if handle is not None:
                with contextlib.suppress(OSError):
                    handle.close()
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    if error is None:
        return None, None
    failed = RuntimeError(f"writing checkpoint {path} failed ({type(error).__name__}: "
                          f"{error}); the previous checkpoint there is unchanged")
    return failed, None if isinstance(error, Exception) else error


# -------------------------------------------------------------------------------- load


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
         comm: MPICommunication | None = None, rng: bool = True, strict: bool = True,
         **stateful) -> Loaded:
    """Collective: restore ``model`` (bare or wrapped), ``optimizer`` and every keyword object's
    state (same names as in :func:`save`) from ``path``; return the plain ``extra`` values.

    Pending deferred updates are applied first (as in :func:`save`). Rank 0 reads and verifies
    the file and sends every rank its part. A missing, truncated or corrupted file raises
    (FileNotFoundError, :class:`CheckpointError`) on every rank before any object is changed;
    so does a checkpoint that does not fit the objects. Loading is all or nothing: if restoring
    fails on any rank, every object on every rank is put back as it was and the error is
    raised on every rank (see the module docstring).

    A DASO loaded at another world size in the middle of an epoch (``optimizer``, or the
    optimizer of the DataParallelMultiGPU ``model``) continues at the position of the data
    loader, when exactly one :class:`heatlike.utils.data.DataLoader` is passed among the keyword
    objects (see ``DASO.resume_at``).
    """
    comm = _comm_of(model, optimizer, comm)
    try:
        _check_model(model)
        _check_flags(rng=rng, strict=strict)
        for name, obj in stateful.items():
            if not _stateful(obj):
                raise TypeError(f"checkpoint.load's keyword argument {name!r} must have "
                                "state_dict() and load_state_dict() (the plain values saved as "
                                "extra are what load returns)")
        error = None
    except TypeError as e:
        error = e
    raise_together(error, comm, (CheckpointError,))
    agree_on({"path": os.fspath(path)}, comm, "checkpoint.load")
    error = None
    try:
        _flush_pending(model, optimizer, *stateful.values())
    except Exception as e:  # noqa: BLE001
        error = e
    raise_together(error, comm, (CheckpointError,))
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
    index = comm.bcast(index, root=0)
    saved_size = int(index["world_size"])
    shared = _bcast_bytes(comm, segments["shared"] if comm.rank == 0 else None)

    if saved_size == comm.size:
        if comm.rank == 0:
            for dest in range(1, comm.size):
                _send_bytes(comm, segments[f"rank{dest}"], dest)
            mine_blob = segments["rank0"]
        else:
            mine_blob = _recv_bytes(comm, 0)
    else:
        resized = None
        if comm.rank == 0:
            try:
                resized = _dumps(_merge_ranks([_loads(segments[f"rank{r}"], f"{path}")
                                               for r in range(saved_size)]))
            except Exception as e:  # noqa: BLE001
                resized, error = b"", e
        _raise_from_root(error, comm)
        mine_blob = _bcast_bytes(comm, resized)
    del segments

    error, plan = None, None
    try:
        tree = _loads(shared, f"{path}")
        mine = _loads(mine_blob, f"{path}")
        plan = _prepare(tree, mine, saved_size, model, optimizer, rng, strict, stateful)
    except Exception as e:  # noqa: BLE001
        error = e
    raise_together(error, comm, (CheckpointError,))
    _apply(plan, comm)
    _resume_position(model, optimizer, stateful)
    result = plan.result
    if result.averaged or result.reset:
        get_logger().warning(
            "checkpoint %s was saved at %d ranks, loaded at %d: per-rank state averaged over "
            "the saved ranks: %s; reset: %s", path, saved_size, comm.size,
            _shorten(result.averaged), _shorten(result.reset))
    return result


def _resume_position(model, optimizer, stateful: dict) -> None:
    """An optimizer that lost its position in the epoch while loading (DASO at another world
    size, ``position_unknown``) continues at the position of the data loader loaded with it,
    when exactly one :class:`heatlike.utils.data.DataLoader` was passed: the batches of its
    current epoch already served. The same on every rank (so are the mark and the position)."""
    from .data import DataLoader

    loaders = [obj for obj in stateful.values() if isinstance(obj, DataLoader)]
    if len(loaders) != 1:
        return
    for candidate in (optimizer, getattr(model, "optimizer", None)):
        if getattr(candidate, "position_unknown", False) is True:
            candidate.resume_at(loaders[0]._position)
            return


def _shorten(names: list[str], most: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _raise_from_root(error: Exception | None, comm: MPICommunication) -> None:
    """Collective: raise rank 0's error (same type where possible) on every rank."""
    verdict = comm.bcast(None if error is None else (type(error).__name__, str(error)),
                         root=0)
    if verdict is not None:
        kind, message = verdict
        cls = {"FileNotFoundError": FileNotFoundError,
               "PermissionError": PermissionError}.get(kind, CheckpointError)
        raise cls(message) from error


def _reset_unit(path: Path_) -> Path_:
    """What is reset together with a per-rank leaf: everything below ``engine``, the wrapper
    section, one generator's whole state (torch's, numpy's, Python's, heatlike's: each stream
    that was the same on every rank loads, such as torch's seeded alike while Python's was left
    unseeded), a whole keyword argument, otherwise the leaf alone."""
    for i, key in enumerate(path):
        if isinstance(key, str) and key in _RESET_KEYS:
            return path[:i + 1]
    if path[0] == "wrapper":
        return path[:1]
    return path[:2] if path[0] in ("rng", "states", "extra") else path


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


class _Plan:
    """What :func:`_apply` restores, every part checked against the objects."""

    def __init__(self, **parts) -> None:
        self.__dict__.update(parts)


def _prepare(tree: dict, mine: dict, saved_size: int, model, optimizer, rng: bool,
             strict: bool, stateful: dict) -> _Plan:
    """This rank's final tree (its own leaves, averages or resets at another world size,
    stored values decoded), checked against every object; changes nothing. Raises
    CheckpointError on the first misfit."""
    for name, section in mine["sections"].items():
        tree[name] = section
    reset = mine.get("reset", [])
    current = _tree(model, optimizer, rng, stateful, encode=False)  # (decoding is the identity)
    replace = {unit: _get(current, unit) for unit in reset}
    tree = _rebuild(tree, lambda path, leaf: mine["leaves"].get(path, leaf), replace)

    for name in stateful:
        if name not in tree["states"]:
            raise CheckpointError(f"the checkpoint has no state for {name!r} (it has "
                                  f"{sorted(tree['states']) or 'none'})")
    bare, wrapper = _unwrap(model)
    _check_fits(current["model"], tree["model"], strict)
    problems: list[str] = []
    if wrapper is not None and tree["wrapper"] is not None:
        _check_engine(tree["wrapper"], current["wrapper"], "the model's engine", problems)
    if optimizer is not None:  # resuming training: the engine's state must go somewhere
        _check_engine_home(tree, current, problems)
    if optimizer is not None:
        if tree["optimizer"] is None:
            raise CheckpointError("the checkpoint has no optimizer state")
        saved_class = (tree.get("classes") or {}).get("optimizer")
        here_class = current["classes"]["optimizer"]
        if saved_class is not None and saved_class != here_class:
            raise CheckpointError(f"the checkpoint's optimizer state is from a {saved_class} "
                                  f"optimizer, the optimizer given is a {here_class}")
        _compare_optimizer(tree["optimizer"], current["optimizer"], optimizer, "optimizer",
                           problems)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError("the checkpoint does not fit: " + "; ".join(problems[:5]) + more)
    states = {name: _decode(tree["states"][name]) for name in stateful}
    extra = _decode(tree["extra"])
    result = Loaded(extra)
    result.world_size = saved_size
    result.averaged = [_name(p) for p in mine.get("averaged", [])]
    result.reset = [_name(p) for p in reset]
    return _Plan(bare=bare, wrapper=wrapper, optimizer=optimizer, strict=strict,
                 stateful=stateful, model_state=tree["model"],
                 wrapper_state=tree["wrapper"] if wrapper is not None else None,
                 optimizer_state=tree["optimizer"] if optimizer is not None else None,
                 states=states, rng_state=tree["rng"] if rng else None, result=result)


def _apply(plan: _Plan, comm: MPICommunication) -> None:
    """Collective: restore every object of ``plan``; if that fails on any rank, every rank puts
    back what it had changed (from a copy taken just before each change) and raises."""
    undo: list[tuple[str, Callable[[], None]]] = []
    error = None

    def step(what: str, snapshot: Callable, restore: Callable, state,
             put_back: Callable | None = None) -> None:
        try:
            saved = snapshot()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"copying the state of {what} before restoring it failed "
                                  f"({type(e).__name__}: {e})") from e
        undo.append((what, lambda: (put_back or restore)(saved)))
        try:
            restore(state)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"restoring {what} from the checkpoint failed "
                                  f"({type(e).__name__}: {e})") from e

    try:
        step("the model", lambda: _copy(plan.bare.state_dict(), device="cpu"),
             lambda sd: plan.bare.load_state_dict(sd, strict=plan.strict), plan.model_state)
        if plan.wrapper_state is not None:
            step("the model's engine", lambda: _copy(plan.wrapper.get_extra_state()),
                 plan.wrapper.set_extra_state, plan.wrapper_state)
        if plan.optimizer is not None:
            step("the optimizer", lambda: _copy(plan.optimizer.state_dict()),
                 plan.optimizer.load_state_dict, plan.optimizer_state)
        for name, obj in plan.stateful.items():
            exact = getattr(obj, "_exact_state", None)  # objects whose state_dict is not all
            if exact is not None:
                step(repr(name), exact, obj.load_state_dict, plan.states[name],
                     obj._set_exact_state)
            else:
                step(repr(name), lambda obj=obj: _copy(obj.state_dict()),
                     obj.load_state_dict, plan.states[name])
        if plan.rng_state is not None:
            step("the random generators", rng_state, set_rng_state, plan.rng_state)
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = e
    try:
        raise_together(error, comm, (CheckpointError,))
    except Exception as e:
        failed = []
        for what, restore in reversed(undo):
            try:
                restore()
            except Exception as bad:  # noqa: BLE001
                failed.append(f"{what} ({type(bad).__name__}: {bad})")
        if failed:
            raise CheckpointError(f"{e}; putting back the previous state failed too for "
                                  f"{', '.join(failed)}") from e
        raise CheckpointError(f"{e}; every object was left as it was") from e


def _copy(state, device: str | None = None):
    """A deep copy of a state dict whose tensors are cloned (to ``device`` if given)."""
    memo: dict = {}
    for _, leaf in _leaves(state):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
            memo[id(leaf)] = leaf.detach().to(device or leaf.device, copy=True)
    return copy.deepcopy(state, memo)


# -------------------------------------------------------------------------------- fit checks

# per-parameter optimizer buffers of torch's optimizers: shaped like their parameter
_PARAMETER_SHAPED = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg",
                     "acc_delta", "sum", "ax", "grad_avg", "prev", "step_size")


def _check_fits(current: dict, saved: dict, strict: bool) -> None:
    """Raise CheckpointError (before anything is changed) unless ``saved`` fits the model."""
    problems = []
    if not isinstance(saved, dict):
        raise CheckpointError("the checkpoint has no model state")
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


def _is_torch_state(x) -> bool:
    return isinstance(x, dict) and "state" in x and "param_groups" in x


def _compare_optimizer(saved, current, owner, where: str, problems: list[str]) -> None:
    """Append to ``problems`` how the saved optimizer state differs from the current one in
    structure: keys, parameter groups, per-parameter state and engine state."""
    if not isinstance(current, dict):
        return
    if not isinstance(saved, dict):
        problems.append(f"{where} is a {type(saved).__name__} in the checkpoint, a dict here")
        return
    if _is_torch_state(current):
        if not _is_torch_state(saved):
            problems.append(f"{where} in the checkpoint is not a torch optimizer state (keys "
                            f"{sorted(map(str, saved))[:6]})")
            return
        _compare_torch_state(saved, current, owner, where, problems)
    else:
        mine, theirs = set(current) - {"engine"}, set(saved) - {"engine"}
        if mine != theirs:
            problems.append(f"{where} has the keys {sorted(map(str, theirs))} in the "
                            f"checkpoint, {sorted(map(str, mine))} here (another kind of "
                            "optimizer?)")
            return
        for key in sorted(mine, key=str):
            s, c = saved[key], current[key]
            if isinstance(c, dict):
                inner = getattr(owner, key, None) if isinstance(key, str) else None
                _compare_optimizer(s, c, inner, f"{where}.{key}", problems)
            elif isinstance(c, torch.Tensor) and (not isinstance(s, torch.Tensor)
                                                  or s.shape != c.shape):
                shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                problems.append(f"{where}.{key} is {shape} in the checkpoint, "
                                f"{tuple(c.shape)} here")
    if isinstance(saved.get("engine"), dict) and isinstance(current.get("engine"), dict):
        _check_engine(saved["engine"], current["engine"], f"{where}.engine", problems)


def _compare_torch_state(saved: dict, current: dict, owner, where: str,
                         problems: list[str]) -> None:
    groups, here = saved["param_groups"], current["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g
                                               for g in groups):
        problems.append(f"{where}: the checkpoint's parameter groups are damaged")
        return
    sizes, mine = [len(g["params"]) for g in groups], [len(g["params"]) for g in here]
    if sizes != mine:
        problems.append(f"{where} has parameter groups of {sizes} parameters in the "
                        f"checkpoint, {mine} here")
        return
    if not isinstance(saved["state"], dict):
        problems.append(f"{where}: the checkpoint's per-parameter state is damaged")
        return
    saved_ids = [i for g in groups for i in g["params"]]
    here_ids = [i for g in here for i in g["params"]]
    position = {i: n for n, i in enumerate(saved_ids)}
    params = None
    if isinstance(owner, torch.optim.Optimizer):
        found = [p for g in owner.param_groups for p in g["params"]]
        if len(found) == len(saved_ids):
            params = found
    for sid, state in saved["state"].items():
        n = position.get(sid)
        if n is None:
            problems.append(f"{where} has state for a parameter {sid!r} that none of its "
                            "groups lists (damaged)")
            continue
        if not isinstance(state, dict):
            continue
        ours = current["state"].get(here_ids[n])
        if isinstance(ours, dict) and ours and state and set(ours) != set(state):
            problems.append(f"{where}: parameter {n} has the state {sorted(state)} in the "
                            f"checkpoint, {sorted(ours)} here (another optimizer?)")
            continue
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            expected = None
            if isinstance(ours, dict) and isinstance(ours.get(key), torch.Tensor):
                expected = ours[key].shape
            elif key in _PARAMETER_SHAPED and params is not None:
                expected = params[n].shape
            if expected is not None and value.shape != expected:
                problems.append(f"{where}: the state {key!r} of parameter {n} has shape "
                                f"{tuple(value.shape)} in the checkpoint, {tuple(expected)} "
                                "here")


def _engine_home(tree: dict) -> tuple[str | None, dict | None]:
    """Where a state tree keeps its gradient engine (the state with the wire format): the
    DataParallel wrapper's (``"wrapper"``), a preset optimizer's (``"optimizer"``) or none."""
    for home in ("wrapper", "optimizer"):
        part = tree.get(home)
        engine = part.get("engine") if isinstance(part, dict) else None
        if isinstance(engine, dict) and "codec" in engine:
            return home, engine
    return None, None


def _check_engine_home(saved: dict, current: dict, problems: list[str]) -> None:
    """Append to ``problems`` where the checkpoint's engine and this run's live in different
    objects (a DataParallel wrapper's against a preset optimizer's, e.g. plain DataParallel
    against PowerSGD): their wire formats are compared, and an engine that kept state between
    steps (residuals, warm starts) cannot move to the other object, so it is refused too."""
    (there, theirs), (here, ours) = _engine_home(saved), _engine_home(current)
    if theirs is None or ours is None or there == here:
        return
    _check_engine(theirs, ours, "the engine", problems)
    codec = theirs.get("codec")
    states = codec.get("states") if isinstance(codec, dict) else None
    if isinstance(states, dict) and any(states.values()):
        problems.append(f"the checkpoint's engine state (its wire format's memory) belongs to "
                        f"the {'DataParallel wrapper' if there == 'wrapper' else 'optimizer'}, "
                        f"this run's engine is the "
                        f"{'DataParallel wrapper' if here == 'wrapper' else 'optimizer'}'s "
                        "(another algorithm?)")


def _check_engine(saved, current, where: str, problems: list[str]) -> None:
    """Append to ``problems`` where the saved engine state cannot be restored into the current
    engine: a bucket plan over another number of parameters, another wire format (codec)."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return
    if "order" in saved and "sizes" in saved and "order" in current:
        try:
            order, n = [int(i) for i in saved["order"]], len(current["order"])
            fits = sorted(order) == list(range(n)) and \
                sum(int(s) for s in saved["sizes"]) == len(order)
        except (TypeError, ValueError):
            fits, order, n = False, [], len(current["order"])
        if not fits:
            problems.append(f"{where}: the checkpoint's bucket plan covers {len(order)} "
                            f"parameters, this model has {n} trainable parameters")
    codec, ours = saved.get("codec"), current.get("codec")
    if isinstance(codec, str) and isinstance(ours, str) and codec != ours:
        problems.append(f"{where}: the checkpoint was saved with the wire format (codec) "
                        f"{codec!r}, this run uses {ours!r}")
    for key in saved:
        if key in current and key not in ("order", "sizes"):
            _check_engine(saved[key], current[key], f"{where}.{key}", problems)


# -------------------------------------------------------------------------------- helpers


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


def _check_flags(**flags) -> None:
    """``rng`` and ``strict`` are switches; a value of another kind is most likely an extra
    object the caller named like them, which would otherwise be taken for the switch."""
    for name, value in flags.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"checkpoint's {name}= must be True or False, got "
                            f"{type(value).__name__} (an extra value cannot be named {name!r}: "
                            "give it another name)")


def _version() -> str:
    from .._version import __version__

    return __version__
