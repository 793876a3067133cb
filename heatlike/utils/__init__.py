"""Utilities: launching with abort-on-error, data loading, step tracking, stopping on a
scheduler's signal."""

from . import data  # noqa: F401  (heatlike.utils.data, as Heat's heat.utils.data)
from .launch import (  # noqa: F401
    DEVICE_CHOICES,
    abort_on_exception,
    configure_threads,
    install_abort_handler,
    select_device,
)
from .preemption import StopOnSignal  # noqa: F401
from .tracker import Tracker  # noqa: F401
