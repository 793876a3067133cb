"""Module wrappers for distributed training.

As in Heat, the names of ``torch.nn`` are available here too: ``heatlike.nn.Linear is
torch.nn.Linear``, ``heatlike.nn.Module is torch.nn.Module``, and ``heatlike.nn.functional`` is
``torch.nn.functional`` under Heat's name. heatlike's own names (``DataParallel``, ...) come
first; a name neither has raises ``AttributeError``.
"""

import torch as _torch

from .._forwarding import forward_to
from . import functional  # noqa: F401
from .data_parallel import (  # noqa: F401
    DataParallel,
    DataParallelMultiGPU,
    broadcast_module,
    check_replicas,
    verify_replicas,
)
from .join import Join  # noqa: F401
from .sync_batchnorm import SyncBatchNorm  # noqa: F401

__getattr__, __dir__ = forward_to(__name__, globals(), _torch.nn)
