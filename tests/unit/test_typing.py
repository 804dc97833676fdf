"""The core, the scheduler, the job record, the mailbox events and the protocol stay fully
typed: mypy, with every function annotated, finds nothing (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TYPED = ["jobmesh/coordinator/core.py", "jobmesh/coordinator/requests.py", "jobmesh/coordinator/periodic_jobs.py",
         "jobmesh/coordinator/locks.py", "jobmesh/coordinator/periodic_waits.py",
         "jobmesh/coordinator/corebase.py", "jobmesh/coordinator/scheduler.py", "jobmesh/store/base.py",
         "jobmesh/store/columns.py", "jobmesh/store/job.py",
         "jobmesh/coordinator/events.py", "jobmesh/coordinator/waiters.py", "jobmesh/protocol",
         "jobmesh/periodic/codec.py"]


def test_the_typed_modules_are_mypy_clean():
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--disallow-untyped-defs", "--disallow-incomplete-defs",
         "--follow-imports=silent", "--no-error-summary", "--cache-dir", str(ROOT / ".mypy_cache"), *TYPED],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
