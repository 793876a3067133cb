"""Pipelined staging: a large device buffer all-reduced through host memory in chunks.

Without a CUDA-aware MPI library a device buffer is reduced by copying it to host memory,
reducing it there and copying it back. Done one after the other, the two copies add to the
reduction's time. Cut into chunks, the three steps of different chunks overlap: while MPI reduces
chunk k, chunk k+1 is copied to the host and chunk k-1 back to the device.

Protocol of one all-reduce (:class:`Pipeline`):

1. the copy stream (one per device, kept) waits for the current stream, which produced the data;
2. chunk k is copied device -> host on the copy stream into a pinned buffer taken from a pool
   (buffers are reused; no page-locked allocation per call), and an event is recorded;
3. once that event has completed, chunk k's all-reduce starts, in place on the host buffer.
   Chunks start strictly in order, so every rank issues their collectives in the same order. A
   blocking call reduces each chunk with a blocking all-reduce while the copies of the other
   chunks proceed on the device; a non-blocking one starts non-blocking all-reduces;
4. once it has completed, chunk k is copied host -> device on the copy stream, and an event is
   recorded; when that event has completed the host buffer goes back to the pool and the next
   chunk's copy starts. At most :data:`DEPTH` chunks are in flight;
5. after the last chunk the current stream waits for the copy stream: work queued after the call
   sees the result.

The steps of a non-blocking pipeline advance whenever the operation is tested or waited for
(``Test``/``Wait`` of its request, :func:`~heatlike.core.communication.wait_all`, the engine's
progress calls). A blocking call runs chunk after chunk: wait for the chunk's copy, reduce it,
queue its copy back. MPICH's blocking all-reduce of the chunks one after the other took 0.86x
the time of its non-blocking all-reduces of the same chunks all in flight (16 MiB in 4 MiB
chunks of host memory, 2 ranks; 0.89x at 4), and the copies run on the device meanwhile. A
non-blocking pipeline's later chunks' collectives start when this rank's progress reaches them,
so a non-blocking pipelined reduction is only used on a communicator that promises one operation
at a time (``Dup(serial=True)``, the engine's private channels); elsewhere the non-blocking form
stages the whole buffer at once (a single collective).

Each chunk is reduced element by element exactly as in one call; only the MPI library's choice
of algorithm for the smaller message can change the order in which floating-point values of
three or more ranks are added (integers, and any two ranks, give bitwise the same result).

Without a GPU the same protocol runs on host tensors under ``force_staging`` (copies are
immediate and events absent), which is how the suite tests it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from mpi4py import MPI

from .buffer_pool import pool
from .env import env_float

__all__ = ["DEPTH", "chunk_bytes", "staging_chunk", "Pipeline"]

#: chunks in flight at once (each holds one pooled host buffer)
DEPTH = 4

_DEFAULT_CHUNK_MB = 4.0
_chunk_override: int | None = None


def chunk_bytes() -> int:
    """Bytes per chunk: ``HEATLIKE_STAGING_CHUNK_MB`` (MiB, default 4), or the value set by
    :func:`staging_chunk`."""
    if _chunk_override is not None:
        return _chunk_override
    mb = env_float("HEATLIKE_STAGING_CHUNK_MB", _DEFAULT_CHUNK_MB, minimum=1e-6,
                   meaning="MiB per chunk of a pipelined staged reduction")
    return max(1, int(mb * 2 ** 20))


@contextlib.contextmanager
def staging_chunk(nbytes: int) -> Iterator[None]:
    """Use chunks of ``nbytes`` bytes inside the block (tests and benchmarks)."""
    global _chunk_override
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
    old, _chunk_override = _chunk_override, nbytes
    try:
        yield
    finally:
        _chunk_override = old


# ---------------------------------------------------------------------------- copy streams


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    return stream


# ---------------------------------------------------------------------------- the pipeline


class _Chunk:
    __slots__ = ("start", "count", "raw", "host", "event", "request", "stage")

    def __init__(self, start: int, count: int, raw: torch.Tensor, dtype: torch.dtype) -> None:
        self.start, self.count, self.raw = start, count, raw
        self.host = raw[:count * dtype.itemsize].view(dtype)
        self.event = None
        self.request: MPI.Request | None = None
        self.stage = "in"  # "in" (to host), "mpi", "out" (back to the device)


class Pipeline:
    """One pipelined all-reduce of ``src`` into ``dst`` (contiguous tensors of one dtype and
    size; ``src is dst`` in place) with ``op`` over ``comm`` (an mpi4py communicator), in chunks
    of ``chunk`` elements. A request-like phase: ``Test()`` advances it and says whether it has
    finished, ``Wait()`` drives it to the end. Its first copies are queued at construction.
    ``blocking``: the chunks are reduced by blocking all-reduces, so only ``Wait()`` (or a
    ``Test()``, which then waits) completes it; every rank must pass the same value."""

    def __init__(self, comm: MPI.Comm, src: torch.Tensor, dst: torch.Tensor, op: MPI.Op,
                 mpi_type: MPI.Datatype, chunk: int, blocking: bool = False) -> None:
        self.comm, self.op, self.mpi_type = comm, op, mpi_type
        self.blocking = blocking  # the same on every rank: blocking calls never match others
        self.src, self.dst = src.view(-1), dst.view(-1)
        self.chunk = chunk
        self.n = self.dst.numel()
        self.cuda = dst.is_cuda
        self.itemsize = dst.element_size()
        self.stream = None
        if self.cuda:
            self.stream = _copy_stream(dst.device)
            self.stream.wait_stream(torch.cuda.current_stream(dst.device))
        self.flight: list[_Chunk] = []
        self.next_in = 0  # first element not yet taken to the host
        self.finished = False
        self._fill()

    # -- stages --------------------------------------------------------------------------------

    def _fill(self) -> None:
        while len(self.flight) < DEPTH and self.next_in < self.n:
            start = self.next_in
            count = min(self.chunk, self.n - start)
            c = _Chunk(start, count, pool.take(self.chunk * self.itemsize, pinned=self.cuda),
                       self.dst.dtype)
            c.event = self._copy(c.host, self.src[start:start + count])
            self.flight.append(c)
            self.next_in = start + count

    def _copy(self, to: torch.Tensor, frm: torch.Tensor):
        """Copy on the copy stream (immediately on the host); the event marking its end, or
        None."""
        if self.stream is None:
            to.copy_(frm)
            return None
        with torch.cuda.stream(self.stream):
            to.copy_(frm, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    @staticmethod
    def _done(event) -> bool:
        return event is None or event.query()

    def _advance(self) -> None:
        """Move every chunk as far as it can go without blocking; chunks start their collectives
        in order (a chunk waiting for its copy holds back the ones after it)."""
        may_start = True
        for c in list(self.flight):
            if c.stage == "in":
                if may_start and self._done(c.event):
                    memory = MPI.buffer.fromaddress(c.host.data_ptr(), c.host.nbytes)
                    c.request = self.comm.Iallreduce(
                        MPI.IN_PLACE, [memory, c.count, self.mpi_type], self.op)
                    c.stage = "mpi"
                else:
                    may_start = False
            if c.stage == "mpi" and c.request.Test():
                c.event = self._copy(self.dst[c.start:c.start + c.count], c.host)
                c.stage = "out"
            if c.stage == "out" and self._done(c.event):
                self._retire(c)
        self._finish_when_done()

    def _finish_when_done(self) -> None:
        """Queue the next chunks' copies; after the last chunk, order the current stream after
        the copy stream and mark the pipeline finished."""
        self._fill()
        if not self.flight and self.next_in >= self.n and not self.finished:
            if self.stream is not None:
                torch.cuda.current_stream(self.dst.device).wait_stream(self.stream)
            self.finished = True

    def _retire(self, c: _Chunk) -> None:
        self.flight.remove(c)
        pool.give(c.raw, pinned=self.cuda)

    # -- the request interface ------------------------------------------------------------------

    def Test(self, status: MPI.Status | None = None) -> bool:
        if self.blocking:
            self.Wait()
        elif not self.finished:
            self._advance()
        return self.finished

    def Wait(self, status: MPI.Status | None = None) -> None:
        """Drive the pipeline to its end (a blocking pipeline: :meth:`_run_blocking`). While a
        copy is in flight the stages are polled, so a
        chunk's collective starts the moment its copy ends (blocking in the oldest chunk's
        collective instead left the next chunks' collectives unstarted until it completed:
        16 MiB took 1.15-1.22x the host all-reduce's time on an H200, polled 0.99-1.12x); once
        every chunk in flight is in MPI, it blocks in the oldest one's."""
        if self.blocking:
            self._run_blocking()
            return
        while not self.Test():
            if all(c.stage == "mpi" for c in self.flight):
                self.flight[0].request.Wait()

    def _run_blocking(self) -> None:
        """Every chunk in order: wait for its copy to the host, reduce it with a blocking
        all-reduce, queue its copy back; a chunk's host buffer returns to the pool (and the next
        chunk's copy is queued) once its copy back has completed."""
        while not self.finished:
            c = next((c for c in self.flight if c.stage == "in"), None)
            if c is not None:
                if c.event is not None:
                    c.event.synchronize()
                memory = MPI.buffer.fromaddress(c.host.data_ptr(), c.host.nbytes)
                self.comm.Allreduce(MPI.IN_PLACE, [memory, c.count, self.mpi_type], self.op)
                c.event = self._copy(self.dst[c.start:c.start + c.count], c.host)
                c.stage = "out"
            for o in [o for o in self.flight if o.stage == "out"]:
                if c is None and o.event is not None:  # only copies back are left: wait
                    o.event.synchronize()
                if self._done(o.event):
                    self._retire(o)
            self._finish_when_done()

    def Cancel(self) -> None:
        """Collectives cannot be cancelled: nothing to do (as for MPI)."""

    wait, test = Wait, Test
