"""CUDA-aware detection everywhere; CUDA buffer paths where a GPU is present (skipped otherwise)."""

import copy
import os

import pytest
import torch
from _helpers import rank_order_sum
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


@needs_cuda
@pytest.mark.parametrize("shots", ["one", "two"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_node_sum_through_the_peers_device_memory(comm, monkeypatch, dtype, shots):
    """Without a CUDA-aware library, ranks on one node sum device buffers through each other's
    memory (``heatlike.core._nodereduce``: no staging, no data through MPI): the rank-order sum,
    the same bits on every rank, for sizes around the shard boundaries and past the workspace's
    first size, in place and into a strided view, after a producer on a side stream, blocking
    and non-blocking on a serial communicator; in one shot and in two."""
    from heatlike.core import _nodereduce

    monkeypatch.setattr(_nodereduce, "MIN_BYTES", 0)
    if shots == "two":
        monkeypatch.setattr(_nodereduce, "ONE_SHOT_BYTES", 0)
    dev = _device(comm)
    side = torch.cuda.Stream(dev)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    with cuda_aware.assumed(False):
        for n in (1, comm.size + 1, 1000, 2 ** 21 // itemsize + 5):
            g = torch.Generator().manual_seed(100 * comm.rank + n)
            host = (torch.randn(n, generator=g) * 40).to(dtype)
            expected = rank_order_sum(comm, host)
            for mode in ("blocking", "serial"):
                with torch.cuda.stream(side):
                    x = torch.zeros(n, dtype=dtype, device=dev)
                    torch.cuda._sleep(1_000_000)  # the producer is still running at the call
                    x += host.to(dev, non_blocking=True)
                torch.cuda.current_stream(dev).wait_stream(side)
                out = torch.zeros(2 * n, dtype=dtype, device=dev)[::2]
                if mode == "blocking":
                    comm.Allreduce(x, out, MPI.SUM)
                    comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
                else:
                    with comm.Dup(serial=True) as serial:
                        serial.Iallreduce(x, out, MPI.SUM).Wait()
                        req = serial.Iallreduce(MPI.IN_PLACE, x, MPI.SUM)
                        while not req.Test():
                            pass
                assert torch.equal(x.cpu(), expected), (n, mode)
                assert torch.equal(out.cpu(), expected), (n, mode)
        shared = comm.handle.Split_type(MPI.COMM_TYPE_SHARED)
        one_node = shared.Get_size() == comm.size
        shared.Free()
        one_gpu = len(set(comm.handle.allgather(str(torch.cuda.get_device_properties(dev).uuid))))
        if comm.size > 1:  # ranks on different GPUs are staged
            assert comm._hub.node is not None
            assert comm._hub.node.usable == (one_node and one_gpu == 1)


@needs_cuda
def test_data_parallel_on_the_node_path_trains_the_staged_model(comm, monkeypatch):
    """DataParallel's CUDA buckets summed through the peers' memory train the model that
    staging through host memory trains (bitwise at two ranks), which is the model of one
    process with the combined batch."""
    from heatlike.core import _nodereduce

    monkeypatch.setattr(_nodereduce, "MIN_BYTES", 0)  # the model's buckets are small
    dev = _device(comm)
    P, r, B = comm.size, comm.rank, 8

    def batches():
        g = torch.Generator().manual_seed(7)
        return [(torch.randn(P * B, 12, generator=g), torch.randint(0, 4, (P * B,), generator=g))
                for _ in range(4)]

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 4)).to(dev)

    def train(node_path):
        local = net()
        with cuda_aware.assumed(False), _nodereduce.enabled(node_path):
            opt = hl.optim.DataParallelOptimizer(torch.optim.SGD(local.parameters(), lr=0.1),
                                                 blocking=True)
            model = hl.nn.DataParallel(local, comm, opt, bucket_cap_mb=1000 / 2 ** 20)
            for x, y in batches():
                mine = slice(r * B, (r + 1) * B)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[mine].to(dev)),
                                                  y[mine].to(dev)).backward()
                opt.step()
            model.close()
        return [p.detach().cpu() for p in local.parameters()]

    reference = net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches():
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x.to(dev)), y.to(dev)).backward()
        ref_opt.step()
    staged, node = train(False), train(True)
    for a, b, c in zip(staged, node, reference.parameters()):
        if comm.size <= 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, c.detach().cpu(), rtol=1e-5, atol=1e-6)


#: algorithms whose model is the exact data-parallel average with SGD: their parameters on the
#: GPU equal the CPU run's to float32 rounding (the others compress, sample or gossip, and Adam's
#: normalized step turns rounding differences in near-zero gradients into steps of size lr)
EXACT = ("allreduce", "allreduce-nonblocking", "centralized-sgd", "custom-clip",
         "hierarchical", "distopt-fused")
_DATA = {}


@needs_cuda
@pytest.mark.mpi_timeout(240)
@pytest.mark.parametrize("name", sorted(__import__("heatlike.recipes",
                                                   fromlist=["ALGORITHMS"]).ALGORITHMS))
def test_every_algorithm_trains_on_the_gpu_as_on_the_cpu(comm, name):
    """Every algorithm of ``heatlike.recipes`` (DataParallel, the mlbench and SINGA presets,
    FP16Optimizer, DASO) trains the digits MLP on the rank's GPU: 2 epochs reach the CPU run's
    test accuracy within 0.1, and the exact algorithms' parameters equal the CPU run's."""
    from heatlike.recipes import digits_task, load_digits_split, train_task

    data = _DATA.setdefault("digits", load_digits_split(0))
    runs = {}
    for device in ("cpu", _device(comm)):
        runners = []
        result = train_task(name, comm, digits_task(0, data), epochs=2, curve=False,
                            device=device, on_runner=runners.append)
        model = runners[0].eval_model()
        runs[str(device)[:4]] = (result.accuracy,
                                 [p.detach().cpu().clone() for p in model.parameters()])
        runners[0].close()
    (cpu_acc, cpu_params), (gpu_acc, gpu_params) = runs["cpu"], runs["cuda"]
    assert abs(gpu_acc - cpu_acc) <= 0.1, (name, gpu_acc, cpu_acc)
    assert gpu_acc > 0.3, (name, gpu_acc)
    assert all(torch.isfinite(p).all() for p in gpu_params), name
    if name in EXACT:
        for a, b in zip(gpu_params, cpu_params):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-4)


@needs_cuda
@pytest.mark.parametrize("wrapper", ["DataParallel", "DASO"])
def test_grad_scaler_on_the_gpu_gives_the_one_process_step(comm, monkeypatch, wrapper):
    """torch's AMP recipe with a CUDA GradScaler (scale, backward, unscale_, clip_grad_norm_,
    step, update) through DataParallel and DASO (every rank its own node: the cross-node path)
    equals one process's step on the combined batch; a step whose gradients overflow on one
    rank is skipped on every rank."""
    from heatlike.nn import DataParallel, DataParallelMultiGPU
    from heatlike.optim import DASO, DataParallelOptimizer

    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "1")
    dev, P, r, B = _device(comm), comm.size, comm.rank, 4
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 3)).to(dev)
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(P * B, 5, generator=g).to(dev), torch.randint(0, 3, (P * B,), generator=g)
    y = y.to(dev)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    expected = [(p - 0.1 * p.grad).detach() for p in ref.parameters()]
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    if wrapper == "DASO":
        opt = DASO(torch.optim.SGD(net.parameters(), lr=0.1), total_epochs=3, comm=comm,
                   warmup_epochs=1, cooldown_epochs=1, downcast_type=torch.float32)
        opt.add_scaler(scaler)
        model = DataParallelMultiGPU(net, opt)
        opt.last_batch = 4
    else:
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
        model = DataParallel(net, comm, opt)
    mine = slice(B * r, B * (r + 1))
    for poison in (False, True):
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
        if poison and r == P - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        if wrapper == "DASO":
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        for p, e in zip(net.parameters(), before if poison else expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == 512.0
    model.close()


@needs_cuda
def test_sync_batchnorm_on_the_gpu_as_on_the_cpu(comm):
    """SyncBatchNorm over CUDA inputs: the outputs, input gradients and running statistics of the
    same batches on the CPU (statistics gathered through host memory)."""
    device = hl.utils.select_device("cuda", comm)
    results = {}
    for where in ("cpu", device):
        torch.manual_seed(0)
        norm = hl.nn.SyncBatchNorm(4).to(where)
        g = torch.Generator().manual_seed(comm.rank)
        x = (torch.randn(3, 4, 5, 5, generator=g) * 2 + 1).to(where).requires_grad_()
        out = norm(x)
        (out * out).sum().backward()
        results[str(where)] = [t.detach().cpu() for t in (out, x.grad, norm.running_mean,
                                                          norm.running_var, norm.weight.grad)]
    for on_cpu, on_gpu in zip(*results.values()):
        torch.testing.assert_close(on_gpu, on_cpu, atol=1e-5, rtol=1e-4)


@needs_cuda
def test_zero_redundancy_optimizer_on_the_gpu_as_unsharded(comm):
    """ZeroRedundancyOptimizer over CUDA parameters (shards broadcast through heatlike's device
    buffer paths): bitwise the unsharded Adam's parameters on every rank."""
    device = hl.utils.select_device("cuda", comm)
    torch.manual_seed(0)
    shapes = [(300, 300), (7,), (64, 33), (3,)]  # large ones in place, small ones packed
    ours = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = hl.optim.ZeroRedundancyOptimizer(ours, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(theirs, lr=0.01)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g).to(device)
            q.grad = p.grad.clone()
        opt.step()
        plain.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
