"""Utilities: launching with abort-on-error, data loading, step tracking."""

from .launch import abort_on_exception, configure_threads, install_abort_handler  # noqa: F401
from .tracker import Tracker  # noqa: F401
