"""examples/kmeans.py against scikit-learn's KMeans on the same data and initial centroids."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from _dndarray_helpers import COMM, layouts

import heatlike as hl

pytestmark = pytest.mark.mpi

sklearn_cluster = pytest.importorskip("sklearn.cluster")
sklearn_datasets = pytest.importorskip("sklearn.datasets")

_spec = importlib.util.spec_from_file_location(
    "kmeans_example", Path(__file__).resolve().parent.parent / "examples" / "kmeans.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_kmeans_matches_scikit_learn():
    X, _ = sklearn_datasets.make_blobs(n_samples=240, centers=4, n_features=3, cluster_std=1.5,
                                       random_state=3)
    init = X[[0, 60, 120, 180]]
    ref = sklearn_cluster.KMeans(n_clusters=4, init=init, n_init=1, algorithm="lloyd",
                                 tol=1e-4, max_iter=300).fit(X)
    for what, x in layouts(X, seed=2):
        centroids, labels, inertia, iterations = example.kmeans(x, 4, init=hl.array(init))
        assert centroids.split is None
        np.testing.assert_allclose(centroids.numpy(), ref.cluster_centers_, rtol=1e-9,
                                   atol=1e-9, err_msg=what)
        np.testing.assert_array_equal(labels.numpy(), ref.labels_, err_msg=what)
        np.testing.assert_allclose(inertia, ref.inertia_, rtol=1e-9)
        assert iterations <= ref.n_iter_ + 1


def test_kmeans_example_runs_and_is_independent_of_ranks():
    centers = hl.array([[0.0, 0.0], [5.0, 5.0], [-5.0, 5.0]], dtype=hl.float64)
    x, truth = example.blobs(600, centers, seed=4)
    centroids, labels, inertia, _ = example.kmeans(x, 3, init=centers + 0.5)
    found = centroids.numpy()
    np.testing.assert_allclose(np.sort(found, axis=0), np.sort(centers.numpy(), axis=0),
                               atol=0.1)
    assert labels.split == 0 and labels.gshape == (600,)
    # the data do not depend on the number of ranks: compare with one process alone
    hl.random.seed(4)
    local = example.blobs(600, hl.array(centers.numpy(), comm=hl.MPI_SELF), seed=4)[0]
    np.testing.assert_array_equal(local.numpy(), x.numpy())
    np.testing.assert_array_equal(hl.array(labels.numpy(), comm=hl.MPI_SELF).numpy(),
                                  labels.numpy())
    example.kmeans(x, 3)  # random initial centroids
    assert COMM.size >= 1
