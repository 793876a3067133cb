"""The one communication engine every heatlike optimizer is built from: flat buffers and buckets,
codecs (what goes on the wire), reducers (how ranks combine it), and the gradient synchronizer that
runs them during the backward pass."""

from .autotune import Choice, LinkFit, autotune, choose_bucket_bytes, measure_allreduce  # noqa: F401
from .buckets import Bucket, comm_buffer, pack, plan_buckets, unpack  # noqa: F401
from .codecs import (  # noqa: F401
    Cast,
    Codec,
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
)
from .exchange import Context, Gather, Sum, exchange  # noqa: F401
from .gradsync import GradientSync  # noqa: F401
from .links import SimulatedLink, SlowLinkAllReduce  # noqa: F401
from .paramsync import ParameterSync  # noqa: F401
from .reducers import AllReduce, Gossip, Hierarchical, Reducer  # noqa: F401
