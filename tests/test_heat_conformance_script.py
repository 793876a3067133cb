"""scripts/conformance/run_heat_tests.py: Heat's tests run against heatlike through the alias
package (unpacked from ../shared at run time; skipped where the tarball is absent)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "conformance" / "run_heat_tests.py"
TARBALL = ROOT.parent / "shared" / "conformance" / "heat_tests-660efec.tar.xz"

pytestmark = pytest.mark.system  # runs the runner script


@pytest.mark.skipif(not TARBALL.exists(), reason="Heat's tests are not in ../shared/conformance")
def test_runner_resolves_heat_to_heatlike(tmp_path: Path) -> None:
    out = tmp_path / "verdicts.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--files", "factories", "--sizes", "1", "-k",
         "test_eye or test_logspace or test_meshgrid", "--json", str(out),
         "--work", str(tmp_path / "work"), "--test-timeout", "100", "--file-timeout", "300"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    verdicts = json.loads(out.read_text())["factories"]["1"]
    names = {k.rsplit("::", 1)[-1]: v for k, v in verdicts.items()}
    assert set(names) == {"test_eye", "test_logspace", "test_meshgrid"}, names
    assert all(v == "pass" for v in names.values()), names
    # nothing of Heat's tests is left in the repository
    assert not list(ROOT.rglob("test_factories.py"))
