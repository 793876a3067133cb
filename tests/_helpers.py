"""Shared test helpers: per-rank data every rank can recompute, buffer layouts, numpy references."""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from mpi4py import MPI

SENTINEL = 77

NUMPY_OF = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}

# numpy reference of each predefined op; logical ops on integers give 0/1 like MPI
REFERENCE_OPS = {
    "SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
    "LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor,
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}
MPI_OPS = {name: getattr(MPI, name) for name in REFERENCE_OPS}

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.int32, torch.int64, torch.uint8)
VALID_OPS = {
    "SUM": (*FLOATS, *INTS, torch.complex64),
    "PROD": (*FLOATS, *INTS, torch.complex64),
    "MIN": (*FLOATS, *INTS),
    "MAX": (*FLOATS, *INTS),
    "LAND": (*INTS, torch.bool),
    "LOR": (*INTS, torch.bool),
    "LXOR": (*INTS, torch.bool),
    "BAND": INTS,
    "BOR": INTS,
    "BXOR": INTS,
}


def rank_data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, op: str = "SUM",
              seed: int = 0) -> torch.Tensor:
    """Deterministic data of ``rank``. Integer-valued so that every reduction is exact in every
    dtype and order: products of up to 4 ranks stay below 2**8 in magnitude."""
    rng = np.random.default_rng([seed, rank, len(shape), *shape])
    if dtype is torch.bool:
        return torch.from_numpy(rng.integers(0, 2, shape).astype(bool))
    if dtype is torch.uint8:
        low, high = (1, 4) if op == "PROD" else (0, 50)
    elif op == "PROD":
        low, high = -3, 4
    else:
        low, high = -20, 21
    values = rng.integers(low, high, shape)
    if dtype.is_complex:
        values = values + 1j * rng.integers(-3, 4, shape)
        return torch.from_numpy(values.astype(NUMPY_OF[dtype]))
    return torch.from_numpy(values.astype(np.float64)).to(dtype)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy copy of a tensor (bfloat16 via float32, exact for the test values)."""
    t = t.detach().cpu()
    if t.dtype is torch.bfloat16:
        return t.float().numpy()
    return t.numpy().copy()


def reduce_reference(arrays: list[np.ndarray], op: str, dtype: torch.dtype) -> np.ndarray:
    out = functools.reduce(REFERENCE_OPS[op], arrays)
    return out.astype(arrays[0].dtype)


def layouts(dtype: torch.dtype, rank2: bool = True) -> list[str]:
    """Names of the buffer layouts a test should try for ``dtype``."""
    names = ["contiguous", "offset", "strided"]
    if rank2:
        names.append("transposed")
    if dtype in NUMPY_OF:
        names += ["numpy", "numpy-reversed"]
    return names


def make_buffer(values: torch.Tensor, layout: str):
    """A buffer with ``values`` in ``layout``; returns (buffer, base), ``base`` holding memory
    around the view (filled with SENTINEL) that must never change."""
    shape, dtype = tuple(values.shape), values.dtype
    n = values.numel()
    if layout == "contiguous":
        return values.clone(), None
    if layout == "offset":
        base = torch.full((n + 3,), SENTINEL, dtype=dtype)
        view = base[3:].view(shape)
        view.copy_(values)
        return view, base
    if layout == "strided":  # every other element of a larger buffer: gaps the view must not touch
        if len(shape) == 1:
            base = torch.full((2 * n + 1,), SENTINEL, dtype=dtype)
            view = base[1::2]
        else:
            assert len(shape) == 2
            base = torch.full((shape[0], 2 * shape[1]), SENTINEL, dtype=dtype)
            view = base[:, ::2]
        view.copy_(values)
        return view, base
    if layout == "transposed":
        assert len(shape) == 2
        base = torch.full((shape[1], shape[0]), SENTINEL, dtype=dtype)
        view = base.t()
        view.copy_(values)
        return view, base
    if layout == "numpy":
        return to_numpy(values), None
    if layout == "numpy-reversed":
        arr = np.ascontiguousarray(to_numpy(values)[::-1])[::-1]
        assert arr.size < 2 or any(s < 0 for s in arr.strides)
        return arr, None
    raise ValueError(layout)


def read_back(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return np.array(buf)
    return to_numpy(buf)


def gaps_intact(buf, base) -> bool:
    """Whether every element of ``base`` outside the view ``buf`` still holds SENTINEL."""
    if base is None:
        return True
    mask = torch.ones(base.shape, dtype=torch.bool)
    offset = buf.storage_offset() - base.storage_offset()
    view_mask = mask.as_strided(buf.shape, buf.stride(), offset)
    view_mask.fill_(False)
    sentinel = torch.tensor(SENTINEL).to(base.dtype)
    return bool((base[mask] == sentinel).all())


def tensor_identity(t) -> tuple:
    """What must not change about a caller's tensor object (Heat replaced storages with set_)."""
    if isinstance(t, np.ndarray):
        return (t.__array_interface__["data"][0], t.strides, t.shape)
    return (t.data_ptr(), t.stride(), t.storage_offset(), tuple(t.shape))


class SparseEmbedding(torch.nn.Module):
    """An embedding table with sparse gradients (``nn.Embedding(sparse=True)``) read at indices
    taken from float features, and a linear head: ``(n, f)`` floats -> ``(n, classes)``."""

    def __init__(self, rows: int, width: int, classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rows = rows
        self.table = torch.nn.Embedding(rows, width, sparse=True)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x, y=None):
        return self.head(self.table((x.abs() * 7).long().clamp(max=self.rows - 1)).mean(1))


def rank_order_sum(comm, x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks in rank order, float16/bfloat16 accumulated in float32 and
    rounded once (what the node-local sum defines)."""
    rows = torch.empty((comm.size, *x.shape), dtype=x.dtype)
    comm.Allgather(x, rows)
    acc = rows[0].float() if x.dtype in (torch.float16, torch.bfloat16) else rows[0].clone()
    for row in rows[1:]:
        acc += row
    return acc.to(x.dtype)


def train_small_mlp(comm, blocking: bool, scope) -> list[torch.Tensor]:
    """Four DataParallel steps of a 12-32-4 MLP in three gradient buckets inside ``scope`` (a
    context manager: how buffers travel), on rank-specific data; the parameters after them."""
    import heatlike as hl

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with scope:
        opt = hl.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                             blocking=blocking)
        model = hl.nn.DataParallel(net, comm, opt, bucket_cap_mb=600 / 2 ** 20,
                                   first_bucket_mb=600 / 2 ** 20)  # 3 buckets
        assert len(model.grad_sync.buckets) == 3
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(4):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        model(x)  # applies the last deferred update in non-blocking mode
        model.close()
    return [p.detach().clone() for p in net.parameters()]


def raises_on_every_rank(comm, kinds, fn, match: str = "") -> None:
    """``fn()`` raises one of ``kinds`` with ``match`` in its message on this rank, and on every
    other rank too (checked after the call, so every rank reaches the check)."""
    try:
        fn()
    except kinds as error:
        assert match in str(error), str(error)
        raised = 1
    else:
        raised = 0
    assert comm.allreduce(raised, op=MPI.MIN) == 1


def close_daso_objects_built(monkeypatch):
    """Generator for an autouse fixture: every DASO and DataParallelMultiGPU built until it
    resumes is closed then (collective over its communicator; each rank closes those it built,
    in reverse order), freeing its communicators: a dropped one cannot free them, and MPI has
    room for a couple of thousand per process."""
    from heatlike.nn import DataParallelMultiGPU
    from heatlike.optim import DASO

    made = []

    def recorded(cls):
        build = cls.__init__

        def init(self, *args, **kwargs):
            build(self, *args, **kwargs)
            made.append(self)
        monkeypatch.setattr(cls, "__init__", init)

    recorded(DASO)
    recorded(DataParallelMultiGPU)
    yield
    for obj in reversed(made):
        obj.close()


class DynamoLog(logging.Handler):
    """``with DynamoLog("guards") as lines:``: the lines dynamo logs to one of its artifacts
    (``guards``, ``recompiles``: ``torch._logging.set_logs``) while the block runs."""

    def __init__(self, artifact: str) -> None:
        super().__init__()
        self.artifact = artifact
        self.logger = logging.getLogger(f"torch._dynamo.guards.__{artifact}")

    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        torch._logging.set_logs(**{self.artifact: True})
        self.logger.addHandler(self)
        return self.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        torch._logging.set_logs()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())


def sweep_case(comm, kept: bool) -> None:
    """In a sweep over what each rank computes (layer kinds, ways to compile, models) rather
    than over what the ranks exchange, skip the cases not ``kept`` beyond two ranks: the whole
    sweep runs at one and two ranks, its kept cases at every size and on every layout of
    nodes, so that every test function still runs everywhere and ``make test`` stays within
    its time on two cores."""
    import pytest

    if comm.size > 2 and not kept:
        pytest.skip("a case of a sweep over local work: whole at 1 and 2 ranks "
                    "(tests/_helpers.py sweep_case)")
