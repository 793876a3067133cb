"""Flat communication buffers: packing tensors, and gradient buckets.

Every optimizer and wrapper in heatlike moves tensors through the helpers here; nothing else
flattens or packs.

* :func:`comm_buffer` allocates a flat tensor for communication. On the CPU it is backed by numpy
  memory, which numpy advises the kernel to back with transparent huge pages; MPI's shared-memory
  transport is about 20% faster on such memory than on torch's own allocations (see
  ``python -m heatlike.bench comm``).
* :func:`pack` / :func:`unpack` copy a list of tensors into / out of one flat buffer.
* :func:`plan_buckets` groups parameters into :class:`Bucket` s: flat buffers of one dtype and
  device, filled in the given order (backward order for gradients), capped at ``cap_bytes`` with
  a smaller first bucket so communication starts early in the backward pass.

A bucket's buffer holds the parameters' values followed by one *flag* per parameter. Gradient
synchronization writes 1 into a parameter's flag when this rank has a gradient for it, so after a
sum all-reduce the flag counts the ranks that used the parameter in this step: no extra
collective is needed to tell unused parameters apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

__all__ = ["comm_buffer", "pack", "unpack", "dense", "Bucket", "plan_buckets"]

_NUMPY_STORAGE = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.bfloat16: np.uint16, torch.int64: np.int64, torch.int32: np.int32,
    torch.uint8: np.uint8, torch.int8: np.int8, torch.bool: np.bool_,
}


def dense(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a strided tensor: a sparse gradient (``nn.Embedding(sparse=True)``) enters a
    bucket as its dense values, so that its sum over ranks is the dense sum."""
    return grad if grad.layout == torch.strided else grad.to_dense()


def comm_buffer(numel: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialized flat tensor of ``numel`` elements for communication.

    CPU buffers live in numpy memory (huge pages for large buffers); other devices use torch's
    allocator."""
    device = torch.device(device)
    storage = _NUMPY_STORAGE.get(dtype)
    if device.type != "cpu" or storage is None:
        return torch.empty(numel, dtype=dtype, device=device)
    t = torch.from_numpy(np.empty(numel, dtype=storage))
    return t.view(dtype) if t.dtype != dtype else t


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``tensors`` (one dtype and device) one after the other into a flat buffer."""
    total = sum(t.numel() for t in tensors)
    if out is None:
        first = tensors[0]
        out = comm_buffer(total, first.dtype, first.device)
    elif out.numel() < total:
        raise ValueError(f"pack: out has {out.numel()} elements, need {total}")
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset:offset + n].view(t.shape).copy_(t)
        offset += n
    return out


def pack_range(tensors: Sequence[torch.Tensor], start: int, stop: int,
               out: torch.Tensor) -> torch.Tensor:
    """Elements ``start .. stop - 1`` of what :func:`pack` would give, copied into
    ``out[:stop - start]`` (returned) without packing the rest."""
    offset = 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            out[lo - start:hi - start].copy_(t.reshape(-1)[lo - offset:hi - offset])
        offset += n
        if offset >= stop:
            break
    return out[:stop - start]


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (inverse of :func:`pack`)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))
        offset += n


class Bucket:
    """Parameters communicated together through one flat buffer.

    ``buffer[offsets[i]:offsets[i] + numel_i]`` holds parameter i (``views[i]`` has its shape);
    ``flags[i]`` (``buffer[size + i]``) its flag. The buffer (zeroed, of the first parameter's
    dtype and device at planning) is allocated when it is first used: a bucket whose gradient
    is summed where backward left it (``heatlike.engine.gradsync``) may never need one.
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], offsets: list[int],
                 size: int, *, flagged: bool = True) -> None:
        self.index, self.params, self.offsets, self.size = index, params, offsets, size
        self.dtype, self.device = params[0].dtype, params[0].device
        self.itemsize = params[0].element_size()
        self.numel = size + (len(params) if flagged else 0)
        self._buffer: torch.Tensor | None = None

    @property
    def materialized(self) -> bool:
        """Whether the buffer has been allocated."""
        return self._buffer is not None

    @property
    def buffer(self) -> torch.Tensor:
        """The flat buffer: ``size`` values, then one flag per parameter (allocated, zeroed, at
        the first access)."""
        if self._buffer is None:
            self._materialize()
        return self._buffer

    @property
    def views(self) -> list[torch.Tensor]:
        """Parameter i's place in the buffer, with its shape."""
        if self._buffer is None:
            self._materialize()
        return self._views

    @property
    def flags(self) -> torch.Tensor:
        """The buffer's last elements: one use flag per parameter (summed over ranks by the
        exchange: how many ranks had a gradient for it)."""
        if self._buffer is None:
            self._materialize()
        return self._flags

    def _materialize(self) -> None:
        buffer = comm_buffer(self.numel, self.dtype, self.device)
        buffer.zero_()
        self._views = [buffer[o:o + p.numel()].view(p.shape)
                       for o, p in zip(self.offsets, self.params)]
        self._flags = buffer[self.size:]
        # flags are set once per gradient: through a numpy view of the buffer where numpy has
        # the type (0.1 us, against 1.4 us for a torch indexing call on the CPU and a kernel
        # launch on a GPU), else in a host array copied into the buffer once, at the launch
        # (page-locked for a device bucket: the copy is queued, not waited for)
        self._flags_in_place = self._flags.device.type == "cpu" and \
            self._flags.dtype in (torch.float32, torch.float64, torch.float16)
        self._flag_host = None
        if self._flags_in_place:
            self._flag_view = self._flags.numpy()
        else:
            host = torch.zeros(self._flags.numel(), dtype=torch.float32)
            self._flag_host = host.pin_memory() if self._flags.is_cuda else host
            self._flag_view = self._flag_host.numpy()
        self._buffer = buffer

    def set_flag(self, i: int, value: int) -> None:
        """Set parameter i's flag (in the buffer after :meth:`publish_flags`)."""
        if self._buffer is None:
            self._materialize()
        self._flag_view[i] = value

    def publish_flags(self) -> None:
        """Make the flags set so far part of the buffer (before it is communicated)."""
        if self._buffer is None:
            self._materialize()
        if not self._flags_in_place:
            # queued on a device: the host array is next written in the next cycle, after
            # this exchange (which follows the copy on the stream) has completed
            self._flags.copy_(self._flag_host, non_blocking=self._flags.is_cuda)

    def summed_flags(self) -> Sequence[float]:
        """The flags after the exchange, read on the host. Where this rank set every flag, each
        sum is positive whatever the others sent, so a device bucket is not read (a read would
        wait for the whole exchange and the copies queued before it)."""
        if self._buffer is None:
            self._materialize()
        if self._flags_in_place or not self._flag_view.all():
            return self._flags.tolist()
        return self._flag_view

    @property
    def values(self) -> torch.Tensor:
        """The parameter part of the buffer (without flags)."""
        return self.buffer[: self.size]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (allocated or not)."""
        return self.numel * self.itemsize


def plan_buckets(params: Iterable[torch.nn.Parameter], cap_bytes: int,
                 first_cap_bytes: int | None = None, flags: bool = True,
                 sizes: Sequence[int] | None = None,
                 solo_bytes: int | None = None, per_element: bool = False) -> list[Bucket]:
    """Group ``params`` into buckets in the given order.

    A bucket holds parameters of one dtype and device and at most ``cap_bytes`` of them (a single
    larger parameter gets a bucket of its own); the first bucket is capped at
    ``first_cap_bytes``. ``solo_bytes``: a parameter of at least that many bytes gets a bucket of
    its own too (gradients that large are summed in place, without a copy:
    ``heatlike.engine.gradsync``), and the smaller parameters around it keep filling their bucket,
    so that a model of large weights and small biases gets one bucket per weight and few for the
    biases, not one per bias; a bucket of small parameters is closed once the solo parameters
    placed since it opened reach its cap, so that its first gradients wait for at most about a
    cap of others. Such plans are ordered by the buckets' last parameters: the order in which they
    fill when gradients arrive in the given order. Every rank calling this with the same parameter
    list gets the same plan. ``sizes`` (a restored plan) gives the number of parameters of each
    bucket instead: bucket k holds the next ``sizes[k]`` parameters. ``per_element``: the caps count
    elements, not bytes (SINGA's fused buffers, sized in elements whatever the dtype).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    if sizes is not None:
        params = list(params)
        starts = np.cumsum([0, *sizes])
        groups = [params[a:b] for a, b in zip(starts[:-1], starts[1:])]
        if starts[-1] != len(params) or any(
                not g or len({(p.dtype, p.device) for p in g}) != 1 for g in groups):
            raise ValueError("bucket sizes must partition the parameters into non-empty "
                             "groups of one dtype and device")
        return _make_buckets(groups, flags)
    first_cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    groups: list[list[torch.nn.Parameter]] = []
    last: list[int] = []  # position of each group's last parameter
    # (dtype, device) -> [group index, bytes used, cap, solo bytes placed since it opened]
    open_groups: dict[tuple, list] = {}
    for position, p in enumerate(params):
        key = (p.dtype, p.device)
        nbytes = p.numel() if per_element else p.numel() * p.element_size()
        if solo_bytes is not None and nbytes >= solo_bytes:
            groups.append([p])
            last.append(position)
            for k, entry in list(open_groups.items()):
                entry[3] += nbytes
                if entry[3] >= entry[2]:
                    del open_groups[k]
            continue
        entry = open_groups.get(key)
        if entry is None or entry[1] + nbytes > entry[2]:
            entry = [len(groups), 0, first_cap if not groups else cap_bytes, 0]
            groups.append([])
            last.append(position)
            open_groups[key] = entry
        groups[entry[0]].append(p)
        last[entry[0]] = position
        entry[1] += nbytes
    if solo_bytes is None:  # groups in the order they opened, as before solo buckets existed
        return _make_buckets(groups, flags)
    order = sorted(range(len(groups)), key=last.__getitem__)
    return _make_buckets([groups[k] for k in order], flags)


def _make_buckets(groups: list[list[torch.nn.Parameter]], flags: bool) -> list[Bucket]:
    buckets = []
    for index, group in enumerate(groups):
        offsets, size = [], 0
        for p in group:
            offsets.append(size)
            size += p.numel()
        buckets.append(Bucket(index, list(group), offsets, size, flagged=flags))
    return buckets
