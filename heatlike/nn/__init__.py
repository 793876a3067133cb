"""Module wrappers for distributed training."""

from .data_parallel import (  # noqa: F401
    DataParallel,
    DataParallelMultiGPU,
    broadcast_module,
    check_replicas,
    verify_replicas,
)
from .join import Join  # noqa: F401
