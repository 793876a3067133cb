"""``torch.compile`` with heatlike's wrappers: however the model is compiled (the wrapped module's
forward, the wrapper, ``Module.compile()``, or a module compiled and run before it was wrapped,
whose cached graph knows none of the wrapper's hooks), training gives the parameters eager
training gives. The ``aot_eager`` backend traces as inductor does (Dynamo and AOTAutograd) without
generating code, so the tests need no C compiler."""

import contextlib
import copy
import subprocess
import sys

import pytest
import torch
from _helpers import DynamoLog, sweep_case
from torch import nn

from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer
from heatlike.recipes import make_runner
from heatlike.testing.matrix import _clean_env

pytestmark = pytest.mark.mpi

BACKEND = "aot_eager"
KINDS = ["module forward", "wrapper", "Module.compile", "compiled before wrapping"]


def _compile_works() -> bool:
    try:
        return bool(torch.compile(lambda t: t + 1, backend=BACKEND)(torch.ones(1)) == 2)
    except Exception:  # noqa: BLE001 - any failure means: no torch.compile here
        return False


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    if not _compile_works():
        pytest.skip("torch.compile does not work in this environment")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Net(nn.Module):
    """BatchNorm (buffers the wrapper synchronizes before each forward), attention whose
    ``out_proj`` is used without being called, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.norm(self.embed(x)))
        h, _ = self.attn(h.view(-1, 2, 8), h.view(-1, 2, 8), h.view(-1, 2, 8),
                         need_weights=False)
        return self.head(h.mean(1))


def _batches(comm, steps: int = 3):
    g = torch.Generator().manual_seed(comm.rank)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(steps)]


def _train_data_parallel(comm, net, blocking: bool, kind: str | None) -> torch.Tensor:
    if kind == "compiled before wrapping":
        net.forward = torch.compile(net.forward, backend=BACKEND)
        net(torch.randn(8, 4))  # a graph traced before the wrapper's hooks exist
        net.load_state_dict(_Net().state_dict())
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, comm, opt, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    call = model
    if kind == "module forward":
        net.forward = torch.compile(net.forward, backend=BACKEND)
    elif kind == "wrapper":
        call = torch.compile(model, backend=BACKEND)
    elif kind == "Module.compile":
        model.compile(backend=BACKEND)
    for x, y in _batches(comm):
        opt.zero_grad()
        nn.functional.cross_entropy(call(x), y).backward()
        opt.step()
    model.close()  # applies what is pending and frees the communicators (many tests, one job)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()] +
                     [b.detach().reshape(-1).float() for b in net.buffers()])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_compiled_data_parallel_trains_as_eager(comm, blocking, kind):
    """DataParallel, blocking and with deferred updates (one bucket per parameter, so that
    updates are applied one by one), compiled four ways: the parameters and BatchNorm's buffers
    after three steps are those of the same training without compilation."""
    sweep_case(comm, (blocking, kind) in ((True, "wrapper"), (False, "module forward")))
    eager = _train_data_parallel(comm, _Net(), blocking, None)
    torch._dynamo.reset()
    compiled = _train_data_parallel(comm, _Net(), blocking, kind)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["module forward", "Module.compile"])
def test_compiled_daso_trains_as_eager(comm, kind):
    """DASO's module wrapper under torch.compile: its schedule (which synchronization a batch's
    backward runs) is set before every forward, so the parameters equal eager training's."""
    sweep_case(comm, kind == "module forward")

    def train(compile_kind):
        net = _Net()
        runner = make_runner("daso", net, comm, 0.05, 3)
        if compile_kind == "module forward":
            net.forward = torch.compile(net.forward, backend=BACKEND)
        elif compile_kind == "Module.compile":
            runner.model.compile(backend=BACKEND)
        for _ in range(3):
            runner.start_epoch(3)
            for x, y in _batches(comm):
                runner.train_step(x, y)
            runner.end_epoch(1.0)
        runner.finish()
        runner.close()
        return torch.cat([p.detach().reshape(-1) for p in copy.deepcopy(net).parameters()])

    eager = train(None)
    torch._dynamo.reset()
    torch.testing.assert_close(train(kind), eager, rtol=1e-6, atol=1e-7)


# one algorithm per kind of entry point: DataParallel's (with deferred updates), a preset's
# engine, FP16Optimizer's backward_loss, DistOpt's backward_and_update, DASO's wrapper
WHOLE_STEP = ["allreduce-nonblocking", "powersgd-2", "fp16-optimizer", "distopt-fused", "daso"]


@pytest.mark.parametrize("name", WHOLE_STEP)
def test_a_whole_compiled_training_step_trains_as_eager(comm, name):
    """``torch.compile`` of a whole training step (forward, loss, backward, ``step()``): the
    optimizers' ``step``/``zero_grad`` and the engine's gradient hooks and end-of-backward
    callbacks run as plain Python (graph breaks; before, dynamo traced them from the backward
    pass and failed inside the communication code at every world size but one), so the
    parameters equal eager training's. The gradient hooks and the wrapper's module hooks are
    never traced: nothing of them is recompiled (before, dynamo traced each up to its graph break
    and compiled the rest once per parameter, or per hook signature, a recompilation each until
    its cache limit)."""
    sweep_case(comm, name in ("allreduce-nonblocking", "daso"))
    recompiled: list[str] = []

    def train(compiled: bool):
        net = _Net()
        runner = make_runner(name, net, comm, 0.05, 3)
        step = torch.compile(runner._step, backend=BACKEND) if compiled else runner._step
        probe = torch.compile(lambda t: t + 1, backend=BACKEND)
        runner.start_epoch(3)
        with DynamoLog("recompiles") if compiled else contextlib.nullcontext([]) as log:
            probe(torch.ones(2))
            probe(torch.ones(2, 2))  # a recompilation the log must show (the log works)
            for x, y in _batches(comm):
                step(x, y)
        recompiled.extend(r for r in log if r.startswith("Recompiling function"))
        runner.end_epoch(1.0)
        runner.finish()
        params = [p.detach().clone() for p in runner.eval_model().parameters()]
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        return torch.cat([p.reshape(-1) for p in params])

    eager = train(False)
    torch._dynamo.reset()
    torch.testing.assert_close(train(True), eager, rtol=1e-5, atol=1e-6)
    assert any("<lambda>" in r for r in recompiled), recompiled
    assert not [r for r in recompiled if "hooks.py" in r], recompiled


def test_a_compiled_step_that_synchronizes_before_clipping_trains_as_eager(comm):
    """Non-blocking DataParallel: ``synchronize()`` (the averaged gradients, now) and gradient
    clipping inside a compiled step, as a user clips: the eager model's parameters."""

    def train(compiled: bool):
        net = _Net()
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=False)
        model = DataParallel(net, comm, opt)

        def step(x, y):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.synchronize()
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()

        run = torch.compile(step, backend=BACKEND) if compiled else step
        for x, y in _batches(comm):
            run(x, y)
        model.close()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    eager = train(False)
    torch._dynamo.reset()
    torch.testing.assert_close(train(True), eager, rtol=1e-6, atol=1e-7)


def test_heatlike_does_not_import_torch_dynamo_until_something_compiles(comm):
    """heatlike's eager wrappers set dynamo's frame switches without importing ``torch._dynamo``
    (about a second and 90 MB per process): a DNDarray job and the communicator never load it,
    and where this torch lacks the switches the wrappers are ``torch.compiler.disable``'s."""
    code = ("import sys; import heatlike as ht; x = ht.arange(12, split=0); "
            "assert float((x * 2).sum()) == 132.0; ht.MPI_WORLD.Barrier(); "
            "loaded = sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'sympy'))); "
            "print(len(loaded), loaded[:3])")
    if comm.size > 1:
        pytest.skip("a one-process check: run at one rank")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env=_clean_env())
    assert out.stdout.strip() == "0 []", out.stdout + out.stderr

    import heatlike.engine.hooks as hooks

    def fn(t):
        return t + 1

    wrapped = hooks.eager(fn)
    assert wrapped._torchdynamo_disable and wrapped(1) == 2
    saved = hooks.set_eval_frame
    try:
        hooks.set_eval_frame = None
        fallback = hooks.eager(fn)
    finally:
        hooks.set_eval_frame = saved
    assert fallback is not wrapped and fallback._torchdynamo_disable and fallback(1) == 2
