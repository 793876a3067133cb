"""The documentation site builds with ``mkdocs build --strict``: no broken links between pages, no
missing anchors, no API page that fails to load, no docstring warning.

Needs the ``docs`` extra (``pip install -c constraints.txt -e ".[docs]"``); skipped without it.
The build reads the sources statically, so it runs without MPI: the test makes ``import mpi4py``
fail in the build's process to keep it that way.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
