"""heatlike.utils.checkpoint: exact resume, per-rank state, integrity, safe loading.

Exactness: run A trains k steps, saves, trains k more; run B is built from scratch (new model,
optimizer, loader), loads the checkpoint and trains k steps. On every rank B's parameters must
equal A's bit for bit. (tests/test_resume.py repeats this across separate processes.)
"""

import os
from pathlib import Path

import pytest
import torch

import heatlike as hl
from heatlike.bench.workloads import load_digits_split, make_runner, mlp
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


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


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


def test_a_checkpoint_cannot_run_code(comm, tmp_path):
    path = _shared_path(comm, tmp_path)
    marker = _shared_path(comm, tmp_path, "pwned")
    net = torch.nn.Linear(2, 2)
    checkpoint.save(path, net, comm=comm, payload=_Payload(str(marker)))
    with pytest.raises(RuntimeError, match="[Ww]eights only load failed|Unsupported"):
        checkpoint.load(path, net, comm=comm)
    assert not marker.exists()


def test_bad_arguments_raise_on_every_rank(comm, tmp_path):
    path = _shared_path(comm, tmp_path)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        checkpoint.save(path, "not a model", comm=comm)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        checkpoint.load(path, [1, 2], comm=comm)
    net = torch.nn.Linear(3, 2)
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
