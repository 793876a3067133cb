"""Codecs and reducers of the engine, through ``exchange``, against references every rank
computes from every rank's (deterministic) data."""

import math

import pytest
import torch

import heatlike as hl
from heatlike.core._requests import Request, wait_all
from heatlike.core.buffer_pool import pool as buffer_pool
from heatlike.core.topology import NeighborGraph, Topology
from heatlike.engine import (
    AllReduce,
    Cast,
    Context,
    Gossip,
    Hierarchical,
    Identity,
    PerTensor,
    PowerSGD,
    RandomBlock,
    RandomK,
    ScaledSign,
    Sign,
    Threshold,
    TopK,
    Warmup,
    exchange,
)
from heatlike.engine.codecs import (
    _bits_torch,
    _pack_bits_torch,
    count_bits,
    pack_bits,
    unpack_bits,
)

pytestmark = pytest.mark.mpi


def _x(rank, n=64, step=0, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + 10 * rank + step)
    return torch.randn(n, generator=g)


def _run(codec, x, comm, reducer=None, key=0, step=0, shapes=None):
    reducer = reducer or AllReduce(comm, op="sum")
    ctx = Context(key=key, shapes=shapes or [x.shape], size=comm.size, rank=comm.rank,
                  step=step, state=codec.state_for(key))
    Request(exchange(x, codec, reducer, ctx)).Wait()
    return x


def _sum_of(tensors):
    return torch.stack(tensors).sum(0)


def test_identity_and_cast(comm):
    xs = [_x(r) for r in range(comm.size)]
    assert torch.allclose(_run(Identity(), xs[comm.rank].clone(), comm), _sum_of(xs), atol=1e-5)
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 3e-3)):
        got = _run(Cast(dtype), xs[comm.rank].clone(), comm)
        expected = _sum_of([x.to(dtype).float() for x in xs]).to(dtype).float()
        assert torch.allclose(got, expected, atol=tol), dtype


@pytest.mark.parametrize("make", [lambda: TopK(k=5), lambda: TopK(ratio=0.1),
                                  lambda: Threshold(1.0), lambda: RandomK(k=7),
                                  lambda: RandomK(k=7, shared=False), lambda: RandomBlock(k=9),
                                  lambda: RandomBlock(ratio=0.2, shared=False)],
                         ids=["topk-k", "topk-ratio", "threshold", "randomk", "randomk-own",
                              "randomblock", "randomblock-own"])
def test_sparsifiers_send_the_selection_and_keep_the_rest(comm, make):
    """Each rank sends exactly its selection; the decoded tensor is the sum of every rank's
    selection; sent + residual == input (error feedback loses nothing)."""
    codec = make()
    n = 64
    reducer = AllReduce(comm, op="sum")
    xs = [_x(r, n) for r in range(comm.size)]
    got = _run(codec, xs[comm.rank].clone(), comm, reducer)
    residual = codec.state_for(0)["residual"]
    sent = xs[comm.rank] - residual
    nonzero = int((sent != 0).sum())
    if isinstance(codec, TopK):
        k = 5 if codec.k else math.ceil(0.1 * n)
        assert nonzero == k
        assert reducer.bytes_sent == k * 4 + k * 4  # int32 index + float32 value
        kept = torch.topk(xs[comm.rank].abs(), k).values.min()
        assert bool((sent[sent != 0].abs() >= kept).all())
    elif isinstance(codec, Threshold):
        assert bool((sent[sent != 0].abs() >= 1.0).all())
        assert bool((residual.abs() < 1.0).all())
    else:
        k = codec.k or math.ceil(codec.ratio * n)
        assert nonzero == k
        # + one float32: the non-finite marker
        assert reducer.bytes_sent == (k * 4 if codec.shared else k * 8) + 4
    everyone = torch.empty(comm.size * n)
    comm.Allgather(sent, everyone)
    assert torch.allclose(got, everyone.view(comm.size, n).sum(0), atol=1e-5)
    if getattr(codec, "shared", False):  # the same indices on every rank
        mask = (sent != 0).float()
        masks = torch.empty(comm.size * n)
        comm.Allgather(mask, masks)
        assert bool((masks.view(comm.size, n) == mask).all())


def test_topk_picks_largest_magnitudes_below_one(comm):
    """All |x| < 1 (SINGA truncated |x| to int and picked the first k indices)."""
    x = torch.linspace(-0.9, 0.9, 50)[torch.randperm(50, generator=torch.Generator()
                                                     .manual_seed(3))]
    codec = TopK(k=4, error_feedback=True)
    _run(codec, x.clone(), hl.MPI_SELF)
    sent = x - codec.state_for(0)["residual"]
    assert set(sent.nonzero().view(-1).tolist()) == set(x.abs().topk(4).indices.tolist())


@pytest.mark.parametrize("scaled", [False, True])
def test_sign_codecs(comm, scaled):
    """Dense inputs without exact zeros: one bit per value and one float32 marker (and the scale)
    per rank; the decoded sum is the sum of the (scaled) signs."""
    xs = [_x(r, 37) for r in range(comm.size)]
    codec = ScaledSign() if scaled else Sign()
    reducer = AllReduce(comm, op="sum")
    got = _run(codec, xs[comm.rank].clone(), comm, reducer)
    signs = [torch.sign(x) for x in xs]
    if scaled:
        expected = _sum_of([x.abs().mean() * s for x, s in zip(xs, signs)])
        residual = codec.state_for(0)["residual"]
        me = xs[comm.rank]
        assert torch.allclose(residual, me - me.abs().mean() * signs[comm.rank])
        assert reducer.bytes_sent == math.ceil(37 / 8) + 4 + 4  # scale, non-finite marker
    else:
        expected = _sum_of(signs)
        assert reducer.bytes_sent == math.ceil(37 / 8) + 4
        assert torch.equal(got, expected)  # the vote is an exact count
    assert torch.allclose(got, expected, atol=1e-5)


def _with_zeros(rank: int, n: int = 37) -> torch.Tensor:
    """Rank 0 has zeros in every third entry; entry 1 is zero on every rank."""
    x = _x(rank, n, seed=5)
    if rank == 0:
        x[::3] = 0.0
    x[1] = 0.0
    return x


@pytest.mark.parametrize("scaled", [False, True])
def test_sign_of_zero_is_no_vote(comm, scaled):
    """sign(0) = 0: a rank does not vote on an entry it has no opinion on (it used to count as
    +1). When some rank has zeros every rank sends a second bit per value (nonzero or not);
    the residual of error feedback keeps the zeros' values (zero)."""
    n = 37
    xs = [_with_zeros(r, n) for r in range(comm.size)]
    codec = ScaledSign() if scaled else Sign()
    reducer = AllReduce(comm, op="sum")
    got = _run(codec, xs[comm.rank].clone(), comm, reducer)
    scales = [x.abs().mean() if scaled else torch.tensor(1.0) for x in xs]
    expected = _sum_of([s * torch.sign(x) for s, x in zip(scales, xs)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if not scaled:
        assert torch.equal(got, expected)
    assert got[1].item() == 0.0
    assert reducer.bytes_sent == 2 * math.ceil(n / 8) + 4 + (4 if scaled else 0)
    if scaled:
        me = xs[comm.rank]
        torch.testing.assert_close(codec.state_for(0)["residual"],
                                   me - scales[comm.rank] * torch.sign(me))


_MEMORY_CODECS = {
    "topk": lambda: TopK(k=2), "threshold": lambda: Threshold(0.5),
    "randomk": lambda: RandomK(k=2), "randomk-own": lambda: RandomK(k=2, shared=False),
    "randomblock": lambda: RandomBlock(k=2), "scaled-sign": ScaledSign,
    "sign-ef": lambda: Sign(error_feedback=True), "powersgd": lambda: PowerSGD(1),
    "powersgd-reuse": lambda: PowerSGD(1, reuse_query=True, error_feedback=False),
    "per-tensor-powersgd-reuse": lambda: PerTensor(PowerSGD(1, reuse_query=True)),
}


@pytest.mark.parametrize("make", _MEMORY_CODECS.values(), ids=_MEMORY_CODECS.keys())
def test_a_non_finite_input_leaves_no_memory_behind(comm, make):
    """An infinity in one rank's input (an overflow GradScaler skips) shows in that exchange's
    result on every rank and leaves no non-finite residual or warm start: the next exchanges
    are finite again (a residual of inf - inf = NaN made every later one NaN)."""
    codec = make()
    for step in range(3):
        x = _x(comm.rank, n=16, step=step)
        if step == 0 and comm.rank == comm.size - 1:
            x[3] = float("inf")
        out = _run(codec, x, comm, step=step, shapes=[torch.Size([4, 4])])
        assert bool(torch.isfinite(out).all()) == (step > 0), f"step {step}: {out}"

    def tensors(state):
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, dict):
                yield from tensors(v)

    assert all(bool(torch.isfinite(t).all()) for t in tensors(codec.state_for(0)))


def test_clipped_keeps_infinities(comm):
    """Clipped clamps finite values only: an infinity stays one (clamped to the limit, as SINGA
    did, an overflow passed unseen by GradScaler and check_finite)."""
    from heatlike.engine.codecs import Clipped

    for codec in (Clipped(Identity(), 1.0), Clipped(Cast(torch.float16), 100.0),
                  Clipped(TopK(k=2), 1.0)):
        x = _x(comm.rank, n=8) * 10
        if comm.rank == comm.size - 1:
            x[5] = float("-inf")
        codec.pre(x)
        out = _run(codec, x, comm)
        assert not bool(torch.isfinite(out).all()), codec.name
        assert float(out[5]) == float("-inf") or bool(torch.isnan(out).any()), codec.name
        finite = torch.isfinite(out)
        assert bool((out[finite].abs() <= 1.0 * comm.size + 1e-6).all()) or \
            isinstance(codec.inner, Cast), codec.name


def test_scaled_sign_keeps_exactly_what_it_does_not_send_in_float64():
    """The scale travels as float32; the residual is made with that same rounded scale, so
    input + old residual = what was sent + new residual to float64's rounding (the float64
    scale in the residual lost 1e-8 a step)."""
    comm = hl.MPI_WORLD.Split(hl.MPI_WORLD.rank)  # (one rank: the identity is this rank's)
    codec = ScaledSign()
    residual = torch.zeros(33, dtype=torch.float64)
    for step in range(3):
        x = _x(0, n=33, step=step).double() / 3
        total = x + residual
        out = _run(codec, x, comm, step=step)
        residual = codec.state_for(0)["residual"]
        assert float((out + residual - total).abs().max()) < 1e-15, f"step {step}"


def test_scaled_signs_of_large_half_precision_values(comm):
    """Each decoded term is exactly +-s_r (no intermediate 2 s_r, which overflows float16 above
    32752): float16 inputs of magnitude 40000 decode to the sum of the scaled signs."""
    xs = [torch.tensor([4e4, -4e4, 4e4, -4e4], dtype=torch.float16) * (1 if r % 2 else -1)
          for r in range(comm.size)]
    got = _run(ScaledSign(error_feedback=False), xs[comm.rank].clone(), comm)
    expected = _sum_of([x.float().abs().mean() * torch.sign(x.float()) for x in xs])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, rtol=1e-3, atol=0)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 1003])
def test_bit_packing_roundtrip(n):
    """Host tensors are packed by numpy: the same bytes as the formula device tensors use (most
    significant bit first, the last byte padded with zeros), and back; count_bits counts the set
    bits of several vectors per entry."""
    g = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=g) > 0.5
    packed = pack_bits(bits)
    assert packed.numel() == math.ceil(n / 8) and packed.dtype == torch.uint8
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8)
    padded[:n] = bits
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    assert torch.equal(packed, (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8))
    assert torch.equal(unpack_bits(packed, n), bits)
    # the torch operations device tensors take, run on the host: the same bytes and bits
    assert torch.equal(_pack_bits_torch(bits), packed)
    assert torch.equal(_bits_torch(packed, n), bits.to(torch.uint8))
    more = [torch.rand(n, generator=g) > 0.3 for _ in range(3)]
    counts = count_bits([pack_bits(b) for b in [bits, *more]], n, torch.device("cpu"))
    assert counts.dtype == torch.int32
    assert torch.equal(counts, sum(b.to(torch.int32) for b in [bits, *more]))


@pytest.mark.parametrize("reuse", [False, True])
def test_powersgd_full_rank_is_exact(comm, reuse):
    """rank >= min(n, m): the decoded sum equals the exact sum; 1-D tensors pass untouched."""
    shapes = [torch.Size([6, 4]), torch.Size([5]), torch.Size([3, 2, 2])]
    n = sum(math.prod(s) for s in shapes)
    xs = [_x(r, n, seed=5) for r in range(comm.size)]
    codec = PowerSGD(rank=4, reuse_query=reuse)
    got = _run(codec, xs[comm.rank].clone(), comm, shapes=shapes)
    assert torch.allclose(got, _sum_of(xs), atol=1e-4)
    # each rank keeps what the shared basis misses of its own matrix; together nothing
    residual = codec.state_for(0)["residual"]
    total = residual.clone()
    comm.Allreduce(hl.IN_PLACE, total)
    assert torch.allclose(total, torch.zeros(n), atol=1e-4)


def test_powersgd_warm_start_after_an_all_zero_matrix_is_drawn_afresh(comm):
    """With ``reuse_query`` a matrix that is zero on every rank (no error feedback) leaves
    Q = 0: the next step would compress onto whatever basis QR makes of zeros. A zero warm
    start is replaced by a fresh query, so the step after approximates as a first step does."""
    shapes = [torch.Size([16, 12])]
    codec = PowerSGD(rank=2, reuse_query=True, error_feedback=False)
    _run(codec, torch.zeros(192), comm, shapes=shapes, step=0)
    assert not codec.state_for(0)["Q"][0].any()
    xs = [_x(r, 192, seed=3) for r in range(comm.size)]
    got = _run(codec, xs[comm.rank].clone(), comm, shapes=shapes, step=1)
    fresh = _run(PowerSGD(rank=2, reuse_query=True, error_feedback=False),
                 xs[comm.rank].clone(), comm, shapes=shapes, step=1)
    torch.testing.assert_close(got, fresh)
    assert codec.state_for(0)["Q"][0].any()


@pytest.mark.parametrize("rank", [1, 2, 8, 9])
def test_powersgd_follows_its_formula_on_large_and_small_matrices(comm, rank):
    """The docstring's formula with plain matrix products, every rank's data known to every
    rank: the decoded sum P Q^T and this rank's residual M_r - P Q_r^T. The 1024 x 512 matrix
    takes the CPU's broadcast products up to 8 columns, the small one the matrix products."""
    shapes = [torch.Size([1024, 512]), torch.Size([7]), torch.Size([20, 3, 3])]
    n = sum(math.prod(s) for s in shapes)
    xs = [_x(r, n, seed=11) for r in range(comm.size)]
    codec = PowerSGD(rank=rank)
    got = _run(codec, xs[comm.rank].clone(), comm, shapes=shapes, step=3)
    residual = codec.state_for(0)["residual"]
    ctx = Context(key=0, shapes=shapes, size=comm.size, rank=comm.rank, step=3)
    offset = 0
    for i, shape in enumerate(shapes):
        size = math.prod(shape)
        piece = slice(offset, offset + size)
        offset += size
        if len(shape) == 1:
            torch.testing.assert_close(got[piece], _sum_of([x[piece] for x in xs]))
            assert torch.equal(residual[piece], torch.zeros(size))
            continue
        ms = [x[piece].view(shape[0], -1).double() for x in xs]
        r = min(rank, *ms[0].shape)
        q = torch.randn(ms[0].shape[1], r, generator=ctx.generator(salt=i)).double()
        p = torch.linalg.qr(sum(m @ q for m in ms), mode="reduced").Q
        q_each = [m.t() @ p for m in ms]
        expected = p @ sum(q_each).t()
        torch.testing.assert_close(got[piece].view(expected.shape).double(), expected,
                                   rtol=1e-4, atol=1e-4)
        mine = ms[comm.rank] - p @ q_each[comm.rank].t()
        torch.testing.assert_close(residual[piece].view(mine.shape).double(), mine,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=1), lambda: PowerSGD(rank=2,
                                                                              reuse_query=True),
                                  lambda: TopK(k=3), lambda: RandomK(k=4), lambda: ScaledSign()],
                         ids=["powersgd-1", "powersgd-2-warm", "topk", "randomk", "ef-sign"])
def test_error_feedback_tracks_the_true_sum(comm, make):
    """With a fixed gradient per rank, sum_t (applied update) = T * mean gradient - mean
    residual: the compression error does not accumulate."""
    shapes = [torch.Size([8, 5]), torch.Size([4])]
    n = 44
    codec = make()
    grads = [_x(r, n, seed=9) for r in range(comm.size)]
    mean = _sum_of(grads) / comm.size
    applied = torch.zeros(n)
    T = 40
    for t in range(T):
        out = _run(codec, grads[comm.rank].clone(), comm, AllReduce(comm), step=t, shapes=shapes)
        applied += out
    residual = codec.state_for(0)["residual"]
    everyone = torch.empty(comm.size * n)
    comm.Allgather(residual, everyone)
    mean_residual = everyone.view(comm.size, n).mean(0)
    assert torch.allclose(applied, T * mean - mean_residual, atol=1e-3)
    assert (applied / T - mean).norm() < 0.25 * mean.norm()


@pytest.mark.parametrize("make", [lambda: TopK(k=3), lambda: PowerSGD(rank=1, reuse_query=True),
                                  lambda: Cast(torch.bfloat16)], ids=["topk", "powersgd", "bf16"])
def test_warmup_sums_exactly_then_is_the_inner_codec_from_a_fresh_state(comm, make):
    """Warmup(c, 2): exchanges 0 and 1 give the exact sum and leave no state; from exchange 2 on
    the result equals c's, started fresh at step 2, bitwise."""
    shapes = [torch.Size([8, 5]), torch.Size([4])]
    warm, plain = Warmup(make(), 2), make()
    assert (warm.linear, warm.single_round) == (plain.linear, plain.single_round)
    for step in range(5):
        x = _x(comm.rank, 44, step=step, seed=3)
        got = _run(warm, x.clone(), comm, step=step, shapes=shapes)
        if step < 2:
            xs = [_x(r, 44, step=step, seed=3) for r in range(comm.size)]
            torch.testing.assert_close(got, _sum_of(xs), rtol=1e-6, atol=1e-5)
            assert not warm.state_for(0), warm.states
        else:
            assert torch.equal(got, _run(plain, x.clone(), comm, step=step, shapes=shapes)), step
    with pytest.raises(ValueError, match="steps"):
        Warmup(TopK(k=3), -1)
    with pytest.raises(TypeError, match="codec instance"):
        Warmup(TopK, 2)


@pytest.mark.parametrize("min_kb", ["0", "1024"], ids=["three-phases", "small-sums-flat"])
def test_hierarchical_equals_flat(comm, monkeypatch, min_kb):
    """Equal nodes (node-aware: reduce-scatter, concurrent cross all-reduces, all-gather; shards
    of every size, empty ones included) and unequal nodes (through the node leaders); sums under
    ``HEATLIKE_NODE_AWARE_MIN_KB`` take one all-reduce over the world, and nothing over the
    node-local or cross-node communicators."""
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_MIN_KB", min_kb)
    phased = []
    for per_node in (1, 2, 3):
        monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(per_node))
        topo = Topology(comm)
        try:
            for n in (1, 33):
                xs = [_x(r, n) for r in range(comm.size)]
                for op in ("avg", "max"):
                    red = Hierarchical(comm, op=op, topology=topo)
                    channel = red.open_channel()
                    for part in ("node", "cross"):
                        for c in (channel[part], getattr(topo, f"{part}_comm")):
                            for name in ("Ireduce_scatter", "Ireduce", "Iallreduce", "Ibcast",
                                         "Iallgatherv"):
                                real = getattr(c, name)
                                monkeypatch.setattr(c, name, lambda *a, real=real, **k: (
                                    phased.append(real.__name__), real(*a, **k))[1])
                    try:
                        for ch in (None, channel):
                            got = xs[comm.rank].clone()
                            Request(exchange(got, Identity(), red, Context(
                                key=0, shapes=[(n,)], size=comm.size, rank=comm.rank, step=0,
                                state={}), channel=ch)).Wait()
                            stacked = torch.stack(xs)
                            expected = stacked.mean(0) if op == "avg" else stacked.amax(0)
                            assert torch.allclose(got, expected, atol=1e-5), (per_node, n, op)
                    finally:
                        for c in channel.values():
                            c.Free()
        finally:
            topo.free()
    assert bool(phased) == (min_kb == "0" and comm.size > 1), phased


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_sums_on_equal_nodes_are_node_aware(comm, monkeypatch, dtype):
    """A half-precision Sum on a private channel over several equal nodes takes the node-aware
    route (what crosses the links is half of float32's), and equals the float32 sum of the
    half inputs within two roundings to the half type; on one node, or unequal nodes, MPI's
    route."""
    import heatlike.engine.reducers as reducers

    calls = []
    original = reducers.node_aware_sum

    def spy(*args):
        calls.append(args[0].numel())
        return (yield from original(*args))

    monkeypatch.setattr(reducers, "node_aware_sum", spy)
    n = 40_003  # above the half route's threshold, shards of unequal sizes
    for per_node in (1, 2, comm.size):
        monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(per_node))
        c = comm.Dup()
        try:
            red = AllReduce(c, op="avg")
            channel = red.open_channel()
            xs = [_x(r, n).to(dtype) for r in range(comm.size)]
            got = xs[comm.rank].clone()
            calls.clear()
            Request(exchange(got, Cast(dtype), red, Context(
                key=0, shapes=[(n,)], size=comm.size, rank=comm.rank, step=0, state={}),
                channel=channel)).Wait()
            expected = torch.stack([x.float() for x in xs]).mean(0)
            ulp = 2.0 ** -7 if dtype is torch.bfloat16 else 2.0 ** -10
            bound = 2 * ulp * torch.stack([x.float().abs() for x in xs]).sum(0) / comm.size
            assert (got.float() - expected).abs().le(bound + 1e-6).all(), per_node
            equal = comm.size % per_node == 0 and 1 < per_node < comm.size
            assert calls == ([n] if equal else []), (per_node, calls)
            for ch in (channel.values() if isinstance(channel, dict) else [channel]):
                ch.Free()
        finally:
            c.Free()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_node_aware_sum_in_chunks_equals_the_sum(comm, monkeypatch, dtype):
    """The pipelined node-aware sum on nodes of 1, 2 and all ranks (where they divide the world):
    buffers of one element, fewer elements than ranks per node, exactly one chunk, one more, and
    many chunks with a ragged last one, each equal on every rank to the sum of every rank's data
    (exact for float64 integers; within the half sum's bound for bfloat16)."""
    from heatlike.engine.reducers import node_aware_sum

    chunk_bytes = 64 * torch.empty(0, dtype=dtype).element_size()  # 64 elements a chunk
    for per_node in sorted({1, 2, comm.size}):
        if comm.size % per_node:
            continue
        monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(per_node))
        topo = Topology(comm)
        try:
            for n in (1, 3, 64, 65, 64 * 7 + 5):
                xs = [torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(
                    r * 1000 + n)).to(dtype) for r in range(comm.size)]
                got = xs[comm.rank].clone()
                Request(node_aware_sum(got, hl.MPI.SUM, topo.node_comm, topo.cross_comm,
                                       chunk_bytes=chunk_bytes)).Wait()
                expected = torch.stack([x.double() for x in xs]).sum(0)
                if dtype is torch.bfloat16:  # two roundings: the node's partial sum, the total
                    bound = 2 * 2.0 ** -7 * torch.stack([x.double().abs() for x in xs]).sum(0)
                    assert (got.double() - expected).abs().le(bound).all(), (per_node, n)
                else:
                    assert torch.equal(got.double(), expected), (per_node, n, dtype)
        finally:
            topo.free()


@pytest.mark.parametrize("setting", ["on", "off"])
def test_float_sums_on_equal_nodes_go_node_aware_from_the_threshold(comm, monkeypatch,
                                                                    setting):
    """AllReduce over several nodes of equal size (> 1 rank): float32 sums of at least
    ``HEATLIKE_NODE_AWARE_MIN_KB`` run as the node-aware sum on the channel and smaller ones as
    MPI's all-reduce; ``HEATLIKE_NODE_AWARE=0``, one node, or nodes of one rank: always MPI's.
    ``single_phase`` says which (what the engine's lanes are built from). Results equal the
    average on every rank either way."""
    import heatlike.engine.reducers as reducers

    calls = []
    original = reducers.node_aware_sum

    def spy(*args, **kwargs):
        calls.append(args[0].numel())
        return (yield from original(*args, **kwargs))

    monkeypatch.setattr(reducers, "node_aware_sum", spy)
    monkeypatch.setenv("HEATLIKE_NODE_AWARE", "1" if setting == "on" else "0")
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_MIN_KB", "4")  # 1024 float32
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_CHUNK_KB", "1")
    per_node = 2 if comm.size % 2 == 0 else comm.size
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", str(per_node))
    c = comm.Dup()
    try:
        red = AllReduce(c, op="avg")
        layered = setting == "on" and per_node == 2 and comm.size >= 4
        assert red.node_aware is layered and red.single_phase is not layered
        channel = red.open_channel()
        for n in (1023, 1024, 3000):
            xs = [_x(r, n) for r in range(comm.size)]
            got = xs[comm.rank].clone()
            calls.clear()
            Request(exchange(got, Identity(), red, Context(
                key=0, shapes=[(n,)], size=comm.size, rank=comm.rank, step=0, state={}),
                channel=channel)).Wait()
            torch.testing.assert_close(got, torch.stack(xs).mean(0), rtol=1e-6, atol=1e-6)
            assert calls == ([n] if layered and n >= 1024 else []), (n, calls)
        for ch in (channel.values() if isinstance(channel, dict) else [channel]):
            ch.Free()
    finally:
        c.Free()


def test_node_aware_settings_are_checked(monkeypatch):
    from heatlike.engine.reducers import node_aware_chunk_bytes, node_aware_min_bytes

    monkeypatch.setenv("HEATLIKE_NODE_AWARE_CHUNK_KB", "2")
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_MIN_KB", "0")
    assert node_aware_chunk_bytes() == 2048 and node_aware_min_bytes() == 0
    monkeypatch.setenv("HEATLIKE_NODE_AWARE_CHUNK_KB", "1MB")
    with pytest.raises(ValueError, match="HEATLIKE_NODE_AWARE_CHUNK_KB='1MB' is not valid"):
        node_aware_chunk_bytes()


@pytest.mark.parametrize("kind", ["ring", "torus", "exponential", "complete"])
@pytest.mark.parametrize("weights", ["metropolis", "uniform"])
def test_gossip_preserves_average_and_contracts(comm, kind, weights):
    graph = getattr(NeighborGraph, kind)(comm, weights=weights)
    regular = len({len(a) for a in graph.adjacency}) == 1
    try:
        x = _x(comm.rank, 20, seed=2)
        everyone = torch.empty(comm.size * 20)

        def stats(t):
            comm.Allgather(t, everyone)
            xs = everyone.view(comm.size, 20)
            return xs.mean(0), ((xs - xs.mean(0)) ** 2).sum(1).mean().item()

        mean0, dist0 = stats(x)
        for _ in range(5):
            _run(Identity(), x, comm, Gossip(graph))
        mean5, dist5 = stats(x)
        if weights == "metropolis" or regular:
            assert torch.allclose(mean5, mean0, atol=1e-5)
        if comm.size > 1:
            assert dist5 < dist0 * 0.9
    finally:
        graph.free()


def test_gossip_mixes_exchanges_in_flight_together_with_reused_buffers(comm):
    """Two tensors of one size mixed at once (each exchange in flight holds its own receive
    buffer), three times over (the buffers of finished mixes are reused): every result is
    ``W_ii x_i + sum_j W_ij x_j`` of the values every rank held before."""
    graph = NeighborGraph.ring(comm)
    buffer_pool.clear()
    try:
        reducer = Gossip(graph)
        xs = [_x(comm.rank, 30, seed=s) for s in (3, 4)]
        for step in range(3):
            everyone = [torch.empty(comm.size * 30) for _ in xs]
            for x, all_x in zip(xs, everyone):
                comm.Allgather(x, all_x)
            expected = []
            for all_x in everyone:
                rows = all_x.view(comm.size, 30)
                mix = graph.self_weight * rows[comm.rank]
                for w, j in zip(graph.weights, graph.neighbors):
                    mix = mix + w * rows[j]
                expected.append(mix)
            requests = [Request(exchange(x, Identity(), reducer,
                                         Context(key=k, shapes=[x.shape], size=comm.size,
                                                 rank=comm.rank, step=step)))
                        for k, x in enumerate(xs)]
            wait_all(requests)
            for x, want in zip(xs, expected):
                torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
        if comm.size > 1:  # the two receive buffers, returned after each of the 3 rounds
            nbytes = len(graph.neighbors) * 30 * 4
            assert len(buffer_pool._free[(nbytes, torch.device("cpu"), False)]) == 2
    finally:
        graph.free()


def test_graph_validation(comm):
    size, r = comm.size, comm.rank
    if size >= 3:  # asymmetric: rank 0 lists 1, but 1 does not list 0
        nbrs = [1] if r == 0 else [j for j in range(size) if j not in (r, 0)] or [2]
        with pytest.raises(ValueError, match="symmetric"):
            NeighborGraph(comm, nbrs)
    if size >= 4:  # two components: the pair {0, 1}, and a line through the other ranks
        pair = [1 - r] if r < 2 else [j for j in (r - 1, r + 1) if 2 <= j < size]
        with pytest.raises(ValueError, match="not connected"):
            NeighborGraph(comm, pair)
    with pytest.raises(ValueError, match="itself"):
        NeighborGraph(comm, [r])
    with pytest.raises(ValueError, match="not a rank"):
        NeighborGraph(comm, [size + 3])
    with pytest.raises(ValueError, match="weights"):
        NeighborGraph(comm, [], weights="random")
    if size >= 2:  # one mixing rule everywhere (before: a matrix whose columns did not sum to 1)
        ring = sorted({(r - 1) % size, (r + 1) % size})
        with pytest.raises(ValueError, match="different weights"):
            NeighborGraph(comm, ring, weights="uniform" if r == 0 else "metropolis")
    g = NeighborGraph.from_adjacency(comm, [[j for j in range(size) if j != i]
                                            for i in range(size)])
    assert g.neighbors == [j for j in range(size) if j != r]  # rank 0 included like any other
    g.free()


def test_variable_gather_and_reducer_validation(comm):
    red = AllReduce(comm, op="sum")
    parts = [torch.arange(comm.rank + 1, dtype=torch.float32)]
    result = drive_gather(red, parts)
    assert [len(x[0]) for x in result] == list(range(1, comm.size + 1))
    with pytest.raises(ValueError, match="op"):
        AllReduce(comm, op="median")
    with pytest.raises(ValueError, match="divide_before"):
        AllReduce(comm, op="sum", divide_before=True)
    with pytest.raises(ValueError, match="denom"):
        AllReduce(comm, op="custom_avg").set_denom(0)
    with pytest.raises(ValueError, match="k and ratio"):
        TopK()
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=0)


def test_fixed_gather_packs_mixed_dtypes_into_one_allgather(comm, monkeypatch):
    """Several fixed-size tensors (dtypes of 1, 2, 4, 8 and 16 bytes, odd lengths, empty, 0-d)
    travel as one all-gather and come back per rank with their dtypes, shapes and values (a
    complex128 piece after 8 bytes used to fail: pieces were padded to 8 bytes only)."""
    def parts_of(r):
        return [torch.full((2,), r + 0.25), torch.arange(3.0).to(torch.complex128) * (1 + r * 1j),
                torch.arange(3, dtype=torch.int32) + r, torch.full((5,), r + 0.5),
                torch.tensor([r % 2 == 0, True, False]), torch.zeros(0),
                torch.arange(7, dtype=torch.bfloat16) * (r + 1), torch.tensor(float(r)),
                torch.arange(4, dtype=torch.int64).view(2, 2) - r, torch.ones(3, dtype=torch.uint8)]
    calls = []
    real = type(comm).Iallgather
    monkeypatch.setattr(type(comm), "Iallgather",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    red = AllReduce(comm, op="sum")
    result = drive_gather(red, parts_of(comm.rank), variable=False)
    assert len(calls) == (1 if comm.size > 1 else 0)  # one rank: copies, no collective
    assert red.bytes_sent == sum(t.numel() * t.element_size() for t in parts_of(0))
    for r in range(comm.size):
        for got, expected in zip(result[r], parts_of(r), strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got, expected)


@pytest.mark.parametrize("make", [lambda: TopK(k=3), lambda: RandomK(k=3, shared=False),
                                  lambda: Sign(), lambda: RandomK(k=3)])
def test_bucket_flags_are_summed_exactly(comm, monkeypatch, make):
    """A bucket's use counters are summed over the ranks; with a codec whose first message is a
    gather of fixed sizes they travel in it (no all-reduce of their own)."""
    calls = {"Iallgather": 0, "Iallreduce": 0}
    for name in calls:
        real = getattr(type(comm), name)
        monkeypatch.setattr(type(comm), name, lambda self, *a, _n=name, _f=real, **k:
                            calls.__setitem__(_n, calls[_n] + 1) or _f(self, *a, **k))
    codec = make()
    flags = torch.tensor([1.0, float(comm.rank % 2), 0.0])
    reducer = AllReduce(comm, op="avg")
    ctx = Context(key=0, shapes=[torch.Size([16])], size=comm.size, rank=comm.rank,
                  state=codec.state_for(0))
    Request(exchange(_x(comm.rank, 16), codec, reducer, ctx, flags)).Wait()
    assert flags.tolist() == [comm.size, comm.size // 2, 0]
    if comm.size == 1:  # nothing to exchange
        assert calls == {"Iallgather": 0, "Iallreduce": 0}
    elif isinstance(codec, RandomK) and codec.shared:  # a sum: the flags' own all-reduce
        assert calls["Iallreduce"] == 2
    else:
        assert calls["Iallreduce"] == 0 and calls["Iallgather"] >= 1


def test_average_of_a_sparse_result_scales_only_its_support(comm):
    """AllReduce's division after a sparse codec touches only ``support`` (a slice, or indices
    that repeat) and gives what dividing the whole tensor gives."""
    red = AllReduce(comm, op="avg")
    x = torch.zeros(20)
    x[[2, 5, 11]] = torch.tensor([3.0, -6.0, 1.5])
    expected = x / comm.size
    for support in (torch.tensor([5, 2, 11, 5, 2]), slice(2, 12)):
        got = x.clone()
        red.finish(got, None, support)
        assert torch.equal(got, expected)


def test_codec_state_dict_is_a_copy(comm):
    """Codecs update their residual in place: a state taken earlier keeps its values, and
    loading it restores them."""
    codec = TopK(k=2)
    _run(codec, _x(comm.rank, 16), comm)
    state = codec.state_dict()
    saved = state["states"][0]["residual"].clone()
    _run(codec, _x(comm.rank, 16, step=1), comm)
    assert torch.equal(state["states"][0]["residual"], saved)
    assert not torch.equal(codec.state_for(0)["residual"], saved)
    codec.load_state_dict(state)
    _run(codec, _x(comm.rank, 16, step=2), comm)
    assert torch.equal(state["states"][0]["residual"], saved)


def drive_gather(reducer, tensors, variable=True):
    gen = reducer.gather(tensors, variable=variable)
    try:
        while True:
            next(gen).Wait()
    except StopIteration as stop:
        return stop.value


def test_codec_state_round_trip(comm):
    codec = PowerSGD(rank=1, reuse_query=True)
    _run(codec, _x(comm.rank, 12), comm, shapes=[torch.Size([3, 4])])
    state = codec.state_dict()
    other = PowerSGD(rank=1, reuse_query=True)
    other.load_state_dict(state)
    assert torch.equal(other.state_for(0)["residual"], codec.state_for(0)["residual"])
    with pytest.raises(ValueError, match="codec"):
        TopK(k=1).load_state_dict(state)


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=64), lambda: Sign(),
                                  lambda: TopK(k=3, error_feedback=False),
                                  lambda: Cast(torch.bfloat16)],
                         ids=["powersgd", "sign", "topk", "bf16"])
def test_many_multi_round_exchanges_in_flight(comm, make):
    """Many buckets whose exchanges have several collectives each, driven by Test from hooks
    in whatever order: every bucket gets its own result (the engine runs them one after another
    on a private channel)."""
    from heatlike.engine import GradientSync

    shapes = [(4000, 9), (9,), (30, 40), (7, 8), (50,), (12, 3)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    sync = GradientSync(params, comm, 1e-6, 1e-6, codec=make(), reducer=AllReduce(comm),
                        hooks=False, grad_as_bucket_view=False)
    assert len(sync.buckets) == len(shapes) and sync.lane.private

    def grads(rank):
        g = torch.Generator().manual_seed(77 + rank)
        return [torch.randn(s, generator=g) for s in shapes]

    for p, g in zip(params, grads(comm.rank)):
        p.grad = g.clone()
    sync.launch_all()
    for _ in range(3):  # hooks would Test in flight requests in any order
        for b in reversed(range(len(sync.buckets))):
            sync._requests[b].Test()
    sync.synchronize()
    everyone = [grads(r) for r in range(comm.size)]
    for i, p in enumerate(params):
        rows = [e[i] for e in everyone]
        if isinstance(sync.codec, Sign):
            expected = sum(torch.sign(r) for r in rows) / comm.size
        elif isinstance(sync.codec, TopK):
            sent = []
            for r in rows:
                flat = r.reshape(-1)
                s = torch.zeros_like(flat)
                idx = flat.abs().topk(min(3, flat.numel())).indices
                s[idx] = flat[idx]
                sent.append(s.view(r.shape))
            expected = sum(sent) / comm.size
        elif isinstance(sync.codec, Cast):
            expected = sum(r.to(torch.bfloat16).float() for r in rows) / comm.size
        else:
            expected = sum(rows) / comm.size
        tol = {Cast: 2e-2, PowerSGD: 2e-3}.get(type(sync.codec), 1e-5)  # QR of 4000 x 9 in fp32
        torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=f"bucket {i}")


NONFINITE_CODECS = {
    "identity": Identity, "bf16": lambda: Cast(torch.bfloat16),
    "fp16": lambda: Cast(torch.float16), "topk": lambda: TopK(k=2),
    "threshold": lambda: Threshold(1.0), "randomk": lambda: RandomK(k=2),
    "randomk-own": lambda: RandomK(k=2, shared=False), "randomblock": lambda: RandomBlock(k=2),
    "randomblock-own": lambda: RandomBlock(k=2, shared=False),
    "sign": Sign, "sign-noef": lambda: Sign(error_feedback=False), "scaled-sign": ScaledSign,
    "powersgd": lambda: PowerSGD(rank=1),
    "warmup-topk": lambda: Warmup(TopK(k=2), 1),
}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", sorted(NONFINITE_CODECS))
def test_codecs_never_hide_a_nonfinite_input(comm, name, bad):
    """One rank's single NaN / inf (among 64 values, most of which the lossy codecs drop) makes
    the decoded result non-finite on every rank; finite inputs, zeros included, stay finite."""
    codec = NONFINITE_CODECS[name]()
    shapes = [torch.Size([8, 8])]
    x = _x(comm.rank)
    if comm.rank == comm.size - 1:
        x[37] = bad
    got = _run(codec, x, comm, shapes=shapes)
    assert not bool(torch.isfinite(got).all()), name
    for data in (_x(comm.rank), torch.zeros(64), torch.full((64,), 1e-30)):
        fresh = NONFINITE_CODECS[name]()
        assert bool(torch.isfinite(_run(fresh, data.clone(), comm, shapes=shapes)).all()), name


def test_random_subsets_of_large_tensors_are_uniform_and_distinct():
    """RandomK's O(k) selection for large tensors: k distinct indices, each index as likely as
    any other (chi-square against uniform), and the finiteness check agrees with isfinite."""
    from heatlike.engine.codecs import _FAST_SUBSET_MIN, all_finite

    n, k, draws = _FAST_SUBSET_MIN, 1024, 64
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(n)
    for _ in range(draws):
        idx = RandomK(k=k)._select(n, k, g, "cpu")
        assert idx.numel() == k and idx.unique().numel() == k and 0 <= int(idx.min())
        counts.index_add_(0, idx, torch.ones(k))
    # 64 equal bins of indices: each expects draws * k / 64 hits
    bins = counts.view(64, -1).sum(1)
    expected = draws * k / 64
    chi2 = float(((bins - expected) ** 2 / expected).sum())
    assert chi2 < 110, chi2  # 63 degrees of freedom: p < 1e-4 beyond 110
    x = torch.randn(1000)
    assert all_finite(x) and all_finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[7] = bad
        assert not all_finite(y)
    assert all_finite(torch.full((4,), 3e38))  # a sum that overflows, entries that do not


def test_codec_clock_counts_the_codec_and_not_the_communication(comm):
    """CodecClock sums the time spent in the codec (pre, encoding, decoding after each result),
    not the reducer's: a codec that sleeps 30 ms before its message (10 of them in pre) and
    20 ms after the result, over a reducer that sleeps 200 ms in its collective."""
    import time

    from heatlike.engine.exchange import CODEC_CLOCK, Sum

    class Slow(Identity):
        def pre(self, x):
            time.sleep(0.01)

        def rounds(self, x, ctx):
            time.sleep(0.02)
            yield Sum(x)
            time.sleep(0.02)

    class SlowSum(AllReduce):
        def combine(self, tensor, channel=None):
            time.sleep(0.2)
            yield from super().combine(tensor, channel=channel)

    before = CODEC_CLOCK.seconds
    x = _run(Slow(), torch.full((4,), float(comm.rank)), comm, SlowSum(comm, op="sum"))
    spent = CODEC_CLOCK.seconds - before
    assert torch.equal(x, torch.full((4,), float(sum(range(comm.size)))))
    assert 0.05 <= spent < 0.2, spent


def test_flat_nonzero_equals_torch_nonzero():
    from heatlike.engine.codecs import flat_nonzero

    g = torch.Generator().manual_seed(3)
    for mask in (torch.rand(100_003, generator=g) < 0.01, torch.zeros(10, dtype=torch.bool),
                 torch.ones(7, dtype=torch.bool), (torch.rand(4000, generator=g) < 0.5)[::3]):
        got = flat_nonzero(mask)
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.nonzero(mask).view(-1))


def test_largest_selects_exactly_what_topk_selects():
    """The threshold-first selection of TopK equals torch.topk's choice (as a set of values) on
    large inputs of every float type, with NaN counted as largest (numpy's partition on the CPU,
    torch.topk for bfloat16), and falls back to torch.topk when the strided sample misleads the
    threshold."""
    from heatlike.engine.codecs import largest

    g = torch.Generator().manual_seed(5)
    n = 300_001
    cases = {"normal": torch.randn(n, generator=g).abs(),
             "ties": torch.randint(0, 50, (n,), generator=g).float()}
    with_nan = torch.randn(n, generator=g).abs()
    with_nan[[7, 70_000, 299_999]] = float("nan")
    cases["nan"] = with_nan
    misleading = torch.rand(n, generator=g)
    misleading[::n // (1 << 15)] += 100.0  # the sample sees only the large values
    cases["misleading sample"] = misleading
    cases["float64 nan"] = with_nan.double()
    cases["float16 ties"] = cases["ties"].half()
    cases["bfloat16"] = cases["normal"].bfloat16()  # torch's own selection among candidates
    for name, a in cases.items():
        for k in (1, 37, 3000, n // 8):
            got = largest(a, k)
            assert got.numel() == k and got.unique().numel() == k, (name, k)
            want = torch.topk(a, k, sorted=False).values
            torch.testing.assert_close(a[got].sort().values, want.sort().values, rtol=0, atol=0,
                                       equal_nan=True, msg=f"{name}, k={k}")
    nan_first = largest(with_nan, 3)
    assert sorted(nan_first.tolist()) == [7, 70_000, 299_999]


@pytest.mark.parametrize("name", sorted(NONFINITE_CODECS))
def test_one_rank_exchanges_call_no_collective(name, monkeypatch):
    """On a one-rank communicator every codec's exchange gives its one-rank result (the codec
    applied to the rank's own values) without calling MPI, so device buffers are never staged."""
    self_comm = hl.MPI_SELF
    calls = []
    for op in ("Iallreduce", "Iallgather", "Iallgatherv"):
        monkeypatch.setattr(type(self_comm), op, lambda *a, _op=op, **k: calls.append(_op))
    x = _x(0, 64)
    got = _run(NONFINITE_CODECS[name](), x.clone(), self_comm,
               reducer=AllReduce(self_comm, op="avg"))
    assert not calls
    if name in ("identity", "powersgd", "warmup-topk"):  # 1-D: exact through PowerSGD; the
        # warm-up's first exchange is exact
        assert torch.equal(got, x)
    elif name in ("bf16", "fp16"):
        assert torch.equal(got, x.to(torch.bfloat16 if name == "bf16" else torch.float16).float())
    elif name.startswith("sign") or name == "scaled-sign":
        scale = x.abs().mean() if name == "scaled-sign" else 1.0
        assert torch.allclose(got, scale * torch.sign(x))
    else:  # sparsifiers: k (or the threshold's) entries of x, zeros elsewhere
        kept = got != 0
        assert torch.equal(got[kept], x[kept])
        if name == "topk":
            assert set(kept.nonzero().view(-1).tolist()) == set(x.abs().topk(2).indices.tolist())
        elif name == "threshold":
            assert torch.equal(kept, x.abs() >= 1.0)
        else:
            assert int(kept.sum()) == 2


@pytest.mark.parametrize("codec", ["identity", "powersgd"])
def test_concurrent_bucket_exchanges_equal_serial_ones(comm, codec):
    """Bucket exchanges on several private channels at once (``concurrent_buckets``) give the
    same bits as one after another, and the average of every rank's gradients. Buckets of
    1.2 MB: over several equal nodes (the 4-rank run) they are node-aware sums of three phases
    each; a multi-round codec is private at every size. Waited for last bucket first, as a
    non-blocking model's next forward does."""
    from heatlike.engine import GradientSync

    shapes = [(300_000,), (500, 600), (17,), (290_000,), (3, 5)]

    def grads(rank):
        g = torch.Generator().manual_seed(5 + rank)
        return [torch.randn(s, generator=g) for s in shapes]

    results = {}
    for width in (1, 3):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        make = (lambda: PowerSGD(rank=2)) if codec == "powersgd" else Identity
        sync = GradientSync(params, comm, 1.0, 1.0, codec=make(), reducer=AllReduce(comm),
                            hooks=False, grad_as_bucket_view=False, concurrent_buckets=width)
        try:
            if sync.lane.private:
                assert sync.lane.width == min(width, len(sync.buckets))
                assert len(sync.lane.channels) == sync.lane.width
            for _ in range(2):  # a second cycle: the channels are reused
                for p, g in zip(params, grads(comm.rank)):
                    p.grad = g.clone()
                sync.launch_all()
                for b in reversed(range(len(sync.buckets))):
                    if not sync.passthrough:  # one rank, identity: .grad is the average already
                        sync.unpack(b)
            results[width] = [p.grad.clone() for p in params]
        finally:
            sync.close()
        assert sync.lane.channels == []
    for a, b in zip(results[1], results[3]):
        assert torch.equal(a, b)
    if codec == "identity":
        everyone = [grads(r) for r in range(comm.size)]
        for i, got in enumerate(results[3]):
            expected = sum(e[i].double() for e in everyone) / comm.size
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_lane_width_must_be_a_positive_int(comm):
    from heatlike.engine import GradientSync
    from heatlike.engine.exchange import Lane

    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="width"):
            Lane(Identity(), AllReduce(comm), width=bad)
        with pytest.raises(ValueError, match="concurrent_buckets"):
            GradientSync([torch.nn.Parameter(torch.zeros(3))], comm, concurrent_buckets=bad)
    one_rank_bad = 0 if comm.rank == 0 else 2  # raised on every rank, nobody left waiting
    with pytest.raises(ValueError, match="concurrent_buckets"):
        GradientSync([torch.nn.Parameter(torch.zeros(3))], comm, concurrent_buckets=one_rank_bad)
    lane = Lane(Identity(), AllReduce(comm), width=4)
    try:  # one collective per exchange (a flat all-reduce) needs no channel
        assert (lane.width, len(lane.channels)) == ((4, 4) if lane.private else (1, 0))
        assert (lane.channel is None) == (not lane.private)
    finally:
        lane.close()


def test_waiting_for_one_bucket_advances_the_others(comm):
    """While a rank waits for one bucket, every test of it first tests the exchanges in flight
    on the other channels (their next collectives are issued only when their own requests are
    tested); the request waited for stays what a timeout report looks into."""
    from heatlike.core.checks import _innermost
    from heatlike.engine.gradsync import _Advancing

    class Fake:
        def __init__(self, ready_after):
            self.tests, self.ready_after = 0, ready_after
            self._req, self._board, self._seq, self._label = None, None, 0, "fake"

        def Test(self, status=None):
            self.tests += 1
            return self.tests >= self.ready_after

    target, others = Fake(3), [Fake(1), Fake(10)]
    waiting = _Advancing(target, others)
    results = [waiting.Test() for _ in range(3)]
    assert results == [False, False, True]
    assert [o.tests for o in others] == [3, 3] and target.tests == 3
    assert _innermost(waiting, None, 0) == (None, 0, "")  # descends into the target
    target._req = Fake(1)
    target._board, target._seq = "board", 7
    assert _innermost(waiting, None, 0) == ("board", 7, " (waiting in fake)")


def test_set_reducer_frees_the_old_channels(comm):
    """A new reducer gets a new lane; the old lane's private channels are freed, not left to
    MPI_Finalize (four channels of up to three communicators each)."""
    from heatlike.engine import GradientSync

    params = [torch.nn.Parameter(torch.zeros(5)) for _ in range(3)]
    sync = GradientSync(params, comm, 1e-6, 1e-6, codec=PowerSGD(rank=1), hooks=False)
    if sync.passthrough:
        pytest.skip("one rank, nothing exchanged")
    old = sync.lane
    assert old.private and len(old.channels) == 3
    sync.set_reducer(AllReduce(comm))
    try:
        assert old.channels == [] and sync.lane is not old and len(sync.lane.channels) == 3
        for p in params:
            p.grad = torch.full((5,), float(comm.rank))
        sync.launch_all()
        sync.synchronize()
        for p in params:
            torch.testing.assert_close(p.grad, torch.full((5,), (comm.size - 1) / 2))
    finally:
        sync.close()


def test_summed_flags_are_read_only_where_this_rank_left_one_unset():
    """A bucket whose flags travel from a host array (device and bfloat16 buckets) answers from
    that array when this rank set every flag (each sum is then positive), and reads the summed
    flags from the buffer otherwise."""
    from heatlike.engine.buckets import plan_buckets

    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(3)]
    (bucket,) = plan_buckets(params, cap_bytes=2 ** 20)
    for i in range(3):
        bucket.set_flag(i, 1)
    bucket.publish_flags()
    bucket.flags.copy_(torch.tensor([2.0, 3.0, 1.0]))  # what an exchange leaves
    assert [float(f) for f in bucket.summed_flags()] == [1.0, 1.0, 1.0]
    bucket.set_flag(1, 0)
    bucket.publish_flags()
    bucket.flags.copy_(torch.tensor([2.0, 0.0, 1.0]))
    assert [float(f) for f in bucket.summed_flags()] == [2.0, 0.0, 1.0]
    (fresh,) = plan_buckets(params, cap_bytes=2 ** 20)  # no buffer yet: allocated, zeroed
    assert not fresh.materialized and list(fresh.summed_flags()) == [0.0, 0.0, 0.0]
    (host,) = plan_buckets([torch.nn.Parameter(torch.zeros(2))], cap_bytes=2 ** 20)
    host.set_flag(0, 1)  # float32 host bucket: the flag lives in the buffer itself
    host.flags.fill_(4.0)
    assert list(host.summed_flags()) == [4.0]


def test_small_parameters_between_solo_ones_share_buckets_ordered_by_their_last_parameter():
    """Large parameters (``solo_bytes`` and more) get buckets of their own; the small ones around
    them keep filling theirs (one bucket for a residual MLP's biases, not one per bias), by
    dtype, until the byte cap or until the solo parameters placed since the bucket opened reach
    the cap; buckets come in the order they fill (by their last parameter), so a bucket is
    complete whenever every bucket before it is, and a restored plan (``sizes``, bucket-major
    order) is the same plan. Without ``solo_bytes`` the plan is as it always was."""
    from heatlike.engine.buckets import plan_buckets

    def param(n, dtype=torch.float32):
        return torch.nn.Parameter(torch.zeros(n, dtype=dtype))

    w = [param(1024) for _ in range(4)]  # 4 KiB each: solo from 4 KiB on
    b = [param(8) for _ in range(4)]  # 32 bytes each
    half = param(8, torch.float16)
    order = [b[0], w[0], b[1], half, w[1], b[2], w[2], b[3], w[3]]

    def plan(**kwargs):
        return [[id(p) for p in bucket.params] for bucket in plan_buckets(order, **kwargs)]

    def ids(*groups):
        return [[id(p) for p in group] for group in groups]

    wide = plan(cap_bytes=16384, solo_bytes=4096)
    assert wide == ids([w[0]], [half], [w[1]], [w[2]], b, [w[3]])
    buckets = plan_buckets(order, cap_bytes=16384, solo_bytes=4096)
    assert [bucket.index for bucket in buckets] == list(range(6))
    position = {id(p): k for k, p in enumerate(order)}
    ends = [max(position[i] for i in bucket) for bucket in wide]
    assert ends == sorted(ends)
    # 8 KiB of solo parameters close a bucket of an 8 KiB cap; the byte cap closes one too
    assert plan(cap_bytes=8192, solo_bytes=4096) == ids(
        [w[0]], [b[0], b[1]], [half], [w[1]], [w[2]], [b[2], b[3]], [w[3]])
    # the first bucket (64 bytes) closes at the first solo parameter, before it in the plan
    assert plan(cap_bytes=16384, first_cap_bytes=64, solo_bytes=4096) == ids(
        [b[0]], [w[0]], [half], [w[1]], [w[2]], [b[1], b[2], b[3]], [w[3]])
    restored = plan_buckets([p for bucket in buckets for p in bucket.params], cap_bytes=16384,
                            sizes=[len(bucket.params) for bucket in buckets])
    assert [[id(p) for p in bucket.params] for bucket in restored] == wide
    # without solo_bytes: groups in the order they open, by dtype
    assert plan(cap_bytes=1 << 20) == ids([b[0], w[0], b[1], w[1], b[2], w[2], b[3], w[3]],
                                          [half])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_averages_divide_by_a_power_of_two_as_a_multiplication_with_the_same_bits(dtype):
    """``reducers.divide`` multiplies by ``1 / d`` where that reciprocal is exact in the dtype (d a
    power of two: both round the same real number, and the multiplication is several times
    faster on a CPU), and divides otherwise; either way bitwise ``x / d``, in place or into
    ``out``, subnormals, signed zeros and extremes included."""
    from heatlike.engine.reducers import _exact_reciprocal, divide

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 1e3).to(dtype)
    info = torch.finfo(dtype)
    x[:8] = torch.tensor([info.tiny, -info.tiny / 4, info.max, -info.max, 0.0, -0.0, 3.0,
                          info.eps], dtype=torch.float64).to(dtype)
    for d in (1, 2, 3, 4, 6, 8, 1024, 2.0**20, 2.0**30):
        expected = x / d
        assert torch.equal(divide(x.clone(), d), expected), d
        out = torch.empty_like(x)
        assert divide(x, d, out=out) is out and torch.equal(out, expected), d
        assert torch.equal(torch.signbit(out), torch.signbit(expected)), d
    assert _exact_reciprocal(3.0, dtype) is None and _exact_reciprocal(8.0, dtype) == 0.125
    assert _exact_reciprocal(2.0**30, torch.float16) is None  # 2**-30 is below float16's range


PER_TENSOR_INNER = {
    "topk": lambda: TopK(k=3), "randomk-own": lambda: RandomK(k=4, shared=False),
    "randomblock-own": lambda: RandomBlock(k=5, shared=False), "randomk": lambda: RandomK(k=4),
    "threshold": lambda: Threshold(0.8), "sign": Sign, "powersgd": lambda: PowerSGD(rank=1),
}


class _Counting(AllReduce):
    """AllReduce that counts the rounds it is handed."""

    def __init__(self, comm):
        super().__init__(comm, op="avg")
        self.rounds = 0

    def combine(self, t, channel=None):
        self.rounds += 1
        return (yield from super().combine(t, channel))

    def gather(self, tensors, variable=False, channel=None):
        self.rounds += 1
        return (yield from super().gather(tensors, variable, channel))


@pytest.mark.parametrize("name", sorted(PER_TENSOR_INNER))
def test_per_tensor_equals_each_tensor_exchanged_alone(comm, name):
    """PerTensor(c) over a bucket of tensors gives, bitwise, what c gives each tensor alone
    (keyed (bucket, i), the same step and seed, averaged): the decoded values, the residuals and
    the supports, over three steps; with one collective per round for the whole bucket. Zeros in
    one tensor make Sign's tensors run different rounds."""
    shapes = [torch.Size([6, 5]), torch.Size([7]), torch.Size([1]), torch.Size([3, 4, 2]),
              torch.Size([0])]
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    fused, alone = PerTensor(PER_TENSOR_INNER[name]()), PER_TENSOR_INNER[name]()
    for step in range(3):
        x = _x(comm.rank, n, step=step, seed=13)
        x[30:37] = 0.0 if step == 1 else x[30:37]  # the second tensor all zeros once
        reducer = _Counting(comm)
        ctx = Context(key=4, shapes=shapes, size=comm.size, rank=comm.rank, step=step,
                      state=fused.state_for(4))
        got = x.clone()
        Request(exchange(got, fused, reducer, ctx)).Wait()
        offset, rounds = 0, 0
        for i, (shape, size) in enumerate(zip(shapes, sizes)):
            part = slice(offset, offset + size)
            offset += size
            single = _Counting(comm)
            sub = Context(key=(4, i), shapes=[shape], size=comm.size, rank=comm.rank, step=step,
                          state=alone.state_for((4, i)))
            want = x[part].clone()
            Request(exchange(want, alone, single, sub)).Wait()
            rounds = max(rounds, single.rounds)
            assert torch.equal(got[part], want), (step, i)
            mine, theirs = ctx.state[i].get("residual"), sub.state.get("residual")
            assert (mine is None) == (theirs is None)
            assert mine is None or torch.equal(mine, theirs), (step, i)
            if sub.support is None:
                assert ctx.parts[i] is None
            elif isinstance(sub.support, slice):
                assert ctx.parts[i] == sub.support
            else:
                assert torch.equal(ctx.parts[i], sub.support)
        # one collective per round; Sign's all-zero tensor may add a round of the other kind
        assert reducer.rounds <= rounds + (1 if name == "sign" else 0), (step, reducer.rounds)


def test_per_tensor_support_is_the_union_and_parts_reach_the_parameters(comm):
    """A bucket of two parameters through PerTensor(RandomK(own)) in mlbench's sparsified SGD:
    each parameter changes exactly by the average of what the ranks sent of it, the bucket's
    support covers both, and coordinates nobody sent stay bitwise equal."""
    from heatlike import optim

    torch.manual_seed(3)
    w1, w2 = torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(50, 40))
    opt = optim.CentralizedSparsifiedSGD([w1, w2], lr=0.5, sparse_grad_size=10,
                                         random_sparse=True, comm=comm)
    assert len(opt.sync.buckets) == 1 and len(opt.sync.buckets[0].params) == 2
    g = torch.Generator().manual_seed(comm.rank)
    grads = [torch.randn(3000, generator=g), torch.randn(50, 40, generator=g)]
    before = [w1.detach().clone(), w2.detach().clone()]
    w1.grad, w2.grad = grads[0].clone(), grads[1].clone()
    opt.step()
    state = opt.sync.codec.state_for(0)
    b = opt.sync.buckets[0]
    for w, grad, old in zip([w1, w2], grads, before):
        i = next(j for j, p in enumerate(b.params) if p is w)
        support = opt.sync.support_of(w)
        assert support is not None and support.numel() == 10 * comm.size
        sent = 0.5 * grad.reshape(-1) - state[i]["residual"]
        assert int((sent != 0).sum()) == 10
        total = sent.clone()
        comm.Allreduce(hl.IN_PLACE, total)
        torch.testing.assert_close(w.detach().reshape(-1), old.reshape(-1) - total / comm.size)
        untouched = total == 0
        assert torch.equal(w.detach().reshape(-1)[untouched], old.reshape(-1)[untouched])


def test_per_tensor_loads_the_state_its_inner_codec_kept_alone():
    """A state saved with one tensor per bucket by the inner codec itself loads as each bucket's
    tensor 0; another codec's state is refused; PerTensor does not nest."""
    inner = TopK(k=2)
    inner.state_for(0)["residual"] = torch.arange(4.0)
    inner.state_for(1)["residual"] = torch.ones(3)
    fused = PerTensor(TopK(k=2))
    fused.load_state_dict(inner.state_dict())
    assert torch.equal(fused.state_for(0)[0]["residual"], torch.arange(4.0))
    assert torch.equal(fused.state_for(1)[0]["residual"], torch.ones(3))
    again = PerTensor(TopK(k=2))
    again.load_state_dict(fused.state_dict())
    assert torch.equal(again.state_for(1)[0]["residual"], torch.ones(3))
    with pytest.raises(ValueError, match="state of codec"):
        PerTensor(TopK(k=3)).load_state_dict(inner.state_dict())
    with pytest.raises(TypeError, match="wraps a codec"):
        PerTensor(fused)


@pytest.mark.parametrize("name", ["topk", "randomk-own", "randomblock-own", "threshold", "sign"])
def test_an_empty_tensor_exchanges_through_every_gathering_codec(comm, name):
    """A tensor of no entries (a zero-size parameter) sends nothing and decodes to nothing at
    every size: a fixed-size gather of empty tensors issues no collective (an all-gather of no
    bytes viewed its ranks' rows at odd offsets and raised)."""
    codec = PER_TENSOR_INNER[name]()
    got = _run(codec, torch.empty(0), comm, AllReduce(comm), shapes=[torch.Size([0])])
    assert got.numel() == 0


@pytest.mark.parametrize("n, k", [(10, 5), (12, 3), (10, 4), (7, 7), (3, 5)])
def test_random_block_draws_aligned_blocks(comm, n, k):
    """RandomBlock draws mlbench-core's aligned blocks ``[b k, (b + 1) k)``, each as likely, so
    every entry is sent with probability k / n when k divides n (a start drawn from
    ``[0, n - k]`` sent the edges far less often than the middle). When k does not divide n,
    one more block, the last k entries, is drawn as often as the others (mlbench never sent the
    last ``n mod k``). Through the exchange: shared blocks are the same on every rank, the
    ranks' own blocks differ between ranks."""
    T = 3000
    kk = min(k, n)
    starts = list(range(0, n - kk + 1, kk)) if n % kk == 0 else \
        list(range(0, n - kk + 1, kk)) + [n - kk]
    expected = torch.zeros(n)
    for s in starts:
        expected[s:s + kk] += 1 / len(starts)
    codec = RandomBlock(k=k)
    hits, seen = torch.zeros(n), set()
    for step in range(T):
        chosen = codec._select(n, kk, Context(key=(0, 0), shapes=[], size=comm.size,
                                              rank=comm.rank, step=step).generator(), "cpu")
        seen.add(chosen.start)
        hits[chosen] += 1
    assert seen == set(starts)
    assert torch.allclose(hits / T, expected, atol=0.04), (hits / T).tolist()
    for shared in (True, False):
        codec = RandomBlock(k=k, shared=shared)
        blocks = []
        for step in range(8):
            x = torch.arange(1.0, n + 1) * (comm.rank + 1)
            _run(codec, x.clone(), comm, step=step)
            sent = (x - codec.state_for(0)["residual"]) != 0
            first = int(sent.float().argmax())
            assert first in starts and int(sent.sum()) == kk
            blocks.append(first)
            codec.states.clear()
        everyone = comm.handle.allgather(blocks)
        if shared or len(starts) == 1:
            assert all(b == blocks for b in everyone)
        elif comm.size > 1:
            assert any(b != blocks for b in everyone)
