#!/usr/bin/env python3
"""Run Heat's own test files against heatlike (or against Heat itself) and count what passes.

    python scripts/conformance/run_heat_tests.py [--impl heatlike|heat] [--heat-path PATH]
        [--files factories,dndarray,arithmetics,statistics,manipulations] [--sizes 1,2,3]
        [--test-timeout 120] [--file-timeout 1800] [--json OUT] [--reference REF.json]
        [--tarball PATH] [--work DIR] [-k EXPR]

Heat's tests are never part of this repository: the script unpacks them at run time from the
tarball in ``../shared/conformance/`` (``--tarball`` to point elsewhere) into a scratch directory
and runs each file there under ``mpiexec -n N python -m pytest`` for every N of ``--sizes``.

``--impl heatlike`` (default) puts an alias package named ``heat`` first on ``PYTHONPATH``:
``import heat`` and ``import heat.core.x`` give heatlike's modules (thin module proxies that
forward every attribute), and ``heat.testing.basic_test.TestCase`` is a base class written here
(the helpers Heat's tests call: ``assert_array_equal``, ``assert_func_equal``, ...; its
``tearDown`` waits for every rank, so that a test failing on some ranks only does not leave the
others a test ahead). Nothing else is added: a name heatlike lacks fails the tests that use it.
``--impl heat`` runs the same files against a real Heat found on ``--heat-path`` (e.g.
``pip install --no-deps --target DIR heat``), which is how the reference is made.

Per test the verdict is taken over all ranks: ``pass`` when every rank passed, ``fail`` when any
rank failed, ``skip`` when skipped and none failed, ``hang`` when a test ran past
``--test-timeout`` (the launch is killed and resumed after that test), ``crash`` when the launch
died during it. Tests already finished are never run twice. ``--reference`` (the JSON of a run
with ``--impl heat``) restricts the counts to the tests that pass on Heat at the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARBALL = ROOT.parent / "shared" / "conformance" / "heat_tests-660efec.tar.xz"
TENSOR_FILES = ["factories", "dndarray", "arithmetics", "statistics", "manipulations"]

# -- files written into the scratch directory -------------------------------------------------

ALIAS_INIT = '''"""``heat`` resolved to heatlike: every ``heat.x.y`` module is a proxy of
``heatlike.x.y`` (except ``heat.testing``, the base class written by the conformance runner)."""
import importlib
import importlib.abc
import importlib.util
import sys
import types as _types

import heatlike as _target


class _Proxy(_types.ModuleType):
    """A module forwarding attribute reads to the heatlike module it stands for."""

    def __init__(self, name, real):
        super().__init__(name)
        object.__setattr__(self, "_real", real)

    def __getattr__(self, attr):
        return getattr(object.__getattribute__(self, "_real"), attr)

    def __dir__(self):
        return dir(object.__getattribute__(self, "_real"))


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if not name.startswith("heat.") or name.split(".")[1] == "testing":
            return None
        real = "heatlike." + name[len("heat."):]
        try:
            if importlib.util.find_spec(real) is None:
                return None
        except ModuleNotFoundError:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        real = importlib.import_module("heatlike." + spec.name[len("heat."):])
        return _Proxy(spec.name, real)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(attr):
    return getattr(_target, attr)


def __dir__():
    return dir(_target)


globals().update({k: v for k, v in vars(_target).items() if not k.startswith("__")})
'''

BASE_TEST = '''"""The base class Heat's tests derive from, written to run them against heatlike."""
import os
import unittest

import numpy as np
import torch
from mpi4py import MPI

import heat as ht


class TestCase(unittest.TestCase):
    device = None
    other_device = None
    envar = "cpu"
    is_mps = False
    _hostnames = None

    @classmethod
    def setUpClass(cls):
        if os.getenv("HEAT_TEST_USE_DEVICE", "cpu") != "cpu":
            raise RuntimeError("only HEAT_TEST_USE_DEVICE=cpu is supported here")
        ht.use_device("cpu")
        cls.device = ht.cpu
        cls.other_device = ht.cpu

    def setUp(self):
        ht.random.seed(42)

    def tearDown(self):
        # a test that failed on some ranks only must not leave the others a test ahead
        MPI.COMM_WORLD.Barrier()

    @property
    def comm(self):
        return ht.MPI_WORLD

    def get_rank(self):
        return self.comm.rank

    def get_size(self):
        return self.comm.size

    @classmethod
    def get_hostnames(cls):
        if not cls._hostnames:
            cls._hostnames = sorted(set(MPI.COMM_WORLD.allgather(os.uname()[1])))
        return cls._hostnames

    def assert_array_equal(self, heat_array, expected_array, rtol=1e-5, atol=1e-08):
        """Global shape, balanced local shape and values (on every rank) agree."""
        if isinstance(expected_array, torch.Tensor):
            expected_array = expected_array.cpu().numpy()
        self.assertIsInstance(heat_array, ht.DNDarray)
        self.assertIsInstance(expected_array, np.ndarray)
        self.assertEqual(tuple(heat_array.shape), expected_array.shape)
        if not heat_array.is_balanced():
            heat_array.balance_()
        split = heat_array.split
        key = [slice(None)] * heat_array.ndim
        if split is not None:
            lo = sum(heat_array.counts[: self.comm.rank])
            key[split] = slice(lo, lo + heat_array.counts[self.comm.rank])
        part = expected_array[tuple(key)]
        self.assertEqual(tuple(heat_array.lshape), part.shape)
        local = heat_array.larray.cpu()
        if local.dtype is torch.bfloat16:
            local = local.float()
        ok = int(np.allclose(local.numpy(), part, rtol=rtol, atol=atol))
        self.assertEqual(MPI.COMM_WORLD.allreduce(ok), self.comm.size)

    def assert_func_equal(self, shape, heat_func, numpy_func, distributed_result=True,
                          heat_args=None, numpy_args=None,
                          data_types=(np.int32, np.int64, np.float32, np.float64),
                          low=-10000, high=10000):
        if not isinstance(shape, (tuple, list)):
            raise ValueError(f"The shape must be either a list or a tuple but was {type(shape)}")
        for dtype in data_types:
            seed = MPI.COMM_WORLD.bcast(int(np.random.randint(1000000)), root=0)
            rng = np.random.default_rng(seed)
            if issubclass(dtype, np.floating):
                arr = rng.standard_normal(shape).astype(dtype)
            elif issubclass(dtype, np.integer):
                arr = rng.integers(low, high, shape).astype(dtype)
            else:
                raise ValueError(f"unsupported dtype {dtype}")
            self.assert_func_equal_for_tensor(arr, heat_func, numpy_func, heat_args, numpy_args,
                                              distributed_result)

    def assert_func_equal_for_tensor(self, tensor, heat_func, numpy_func, heat_args=None,
                                     numpy_args=None, distributed_result=True):
        self.assertTrue(callable(heat_func))
        self.assertTrue(callable(numpy_func))
        heat_args = heat_args or {}
        numpy_args = numpy_args or {}
        if isinstance(tensor, np.ndarray):
            t = torch.from_numpy(tensor.copy())
            np_array = tensor
        elif isinstance(tensor, torch.Tensor):
            t = tensor
            np_array = tensor.cpu().numpy().copy()
        else:
            raise TypeError(f"unsupported input {type(tensor)}")
        np_res = numpy_func(np_array, **numpy_args)
        if not isinstance(np_res, np.ndarray):
            np_res = np.array(np_res)
        for split in range(t.ndim):
            x = ht.array(t, split=split, dtype=t.dtype, device=self.device, comm=self.comm)
            res = heat_func(x, **heat_args)
            self.assertEqual(x.device, res.device)
            self.assertEqual(x.larray.device, res.larray.device)
            if distributed_result:
                self.assert_array_equal(res, np_res)
            else:
                self.assertTrue(np.array_equal(res.larray.cpu().numpy(), np_res))

    def assertTrue_memory_layout(self, tensor, order):
        stride = tensor.larray.stride()
        if order == "C":
            return self.assertTrue(all(np.diff(list(stride)) <= 0))
        if order == "F":
            return self.assertTrue(all(np.diff(list(stride)) >= 0))
        raise ValueError(f"expected order to be 'C' or 'F', but was {order}")
'''

PLUGIN = '''"""Records every test's outcome on this rank, line by line, for the runner."""
import os
import time

_out = None
_state = {}


def _rank():
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _log(line):
    global _out
    if _out is None:
        path = os.path.join(os.environ["HEATCONF_OUT"], f"rank{_rank()}.log")
        _out = open(path, "a", buffering=1)
    _out.write(line + "\\n")
    _out.flush()


def pytest_collection_modifyitems(session, config, items):
    skip_file = os.environ.get("HEATCONF_SKIP")
    skip = set()
    if skip_file and os.path.exists(skip_file):
        skip = set(open(skip_file).read().split("\\n"))
    keep = [it for it in items if it.nodeid not in skip]
    gone = [it for it in items if it.nodeid in skip]
    if gone:
        config.hook.pytest_deselected(items=gone)
    items[:] = keep
    _log("C " + str(len(keep)))


def pytest_runtest_logstart(nodeid, location):
    _state[nodeid] = "pass"
    _log(f"S {time.time():.3f} {nodeid}")


def pytest_runtest_logreport(report):
    if report.failed:
        _state[report.nodeid] = "fail"
    elif report.skipped and _state.get(report.nodeid) != "fail":
        _state[report.nodeid] = "skip"


def pytest_runtest_logfinish(nodeid, location):
    _log(f"R {_state.get(nodeid, 'fail')} {nodeid}")
'''


def _prepare(work: Path, tarball: Path, impl: str) -> Path:
    """Unpack the tests and write the alias package, base class and plugin; returns the test
    directory."""
    tests = work / "heat_tests"
    if not tests.exists():
        tests.mkdir(parents=True)
        with tarfile.open(tarball) as tf:
            tf.extractall(tests, filter="data")
    support = work / "support"
    if support.exists():
        shutil.rmtree(support)
    (support / "plugin").mkdir(parents=True)
    (support / "plugin" / "heatconf_plugin.py").write_text(PLUGIN)
    if impl == "heatlike":
        pkg = support / "alias" / "heat"
        (pkg / "testing").mkdir(parents=True)
        (pkg / "__init__.py").write_text(ALIAS_INIT)
        (pkg / "testing" / "__init__.py").write_text("")
        (pkg / "testing" / "basic_test.py").write_text(BASE_TEST)
    return tests / "tests"


def _read_logs(out: Path) -> dict[int, list[str]]:
    logs = {}
    for f in out.glob("rank*.log"):
        logs[int(f.stem[4:])] = f.read_text().splitlines()
    return logs


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_file(path: Path, size: int, env: dict[str, str], mpiexec: list[str], scratch: Path,
             test_timeout: float, file_timeout: float, kexpr: str | None) -> dict[str, str]:
    """Every test of one file at one size: ``{test id: verdict}``."""
    verdicts: dict[str, str] = {}
    outcomes: dict[str, dict[int, str]] = {}
    skip_file = scratch / "skip.txt"
    begin = time.monotonic()
    launches = 0
    while True:
        launches += 1
        out = scratch / f"launch{launches}"
        out.mkdir(parents=True)
        skip_file.write_text("\n".join(sorted(verdicts)))
        cmd = [*mpiexec, "-n", str(size), sys.executable, "-m", "pytest", "-q", "-p",
               "heatconf_plugin", "-p", "no:cacheprovider", "-o", "addopts=", str(path.name)]
        if kexpr:
            cmd += ["-k", kexpr]
        e = dict(env, HEATCONF_OUT=str(out), HEATCONF_SKIP=str(skip_file))
        with open(out / "stdout.txt", "w") as log:
            proc = subprocess.Popen(cmd, cwd=path.parent, env=e, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            hung = ""
            while proc.poll() is None:
                time.sleep(0.5)
                now = time.time()
                for lines in _read_logs(out).values():
                    started = [ln for ln in lines if ln.startswith("S ")]
                    finished = {ln.split(" ", 2)[2] for ln in lines if ln.startswith("R ")}
                    for ln in started:
                        _, t0, nid = ln.split(" ", 2)
                        if nid not in finished and now - float(t0) > test_timeout:
                            hung = nid
                if hung or time.monotonic() - begin > file_timeout:
                    _kill(proc)
                    break
        logs = _read_logs(out)
        running = ""
        for rank, lines in logs.items():
            for ln in lines:
                if ln.startswith("R "):
                    _, what, nid = ln.split(" ", 2)
                    outcomes.setdefault(nid, {})[rank] = what
            started = [ln.split(" ", 2)[2] for ln in lines if ln.startswith("S ")]
            if started and started[-1] not in {ln.split(" ", 2)[2] for ln in lines
                                               if ln.startswith("R ")}:
                running = running or started[-1]
        for nid, per_rank in outcomes.items():
            if nid in verdicts:
                continue
            if len(per_rank) == size or not (hung or running):
                vals = set(per_rank.values())
                verdicts[nid] = "fail" if "fail" in vals or len(per_rank) < size else \
                    "skip" if "skip" in vals else "pass"
        stuck = hung or running
        if stuck:
            verdicts[stuck] = "hang" if hung else "crash"
        if time.monotonic() - begin > file_timeout:
            verdicts["<file timeout>"] = "hang"
            break
        if not stuck:
            break
        if launches > 200:
            break
    return verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["heatlike", "heat"], default="heatlike")
    ap.add_argument("--heat-path", default="", help="PYTHONPATH entries holding a real Heat")
    ap.add_argument("--files", default=",".join(TENSOR_FILES))
    ap.add_argument("--sizes", default="1,2,3")
    ap.add_argument("--tarball", default=str(DEFAULT_TARBALL))
    ap.add_argument("--work", default="", help="scratch directory (default: a temporary one)")
    ap.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    ap.add_argument("--test-timeout", type=float, default=120.0)
    ap.add_argument("--file-timeout", type=float, default=1800.0)
    ap.add_argument("--json", default="", help="write the verdicts here")
    ap.add_argument("--reference", default="", help="verdicts of a run with --impl heat")
    ap.add_argument("-k", dest="kexpr", default=None, help="pytest -k expression")
    args = ap.parse_args(argv)

    tarball = Path(args.tarball)
    if not tarball.exists():
        print(f"Heat's tests not found at {tarball} (use --tarball)", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="heatconf-"))
    work.mkdir(parents=True, exist_ok=True)
    testdir = _prepare(work, tarball, args.impl)
    paths = [str(work / "support" / "plugin")]
    if args.impl == "heatlike":
        paths.insert(0, str(work / "support" / "alias"))
    elif args.heat_path:
        paths.insert(0, args.heat_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    reference = json.loads(Path(args.reference).read_text()) if args.reference else None

    results: dict[str, dict[str, dict[str, str]]] = {}
    rows = []
    for name in args.files.split(","):
        path = testdir / "core" / f"test_{name}.py"
        if not path.exists():
            path = next(testdir.rglob(f"test_{name}.py"))
        for size in (int(s) for s in args.sizes.split(",")):
            t0 = time.monotonic()
            scratch = work / "runs" / args.impl / f"{name}-{size}"
            if scratch.exists():
                shutil.rmtree(scratch)
            v = run_file(path, size, env, args.mpiexec.split(), scratch, args.test_timeout,
                         args.file_timeout, args.kexpr)
            results.setdefault(name, {})[str(size)] = v
            counted = v
            if reference is not None:
                ref = reference.get(name, {}).get(str(size), {})
                counted = {k: x for k, x in v.items() if ref.get(k) == "pass"}
                for k, x in ref.items():
                    if x == "pass" and k not in counted:
                        counted[k] = "fail"
            n = {w: sum(1 for x in counted.values() if x == w)
                 for w in ("pass", "fail", "skip", "hang", "crash")}
            total = len(counted)
            rows.append((name, size, n, total, time.monotonic() - t0))
            print(f"{name:14s} n={size}  pass {n['pass']:3d}/{total:3d}  fail {n['fail']:3d}  "
                  f"skip {n['skip']:2d}  hang {n['hang']}  crash {n['crash']}  "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    tot_pass = sum(r[2]["pass"] for r in rows)
    tot = sum(r[3] for r in rows)
    print(f"{'all':14s}        pass {tot_pass}/{tot} = {100 * tot_pass / max(tot, 1):.1f}%"
          + (" of the tests that pass on Heat" if reference is not None else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
