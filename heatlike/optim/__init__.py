"""Distributed optimizers: thin presets over the engine (``heatlike.engine``).

Heat: DataParallelOptimizer, DASO. torch: ZeroRedundancyOptimizer (sharded optimizer state,
over MPI). mlbench-core: GenericCentralizedOptimizer, CentralizedSGD,
CentralizedAdam, CustomCentralizedOptimizer, CentralizedSparsifiedSGD, PowerSGD,
DecentralizedSGD, SignSGD, SparsifiedSGD, FP16Optimizer. Apache SINGA: DistOpt (and SINGA's
RMSProp / AdaGrad formulas in ``heatlike.optim.singa``).

As in Heat, the names of ``torch.optim`` are available here too: ``heatlike.optim.SGD is
torch.optim.SGD``, ``heatlike.optim.lr_scheduler is torch.optim.lr_scheduler``. heatlike's own
names come first; a name neither has raises ``AttributeError``.
"""

import torch as _torch

from .._forwarding import forward_to
from . import singa  # noqa: F401,E402
from .centralized import (  # noqa: F401
    CentralizedAdam,
    CentralizedSGD,
    CustomCentralizedOptimizer,
    GenericCentralizedOptimizer,
)
from .compressed import CentralizedSparsifiedSGD, PowerSGD, SignSGD, SparsifiedSGD  # noqa: F401
from .daso import DASO  # noqa: F401
from .decentralized import DecentralizedSGD, consensus_distance  # noqa: F401
from .distopt import DistOpt  # noqa: F401
from .dp_optimizer import DataParallelOptimizer  # noqa: F401
from .fp16 import FP16Optimizer  # noqa: F401
from .zero import ZeroRedundancyOptimizer  # noqa: F401

__getattr__, __dir__ = forward_to(__name__, globals(), _torch.optim)
