"""Distributed optimizers: thin presets over the engine (``heatlike.engine``)."""

from .dp_optimizer import DataParallelOptimizer  # noqa: F401
