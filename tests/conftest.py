"""Fixtures shared by the suite (the MPI plugin itself is enabled in setup.cfg)."""

import pytest

import heatlike as hl


@pytest.fixture
def comm():
    """The world communicator."""
    return hl.MPI_WORLD
