"""The whole package is typed: ``python -m mypy jobmesh`` with the configuration in
setup.cfg (every function annotated; gevent, which has no type information, is the one
library whose imports are unchecked) reports nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_is_mypy_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    # From the repository root, so that mypy reads setup.cfg; the incremental cache (the one
    # a plain ``mypy`` run there uses too) keeps a run after small changes to a few seconds.
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"), "jobmesh"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("Success:") and not proc.stderr, \
        proc.stdout + proc.stderr
