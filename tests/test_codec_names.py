"""``codec=`` takes a name ("bf16", "fp16", "none", ...) wherever heatlike takes a codec, through
one resolver (``heatlike.engine.codecs.codec_from``); anything else is refused with the valid
names, on every rank, before anything is sent."""

import pytest
import torch
from torch import nn

from heatlike.aggregation import AllReduceAggregation
from heatlike.engine import Cast, Codec, Identity, TopK
from heatlike.engine.codecs import CODEC_NAMES, codec_from
from heatlike.nn import DataParallel
from heatlike.optim import CentralizedSGD, DataParallelOptimizer, DecentralizedSGD

pytestmark = pytest.mark.mpi


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


# every place that takes codec=, and where it keeps the codec it uses
SITES = {
    "DataParallel": lambda comm, codec: DataParallel(_net(), comm, codec=codec).grad_sync.codec,
    "CentralizedSGD": lambda comm, codec: CentralizedSGD(model=_net(), lr=0.1, comm=comm,
                                                         codec=codec).sync.codec,
    "CentralizedSGD(agg_grad=False)": lambda comm, codec: CentralizedSGD(
        model=_net(), lr=0.1, agg_grad=False, comm=comm, codec=codec).sync.codec,
    "DecentralizedSGD": lambda comm, codec: DecentralizedSGD(model=_net(), lr=0.1, comm=comm,
                                                             codec=codec).sync.codec,
    "AllReduceAggregation": lambda comm, codec: AllReduceAggregation(comm=comm,
                                                                     codec=codec).codec,
}


@pytest.mark.parametrize("spec,name", [("bf16", "cast-bfloat16"), ("BFloat16", "cast-bfloat16"),
                                       ("fp16", "cast-float16"), ("float16", "cast-float16"),
                                       ("half", "cast-float16"), ("none", "identity"),
                                       ("fp32", "identity"), (torch.bfloat16, "cast-bfloat16"),
                                       (torch.float32, "identity")])
def test_names_and_dtypes_build_their_codec(spec, name):
    codec = codec_from(spec)
    assert isinstance(codec, Codec) and codec.name == name
    assert codec is not codec_from(spec)  # a fresh codec each time: no shared state


def test_instances_and_none_pass_through():
    topk = TopK(k=3)
    assert codec_from(topk) is topk
    assert codec_from(None) is None
    assert set(CODEC_NAMES) >= {"bf16", "bfloat16", "fp16", "float16", "none", "fp32"}


@pytest.mark.parametrize("spec,error,match", [
    ("bf17", ValueError, "unknown codec 'bf17': use one of 'none', 'identity', 'fp32'"),
    ("topk", ValueError, r"codec instance such as heatlike.engine.TopK"),
    (Cast, TypeError, r"codec=Cast is a class: pass an instance"),
    (16, TypeError, "codec must be a heatlike.engine codec, a name"),
    (torch.int8, ValueError, "is not a wire type")])
def test_anything_else_is_refused_with_the_valid_names(spec, error, match):
    with pytest.raises(error, match=match):
        codec_from(spec)


@pytest.mark.parametrize("site", SITES)
def test_every_codec_argument_takes_a_name(comm, site):
    assert SITES[site](comm, "bf16").name == "cast-bfloat16"
    assert SITES[site](comm, "FP16").name == "cast-float16"
    assert isinstance(SITES[site](comm, "none"), Identity)
    assert isinstance(SITES[site](comm, Cast(torch.float16)), Cast)


@pytest.mark.parametrize("site", SITES)
def test_a_bad_codec_on_one_rank_fails_on_every_rank(comm, site):
    """The last rank alone passes a bad name: every rank raises, naming it, and no rank is left
    in a collective (the barrier below completes)."""
    last = comm.size - 1
    spec = "bf17" if comm.rank == last else "bf16"
    where = f"on rank {last}: " if comm.size > 1 else ""
    with pytest.raises(ValueError, match=f"{where}unknown codec 'bf17'"):
        SITES[site](comm, spec)
    comm.handle.Barrier()


def test_data_parallel_with_a_name_trains_as_with_the_codec(comm):
    """``codec="bf16"`` (the AttributeError of before) is ``codec=Cast(torch.bfloat16)``."""
    results = []
    for codec in ("bf16", Cast(torch.bfloat16)):
        net = _net(seed=1)
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
        model = DataParallel(net, comm, optimizer=opt, codec=codec)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + comm.rank)
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        results.append(torch.cat([p.detach().view(-1) for p in net.parameters()]))
    assert torch.equal(results[0], results[1])
