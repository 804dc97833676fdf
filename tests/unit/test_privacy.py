"""No module reads another module's ``_private`` names (docs/ARCHITECTURE.md).

Every module under ``jobmesh/`` is parsed with ``ast``, never imported. A name with one
leading underscore (dunders are public) is private to the module that defines it: as a
module-level name, a function or class, a method or class attribute, an entry of
``__slots__``, or an attribute set on ``self`` / ``cls``. Flagged:

* ``from jobmesh.x import _name``;
* ``module._name`` where ``module`` is an imported module;
* ``obj._name`` where ``obj`` is anything but ``self`` / ``cls`` and no class or
  function of this module defines ``_name``.

``self._name`` is the class's own business, even if a base class elsewhere defines it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jobmesh

PACKAGE_DIR = Path(jobmesh.__file__).parent
OWN = {"self", "cls"}
# Known exceptions, (module, name): the Periodic part's handler table names the methods of
# its mixin base in periodic_waits.py. Composed parts that call each other's public
# methods leave this empty.
EXCEPTIONS: set[tuple[str, str]] = set()


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.Module) -> set[str]:
    """The private names this module defines."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)  # module, class and function level assignments
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in OWN):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {name for name in names if private(name)}


def module_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Local names bound to modules (``import x``, ``import x as y``, ``from pkg import module``):
    jobmesh's, and the others (the standard library's ``os._exit`` is public API)."""
    ours: set[str] = set()
    others: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = ours if alias.name.split(".")[0] == "jobmesh" else others
                target.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] == "jobmesh":
                target, base = ours, PACKAGE_DIR
                if not node.level:
                    base = PACKAGE_DIR.parent.joinpath(*(node.module or "").split("."))
            else:
                target, base = others, None
            for alias in node.names:
                is_module = base is None or (base / alias.name).is_dir() or (base / (alias.name + ".py")).exists()
                if is_module or node.level:  # a relative import's names are checked like modules' names
                    target.add(alias.asname or alias.name)
    return ours, others


def findings(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    own = defined_names(tree) | {name for module, name in EXCEPTIONS if module == where}
    ours, others = module_aliases(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "jobmesh"):
            for alias in node.names:
                if private(alias.name):
                    out.append("%s:%d imports %s from %s" % (where, node.lineno, alias.name, node.module))
        elif isinstance(node, ast.Attribute) and private(node.attr):
            value = node.value
            name = value.id if isinstance(value, ast.Name) else None
            if name in ours:
                out.append("%s:%d reads %s.%s of another module" % (where, node.lineno, name, node.attr))
            elif name not in OWN and name not in others and node.attr not in own:
                out.append("%s:%d reads %s of an object this module does not define"
                           % (where, node.lineno, ast.unparse(node)))
    return out


def test_no_module_reads_another_modules_private_names():
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        found += findings(path.read_text(), str(path.relative_to(PACKAGE_DIR.parent)))
    assert found == []


# ---- the checker itself -------------------------------------------------------------------


def test_a_private_method_called_from_outside_its_module_is_found():
    source = "def pause(conn):\n    conn._wait_for(lambda: True)\n"
    assert findings(source, "m.py") == ["m.py:2 reads conn._wait_for of an object this module does not define"]


def test_importing_a_private_name_is_found():
    source = "from jobmesh.coordinator.ports.server import Output, _nodelay\nfrom .server import _encode as enc\n"
    assert findings(source, "m.py") == ["m.py:1 imports _nodelay from jobmesh.coordinator.ports.server",
                                        "m.py:2 imports _encode from server"]


def test_a_private_name_of_a_jobmesh_module_is_found():
    source = ("from jobmesh.coordinator.shell import clock\nimport jobmesh.coordinator.ports.server as server\nimport os\n"
              "x = clock._ANCHOR\ny = server._encode\nz = os._exit\n")
    assert findings(source, "m.py") == ["m.py:4 reads clock._ANCHOR of another module",
                                        "m.py:5 reads server._encode of another module"]


def test_what_a_module_defines_itself_is_its_own():
    source = (
        "class Box:\n"
        "    __slots__ = ('_items',)\n"
        "    def _peek(self):\n"
        "        return self._items\n"
        "    def __len__(self):\n"
        "        return len(self._items)\n"
        "def peek(box, other):\n"
        "    return box._peek(), other._items, box.__len__(), self_free._peek\n"
    )
    assert findings(source, "m.py") == []
