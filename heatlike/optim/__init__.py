"""Distributed optimizers: thin presets over the engine (``heatlike.engine``).

Heat: DataParallelOptimizer, DASO. mlbench-core: GenericCentralizedOptimizer, CentralizedSGD,
CentralizedAdam, CustomCentralizedOptimizer, CentralizedSparsifiedSGD, PowerSGD,
DecentralizedSGD, SignSGD, SparsifiedSGD, FP16Optimizer. Apache SINGA: DistOpt (and SINGA's
RMSProp / AdaGrad formulas in ``heatlike.optim.singa``).
"""

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
