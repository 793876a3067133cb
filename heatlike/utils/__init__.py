"""Utilities: launching with abort-on-error, (later) data loading, checkpoints, tracing."""

from .launch import abort_on_exception, configure_threads, install_abort_handler  # noqa: F401
