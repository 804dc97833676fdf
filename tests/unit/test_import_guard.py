"""No library module monkey-patches on import (GEVENT.md §1, STYLE.md §2).

Only ``jobmesh.__main__`` patches, first thing, in the process entry. Every other module
must be importable by the unpatched test process. Modules are discovered by walking the
package, so modules added later are covered automatically.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import gevent.monkey

import jobmesh

ENTRY = "jobmesh.__main__"


def library_modules() -> list[str]:
    names = ["jobmesh"]
    errors: list[str] = []
    for info in pkgutil.walk_packages(jobmesh.__path__, prefix="jobmesh.", onerror=errors.append):
        if info.name != ENTRY:
            names.append(info.name)
    assert not errors, "sub-packages failed to import while walking: %r" % errors
    return sorted(names)


def test_walk_finds_the_protocol_modules():
    names = library_modules()
    for expected in ("jobmesh.cli", "jobmesh.config", "jobmesh.errors", "jobmesh.protocol.framing",
                     "jobmesh.protocol.messages", "jobmesh.protocol.jobs", "jobmesh.protocol.payloads"):
        assert expected in names
    assert ENTRY not in names


def test_importing_every_library_module_patches_nothing():
    assert not gevent.monkey.is_anything_patched(), "the test process was patched before this test"
    for name in library_modules():
        importlib.import_module(name)
        assert not gevent.monkey.is_anything_patched(), "importing %s monkey-patched the process" % name


# In a fresh interpreter, so a module that patches is named precisely and cannot taint this process.
CHILD = r"""
import importlib, json, sys
import gevent.monkey
out = {}
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    out[name] = bool(gevent.monkey.is_anything_patched())
    if out[name]:
        break
print(json.dumps(out))
"""


def test_each_module_in_a_fresh_interpreter():
    names = library_modules()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(names)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    patched = [name for name, was in result.items() if was]
    assert patched == [], "modules that monkey-patch on import: %s" % patched
    assert set(result) == set(names)


def test_package_init_imports_nothing_of_jobmesh():
    # jobmesh/__init__.py must stay empty (a console script imports it before the entry).
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, jobmesh; print(sorted(m for m in sys.modules "
                               "if m.startswith(('jobmesh.', 'gevent'))))"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
