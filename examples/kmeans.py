"""K-means clustering (Lloyd's algorithm) with DNDarray operations only.

Run with ``mpiexec -n 4 python -m heatlike examples/kmeans.py [n_samples]`` (default 100000).

The samples ``x`` (n x d) are split along their rows; the k centroids are small and replicated.
One iteration:

* squared distances ``|x|^2 - 2 x c^T + |c|^2`` (n x k, split 0): a (0, None) matmul, local;
* labels: ``argmin`` over the centroid axis, local;
* new centroids: ``onehot^T @ x`` is a (1, 0) matmul, so each rank multiplies its rows and one
  ``Allreduce`` of k x d values sums the partial products; cluster sizes likewise (k values).

Convergence follows scikit-learn: stop when no label changes or when the centroids move less
than ``tol`` times the mean feature variance (squared Frobenius norm), then label once more.
Without given initial centroids, the maximin rule picks them: a random row, then repeatedly the
row farthest from those chosen (a distributed ``argmax`` and a row broadcast per centroid).
"""

from __future__ import annotations

import argparse
import time

import heatlike as hl


def _labels(x: hl.DNDarray, centroids: hl.DNDarray) -> tuple[hl.DNDarray, hl.DNDarray]:
    """Labels of the nearest centroid and the squared distance to it, one per row of ``x``."""
    d = (x * x).sum(axis=1, keepdims=True) - 2.0 * (x @ centroids.T) \
        + (centroids * centroids).sum(axis=1)
    return d.argmin(axis=1), d.min(axis=1)


def farthest_points(x: hl.DNDarray, k: int) -> hl.DNDarray:
    """``k`` rows of ``x`` spread out (maximin initialization): a random row first, then each
    time the row farthest from all rows chosen so far (its index from a distributed argmax)."""
    first = int(hl.random.randint(0, x.shape[0], size=1, comm=x.comm).item())
    chosen = x[first].expand_dims(0).resplit(None)
    nearest = ((x - chosen) ** 2).sum(axis=1)
    for _ in range(1, k):
        row = x[int(nearest.argmax().item())].expand_dims(0).resplit(None)
        chosen = hl.concatenate([chosen, row])
        nearest = hl.minimum(nearest, ((x - row) ** 2).sum(axis=1))
    return chosen


def kmeans(x: hl.DNDarray, k: int, init: hl.DNDarray | None = None, max_iter: int = 300,
           tol: float = 1e-4) -> tuple[hl.DNDarray, hl.DNDarray, float, int]:
    """Cluster the rows of ``x`` into ``k`` groups.

    ``init``: the initial centroids (k x d); default: :func:`farthest_points`. Returns
    ``(centroids, labels, inertia, iterations)``: centroids replicated on every rank, labels
    distributed like the rows of ``x``, inertia the sum of squared distances to the nearest
    centroid.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be a 2-D array of samples, got shape {x.shape}")
    n = x.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if init is None:
        init = farthest_points(x, k)
    centroids = hl.array(init, dtype=x.dtype).resplit(None)
    threshold = tol * float(x.var(axis=0).mean().item())
    clusters = hl.arange(k, device=x.device, comm=x.comm)
    labels = None
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        new_labels, _ = _labels(x, centroids)
        if labels is not None and bool(hl.all(new_labels == labels).item()):
            break
        labels = new_labels
        onehot = (labels.expand_dims(1) == clusters).astype(x.dtype)
        sums = onehot.T @ x
        sizes = onehot.sum(axis=0).expand_dims(1)
        moved = hl.where(sizes > 0, sums / hl.maximum(sizes, 1.0), centroids).resplit(None)
        shift = float(((moved - centroids) ** 2).sum().item())
        centroids = moved
        if shift <= threshold:
            break
    labels, distances = _labels(x, centroids)
    return centroids, labels, float(distances.sum().item()), iterations


def blobs(n: int, centers: hl.DNDarray, spread: float = 0.4, seed: int = 0
          ) -> tuple[hl.DNDarray, hl.DNDarray]:
    """``n`` samples around the rows of ``centers`` (split along the samples) and their
    generating cluster; the same data for any number of ranks."""
    hl.random.seed(seed)
    truth = hl.random.randint(0, centers.shape[0], size=n, split=0, comm=centers.comm)
    noise = hl.random.randn(n, centers.shape[1], dtype=centers.dtype, split=0,
                            comm=centers.comm)
    return centers[truth] + spread * noise, truth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n_samples", nargs="?", type=int, default=100_000,
                   help="samples drawn around 4 centers in 3-D (default 100000)")
    args = p.parse_args(argv)
    if args.n_samples < 4:
        p.error(f"n_samples must be at least 4 (one per cluster), got {args.n_samples}")
    return args


def main(n: int = 100_000) -> None:
    """Cluster ``n`` samples drawn around 4 centers and log what was found (rank 0)."""
    comm = hl.get_comm()
    log = hl.get_logger("kmeans")
    centers = hl.array([[0.0, 0.0, 0.0], [4.0, 4.0, 0.0], [-4.0, 4.0, 2.0], [0.0, -5.0, 3.0]],
                       dtype=hl.float64)
    x, _ = blobs(n, centers)
    start = time.perf_counter()
    centroids, labels, inertia, iterations = kmeans(x, k=4)
    seconds = time.perf_counter() - start
    sizes = [int((labels == j).sum().item()) for j in range(4)]
    found = (centroids.numpy().round(1) + 0.0).tolist()  # + 0.0: no "-0.0"
    log.info("%d samples on %d ranks: %d iterations in %.3f s, inertia %.1f", n, comm.size,
             iterations, seconds, inertia)
    clusters = sorted(zip(found, sizes))  # each centroid with its own cluster's size
    log.info("centroids %s, cluster sizes %s", [c for c, _ in clusters], [m for _, m in clusters])


if __name__ == "__main__":
    main(parse_args().n_samples)
