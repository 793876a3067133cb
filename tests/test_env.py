"""Environment variables: one parser (heatlike.core.env) behind every ``HEATLIKE_*`` variable.

Flags accept 1/0, true/false, on/off, yes/no in any case with spaces around; numbers are
validated (finite, within bounds); anything else raises ValueError naming the variable, the value
and what is accepted, on every rank (each reads its own environment; launchers give all ranks
the same). Every read in the package goes through the parser, and every variable is documented
in one table.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import mpiexec

from heatlike.core import checks, cuda_aware, env, topology
from heatlike.testing.matrix import _clean_env

log = importlib.import_module("heatlike.core.log")  # (heatlike.core.log is also the function)

ROOT = Path(__file__).resolve().parent.parent
VAR = "HEATLIKE_SOMETHING"


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("0", False), ("true", True), ("false", False), ("False", False),
    ("TRUE", True), ("on", True), ("Off", False), ("OFF", False), (" yes ", True), ("No", False),
    ("\tON\n", True)])
def test_flag_words_in_any_case(monkeypatch, value, expected):
    monkeypatch.setenv(VAR, value)
    assert env.env_flag(VAR, not expected) is expected


@pytest.mark.parametrize("value", [None, "", "   "])
def test_unset_or_blank_gives_the_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    assert env.env_flag(VAR, True) is True and env.env_flag(VAR, None) is None
    assert env.env_float(VAR, 2.5) == 2.5 and env.env_int(VAR, 3) == 3
    assert env.env_str(VAR, "x") == "x" and env.env_int_list(VAR) is None
    assert env.env_choice(VAR, "INFO", ["INFO", "DEBUG"]) == "INFO"


@pytest.mark.parametrize("value", ["2", "enabled", "y", "-1", "truee", "1 0"])
def test_other_flag_values_are_refused(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ValueError, match=rf"{VAR}={re.escape(repr(value.strip()))} is not valid:"
                                         " expected one of 1/0, true/false, on/off, yes/no"):
        env.env_flag(VAR)


@pytest.mark.parametrize("value,expected", [("3", 3.0), (" 2.5 ", 2.5), ("1e3", 1000.0),
                                            ("0", 0.0)])
def test_numbers(monkeypatch, value, expected):
    monkeypatch.setenv(VAR, value)
    assert env.env_float(VAR, None, minimum=0.0) == expected


@pytest.mark.parametrize("value", ["-5", "nan", "NaN", "inf", "-inf", "abc", "1,5", "5s"])
def test_bad_numbers_are_refused(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ValueError, match=rf"{VAR}=.* is not valid: expected a finite number >= 0"
                                         r" \(seconds\)"):
        env.env_float(VAR, None, minimum=0.0, meaning="seconds")


def test_integers_lists_and_choices(monkeypatch):
    monkeypatch.setenv(VAR, " 4 ")
    assert env.env_int(VAR, minimum=1) == 4
    for bad, says in [("4.0", "an integer >= 1"), ("0", "an integer >= 1"), ("x", "integer")]:
        monkeypatch.setenv(VAR, bad)
        with pytest.raises(ValueError, match=f"{VAR}='{re.escape(bad)}' is not valid: .*{says}"):
            env.env_int(VAR, minimum=1)
    monkeypatch.setenv(VAR, " 0, 0 ,1,1")
    assert env.env_int_list(VAR, minimum=0) == [0, 0, 1, 1]
    for bad in ["0,a", "0,,1", "0,-1"]:
        monkeypatch.setenv(VAR, bad)
        with pytest.raises(ValueError, match="comma-separated integers >= 0"):
            env.env_int_list(VAR, minimum=0)
    monkeypatch.setenv(VAR, "debug")
    assert env.env_choice(VAR, "INFO", ["INFO", "DEBUG"]) == "DEBUG"
    monkeypatch.setenv(VAR, "loud")
    with pytest.raises(ValueError, match="one of INFO, DEBUG"):
        env.env_choice(VAR, "INFO", ["INFO", "DEBUG"])


# -- every reader of a HEATLIKE_ variable ----------------------------------------------------------

def test_comm_timeout_and_stall_warning(monkeypatch):
    """Negative and nan used to be ignored silently (no deadline); 0 means off."""
    for name in ("HEATLIKE_COMM_TIMEOUT", "HEATLIKE_STALL_WARN"):
        for value, expected in [("2.5", 2.5), (" 30 ", 30.0), ("0", None), ("", None)]:
            monkeypatch.setenv(name, value)
            assert checks._env_seconds(name) == expected
        for bad in ["-5", "nan", "inf", "soon"]:
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name}='{bad}' is not valid: expected a "
                                                 "finite number >= 0 \\(seconds; 0 or unset: off"):
                checks._env_seconds(name)


def test_cuda_aware_override(monkeypatch):
    for value, expected in [("YES", True), (" off ", False), ("", None)]:
        monkeypatch.setenv("HEATLIKE_CUDA_AWARE_MPI", value)
        assert cuda_aware._from_environment() is expected
    monkeypatch.setenv("HEATLIKE_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ValueError, match="HEATLIKE_CUDA_AWARE_MPI='maybe' is not valid"):
        cuda_aware._from_environment()


def test_log_ranks(monkeypatch):
    for value, expected in [("ALL", None), ("*", None), ("0, 2", frozenset({0, 2})),
                            ("", frozenset({0}))]:
        monkeypatch.setenv("HEATLIKE_LOG_RANKS", value)
        assert log._parse_ranks() == expected
    monkeypatch.setenv("HEATLIKE_LOG_RANKS", "first")
    with pytest.raises(ValueError, match="HEATLIKE_LOG_RANKS='first' is not valid: .*or 'all'"):
        log._parse_ranks()


def test_node_layout(monkeypatch):
    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", " 2 ")
    assert topology._env_node_ids(5) == [0, 0, 1, 1, 2]
    for bad in ["0", "2.5", "two", "-1"]:
        monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", bad)
        with pytest.raises(ValueError, match="HEATLIKE_RANKS_PER_NODE=.* an integer >= 1"):
            topology._env_node_ids(4)
    monkeypatch.setenv("HEATLIKE_NODE_IDS", "0,1,x")
    with pytest.raises(ValueError, match="HEATLIKE_NODE_IDS='0,1,x' is not valid"):
        topology._env_node_ids(3)


def test_benchmark_layout_label(monkeypatch):
    """The benchmarks' label of the layout used to ignore a bad value (and report the real
    layout); now the same error as the topology."""
    from heatlike.bench._common import topology_label

    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "2")
    assert topology_label(4) == "2 emulated nodes x 2 ranks"
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "2 per node")
    with pytest.raises(ValueError, match="HEATLIKE_RANKS_PER_NODE"):
        topology_label(4)


PROBE = ("import logging, heatlike; from heatlike.core import checks; "
         "from heatlike.core.log import get_logger; get_logger(); "
         "print(f'settings {checks.checking()} {checks.timeout()} {checks.stall_warning()} "
         "{logging.getLogger(\"heatlike\").level}', flush=True)")  # one write: ranks interleave


def _probe(ranks: int, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, "-c", PROBE],
                          capture_output=True, text=True, timeout=120,
                          env={**_clean_env(), "HEATLIKE_COMM_TIMEOUT": "",
                               "HEATLIKE_STALL_WARN": "", "HEATLIKE_CHECK": "",
                               "HEATLIKE_LOG_LEVEL": "", **variables})


@pytest.mark.system
def test_the_variables_read_at_import_on_every_rank():
    """HEATLIKE_CHECK=False used to turn checking on; a bad value now stops every rank at
    import with the message, instead of being ignored."""
    proc = _probe(2, HEATLIKE_CHECK="False", HEATLIKE_COMM_TIMEOUT=" 7 ",
                  HEATLIKE_LOG_LEVEL="debug")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("settings False 7.0 None 10") == 2, proc.stdout
    proc = _probe(1, HEATLIKE_CHECK=" On ", HEATLIKE_STALL_WARN="0")
    assert "settings True None None 20" in proc.stdout, proc.stdout + proc.stderr
    proc = _probe(2, HEATLIKE_COMM_TIMEOUT="nan")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "settings" not in out
    assert out.count("environment variable HEATLIKE_COMM_TIMEOUT='nan' is not valid") == 2, out


# -- every read goes through the parser; every variable is documented ------------------------------

_RAW_READ = re.compile(r"""os\.environ\.get\(\s*["']HEATLIKE_|os\.getenv\(\s*["']HEATLIKE_|"""
                       r"""os\.environ\[\s*["']HEATLIKE_\w+["']\s*\](?!\s*=)|"""
                       r"""["']HEATLIKE_\w+["']\s+(?:not\s+)?in\s+os\.environ""")


def test_every_heatlike_variable_is_read_through_the_parser():
    offenders = []
    for path in sorted((ROOT / "heatlike").rglob("*.py")):
        if path.name == "env.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _RAW_READ.search(code) and not code.lstrip().startswith("del "):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "read these through heatlike.core.env:\n" + "\n".join(offenders)


def test_every_heatlike_variable_is_in_the_table():
    doc = (ROOT / "docs" / "communication.md").read_text()
    table = doc[doc.index("## Environment variables"):]
    table = table[:table.index("\n## ", 3)]
    named = set()
    for path in (ROOT / "heatlike").rglob("*.py"):
        named |= set(re.findall(r"HEATLIKE_[A-Z_]*[A-Z]", path.read_text()))
    missing = sorted(v for v in named if f"`{v}" not in table)
    assert not missing, f"not in docs/communication.md's table: {missing}"


def test_inplace_min_kb_sets_which_gradients_are_summed_in_place(monkeypatch, comm):
    """HEATLIKE_INPLACE_MIN_KB: parameters of at least that many KiB get buckets of their own
    (several ranks: summed in place); above the largest one, none does; a bad value raises on
    every rank, before anything is built."""
    import torch

    from heatlike.nn import DataParallel

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))  # 16 and 8 KiB
    for kib, solo in [("8", 2), ("9", 1), ("17", 0)]:
        monkeypatch.setenv("HEATLIKE_INPLACE_MIN_KB", kib)
        model = DataParallel(net, comm)
        try:
            assert sum(model.grad_sync._solo) == (solo if comm.size > 1 else 0), kib
        finally:
            model.close()
    for bad in ("0", "1.5", "big"):
        monkeypatch.setenv("HEATLIKE_INPLACE_MIN_KB", bad)
        with pytest.raises(ValueError, match="HEATLIKE_INPLACE_MIN_KB="):
            DataParallel(net, comm)


def test_hold_back_can_be_turned_off(monkeypatch, comm):
    """HEATLIKE_HOLD_BACK: non-blocking DataParallel holds back gradient buckets (on by
    default; never in blocking mode); 0 turns it off, a bad value raises on every rank."""
    import torch

    from heatlike.nn import DataParallel
    from heatlike.optim import DataParallelOptimizer

    def hold_back(blocking: bool) -> bool:
        net = torch.nn.Linear(4, 4)
        opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=blocking)
        model = DataParallel(net, comm, optimizer=opt)
        try:
            return model.grad_sync.hold_back
        finally:
            model.close()

    several = comm.size > 1  # one rank defers nothing
    assert hold_back(False) == several and not hold_back(True)
    monkeypatch.setenv("HEATLIKE_HOLD_BACK", "0")
    assert not hold_back(False)
    monkeypatch.setenv("HEATLIKE_HOLD_BACK", "sometimes")
    with pytest.raises(ValueError, match="HEATLIKE_HOLD_BACK="):
        hold_back(False)


def test_bucket_cap_and_concurrent_buckets(monkeypatch, comm):
    """HEATLIKE_BUCKET_CAP_MB is DataParallel's bucket size when none is given (an explicit one
    wins), HEATLIKE_CONCURRENT_BUCKETS the gradient synchronization's channels; bad values
    raise on every rank, before anything is built."""
    import torch

    from heatlike.engine import GradientSync, gradsync
    from heatlike.nn import DataParallel

    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 1 MiB each
    # buckets by size only: no bucket of its own for a gradient summed in place (several ranks)
    monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES", 1 << 62)
    monkeypatch.setenv("HEATLIKE_BUCKET_CAP_MB", " 1.5 ")
    monkeypatch.setenv("HEATLIKE_CONCURRENT_BUCKETS", "1")
    model = DataParallel(net, comm, first_bucket_mb=1.5)
    try:
        assert len(model.grad_sync.buckets) == 2 and model.grad_sync.concurrent_buckets == 1
        assert model.grad_sync.lane.width == 1
    finally:
        model.close()
    model = DataParallel(net, comm, bucket_cap_mb=25.0, first_bucket_mb=25.0)
    try:
        assert len(model.grad_sync.buckets) == 1
    finally:
        model.close()
    for name, bad in [("HEATLIKE_BUCKET_CAP_MB", "0"), ("HEATLIKE_BUCKET_CAP_MB", "big"),
                      ("HEATLIKE_CONCURRENT_BUCKETS", "0"), ("HEATLIKE_CONCURRENT_BUCKETS", "2.5")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}="):
            if name == "HEATLIKE_BUCKET_CAP_MB":
                DataParallel(net, comm)
            else:
                GradientSync(list(net.parameters()), comm)
        monkeypatch.delenv(name)
