"""Distributed data loading.

The sampling rule (:class:`DistributedBatchSampler`): epoch e visits the N samples in the order of
a permutation that depends only on (N, seed, e), never on the number of ranks. Each step takes
the next *global batch* of P*b consecutive samples of that order and rank r takes rows
[r*b, (r+1)*b) of it. So every rank runs the same number of steps, and the union of the ranks'
batches at a step is exactly the batch a single process with batch size P*b would see: the
property data-parallel training needs to reproduce the single-process trajectory. The last,
incomplete global batch is dropped (``drop_last=True``) or completed by wrapping around to the
start of the order (like ``torch.utils.data.DistributedSampler``).

:class:`Dataset` holds samples either whole on every rank (tensors, numpy arrays, any torch
``Dataset``) or distributed as DNDarrays split along axis 0. In the distributed case
:class:`DataLoader` starts each epoch with one ``Alltoallv`` that brings every rank exactly the rows
its batches of that epoch need (each row moves at most once), then serves batches locally.

Heat's names: ``heatlike.utils.data.datatools`` is this module's ``DataLoader`` and ``Dataset``
under Heat's module name (``heat.utils.data.datatools``). :class:`Dataset` accepts Heat's keywords
``transforms``, ``ishuffle`` and ``test_set``. Heat shuffles between epochs by sending half of
each rank's samples to the next rank, blocking or (``ishuffle=True``) non-blocking, and calls the
dataset's ``Shuffle()`` / ``Ishuffle()`` for it; heatlike's rule above already mixes samples
across all ranks every epoch, so ``ishuffle`` is kept as an attribute and changes nothing, and
those methods are not called. ``test_set=True`` turns shuffling off (the loader's default), as it
does in Heat.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ..core.agreement import agree_on, raise_together
from ..core.communication import MPICommunication, sanitize_comm

__all__ = ["DistributedBatchSampler", "Dataset", "DataLoader", "datatools"]


class DistributedBatchSampler:
    """Per-rank index batches of the global batches of a seeded permutation (module docstring).

    Yields lists of ``batch_size`` global sample indices for this rank; ``len()`` is the number of
    steps per epoch, equal on every rank. Call :meth:`set_epoch` before each epoch.
    """

    def __init__(self, num_samples: int, batch_size: int, comm: MPICommunication | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        self.comm = sanitize_comm(comm)
        if not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        global_batch = batch_size * self.comm.size
        if drop_last and num_samples < global_batch:
            raise ValueError(f"drop_last with {num_samples} samples and a global batch of "
                             f"{global_batch} ({self.comm.size} ranks x {batch_size}) leaves "
                             "no batch at all")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.comm.size

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's visiting order of all samples (independent of the number of ranks)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def rank_indices(self, rank: int, epoch: int | None = None) -> torch.Tensor:
        """All indices ``rank`` visits in the epoch, batch after batch (len(self) * batch_size)."""
        order = self.order(epoch)
        steps, gb, b = len(self), self.global_batch_size, self.batch_size
        needed = steps * gb
        if needed > order.numel():  # wrap around to complete the last global batch
            order = torch.cat([order] * math.ceil(needed / order.numel()))
        batches = order[:needed].view(steps, self.comm.size, b)
        return batches[:, rank].reshape(-1)

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.rank_indices(self.comm.rank)
        for batch in mine.view(len(self), self.batch_size):
            yield batch.tolist()


def _is_dndarray(obj: object) -> bool:
    return type(obj).__name__ == "DNDarray" and hasattr(obj, "larray")


def _is_array(obj: object) -> bool:
    """What :class:`Dataset` takes as data: a DNDarray, a tensor, a numpy array, a torch dataset
    or a sequence of samples (not a string)."""
    return _is_dndarray(obj) or \
        isinstance(obj, (torch.Tensor, np.ndarray, torch.utils.data.Dataset)) or \
        (isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)))


class Dataset(torch.utils.data.Dataset):
    """Samples ``data[i]`` (and ``targets[i]``), optionally transformed.

    ``data`` / ``targets`` are torch tensors or numpy arrays held whole on every rank, or DNDarrays
    split along axis 0 (each rank holds its rows); ``transform`` / ``target_transform`` apply to
    one sample. A distributed dataset is served through :class:`DataLoader`.

    Heat's keywords (``heat.utils.data.Dataset(array, transforms=None, ishuffle=False,
    test_set=False)``): ``transforms`` is a callable or a list of them whose first entry is
    applied to each sample (Heat's ``__getitem__`` does the same; the list is kept as
    ``self.transforms``); ``ishuffle`` is stored as ``self.ishuffle`` and changes nothing, since
    :class:`DataLoader` reshuffles across all ranks by its own rule (module docstring);
    ``test_set=True`` (``self.test_set``) makes :class:`DataLoader` keep the order, as Heat does
    not shuffle a test set.
    """

    def __init__(self, data, targets=None, transform: Callable | None = None,
                 target_transform: Callable | None = None, *,
                 transforms: Callable | Sequence[Callable] | None = None, ishuffle: bool = False,
                 test_set: bool = False) -> None:
        if not _is_array(data):
            raise TypeError(f"data must be a DNDarray, a torch tensor, a numpy array, a torch "
                            f"dataset or a sequence of samples, got {type(data).__name__}")
        if callable(targets) or (isinstance(targets, (list, tuple)) and targets
                                 and all(callable(t) for t in targets)):
            raise TypeError("targets must be an array, got a callable: Heat's second argument "
                            "is a keyword here, Dataset(data, transforms=...)")
        if targets is not None and not _is_array(targets):
            raise TypeError(f"targets must be a DNDarray, a torch tensor, a numpy array or a "
                            f"sequence, got {type(targets).__name__}")
        for name, flag in (("ishuffle", ishuffle), ("test_set", test_set)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if transforms is not None:
            if not isinstance(transforms, (list, tuple)):
                transforms = [transforms]
            transforms = list(transforms)
            if not transforms or not all(callable(t) for t in transforms):
                raise TypeError("transforms must be a callable or a non-empty list of callables")
            if transform is not None:
                raise TypeError("give transform or Heat's transforms, not both")
            transform = transforms[0]
        self.transforms = transforms
        self.ishuffle = ishuffle
        self.test_set = test_set
        self.distributed = _is_dndarray(data)
        if targets is not None and _is_dndarray(targets) != self.distributed:
            raise TypeError("data and targets must both be DNDarrays or both be local arrays")
        if self.distributed:
            for name, arr in (("data", data), ("targets", targets)):
                if arr is not None and arr.split != 0:
                    raise ValueError(f"{name} must be split along axis 0, got split={arr.split}")
            if targets is not None and data.gshape[0] != targets.gshape[0]:
                raise ValueError(f"data has {data.gshape[0]} samples, targets "
                                 f"{targets.gshape[0]}")
            if targets is not None and data.lshape_map[:, 0].tolist() != \
                    targets.lshape_map[:, 0].tolist():
                raise ValueError("data and targets must be distributed the same way")
            self.comm = data.comm
            self.num_samples = data.gshape[0]
        else:
            data = torch.as_tensor(data) if isinstance(data, np.ndarray) else data
            targets = torch.as_tensor(targets) if isinstance(targets, np.ndarray) else targets
            if targets is not None and len(data) != len(targets):
                raise ValueError(f"data has {len(data)} samples, targets {len(targets)}")
            self.num_samples = len(data)
        self.data, self.targets = data, targets
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return self.num_samples

    def _item(self, x, y):
        if self.transform is not None:
            x = self.transform(x)
        if y is None:
            return x
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y

    def __getitem__(self, index: int):
        if self.distributed:
            raise TypeError("a distributed Dataset is read through heatlike.utils.data.DataLoader")
        return self._item(self.data[index], None if self.targets is None else self.targets[index])

    def fetch(self, wanted: Sequence[torch.Tensor], comm: MPICommunication) -> tuple:
        """Collective for distributed data: this rank's rows ``wanted[comm.rank]`` (global indices,
        in that order) of data and targets, when rank r asks for ``wanted[r]``; one Alltoallv per
        array."""
        arrays = [self.data] + ([self.targets] if self.targets is not None else [])
        return tuple(_fetch_rows(a, wanted, comm) for a in arrays)


def _fetch_rows(array, wanted: Sequence[torch.Tensor], comm: MPICommunication) -> torch.Tensor:
    """Rows ``wanted[comm.rank]`` of the split-0 DNDarray ``array`` on this rank, in that order,
    when every rank asks for ``wanted[rank]``. Each row travels once, straight from its owner."""
    local = array.larray
    counts = [int(c) for c in array.lshape_map[:, 0].tolist()]
    starts = np.cumsum([0] + counts[:-1])
    row = tuple(local.shape[1:])
    me = comm.rank
    start, stop = int(starts[me]), int(starts[me]) + counts[me]
    sends = []
    for indices in wanted:
        mask = (indices >= start) & (indices < stop)
        sends.append(local[indices[mask] - start])
    send = torch.cat(sends) if sends else local[:0]
    owner = np.searchsorted(np.cumsum(counts), wanted[me].numpy(), side="right")
    mine = torch.empty((len(wanted[me]), *row), dtype=local.dtype)
    rcounts = [int((owner == s).sum()) for s in range(comm.size)]
    recv = torch.empty((sum(rcounts), *row), dtype=local.dtype)
    comm.Alltoallv((send.contiguous(), [s.shape[0] for s in sends]), (recv, rcounts))
    offset = 0
    for s in range(comm.size):
        positions = torch.from_numpy(np.nonzero(owner == s)[0])
        mine[positions] = recv[offset:offset + rcounts[s]]
        offset += rcounts[s]
    return mine


class DataLoader:
    """Batches of a :class:`Dataset` (or any torch dataset held on every rank) for this rank,
    following :class:`DistributedBatchSampler`: same number of batches on every rank, reshuffled
    every epoch from ``seed``. ``progress=True`` shows a tqdm bar on rank 0 only.

    ``dataset`` may also be an array (DNDarray split along axis 0, torch tensor, numpy array),
    wrapped in a :class:`Dataset`; anything else raises ``TypeError`` on every rank.
    ``batch_size`` is per rank (default 1, as in Heat). ``shuffle=None`` (default) shuffles unless
    the dataset was built with Heat's ``test_set=True``.

    Iterating starts the next epoch (``set_epoch`` chooses one explicitly). ``state_dict()``
    records the epoch and how many batches of it were served; after ``load_state_dict`` the next
    iteration continues the interrupted epoch with the batch after the last one served."""

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool | None = None, seed: int = 0,
                 drop_last: bool = False, comm: MPICommunication | None = None,
                 progress: bool = False, collate_fn: Callable | None = None) -> None:
        error = None
        if not isinstance(dataset, torch.utils.data.Dataset) and (
                _is_dndarray(dataset) or isinstance(dataset, (torch.Tensor, np.ndarray))):
            try:
                dataset = Dataset(dataset)
            except (TypeError, ValueError) as bad:  # raised below on every rank
                error = bad
                if _is_dndarray(dataset) and comm is None:
                    comm = dataset.comm
        distributed = isinstance(dataset, Dataset) and dataset.distributed
        self.comm = sanitize_comm(dataset.comm if distributed else comm)
        if error is None and not isinstance(dataset, torch.utils.data.Dataset):
            error = TypeError(f"dataset must be a heatlike.utils.data.Dataset, a torch Dataset or "
                              f"an array (DNDarray, torch.Tensor, numpy.ndarray), got "
                              f"{type(dataset).__name__}")
        elif error is None and shuffle is not None and not isinstance(shuffle, bool):
            error = TypeError(f"shuffle must be a bool or None, got {type(shuffle).__name__}")
        if shuffle is None:  # Heat's rule: a test set is not shuffled
            shuffle = not getattr(dataset, "test_set", False)
        if error is None:
            try:
                self.sampler = DistributedBatchSampler(len(dataset), batch_size, self.comm,
                                                       shuffle, seed, drop_last)
            except (TypeError, ValueError) as e:
                error = e
        raise_together(error, self.comm)
        self.dataset = dataset
        agree_on({"samples": len(dataset), "batch_size": batch_size, "shuffle": shuffle,
                  "seed": seed, "drop_last": drop_last}, self.comm, "the DataLoader")
        self.progress = progress
        self.collate_fn = collate_fn
        self._position = 0  # batches of the current epoch served so far
        self._skip = 0      # batches the next iteration skips (a restored position)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves (advances after each complete pass)."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The epoch, the samples of it served so far (over all ranks) and the sampling
        configuration they refer to."""
        return {"epoch": self.sampler.epoch,
                "samples": self._position * self.sampler.global_batch_size,
                "seed": self.sampler.seed, "shuffle": self.sampler.shuffle,
                "num_samples": self.sampler.num_samples}

    def load_state_dict(self, state: dict) -> None:
        """Continue where :meth:`state_dict` was taken (at another world size, from the first
        global batch not completely served)."""
        mine = (self.sampler.seed, self.sampler.shuffle, self.sampler.num_samples)
        saved = (state["seed"], state["shuffle"], state["num_samples"])
        if mine != saved:
            raise ValueError(f"the saved data loader state is for (seed, shuffle, samples) = "
                             f"{saved}, this loader has {mine}")
        self.sampler.set_epoch(int(state["epoch"]))
        self._skip = int(state["samples"]) // self.sampler.global_batch_size
        self._position = self._skip

    def _exact_state(self) -> tuple[int, int, int]:
        """Everything :meth:`load_state_dict` changes, including the batches the next iteration
        skips, which ``state_dict`` cannot tell from the batches served by an iteration still
        running: a failed checkpoint load puts this back (``_set_exact_state``) so that a live
        iteration goes on, and the next one starts, exactly as before the load."""
        return self.sampler.epoch, self._position, self._skip

    def _set_exact_state(self, state: tuple[int, int, int]) -> None:
        epoch, self._position, self._skip = state
        self.sampler.set_epoch(epoch)

    def _batches(self, skip: int = 0) -> Iterator:
        ds = self.dataset
        if not (isinstance(ds, Dataset) and ds.distributed):
            # torch's loader draws a seed for its workers when an epoch starts: from a generator
            # of its own, not from the global RNG, whose stream (dropout masks) a resumed run
            # must continue exactly where it was saved
            own = torch.Generator().manual_seed(self.sampler.seed + self.sampler.epoch)
            yield from torch.utils.data.DataLoader(ds, batch_sampler=list(self.sampler)[skip:],
                                                   collate_fn=self.collate_fn, generator=own)
            return
        wanted = [self.sampler.rank_indices(r) for r in range(self.comm.size)]
        arrays = ds.fetch(wanted, self.comm)
        b = self.sampler.batch_size
        transformed = ds.transform is not None or ds.target_transform is not None
        for step in range(skip, len(self)):
            rows = [a[step * b:(step + 1) * b] for a in arrays]
            if transformed or self.collate_fn is not None:
                targets = rows[1] if len(rows) > 1 else [None] * b
                collate = self.collate_fn or torch.utils.data.default_collate
                yield collate([ds._item(x, y) for x, y in zip(rows[0], targets)])
            else:
                yield rows[0] if len(rows) == 1 else tuple(rows)

    def __iter__(self) -> Iterator:
        skip, self._skip = self._skip, 0
        self._position = skip
        batches = self._batches(skip)
        if self.progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, total=len(self), initial=skip, disable=self.comm.rank != 0,
                           desc=f"epoch {self.sampler.epoch}", leave=False)
        for batch in batches:
            self._position += 1
            yield batch
        self.sampler.set_epoch(self.sampler.epoch + 1)
        self._position = 0


# Heat's module name for the loader and the dataset: heat.utils.data.datatools
datatools = types.ModuleType(
    __name__ + ".datatools",
    "Heat's ``heat.utils.data.datatools``: heatlike's :class:`DataLoader` and :class:`Dataset` "
    "(the same classes as in ``heatlike.utils.data``).")
datatools.DataLoader = DataLoader
datatools.Dataset = Dataset
datatools.__all__ = ["DataLoader", "Dataset"]
datatools.__spec__ = importlib.machinery.ModuleSpec(datatools.__name__, None)
sys.modules[datatools.__name__] = datatools
