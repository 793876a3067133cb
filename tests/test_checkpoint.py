"""heatlike.utils.checkpoint: exact resume, per-rank state, integrity, safe loading.

Exactness: run A trains k steps, saves, trains k more; run B is built from scratch (new model,
optimizer, loader), loads the checkpoint and trains k steps. On every rank B's parameters must
equal A's bit for bit. (tests/test_resume.py repeats this across separate processes.)
"""

import argparse
import collections
import copy
import hashlib
import os
from collections import OrderedDict
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
import pytest
import torch

import heatlike as hl
from heatlike import recipes
from heatlike.recipes import load_digits_split, make_runner, mlp
from heatlike.utils import checkpoint
from heatlike.utils.checkpoint import CheckpointError
from heatlike.utils.data import DataLoader, Dataset

pytestmark = pytest.mark.mpi

_DATA = None


def _data():
    global _DATA
    if _DATA is None:
        x, y, _, _ = load_digits_split()
        _DATA = (x[:128], y[:128])
    return _DATA


@pytest.fixture(autouse=True)
def _short_compression_warmup(monkeypatch):
    """"topk-1%" and "powersgd-2" average exactly in their first recipes.COMPRESSION_WARMUP
    steps; 2 here, so that these short runs save and resume in the compressed phase."""
    monkeypatch.setattr(recipes, "COMPRESSION_WARMUP", 2)


class Loop:
    """A training loop that can stop after any step and go on (epoch hooks included)."""

    def __init__(self, name: str, comm, epochs: int = 3) -> None:
        self.comm = comm
        self.net = mlp([64, 24, 10])
        self.runner = make_runner(name, self.net, comm, lr=0.05, epochs=epochs)
        self.loader = DataLoader(Dataset(*_data()), batch_size=8, seed=1, comm=comm)
        self.losses: list[float] = []
        self._it = None

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self._it is None:
                self.runner.start_epoch(len(self.loader))
                self._it = iter(self.loader)
            xb, yb = next(self._it)
            self.losses.append(self.runner.train_step(xb, yb))
            if self.loader._position == len(self.loader):  # the epoch's last batch
                self.runner.end_epoch(sum(self.losses) / len(self.losses))
                self.losses = []
                next(self._it, None)  # let the loader close the epoch
                self._it = None

    def save(self, path) -> None:
        checkpoint.save(path, self.runner.model, self.runner.optimizer, loader=self.loader,
                        losses=self.losses, note="hello")

    def load(self, path) -> dict:
        state = checkpoint.load(path, self.runner.model, self.runner.optimizer,
                                loader=self.loader)
        self.losses = list(state.get("losses", []))  # per rank: reset at another size
        return state

    def parameters(self) -> list[torch.Tensor]:
        self.runner.finish()
        return [p.detach().clone() for p in self.net.parameters()]


def _shared_path(comm, tmp_path: Path, name: str = "run.ckpt") -> Path:
    """A path every rank agrees on (rank 0's temporary directory)."""
    return Path(comm.handle.bcast(str(tmp_path / name), root=0))


CASES = ["allreduce", "allreduce-nonblocking", "topk-1%", "powersgd-2", "distopt-sparse",
         "decentralized", "sign", "daso"]


@pytest.mark.parametrize("name", CASES)
def test_resume_continues_bitwise(comm, tmp_path, name):
    path = _shared_path(comm, tmp_path)
    a = Loop(name, comm)
    k = len(a.loader) + 1  # the second epoch's first batch (DASO: a merge is in flight)
    a.run(k)
    a.save(path)
    after_save = torch.rand(3)
    a.run(k)
    expected = a.parameters()

    b = Loop(name, comm)
    state = b.load(path)
    assert state["note"] == "hello" and state.world_size == comm.size
    assert not state.reset and not state.averaged
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where it was saved
    b.run(k)
    for p, q in zip(b.parameters(), expected):
        assert torch.equal(p, q), name


def test_per_rank_state_is_kept_per_rank(comm, tmp_path):
    """Error-feedback residuals differ between ranks; each rank gets its own back."""
    path = _shared_path(comm, tmp_path)
    a = Loop("topk-1%", comm)
    a.run(3)
    a.save(path)
    residuals = {k: v["residual"].clone() for k, v in a.runner.optimizer.sync.codec.states.items()}
    assert residuals
    b = Loop("topk-1%", comm)
    b.load(path)
    for key, residual in residuals.items():
        assert torch.equal(b.runner.optimizer.sync.codec.states[key]["residual"], residual)
    index = checkpoint.verify(path)
    assert index["world_size"] == comm.size
    assert (index["per_rank_leaves"] > 0) == (comm.size > 1)


def test_loading_at_another_world_size_averages_and_resets(comm, tmp_path):
    """Saved by all ranks, loaded by each rank alone (a world of one): the decentralized
    replicas become their average, the error-feedback residuals are reset, and both are
    reported."""
    if comm.size == 1:
        pytest.skip("needs a second rank to save per-rank state")
    path = _shared_path(comm, tmp_path)
    a = Loop("decentralized", comm)
    a.run(4)
    a.save(path)
    mine = [p.detach().clone() for p in a.net.parameters()]
    everyone = comm.handle.allgather(mine)
    comm.Barrier()
    b = Loop("decentralized", hl.MPI_SELF)
    state = b.load(path)
    assert state.world_size == comm.size
    differ = any(not torch.equal(e[i], everyone[0][i]) for e in everyone
                 for i in range(len(mine)))  # (at 2 ranks one gossip step equalizes them)
    assert any(name.startswith("model.") for name in state.averaged) == differ
    for i, p in enumerate(b.net.parameters()):
        average = sum(e[i].double() for e in everyone) / comm.size
        assert torch.allclose(p.double(), average, atol=1e-6)
    c = Loop("topk-1%", comm)
    c.run(3)
    c.save(path)
    comm.Barrier()
    d = Loop("topk-1%", hl.MPI_SELF)
    state = d.load(path)
    assert "optimizer.engine" in state.reset
    assert all(not s for s in d.runner.optimizer.sync.codec.states.values())


def test_at_another_world_size_what_every_rank_had_alike_loads(comm, tmp_path):
    """A set of strings equal on every rank loads as it is (its pickle follows each process's
    hash seed: it was taken for per-rank and dropped), and each random generator is judged on
    its own: torch's and numpy's, seeded alike, load; only Python's, seeded per rank, is reset
    (the whole section was)."""
    import random

    if comm.size == 1:
        pytest.skip("needs a second rank to save state that differs between ranks")
    path = _shared_path(comm, tmp_path)
    net = mlp([4, 3])
    tags = {f"tag{i}" for i in range(12)}
    torch.manual_seed(5)
    np.random.seed(5)  # noqa: NPY002 (the global stream is what a checkpoint saves)
    random.seed(comm.rank)
    checkpoint.save(path, net, comm=comm, tags=tags)
    expected = (torch.rand(3), np.random.rand(3))  # noqa: NPY002
    comm.Barrier()
    torch.manual_seed(99)
    np.random.seed(99)  # noqa: NPY002
    state = checkpoint.load(path, mlp([4, 3]), comm=hl.MPI_SELF)
    assert state["tags"] == tags
    assert state.reset == ["rng.python"]
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])  # noqa: NPY002


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _with_index(raw: bytes) -> bytes:
    """A file with heatlike's header and trailer around the index ``raw``, its checksum right."""
    return checkpoint.MAGIC + raw + len(raw).to_bytes(8, "little") + \
        hashlib.sha256(raw).digest() + checkpoint.END


def _with_world_size(good: bytes, size: int) -> bytes:
    """``good`` with its index rewritten (checksum right) to claim ``size`` ranks."""
    import json

    tail = good[-(8 + 32 + len(checkpoint.END)):]
    length = int.from_bytes(tail[:8], "little")
    start = len(good) - len(tail) - length
    index = json.loads(good[start:start + length])
    index["world_size"] = size
    raw = json.dumps(index).encode()
    return good[:start] + raw + len(raw).to_bytes(8, "little") + hashlib.sha256(raw).digest() + \
        checkpoint.END


def test_damaged_files_are_rejected_on_every_rank(comm, tmp_path):
    path = _shared_path(comm, tmp_path)
    loop = Loop("allreduce", comm)
    loop.run(2)
    loop.save(path)
    good = path.read_bytes()
    damaged = {
        "truncated": good[: len(good) // 2],
        "flipped": good[:200] + bytes([good[200] ^ 0xFF]) + good[201:],
        "empty": b"",
        "not a checkpoint": b"PK\x03\x04" + good[4:],
        "index flipped": good[:-60] + bytes([good[-60] ^ 1]) + good[-59:],
        # indexes whose checksum matches but whose shape is not heatlike's
        "index a list": _with_index(b"[1, 2]"),
        "index without segments": _with_index(b'{"format": 1, "world_size": 1}'),
        "index with bad segments": _with_index(
            b'{"format": 1, "world_size": 1, "segments": {"shared": [1, 2]}}'),
        # intact segments, but the index claims one rank more than they hold
        "a rank's segment missing": _with_world_size(good, comm.size + 1),
    }
    fresh = Loop("allreduce", comm)
    before = _params(fresh.net)
    for what, blob in damaged.items():
        bad = _shared_path(comm, tmp_path, f"bad-{what.replace(' ', '-')}.ckpt")
        if comm.rank == 0:
            bad.write_bytes(blob)
        comm.Barrier()
        with pytest.raises(CheckpointError, match="not a complete heatlike checkpoint|format"):
            fresh.load(bad)
        assert all(torch.equal(p, q) for p, q in zip(_params(fresh.net), before)), what
    with pytest.raises(FileNotFoundError):
        fresh.load(_shared_path(comm, tmp_path, "missing.ckpt"))
    fresh.load(path)  # the intact file still loads


def test_a_failed_write_keeps_the_previous_checkpoint(comm, tmp_path, monkeypatch):
    path = _shared_path(comm, tmp_path)
    loop = Loop("allreduce", comm)
    loop.run(2)
    loop.save(path)
    first = path.read_bytes() if comm.rank == 0 else None
    saved_params = _params(loop.net)
    loop.run(2)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "replace", fail)
    with pytest.raises(RuntimeError, match="No space left on device.*previous checkpoint"):
        loop.save(path)
    monkeypatch.undo()
    if comm.rank == 0:
        assert path.read_bytes() == first
        assert sorted(os.listdir(path.parent)) == [path.name]  # no temporary file left
    fresh = Loop("allreduce", comm)
    fresh.load(path)
    assert all(torch.equal(p, q) for p, q in zip(_params(fresh.net), saved_params))


class _Payload:
    """Pickles to a call that would create a file when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["every rank", "last rank"])
def test_a_checkpoint_cannot_run_code(comm, tmp_path, monkeypatch, where):
    """save refuses a pickled object; a file holding one anyway (written without that check,
    in the shared segment or in one rank's own) raises CheckpointError on every rank and the
    object's code never runs."""
    path = _shared_path(comm, tmp_path)
    marker = _shared_path(comm, tmp_path, "pwned")
    net = torch.nn.Linear(2, 2)
    payload = _Payload(str(marker)) if where == "every rank" or comm.rank == comm.size - 1 \
        else "harmless"
    with pytest.raises(CheckpointError, match="'payload' is a test_checkpoint._Payload"):
        checkpoint.save(path, net, comm=comm, payload=payload)
    assert not path.exists()
    monkeypatch.setattr(checkpoint, "_check_storable", lambda tree: None)
    checkpoint.save(path, net, comm=comm, payload=payload)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"pickled Python object \(.*open\).*not loaded"):
        checkpoint.load(path, net, comm=comm)
    assert not marker.exists()


def test_bad_arguments_raise_on_every_rank(comm, tmp_path):
    path = _shared_path(comm, tmp_path)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        checkpoint.save(path, "not a model", comm=comm)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        checkpoint.load(path, [1, 2], comm=comm)
    net = torch.nn.Linear(3, 2)
    generator = torch.Generator().manual_seed(comm.rank)  # an extra named like the switch
    with pytest.raises(TypeError, match="rng= must be True or False.*cannot be named 'rng'"):
        checkpoint.save(path, net, comm=comm, rng=generator)
    assert not path.exists()
    with pytest.raises(TypeError, match="strict= must be True or False"):
        checkpoint.load(path, net, comm=comm, strict="yes")
    checkpoint.save(path, net, comm=comm)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        checkpoint.load(path, net, torch.optim.SGD(net.parameters(), lr=0.1), comm=comm)
    with pytest.raises(CheckpointError, match="no state for 'loader'"):
        checkpoint.load(path, net, comm=comm, loader=DataLoader(torch.zeros(8, 2), 2,
                                                                comm=comm))
    other = torch.nn.Linear(4, 2)
    before = _params(other)
    with pytest.raises(CheckpointError, match="does not fit the model.*weight"):
        checkpoint.load(path, other, comm=comm)
    assert all(torch.equal(p, q) for p, q in zip(_params(other), before))


# -- a failed load changes nothing ----------------------------------------------------------------

def _same(a, b) -> bool:
    """Equal trees: tensors bit for bit (and dtype), numpy arrays, containers, plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _everything(model, optimizer=None, *objects) -> dict:
    """A copy of every piece of state a load could touch: the module's parameters and buffers,
    the wrapper's engine, the optimizer (with its engine), keyword objects, the RNGs."""
    bare = getattr(model, "module", model)
    return copy.deepcopy({
        "model": bare.state_dict(),
        "engine": model.get_extra_state() if bare is not model else None,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "objects": [o.state_dict() for o in objects],
        "rng": checkpoint.rng_state()})


class Fussy:
    """A keyword object whose load_state_dict refuses its state on the ranks given."""

    def __init__(self, refuse_on: set[int]) -> None:
        self.value = 1.5
        self.refuse_on = refuse_on

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if hl.MPI_WORLD.rank in self.refuse_on:
            raise ValueError("this state is not for me")
        self.value = state["value"]


def _saved_loop(comm, tmp_path, name: str = "allreduce-nonblocking", steps: int = 5) -> Path:
    path = _shared_path(comm, tmp_path, "source.ckpt")
    source = Loop(name, comm)
    source.run(steps)
    checkpoint.save(path, source.runner.model, source.runner.optimizer, loader=source.loader,
                    fussy=Fussy(set()), losses=source.losses)
    return path


def _mlp_optimizers(net):
    params = list(net.parameters())
    return {
        "more parameters": torch.optim.SGD([*params, torch.nn.Parameter(torch.zeros(3))],
                                           lr=0.1, momentum=0.9),
        "another class": torch.optim.Adam(params, lr=0.1),
        "parameters in another order": torch.optim.SGD(params[::-1], lr=0.1, momentum=0.9),
        "two groups": torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}],
                                      lr=0.1, momentum=0.9),
    }


MISFITS = {
    "more parameters": "parameter groups of \\[4\\] parameters in the checkpoint, \\[5\\]",
    "another class": "from a SGD optimizer, the optimizer given is a Adam",
    "parameters in another order": "'momentum_buffer' of parameter 0 has shape",
    "two groups": "\\[4\\] parameters in the checkpoint, \\[2, 2\\]",
}


@pytest.mark.parametrize("misfit", sorted(MISFITS))
def test_an_optimizer_that_does_not_fit_changes_nothing(comm, tmp_path, misfit):
    """Refused before anything is restored: the module (loaded first before) keeps its weights,
    the optimizer its state, the RNGs theirs."""
    path = _saved_loop(comm, tmp_path, "allreduce")
    net = mlp([64, 24, 10])
    optimizer = _mlp_optimizers(net)[misfit]
    x, y = _data()
    torch.nn.functional.cross_entropy(net(x[:8]), y[:8]).backward()
    optimizer.step()  # some optimizer state
    before = _everything(net, optimizer)
    with pytest.raises(CheckpointError, match=MISFITS[misfit]):
        checkpoint.load(path, net, optimizer, comm=comm)
    assert _same(_everything(net, optimizer), before)


def test_an_engine_that_does_not_fit_changes_nothing(comm, tmp_path):
    """Another wire format (bfloat16 instead of float32), then another heatlike optimizer's
    engine (top-k into PowerSGD)."""
    from heatlike.engine import Cast

    path = _saved_loop(comm, tmp_path, "allreduce")
    net = mlp([64, 24, 10])
    optimizer = hl.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1,
                                                               momentum=0.9))
    model = hl.nn.DataParallel(net, comm, optimizer=optimizer, codec=Cast(torch.bfloat16))
    before = _everything(model, optimizer)
    with pytest.raises(CheckpointError, match="codec\\) 'identity', this run uses "
                                              "'cast-bfloat16'"):
        checkpoint.load(path, model, optimizer)
    assert _same(_everything(model, optimizer), before)

    path = _saved_loop(comm, tmp_path, "topk-1%")
    other = Loop("powersgd-2", comm)
    other.run(2)
    before = _everything(other.runner.model, other.runner.optimizer, other.loader)
    with pytest.raises(CheckpointError, match="optimizer.engine.*codec"):
        other.load(path)
    assert _same(_everything(other.runner.model, other.runner.optimizer, other.loader), before)


@pytest.mark.parametrize("saved,loaded", [("allreduce", "powersgd-2"),
                                          ("powersgd-2", "allreduce"),
                                          ("topk-1%", "allreduce-nonblocking")])
def test_an_engine_of_another_object_does_not_fit(comm, tmp_path, saved, loaded):
    """DataParallel keeps its engine in the wrapper, the presets in the optimizer: a checkpoint
    of one loaded into the other is refused on every rank when the wire formats differ or the
    saved engine kept memory (residuals) that has nowhere to go (before: loaded, PowerSGD's
    residuals dropped or plain DataParallel's run continued as PowerSGD)."""
    path = _saved_loop(comm, tmp_path, saved)
    other = Loop(loaded, comm)
    other.run(2)
    before = _everything(other.runner.model, other.runner.optimizer, other.loader)
    with pytest.raises(CheckpointError, match="wire format|engine state"):
        other.load(path)
    assert _same(_everything(other.runner.model, other.runner.optimizer, other.loader), before)


def test_the_model_alone_loads_from_another_algorithms_checkpoint(comm, tmp_path):
    """Without an optimizer nothing of the engines is restored: PowerSGD's weights load into a
    DataParallel model (the check above is for resuming training)."""
    path = _saved_loop(comm, tmp_path, "powersgd-2")
    other = Loop("allreduce", comm)
    checkpoint.load(path, other.runner.model, comm=comm)
    twin = Loop("powersgd-2", comm)
    twin.load(path)
    for a, b in zip(other.net.parameters(), twin.net.parameters()):
        assert torch.equal(a, b)


def test_a_stateless_engine_moves_between_wrapper_and_optimizer(comm, tmp_path):
    """Plain averaging saved by DataParallel loads into CentralizedSGD (the same wire format,
    no memory): the model and the torch optimizer's state come back."""
    path = _saved_loop(comm, tmp_path, "allreduce")
    other = Loop("centralized-sgd", comm)
    other.load(path)
    twin = Loop("allreduce", comm)
    twin.load(path)
    for a, b in zip(other.runner.model.parameters(), twin.runner.model.parameters()):
        assert torch.equal(a, b)


def test_a_keyword_object_that_does_not_fit_changes_nothing(comm, tmp_path):
    """A keyword object missing from the checkpoint is refused before anything changes; a data
    loader whose load_state_dict refuses the saved state (another seed), after the model, its
    engine and the optimizer were restored: everything is put back, and the run goes on as one
    that never tried."""
    path = _saved_loop(comm, tmp_path)
    target, twin = Loop("allreduce-nonblocking", comm), Loop("allreduce-nonblocking", comm)
    target.run(3)
    twin.run(3)
    objects = (target.runner.model, target.runner.optimizer, target.loader)
    scheduler = torch.optim.lr_scheduler.StepLR(target.runner.optimizer, 2)  # (sets initial_lr)
    before = _everything(*objects)
    with pytest.raises(CheckpointError, match="no state for 'scheduler'"):
        checkpoint.load(path, *objects[:2], loader=target.loader, scheduler=scheduler)
    assert _same(_everything(*objects), before)

    other_seed = DataLoader(Dataset(*_data()), batch_size=8, seed=2, comm=comm)
    with pytest.raises(CheckpointError, match="restoring 'loader'.*seed"):
        checkpoint.load(path, *objects[:2], loader=other_seed, fussy=Fussy(set()))
    assert _same(_everything(*objects), before)
    target.run(3)
    twin.run(3)
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), twin.parameters()))


@pytest.mark.parametrize("fails", ["keyword object", "random generators"])
def test_a_load_failing_on_one_rank_is_undone_on_every_rank(comm, tmp_path, monkeypatch, fails):
    """Restoring fails on the last rank only, at a keyword object or at the RNGs (restored last),
    after the model, its engine, the optimizer and the data loader were restored everywhere:
    every rank puts every object back, raises, and continues exactly like a run that never
    loaded."""
    path = _saved_loop(comm, tmp_path)
    last = comm.size - 1
    target, twin = Loop("allreduce-nonblocking", comm), Loop("allreduce-nonblocking", comm)
    target.run(3)
    twin.run(3)
    fussy = Fussy({last} if fails == "keyword object" else set())
    objects = (target.runner.model, target.runner.optimizer, target.loader, fussy)
    before = _everything(*objects)
    if fails == "random generators":
        original, calls = checkpoint.set_rng_state, []

        def once_broken(state):
            calls.append(1)
            if comm.rank == last and len(calls) == 1:
                raise RuntimeError("the generator refused its state")
            original(state)

        monkeypatch.setattr(checkpoint, "set_rng_state", once_broken)
    where = f"on rank {last}: " if comm.size > 1 else ""
    with pytest.raises(CheckpointError, match=f"{where}restoring .* failed"):
        checkpoint.load(path, *objects[:2], loader=target.loader, fussy=fussy)
    monkeypatch.undo()
    assert _same(_everything(*objects), before)
    assert fussy.value == 1.5
    target.run(3)
    twin.run(3)
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), twin.parameters()))


def test_a_failed_load_leaves_a_running_epoch_and_the_next_one_alone(comm, tmp_path):
    """The loader is restored mid-epoch, then the load fails: the epoch being iterated goes on
    with its next batch and the following epoch starts at its first batch (a put-back loader
    once skipped the restored position at the start of the next epoch)."""
    path = _shared_path(comm, tmp_path, "loader.ckpt")
    x, y = _data()
    saved = DataLoader(Dataset(x, y), batch_size=8, seed=1, comm=comm)
    for _ in zip(range(1), saved):
        pass
    checkpoint.save(path, torch.nn.Linear(1, 1), loader=saved, fussy=Fussy(set()))

    def epochs(broken: bool) -> list[torch.Tensor]:
        loader = DataLoader(Dataset(x, y), batch_size=8, seed=1, comm=comm)
        served, it = [], iter(loader)
        served.append(next(it)[1])
        if broken:
            with pytest.raises(CheckpointError, match="restoring"):
                checkpoint.load(path, torch.nn.Linear(1, 1), loader=loader,
                                fussy=Fussy({comm.size - 1}))
        served += [b[1] for b in it] + [b[1] for b in loader]
        return served

    plain, broken = epochs(False), epochs(True)
    assert len(broken) == len(plain) == 2 * len(saved)
    assert all(torch.equal(a, b) for a, b in zip(plain, broken))


# -- pending deferred updates --------------------------------------------------------------------

def _deferred(comm):
    """A DataParallel with a non-blocking DataParallelOptimizer (SGD with momentum)."""
    net = mlp([64, 24, 10])
    inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    wrapper = hl.optim.DataParallelOptimizer(inner, blocking=False)
    model = hl.nn.DataParallel(net, comm, optimizer=wrapper)
    return net, inner, wrapper, model


def _deferred_steps(model, wrapper, first: int, last: int) -> None:
    x, y = _data()
    for i in range(first, last):
        rows = slice(16 * i + 4 * hl.MPI_WORLD.rank % 128, None)
        wrapper.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows][:4]), y[rows][:4]).backward()
        wrapper.step()  # the update is pending until the next forward


PASSED = {"DataParallel and the torch optimizer": lambda net, inner, wrapper, model: (model, inner),
          "bare module and the torch optimizer": lambda net, inner, wrapper, model: (net, inner),
          "DataParallel and its optimizer": lambda net, inner, wrapper, model: (model, wrapper)}


@pytest.mark.parametrize("passed", sorted(PASSED))
def test_save_and_load_apply_pending_updates_whatever_is_passed(comm, tmp_path, passed):
    """save() right after a deferred step() holds that step's update, whichever objects are
    passed; load() into objects that have an update pending applies it first, so it does not
    land on the loaded weights. Resumed == uninterrupted, bit for bit."""
    path = _shared_path(comm, tmp_path)
    net, inner, wrapper, model = _deferred(comm)
    _deferred_steps(model, wrapper, 0, 3)
    checkpoint.save(path, *PASSED[passed](net, inner, wrapper, model), comm=comm)
    _deferred_steps(model, wrapper, 3, 6)
    model.flush()
    expected = _params(net)

    net, inner, wrapper, model = _deferred(comm)
    _deferred_steps(model, wrapper, 10, 12)  # another run, with an update pending
    checkpoint.load(path, *PASSED[passed](net, inner, wrapper, model), comm=comm)
    _deferred_steps(model, wrapper, 3, 6)
    model.flush()
    assert all(torch.equal(p, q) for p, q in zip(_params(net), expected))


# -- what can be stored --------------------------------------------------------------------------

class Settings:
    """A keyword object whose state holds numpy values and a path."""

    def __init__(self) -> None:
        self.state = {"mean": np.float32(0.0), "table": np.zeros(3), "root": Path(".")}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _stored_values(rank: int) -> dict:
    args = argparse.Namespace(lr=0.1, data=Path("/data/digits"), layers=[64, 10],
                              sizes=np.arange(3, dtype=np.int16), name=None)
    return {
        "args": args,
        "root": Path("runs") / "a",
        "pure": PureWindowsPath("C:/data/x"),
        "posix": PurePosixPath("/x/y"),
        "best": np.float64(0.875),
        "count": np.int64(2**40 + rank),
        "flag": np.bool_(True),
        "table": np.arange(12, dtype=np.float32).reshape(3, 4) * (rank + 1),
        "wide": np.array([1, 2], dtype=">i8"),
        "empty": np.zeros((0, 3), dtype=np.uint8),
        "scalar0d": np.array(3.5),
        "complex": np.array([1 + 2j], dtype=np.complex64),
        "when": np.array(["2024-01-02T03:04"], dtype="datetime64[m]"),
        "history": [np.float32(1.5), {"dir": Path("x"), "t": (np.int8(1), "a")}],
        "ordered": OrderedDict(b=np.zeros(2), a=1),
    }


def test_numpy_paths_and_namespaces_round_trip(comm, tmp_path):
    """Values load refused before (numpy arrays and scalars, pathlib paths, argparse.Namespace,
    also nested, also different per rank, also in a keyword object's state) come back equal and
    of the same types."""
    path = _shared_path(comm, tmp_path)
    net = torch.nn.Linear(2, 2)
    values = _stored_values(comm.rank)
    settings = Settings()
    settings.state["mean"] = np.float32(comm.rank + 0.5)
    checkpoint.save(path, net, comm=comm, settings=settings, **values)
    fresh = Settings()
    loaded = checkpoint.load(path, net, comm=comm, settings=fresh)
    assert set(loaded) == set(values)
    for key, value in values.items():
        got = loaded[key]
        if isinstance(value, argparse.Namespace):
            assert type(got) is argparse.Namespace and sorted(vars(got)) == sorted(vars(value))
            assert all(_same(getattr(got, k), v) for k, v in vars(value).items()), key
        else:
            assert _same(got, value), (key, got, value)
    assert _same(fresh.state, settings.state)
    assert type(fresh.state["mean"]) is np.float32 and fresh.state["mean"] == comm.rank + 0.5


def test_expanded_and_empty_strided_tensors_round_trip(comm, tmp_path):
    """Tensors whose strides are 0 (an expanded scalar, an empty slice of one: DASO keeps an
    empty shard on a rank without a partner on every node) are saved and loaded, with their
    values, on every rank."""
    path = _shared_path(comm, tmp_path)
    net = torch.nn.Linear(2, 2)
    scalar = torch.tensor(float(comm.rank + 2))
    values = {"expanded": scalar.expand(3), "one": scalar.expand(1),
              "empty": scalar.expand(4)[2:2], "empty_2d": torch.zeros(()).expand(0, 5)}
    assert values["one"].stride() == (0,) and values["empty"].numel() == 0
    checkpoint.save(path, net, comm=comm, **values)
    loaded = checkpoint.load(path, net, comm=comm)
    for key, value in values.items():
        assert loaded[key].shape == value.shape and torch.equal(loaded[key], value), key


class Opaque:
    pass


UNSTORABLE = {
    "an object": (lambda: Opaque(), "'value' is a test_checkpoint.Opaque"),
    "a function": (lambda: (lambda: 1), "'value' is a builtins.function"),
    "a defaultdict": (lambda: collections.defaultdict(list), "collections.defaultdict"),
    "an object array": (lambda: np.array([None, 1], dtype=object), "dtype object"),
    "a structured array": (lambda: np.zeros(2, dtype=[("a", "<i4")]), "numpy array of dtype"),
    "nested": (lambda: {"a": [1, {"b": Opaque()}]}, "'value' \\(at a.1.b\\)"),
    "a reserved key": (lambda: {"__heatlike_type__": 1}, "reserve"),
    "a tensor holding a function": (lambda: _tagged(len), "'value' \\(at tag\\) is a builtins"),
    "a sparse tensor": (lambda: torch.ones(2).to_sparse(), "layout torch.sparse_coo"),
    "a meta tensor": (lambda: torch.empty(2, device="meta"), "on meta"),
}


def _tagged(value) -> torch.Tensor:
    """A tensor with a Python attribute (torch.save pickles it with the tensor)."""
    t = torch.ones(3)
    t.tag = value
    return t


def test_a_tensor_s_storable_attributes_round_trip(comm, tmp_path):
    path = _shared_path(comm, tmp_path)
    net = torch.nn.Linear(2, 2)
    checkpoint.save(path, net, comm=comm, value=_tagged({"name": "x", "n": 3}))
    assert checkpoint.load(path, net, comm=comm)["value"].tag == {"name": "x", "n": 3}


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
def test_values_a_checkpoint_cannot_hold_are_refused_at_save(comm, tmp_path, kind):
    """Refused on every rank, naming the value, before anything is written (the previous
    checkpoint stays; no temporary file)."""
    make, says = UNSTORABLE[kind]
    path = _shared_path(comm, tmp_path)
    net = torch.nn.Linear(2, 2)
    checkpoint.save(path, net, comm=comm, value=1)
    first = path.read_bytes() if comm.rank == 0 else None
    with pytest.raises(CheckpointError, match=says):
        checkpoint.save(path, net, comm=comm, value=make())
    if comm.rank == 0:
        assert path.read_bytes() == first
        assert sorted(os.listdir(path.parent)) == [path.name]
    assert checkpoint.load(path, net, comm=comm)["value"] == 1


def test_a_value_refused_on_one_rank_is_refused_on_every_rank(comm, tmp_path):
    path = _shared_path(comm, tmp_path)
    last = comm.size - 1
    where = f"on rank {last}: " if comm.size > 1 else ""
    with pytest.raises(CheckpointError, match=f"^{where}checkpoint.save: the extra value 'v'"):
        checkpoint.save(path, torch.nn.Linear(2, 2), comm=comm,
                        v=Opaque() if comm.rank == last else 1)
    assert not path.exists()


def test_temporary_files_of_killed_saves_are_removed(comm, tmp_path):
    """A save killed outright (SIGKILL) leaves its temporary file; the next save of the same
    path removes it (and only its own: other checkpoints' files stay)."""
    path = _shared_path(comm, tmp_path)
    stale = path.parent / f".{path.name}.k2j4h5g6.tmp"
    other = path.parent / ".other.ckpt.k2j4h5g6.tmp"
    if comm.rank == 0:
        stale.write_bytes(b"half a checkpoint")
        other.write_bytes(b"someone else's")
    comm.Barrier()
    checkpoint.save(path, torch.nn.Linear(2, 2), comm=comm)
    if comm.rank == 0:
        assert not stale.exists() and other.exists()


def test_a_checkpoint_gets_the_permissions_of_a_file_created_as_usual(comm, tmp_path):
    """A new checkpoint gets 0o666 less the umask (as open() would give it, not the 0o600 of
    the temporary file it is written to); one that replaces another keeps the old one's mode, so
    a checkpoint shared with an evaluation job under another account stays readable."""
    path = _shared_path(comm, tmp_path)
    mask = os.umask(0o027)
    try:
        checkpoint.save(path, torch.nn.Linear(2, 2), comm=comm)
        if comm.rank == 0:
            assert path.stat().st_mode & 0o777 == 0o640
            os.chmod(path, 0o644)
        comm.Barrier()
        checkpoint.save(path, torch.nn.Linear(2, 2), comm=comm)
        if comm.rank == 0:
            assert path.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)
    comm.Barrier()
