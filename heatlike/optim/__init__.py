"""Distributed optimizers: thin presets over the engine (``heatlike.engine``)."""

from .daso import DASO  # noqa: F401
from .dp_optimizer import DataParallelOptimizer  # noqa: F401
