"""The documentation site builds with ``mkdocs build --strict``: no broken links between pages, no
missing anchors, no API page that fails to load, no docstring warning. The quick starts' programs
run as printed, their commands work after ``make``, and the Makefile does what they say.

Needs the ``docs`` extra (``pip install -c constraints.txt -e ".[docs]"``); skipped without it.
The build reads the sources statically, so it runs without MPI: the test makes ``import mpi4py``
fail in the build's process to keep it that way.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from heatlike.testing.matrix import _clean_env

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material")


def _missing() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:
            missing.append(name)
    return missing


@pytest.mark.system
@pytest.mark.skipif(bool(_missing()), reason="the docs extra is not installed (missing: "
                    f"{', '.join(_missing())}); pip install -c constraints.txt -e '.[docs]'")
def test_docs_build_strict(tmp_path: Path) -> None:
    # a stand-in mpi4py that cannot be imported: the site must build without MPI
    shim = tmp_path / "shim" / "mpi4py"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('mpi4py is not used to build the docs')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim.parent),
                                                      env.get("PYTHONPATH", "")]))
    env["NO_MKDOCS_2_WARNING"] = "1"  # a theme's notice about future MkDocs releases
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the hook module lives in docs/
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        warnings or output.splitlines()[-30:])
    assert not warnings, "\n".join(warnings)
    for page in ("index.html", "concepts/index.html", "ports/index.html",
                 "benchmarks/index.html", "api/engine/index.html"):
        assert (site / page).is_file(), page
    # the API pages were generated from the package, not left empty
    engine = (site / "api/engine/index.html").read_text()
    assert "heatlike.engine.gradsync.GradientSync" in engine


def _code_blocks(page: Path, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in a Markdown page."""
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M)


@pytest.mark.system
@pytest.mark.slow  # a process each, importing torch (and scikit-learn)
@pytest.mark.parametrize("page,index", [("README.md", 0), ("docs/index.md", 0),
                                        ("docs/data_parallel.md", 0)])
def test_documented_programs_run(tmp_path: Path, page: str, index: int) -> None:
    """The complete programs of the quick starts run as printed (one process, no mpiexec): no
    name in them is left undefined."""
    pytest.importorskip("sklearn")  # the data-parallel example trains on scikit-learn's digits
    code = _code_blocks(ROOT / page, "python")[index]
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**_clean_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{page}, python block {index}:\n{code}\n{proc.stderr}"


def test_quick_start_commands_work_after_make() -> None:
    """``make`` puts mpiexec (the MPICH wheel's) into .venv/bin, not on PATH: the README and
    the docs' quick start activate .venv before calling ``mpiexec`` (or call .venv/bin/...)."""
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        for block in _code_blocks(page, "bash"):
            lines = [line.split("#")[0].strip() for line in block.splitlines()]
            for i, line in enumerate(lines):
                if line.startswith("mpiexec"):
                    assert any(".venv/bin/activate" in earlier for earlier in lines[:i]), \
                        f"{page.name}: {line!r} without activating .venv first"


def test_make_bench_is_described_as_the_makefile_runs_it() -> None:
    recipe = re.search(r"^bench:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and "heatlike.bench all --quick" in recipe.group(1)
    index = (ROOT / "docs" / "index.md").read_text()
    line = next(x for x in index.splitlines() if x.startswith("make bench"))
    assert "every benchmark suite" in line and "quick" in line, line


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_setup_tells_what_takes_minutes(tmp_path: Path) -> None:
    """The first ``make`` spends minutes installing: it says so first and lets pip show its
    progress (no --quiet)."""
    proc = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.splitlines()
    install = next(i for i, c in enumerate(commands) if "pip install" in c)
    assert "--quiet" not in commands[install] and " -q" not in commands[install], commands
    assert any(c.startswith("echo") and "few minutes" in c for c in commands[:install]), commands
