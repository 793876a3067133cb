"""heatlike: MPI-first distributed training and HPC data analytics over PyTorch."""

from . import core, utils  # noqa: F401
from ._version import __version__  # noqa: F401
from .core import (  # noqa: F401
    IN_PLACE,
    MPI_SELF,
    MPI_WORLD,
    MPICommunication,
    get_comm,
    get_logger,
    use_comm,
    wait_all,
)

# isort: split
# the distributed tensor: DNDarray, its factories and operations, heatlike.random
from . import random  # noqa: F401

# Heat's module names: heatlike.types, heatlike.devices, heatlike.communication, ...
from .core import (  # noqa: E402, F401
    arithmetics,
    communication,
    devices,
    dndarray,
    factories,
    indexing,
    io,
    linalg,
    manipulations,
    reductions,
    statistics,
    stride_tricks,
    types,
)
from .core.tensor import *  # noqa: F401, F403

# isort: split
# training, reachable as attributes like Heat's (heatlike.nn.DataParallel, heatlike.optim.DASO)
from . import nn, optim  # noqa: E402, F401

# isort: split
# an uncaught exception on one rank of a multi-rank job aborts the job (heatlike.utils.launch)
utils.launch.install_default_abort_handler()
