"""Fixtures shared by the suite (the MPI plugin itself is enabled in setup.cfg)."""

import pytest

import heatlike as hl
from heatlike.utils import configure_threads


def pytest_sessionstart(session):
    # several ranks share this machine's cores: give each its share of torch threads
    configure_threads()


@pytest.fixture
def comm():
    """The world communicator."""
    return hl.MPI_WORLD
