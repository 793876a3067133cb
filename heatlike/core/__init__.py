"""heatlike core: communication, topology, and (later) the distributed tensor."""

from . import communication, cuda_aware, topology  # noqa: F401
from .communication import (  # noqa: F401
    IN_PLACE,
    MPI_SELF,
    MPI_WORLD,
    MPICommunication,
    Request,
    get_comm,
    sanitize_comm,
    test_all,
    use_comm,
    wait_all,
)
from .dndarray import DNDarray  # noqa: F401  (before .tensor: see heatlike/core/tensor.py)
from .log import get_logger  # noqa: F401
from .tensor import *  # noqa: F401, F403
