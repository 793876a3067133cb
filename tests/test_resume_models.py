"""Exact resume for every kind of layer and every algorithm: train, save a checkpoint mid-run,
train on; then build everything afresh (other initial weights), load the checkpoint and train the
same steps. The parameters must equal the uninterrupted run's bit for bit, on every rank.

Conv layers produce their gradients in another order than the reverse of registration, which is
what once made a saved bucket plan impossible to load; BatchNorm adds buffers, Embedding integer
inputs, a transformer block attention and LayerNorm, tied weights a parameter shared by two
modules, frozen parameters a model whose trainable set is a subset, dropout the random stream a
checkpoint restores."""

from __future__ import annotations

import pytest
import torch
from _helpers import sweep_case
from torch import nn

import heatlike as hl
from heatlike import recipes
from heatlike.recipes import make_runner
from heatlike.utils import checkpoint

CLASSES = 3


class _Tied(nn.Module):
    """An encoder and a decoder sharing one weight (as language models tie embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.dec = nn.Linear(6, 8)
        self.dec.weight = nn.Parameter(self.enc.weight.t().contiguous())
        self.enc.weight = self.dec.weight  # the same Parameter, used transposed by enc
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = torch.relu(self.mid(x @ self.enc.weight))
        return self.head(self.dec(h))


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(dim=1))


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        return self.head(self.embed(x).mean(dim=1))


def _frozen() -> nn.Module:
    net = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                        nn.Linear(12, CLASSES))
    net[0].requires_grad_(False)
    return net


# name -> (model factory, input shape per sample, integer input range or None)
MODELS = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(24, CLASSES)), (2, 8), None),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(),
                                     nn.Linear(144, CLASSES)), (1, 8, 8), None),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(1, 2, 3), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(54, CLASSES)), (1, 5, 5, 5), None),
    "batchnorm": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                        nn.Flatten(), nn.Linear(144, CLASSES)), (1, 8, 8), None),
    "embedding": (_Embedding, (5,), 20),
    "layernorm": (lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(),
                                        nn.Linear(16, CLASSES)), (8,), None),
    "transformer": (_Transformer, (4, 8), None),
    "tied": (_Tied, (8,), None),
    "frozen": (_frozen, (8,), None),
    "dropout": (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5),
                                      nn.Linear(16, CLASSES)), (8,), None),
}

STEPS, SAVE_AT, PER_EPOCH, BATCH = 8, 5, 4, 4


@pytest.fixture(autouse=True)
def _short_compression_warmup(monkeypatch):
    """"topk-1%" and "powersgd-2" average exactly in their first recipes.COMPRESSION_WARMUP
    steps; 2 here, so that the save at SAVE_AT falls in the compressed phase."""
    monkeypatch.setattr(recipes, "COMPRESSION_WARMUP", 2)


def _batch(model: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, shape, vocab = MODELS[model]
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (BATCH, *shape), generator=g) if vocab else \
        torch.randn(BATCH, *shape, generator=g)
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def _runner(model: str, algorithm: str, comm, seed: int):
    torch.manual_seed(seed)
    net = MODELS[model][0]()
    return net, make_runner(algorithm, net, comm, lr=0.05, epochs=3)


def _train(runner, model: str, comm, steps: range, path=None) -> None:
    for step in steps:
        if step % PER_EPOCH == 0 or step == steps.start:  # a resumed run enters mid-epoch
            runner.start_epoch(PER_EPOCH)
        runner.train_step(*_batch(model, step, comm.rank))
        if (step + 1) % PER_EPOCH == 0:
            runner.end_epoch(1.0 / (step + 1))
        if path is not None and step + 1 == SAVE_AT:
            checkpoint.save(path, runner.model, runner.optimizer, step=step + 1)


def _resumes_exactly(tmp_path, model: str, algorithm: str) -> None:
    comm = hl.MPI_WORLD
    path = tmp_path / f"{model}-{algorithm}.ckpt"
    if comm.size > 1:  # every rank writes to rank 0's path
        path = type(path)(comm.handle.bcast(str(path), root=0))
    net, runner = _runner(model, algorithm, comm, seed=0)
    _train(runner, model, comm, range(STEPS), path)
    runner.finish()
    straight = [p.detach().clone() for p in net.state_dict().values()]

    net, runner = _runner(model, algorithm, comm, seed=1)
    state = checkpoint.load(path, runner.model, runner.optimizer)
    assert state["step"] == SAVE_AT
    _train(runner, model, comm, range(SAVE_AT, STEPS))
    runner.finish()
    resumed = list(net.state_dict().values())
    for name, a, b in zip(net.state_dict(), straight, resumed):
        assert torch.equal(a, b), f"{model}/{algorithm}: {name} differs after resume " \
                                  f"(max {(a.double() - b.double()).abs().max().item():.3g})"


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["allreduce", "allreduce-nonblocking", "daso"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_data_parallel_and_daso_resume_every_layer_kind_exactly(tmp_path, model, algorithm):
    sweep_case(hl.MPI_WORLD, model in ("batchnorm", "transformer", "tied", "frozen"))
    _resumes_exactly(tmp_path, model, algorithm)


PRESETS = ["centralized-sgd", "centralized-adam", "custom-clip", "hierarchical", "bf16",
           "fp16-optimizer", "powersgd-2", "topk-1%", "randomk-10%", "sparsified-sgd",
           "sparsified-sgd-shared", "sign", "ef-sign", "decentralized", "distopt-fused",
           "distopt-half", "distopt-partial", "distopt-sparse"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", PRESETS)
@pytest.mark.parametrize("model", ["batchnorm", "transformer", "tied"])
def test_every_preset_resumes_conv_transformer_and_tied_models_exactly(tmp_path, model,
                                                                      algorithm):
    sweep_case(hl.MPI_WORLD, model == "transformer")
    _resumes_exactly(tmp_path, model, algorithm)
