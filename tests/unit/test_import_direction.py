"""Imports point downward only: the layering of docs/ARCHITECTURE.md ("Module map").

Every module under ``jobmesh/`` is parsed with ``ast``, never imported, and every
``import`` / ``from ... import`` anywhere in it counts (inside functions, under
``TYPE_CHECKING``, everywhere), of jobmesh modules and of others (``gevent``) alike.
``from pkg import name`` counts as importing ``pkg``, and ``pkg.name`` too when that is a
module. A rule's modules are a module name and everything below it.

The coordinator is three wings: the core (``coordinator/core/``), the ports and the
shell. The core imports no gevent, no port and no shell; everything outside the core
imports of it only its face (``FACE``: CoordinatorCore, the events, the connection
protocols, the metric shapes), never one of its parts (``PARTS``); each module of the core
is one or the other.

The order is read from the module map itself: within each package, a module (or a
subpackage, with everything in it) imports only the entries listed below it, so
reordering the map is how the order changes.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import jobmesh

PACKAGE_DIR = Path(jobmesh.__file__).parent
ARCHITECTURE = PACKAGE_DIR.parent / "docs" / "ARCHITECTURE.md"

@dataclass(frozen=True)
class Rule:
    modules: str                        # this module and everything below it ...
    only: tuple[str, ...] | None = None  # ... imports no module of ``of`` but these (and below)
    never: tuple[str, ...] = ()          # ... imports none of these (and below; jobmesh or not)
    except_: tuple[str, ...] = ()        # modules the rule does not cover
    of: str = "jobmesh"                  # what ``only`` speaks of: this package (its __init__ is free)


CORE = "jobmesh.coordinator.core"
PORTS = "jobmesh.coordinator.ports"
SHELL = "jobmesh.coordinator.shell"
# What the ports and the shell see of the core: CoordinatorCore, the events it applies, the
# connection protocols it uses, and the shapes of its figures (the metrics port's).
FACE = tuple(CORE + "." + name for name in ("face", "events", "peers", "figures"))
# Everything else in the core: its parts, which only the core composes and uses.
PARTS = tuple(CORE + "." + name for name in (
    "table", "timers", "json_jobs", "limits", "requests", "schedules", "periodic", "registry", "outbox",
    "waiters", "scheduler", "firetimes", "workflows"))

RULES = [
    #    modules                 may import only                             must never import
    Rule("jobmesh.errors",      only=()),
    Rule("jobmesh.protocol",    only=("jobmesh.errors", "jobmesh.protocol")),
    Rule("jobmesh.periodic",    only=("jobmesh.errors", "jobmesh.protocol", "jobmesh.periodic")),
    Rule("jobmesh.store",       only=("jobmesh.errors", "jobmesh.protocol", "jobmesh.store")),
    Rule("jobmesh.coordinator", never=("jobmesh.worker", "jobmesh.client", "jobmesh.cli", "jobmesh.up")),
    Rule(CORE,                  never=("gevent", PORTS, SHELL)),
    # The timers index jobs by time only as the table tells them (its listener protocol):
    # no part but the core's face, which composes them, holds them.
    Rule(CORE,                  never=(CORE + ".timers",), except_=(CORE + ".face", CORE + ".timers")),
    Rule(PORTS,                 only=FACE, of=CORE),
    Rule("jobmesh",             never=PARTS, except_=(CORE,)),
    Rule("jobmesh.worker",      never=("jobmesh.coordinator", "jobmesh.client", "jobmesh.cli")),
    Rule("jobmesh.client",      never=("jobmesh.coordinator", "jobmesh.worker", "jobmesh.cli")),
    Rule("jobmesh",             never=("jobmesh.cli",), except_=("jobmesh.__main__", "jobmesh.cli")),
]


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports_of(name: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``, resolving relative imports: jobmesh
    modules, and the top-level packages of others (``gevent``, ``gevent.event``)."""
    found = []
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, base + "." + alias.name) for alias in node.names
                      if base + "." + alias.name in known]
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, list[tuple[int, str]]]:
    known = set(modules)
    return {name: imports_of(name, path.read_text(), known, path.name == "__init__.py")
            for name, path in modules.items()}


def violations(rule: Rule, graph: dict[str, list[tuple[int, str]]], modules: dict[str, Path]) -> list[str]:
    out = []
    for name, imported in sorted(graph.items()):
        if not within(name, rule.modules) or any(within(name, e) for e in rule.except_):
            continue
        for line, target in imported:
            if target == name:
                continue
            spoken_of = target != rule.of and within(target, rule.of)
            allowed = rule.only is None or not spoken_of or any(within(target, ok) for ok in rule.only)
            forbidden = any(within(target, bad) for bad in rule.never)
            if forbidden or not allowed:
                out.append("%s:%d imports %s" % (modules[name].relative_to(PACKAGE_DIR.parent), line, target))
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or with a self-import (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


ENTRY = re.compile(r"^( +)([A-Za-z_][A-Za-z0-9_]*)(\.py|/)(?=\s|$)")


def module_map(text: str) -> dict[str, list[str]]:
    """Package -> its entries (modules and subpackages, by dotted name) top to bottom, from
    the indented block under "## Module map". An entry is a ``name.py`` or ``name/`` two
    spaces deeper than its package's line; deeper lines continue a description."""
    lines = text.split("## Module map", 1)[1].split("\n## ", 1)[0].splitlines()
    order: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, dotted name) of the packages enclosing this line
    for line in lines:
        match = ENTRY.match(line)
        if not match:
            continue
        indent, name, kind = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not stack:
            if kind != "/" or order:
                continue  # not the map's root line
            dotted = name
        elif indent == stack[-1][0] + 2:
            dotted = stack[-1][1] + "." + name
            order[stack[-1][1]].append(dotted)
        else:
            continue  # a description running on
        if kind == "/":
            order[dotted] = []
            stack.append((indent, dotted))
    return order


def order_violations(order: dict[str, list[str]], graph: dict[str, list[tuple[int, str]]],
                     modules: dict[str, Path]) -> list[str]:
    """Imports of an entry listed above the importer's entry in their nearest common package."""
    position = {entry: (package, i) for package, entries in order.items() for i, entry in enumerate(entries)}
    out = []
    for name, imported in sorted(graph.items()):
        for line, target in imported:
            if within(name, target) or within(target, name):
                continue  # its own package's __init__, or a package's __init__ importing its modules
            here, there = name.split("."), target.split(".")
            common = 0
            while here[common] == there[common]:
                common += 1
            mine, theirs = ".".join(here[: common + 1]), ".".join(there[: common + 1])
            if mine not in position or theirs not in position:
                continue  # a module missing from the map is reported by test_the_map_lists_every_module
            if position[theirs][1] < position[mine][1]:
                out.append("%s:%d imports %s, listed above %s" % (
                    modules[name].relative_to(PACKAGE_DIR.parent), line, target, mine))
    return out


@pytest.fixture(scope="module")
def order():
    return module_map(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def modules():
    return find_modules()


@pytest.fixture(scope="module")
def graph(modules):
    return import_graph(modules)


@pytest.mark.parametrize("rule", RULES, ids=["%d-%s" % (i, r.modules) for i, r in enumerate(RULES)])
def test_layering(rule, graph, modules):
    assert violations(rule, graph, modules) == []


# What the shell may import of the core: its face (CoordinatorCore, and the words it speaks).
CORE = "jobmesh.coordinator.core"
SHELL_SEES = tuple(CORE + "." + name for name in ("face", "events", "peers", "figures"))


def reach_ins(graph: dict[str, list[tuple[int, str]]], modules: dict[str, Path]) -> list[str]:
    """Imports of a core module other than the face by a module of the shell."""
    return ["%s:%d imports %s" % (modules[name].relative_to(PACKAGE_DIR.parent), line, target)
            for name, imported in sorted(graph.items()) if within(name, "jobmesh.coordinator.shell")
            for line, target in imported
            if within(target, CORE) and target != CORE and not any(within(target, ok) for ok in SHELL_SEES)]


def test_the_shell_sees_only_the_core_s_face(graph, modules):
    assert reach_ins(graph, modules) == []


def test_a_reach_into_a_core_part_is_reported(modules):
    graph = {"jobmesh.coordinator.shell.loop": [(3, "jobmesh.coordinator.core.face"),
                                                (4, "jobmesh.coordinator.core.waiters"),
                                                (5, "jobmesh.coordinator.core.periodic.jobs")]}
    modules = {"jobmesh.coordinator.shell.loop": PACKAGE_DIR / "coordinator" / "shell" / "loop.py"}
    assert reach_ins(graph, modules) == [
        "jobmesh/coordinator/shell/loop.py:4 imports jobmesh.coordinator.core.waiters",
        "jobmesh/coordinator/shell/loop.py:5 imports jobmesh.coordinator.core.periodic.jobs"]


def test_the_map_lists_every_module(order, modules):
    listed = {entry for entries in order.values() for entry in entries} | set(order)
    assert sorted(set(modules) - listed) == []  # modules (and packages) the map does not list
    assert sorted(listed - set(modules)) == []  # entries of the map that do not exist


def test_imports_point_down_the_map_within_packages(order, graph, modules):
    assert order_violations(order, graph, modules) == []


def test_no_import_cycles(graph):
    edges = {name: {target for _line, target in imported if target in graph} for name, imported in graph.items()}
    assert cycles(edges) == []


# ---- the checker itself -------------------------------------------------------------------


def test_every_module_is_found(modules):
    for name in ("jobmesh", "jobmesh.__main__", "jobmesh.cli", "jobmesh.errors", "jobmesh.exitcodes",
                 "jobmesh.protocol", "jobmesh.protocol.messages", "jobmesh.client.commands",
                 "jobmesh.coordinator.core.face", "jobmesh.worker.agent"):
        assert name in modules


def test_imports_inside_functions_count(graph):
    # cli imports the coordinator, worker and client only inside main()
    targets = {target for _line, target in graph["jobmesh.cli"]}
    assert {"jobmesh.coordinator.shell.runtime", "jobmesh.worker.agent", "jobmesh.client.commands"} <= targets
    assert "jobmesh.cli" in {target for _line, target in graph["jobmesh.__main__"]}


def test_from_package_import_module_counts_both():
    source = "from jobmesh.client import render\nfrom . import api\nfrom ..errors import ConfigError\n"
    known = {"jobmesh.client", "jobmesh.client.render", "jobmesh.client.api", "jobmesh.errors"}
    found = {target for _line, target in imports_of("jobmesh.client.commands", source, known)}
    assert found == {"jobmesh.client", "jobmesh.client.render", "jobmesh.client.api", "jobmesh.errors"}


def test_a_violation_is_reported_with_its_line(modules):
    graph = {"jobmesh.protocol.jobs": [(7, "jobmesh.config")], "jobmesh.errors": []}
    rule = RULES[1]
    assert violations(rule, graph, modules) == ["jobmesh/protocol/jobs.py:7 imports jobmesh.config"]


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_map_is_read_in_order():
    text = ("# x\n\n## Module map\n\nprose\n\n    pkg/\n      top.py       runs mid.py and a\n"
            "                   sub/ (a description running on)\n      sub/         (imports nothing)\n"
            "        leaf.py    pure\n      mid.py       the middle\n\n## Next\n    other.py\n")
    assert module_map(text) == {"pkg": ["pkg.top", "pkg.sub", "pkg.mid"], "pkg.sub": ["pkg.sub.leaf"]}


def test_an_import_of_an_entry_listed_above_is_reported():
    order = {"jobmesh": ["jobmesh.coordinator", "jobmesh.errors"],
             "jobmesh.coordinator": ["jobmesh.coordinator.ports.server", "jobmesh.coordinator.ports.periodic"]}
    graph = {"jobmesh.coordinator.ports.periodic": [(3, "jobmesh.errors"), (4, "jobmesh.coordinator.ports.server"),
                                                   (5, "jobmesh.coordinator")],
             "jobmesh.errors": [(9, "jobmesh.coordinator.ports.server")]}
    modules = {"jobmesh.coordinator.ports.periodic": PACKAGE_DIR / "coordinator" / "periodic_port.py",
               "jobmesh.errors": PACKAGE_DIR / "errors.py"}
    assert order_violations(order, graph, modules) == [
        "jobmesh/coordinator/periodic_port.py:4 imports jobmesh.coordinator.ports.server, listed above "
        "jobmesh.coordinator.ports.periodic",
        "jobmesh/errors.py:9 imports jobmesh.coordinator.ports.server, listed above jobmesh.errors"]


def rule_for(modules: str, *, never: str | None = None, of: str | None = None) -> Rule:
    return next(r for r in RULES if r.modules == modules and (never is None or never in r.never)
                and (of is None or r.of == of))


def test_every_core_module_is_the_face_or_a_part(modules):
    for name in modules:
        if within(name, CORE) and name != CORE:
            assert any(within(name, group) for group in FACE + PARTS), name


def test_gevent_in_the_core_is_reported_at_module_or_function_level(modules):
    source = "import logging\nfrom gevent.event import Event\n\ndef later():\n    import gevent\n"
    graph = {CORE + ".table": imports_of(CORE + ".table", source, set(modules))}
    assert violations(rule_for(CORE, never="gevent"), graph, modules) == [
        "jobmesh/coordinator/core/table.py:2 imports gevent.event",
        "jobmesh/coordinator/core/table.py:5 imports gevent"]


def test_a_port_or_the_shell_imported_by_the_core_is_reported(modules):
    graph = {CORE + ".face": [(3, PORTS + ".server"), (4, SHELL + ".clock"), (5, CORE + ".table")]}
    assert violations(rule_for(CORE, never="gevent"), graph, modules) == [
        "jobmesh/coordinator/core/face.py:3 imports jobmesh.coordinator.ports.server",
        "jobmesh/coordinator/core/face.py:4 imports jobmesh.coordinator.shell.clock"]


def test_a_part_holding_the_timers_is_reported(modules):
    graph = {CORE + ".json_jobs": [(48, CORE + ".timers")], CORE + ".face": [(9, CORE + ".timers")]}
    assert violations(rule_for(CORE, never=CORE + ".timers"), graph, modules) == [
        "jobmesh/coordinator/core/json_jobs.py:48 imports jobmesh.coordinator.core.timers"]


def test_a_port_importing_more_of_the_core_than_its_face_is_reported(modules):
    source = ("from jobmesh.coordinator.core import events as ev\nfrom jobmesh.coordinator.core.figures import METRICS\n"
              "from jobmesh.coordinator.core.table import JobTable\nfrom jobmesh.protocol import messages\n"
              "import gevent\n")
    graph = {PORTS + ".http": imports_of(PORTS + ".http", source, set(modules))}
    assert violations(rule_for(PORTS), graph, modules) == [
        "jobmesh/coordinator/ports/http.py:3 imports jobmesh.coordinator.core.table"]


def test_a_part_imported_outside_the_core_is_reported(modules):
    graph = {SHELL + ".runtime": [(81, CORE + ".waiters"), (82, CORE + ".table")],
             SHELL + ".mailbox": [(27, CORE + ".waiters"), (28, CORE + ".peers")],
             "jobmesh.cli": [(5, CORE + ".periodic.jobs")],
             CORE + ".face": [(7, CORE + ".table")]}
    assert violations(rule_for("jobmesh", never=CORE + ".table"), graph, modules) == [
        "jobmesh/cli.py:5 imports jobmesh.coordinator.core.periodic.jobs",
        "jobmesh/coordinator/shell/mailbox.py:27 imports jobmesh.coordinator.core.waiters",
        "jobmesh/coordinator/shell/runtime.py:81 imports jobmesh.coordinator.core.waiters",
        "jobmesh/coordinator/shell/runtime.py:82 imports jobmesh.coordinator.core.table"]
