"""The package and its tests are pyflakes-clean: no unused import or variable, no name
defined twice, no undefined name. Fixtures that several modules use live in a conftest.py,
not imported from another test module (pyflakes would see an unused import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_jobmesh_and_tests_are_pyflakes_clean():
    pytest.importorskip("pyflakes", reason="pyflakes is in the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run([sys.executable, "-m", "pyflakes", "jobmesh", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout + proc.stderr == "", proc.stdout + proc.stderr
    assert proc.returncode == 0
