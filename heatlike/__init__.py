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
from .core.tensor import *  # noqa: F401, F403
