"""The DNDarray API in one namespace, re-exported by ``heatlike`` and ``heatlike.core``: the
class, factories, elementwise operations, reductions, manipulations, indexing helpers, matrix
products, I/O, dtype names and the default device.

``heatlike.core`` imports :mod:`heatlike.core.dndarray` before this module: the operation modules
and the class module import each other, and the class module must come first.
"""

from mpi4py import MPI

from . import stride_tricks
from .arithmetics import *  # noqa: F403
from .arithmetics import __all__ as _arithmetics
from .devices import *  # noqa: F403
from .devices import __all__ as _devices
from .dndarray import DNDarray
from .factories import *  # noqa: F403
from .factories import __all__ as _factories
from .indexing import nonzero, take
from .io import *  # noqa: F403
from .io import __all__ as _io
from .linalg import *  # noqa: F403
from .linalg import __all__ as _linalg
from .manipulations import *  # noqa: F403
from .manipulations import __all__ as _manipulations
from .manipulations_more import *  # noqa: F403
from .manipulations_more import __all__ as _manipulations_more
from .reductions import all, any, argmax, argmin, max, mean, min, prod, std, sum, var
from .statistics import *  # noqa: F403
from .statistics import __all__ as _statistics
from .stride_tricks import broadcast_shape, broadcast_shapes
from .types import *  # noqa: F403
from .types import __all__ as _types

__all__ = [
    "DNDarray", "MPI", "take", "nonzero", "stride_tricks", "broadcast_shape", "broadcast_shapes",
    "sum", "prod", "mean", "var", "std", "min", "max", "argmin", "argmax", "all", "any",
    *_factories, *_arithmetics, *_manipulations, *_manipulations_more, *_linalg, *_io,
    *_types, *_statistics,
    *(n for n in _devices if n not in ("torch_device", "device_name")),
]
