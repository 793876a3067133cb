"""CUDA-aware detection everywhere; CUDA buffer paths where a GPU is present (skipped otherwise)."""

import os

import pytest
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core import cuda_aware

pytestmark = pytest.mark.mpi

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_detection_asks_the_library_and_honours_the_override(monkeypatch):
    answer = cuda_aware.query_library()
    assert answer in (True, False, None)
    monkeypatch.delenv("HEATLIKE_CUDA_AWARE_MPI", raising=False)
    assert cuda_aware.refresh() is bool(answer)
    monkeypatch.setenv("HEATLIKE_CUDA_AWARE_MPI", "1")
    assert cuda_aware.refresh() is True
    monkeypatch.setenv("HEATLIKE_CUDA_AWARE_MPI", "0")
    assert cuda_aware.refresh() is False
    monkeypatch.setenv("HEATLIKE_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ValueError, match="HEATLIKE_CUDA_AWARE_MPI"):
        cuda_aware.refresh()
    monkeypatch.delenv("HEATLIKE_CUDA_AWARE_MPI")
    cuda_aware.refresh()


def test_assumed_overrides_the_answer_inside_its_block():
    before = cuda_aware.cuda_aware()
    for aware in (True, False):
        with cuda_aware.assumed(aware):
            assert cuda_aware.cuda_aware() is aware
        assert cuda_aware.cuda_aware() == before


def test_loaded_mpi_library_is_found():
    """The ctypes probe looks at the libmpi mpi4py actually loaded."""
    libs = cuda_aware._loaded_mpi_libraries()
    assert any("libmpi" in os.path.basename(p) for p in libs), libs


def _device(comm):
    return torch.device("cuda", comm.rank % torch.cuda.device_count())


@needs_cuda
@pytest.mark.parametrize("aware", ["0", "library"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_collectives(comm, monkeypatch, aware, dtype):
    """CUDA tensors (contiguous and strided) through host staging (HEATLIKE_CUDA_AWARE_MPI=0) and
    through whatever the library supports; every completion path copies back."""
    if aware == "0":
        monkeypatch.setenv("HEATLIKE_CUDA_AWARE_MPI", "0")
    cuda_aware.refresh()
    try:
        dev = _device(comm)
        for n in (5, 40_000):
            x = torch.full((n,), float(comm.rank + 1), dtype=dtype, device=dev)
            y = torch.empty_like(x)
            comm.Allreduce(x, y)
            assert (y == sum(range(1, comm.size + 1))).all()
            base = torch.zeros(2 * n, dtype=dtype, device=dev)
            view = base[::2]
            view.fill_(1.0)
            comm.Iallreduce(hl.IN_PLACE, view).wait()
            assert (view == comm.size).all() and (base[1::2] == 0).all()
            req = comm.Iallreduce(x, y, MPI.MAX)
            while not req.test():
                pass
            assert (y == comm.size).all()
        g = torch.empty(comm.size * 3, dtype=dtype, device=dev)
        comm.Allgather(torch.full((3,), float(comm.rank), dtype=dtype, device=dev), g)
        expected = torch.arange(comm.size, device=dev).repeat_interleave(3).to(dtype)
        assert torch.equal(g, expected)
        b = torch.full((4,), 3.0 if comm.rank == 0 else 0.0, dtype=dtype, device=dev)
        hl.core.wait_all([comm.Ibcast(b, root=0)])
        assert (b == 3.0).all()
    finally:
        monkeypatch.delenv("HEATLIKE_CUDA_AWARE_MPI", raising=False)
        cuda_aware.refresh()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_pipelined_staging_on_the_device(comm, dtype):
    """Device buffers produced on a side stream, staged in chunks (``heatlike.core._staging``):
    the copy stream waits for the producer, and the result is visible on the current stream
    (every completion path), equal to the all-reduce of the same values on the host."""
    from heatlike.core import _staging

    dev = _device(comm)
    side = torch.cuda.Stream(dev)
    with cuda_aware.assumed(False), _staging.staging_chunk(1024 * 8):
        for n in (1, 1023, 1024, 1025, 10 * 1024 + 7, 300_000):
            host = (torch.arange(n) % 97 + comm.rank).to(dtype)
            expected = host.clone()
            comm.Allreduce(MPI.IN_PLACE, expected, MPI.SUM)
            for mode in ("blocking", "wait", "test"):
                with torch.cuda.stream(side):
                    x = torch.zeros(n, dtype=dtype, device=dev)
                    torch.cuda._sleep(1_000_000)  # the producer is still running at the call
                    x += host.to(dev, non_blocking=True)
                torch.cuda.current_stream(dev).wait_stream(side)
                if mode == "blocking":
                    comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
                else:
                    serial = comm.Dup(serial=True)
                    req = serial.Iallreduce(MPI.IN_PLACE, x, MPI.SUM)
                    if mode == "wait":
                        req.wait()
                    else:
                        while not req.Test():
                            pass
                    serial.Free()
                assert torch.equal(x.cpu(), expected), (n, mode)


@needs_cuda
def test_cupy_arrays(comm):
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(comm.rank % torch.cuda.device_count()):
        x = cupy.full(6, comm.rank + 1, dtype=cupy.float32)
        y = cupy.zeros(6, dtype=cupy.float32)
        comm.Allreduce(x, y)
        assert float(y[0]) == sum(range(1, comm.size + 1))
        z = cupy.zeros(12, dtype=cupy.float32)[::2]
        comm.Allreduce(x, z)
        assert bool((z == sum(range(1, comm.size + 1))).all())


@needs_cuda
def test_gpu_benchmark_suite_and_the_examples_device(comm):
    """The gpu suite runs (quick) and records every all-reduce size and both models; the digits
    recipe trains on the rank's GPU."""
    from heatlike.bench import gpu
    from heatlike.bench._common import Results
    from heatlike.recipes import train_digits
    from heatlike.utils import select_device

    results = Results()
    gpu.run(results, quick=True)
    ratios = {(r.case, r.metric) for r in results.records if r.unit == "ratio"}
    assert {("4 KiB", "allreduce cuda/host"), ("mlp-5M", "heatlike/ddp"),
            ("mlp-100K", "heatlike/ddp")} <= ratios
    device = select_device("cuda", comm)
    assert device.type == "cuda"
    result = train_digits("allreduce", comm, epochs=2, device=device)
    assert result.accuracy > 0.8
