"""Module wrappers for distributed training."""

from .data_parallel import DataParallel, broadcast_module, check_replicas  # noqa: F401
