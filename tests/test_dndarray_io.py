"""save / load of .npy files and HDF5 datasets: every rank reads and writes only its slab."""

import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, assert_matches, global_array, layouts, raises_everywhere

import heatlike as hl

pytestmark = pytest.mark.mpi


@pytest.fixture
def shared_dir():
    """A directory every rank sees under the same path."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="heatlike-io-") if COMM.rank == 0 else None)
    yield path
    COMM.Barrier()
    if COMM.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


SHAPES = [(7,), (0, 3), (5, 4), (2, 3, 4), (1, 6)]


def test_npy_roundtrip_every_layout(shared_dir):
    for i, shape in enumerate(SHAPES):
        g = global_array(i, shape).astype(np.float32)
        for what, x in layouts(g, seed=i):
            path = os.path.join(shared_dir, f"a{i}.npy")
            x.save(path)
            COMM.Barrier()
            np.testing.assert_array_equal(np.load(path), g, err_msg=what)
            for split in [None, *range(len(shape))]:
                y = hl.load(path, split=split)
                assert y.split == split and y.balanced and y.dtype is torch.float32
                assert_matches(y, g, f"{shape} {what} -> {split}")
            COMM.Barrier()
    # files written by numpy, including Fortran order and other dtypes
    for order in ("C", "F"):
        g = np.asarray(global_array(9, (6, 5)).astype(np.int16), order=order)
        path = os.path.join(shared_dir, f"np_{order}.npy")
        if COMM.rank == 0:
            np.save(path, g)
        COMM.Barrier()
        for split in (None, 0, 1):
            y = hl.load_npy(path, split=split, dtype=hl.float64)
            assert y.dtype is torch.float64
            assert_matches(y, g.astype(np.float64), f"{order} {split}")
        COMM.Barrier()


def test_hdf5_roundtrip_every_layout(shared_dir):
    path = os.path.join(shared_dir, "data.h5")
    for i, shape in enumerate(SHAPES):
        g = global_array(i, shape)
        for j, (what, x) in enumerate(layouts(g, seed=i)):
            name = f"s{i}/l{j}"
            hl.save(x, path, name, mode="w" if i == j == 0 else "a")
            COMM.Barrier()
            with h5py.File(path, "r") as f:
                np.testing.assert_array_equal(f[name][...], g, err_msg=what)
            for split in [None, *range(len(shape))]:
                y = hl.load(path, dataset=name, split=split)
                assert y.split == split and y.dtype is torch.float64
                assert_matches(y, g, f"{shape} {what} -> {split}")
            COMM.Barrier()
    b = hl.array(global_array(3, (4, 2), dtype=bool), split=0)
    hl.save_hdf5(b, path, "flags", mode="a", compression="gzip")
    assert_matches(hl.load_hdf5(path, "flags", split=1), global_array(3, (4, 2), dtype=bool))


def test_io_errors_on_every_rank(shared_dir):
    missing = os.path.join(shared_dir, "missing.npy")
    raises_everywhere(FileNotFoundError, lambda: hl.load(missing, split=0), "missing.npy")
    raises_everywhere(OSError, lambda: hl.load(os.path.join(shared_dir, "missing.h5"), "d"))
    x = hl.arange(5, split=0)
    path = os.path.join(shared_dir, "x.h5")
    x.save(path, "x")
    raises_everywhere(KeyError, lambda: hl.load(path, dataset="nope", split=0), "nope")
    raises_everywhere(ValueError, lambda: x.save(path, "x", mode="a"))
    raises_everywhere(ValueError, lambda: hl.save(x, os.path.join(shared_dir, "x.txt")), ".txt")
    raises_everywhere(ValueError, lambda: hl.save(x, path), "dataset")
    raises_everywhere(TypeError, lambda: x.astype(hl.bfloat16).save(
        os.path.join(shared_dir, "b.npy")), "bfloat16")
    raises_everywhere(FileNotFoundError, lambda: x.save(
        os.path.join(shared_dir, "no", "such", "dir.npy")))
    raises_everywhere(ValueError, lambda: hl.load(path, "x", split=1), "out of range")


def test_short_positional_writes_are_continued(shared_dir, monkeypatch):
    """``os.pwrite`` may write fewer bytes than asked (Linux: 2 GiB - 4 KiB at most per call):
    every byte still lands (before: the tail of a slab over 2 GiB stayed zeros, no error)."""
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, bytes(data)[:7], offset))
    g = global_array(21, (9, 5))
    for what, x in layouts(g):
        path = os.path.join(shared_dir, "short.npy")
        x.save(path)
        COMM.Barrier()
        np.testing.assert_array_equal(np.load(path), g, err_msg=what)
        COMM.Barrier()


def test_big_endian_files_load(shared_dir):
    """.npy files and HDF5 datasets in the other byte order load as numpy and h5py read them
    (before: ValueError from torch on every rank)."""
    g = global_array(22, (5, 2)).astype(">f8")
    npy, h5 = os.path.join(shared_dir, "be.npy"), os.path.join(shared_dir, "be.h5")
    if COMM.rank == 0:
        np.save(npy, g)
        with h5py.File(h5, "w") as f:
            f.create_dataset("d", data=g)
    COMM.Barrier()
    for split in (None, 0, 1):
        assert_matches(hl.load(npy, split=split), g.astype("<f8"), "npy", dtype=hl.float64)
        assert_matches(hl.load(h5, dataset="d", split=split), g.astype("<f8"), "hdf5")
