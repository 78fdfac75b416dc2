"""The package layout: no import circles, no import of a higher room, a docstring in every module.

The imports of every module of ``fedapp``, ``strategies`` and ``client_models`` are read as text
(``ast``; nothing is imported, so this takes well under a second): imports inside functions count
too (a lazy import still ties two rooms together), relative imports are resolved, and
``from pkg import name`` counts as an import of the module ``pkg.name`` when there is one, else
of ``pkg``. A module's import of its own enclosing packages is left out: Python runs a
package's ``__init__`` before any of its modules anyway, and an ``__init__`` that re-exports its
modules is not a circle.

Rooms, low to high (see ``fedapp/__init__.py``): a module may import its own room or lower ones.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedapp", "strategies", "client_models")

# (room, its layer): a module belongs to the room whose name is the longest prefix of its own.
ROOMS = {
    "client_models": 0,
    "fedapp": 0,  # the package itself: its docstring, nothing else
    "fedapp.config": 1,
    "fedapp.seeding": 1,
    "fedapp.data": 2,
    "fedapp.runtime": 3,
    "strategies": 4,
    "fedapp.loops": 5,
    "fedapp.server_app": 6,
    "fedapp.client_app": 6,
    "fedapp.cli": 7,
}


def find_modules() -> dict[str, Path]:
    """{dotted module name: path} for every .py file of the three packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` (a module or a name inside one) lives in, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is the package itself, 2 its parent, ...
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import name`: the module pkg.name if it is one, else pkg itself.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            owner = owning_module(target, modules)
            if owner and owner != name and not name.startswith(owner + "."):
                found.add(owner)
    return found


@functools.lru_cache(maxsize=1)
def import_graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    """(modules, {module: the modules of ours it imports}), read once for all the tests."""
    modules = find_modules()
    return modules, {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> int | None:
    rooms = [room for room in ROOMS if module == room or module.startswith(room + ".")]
    return ROOMS[max(rooms, key=len)] if rooms else None


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module)
            if circle:
                return circle
    return None


def test_the_graph_sees_the_known_imports():
    # A guard against a checker that silently finds nothing: these edges exist.
    modules, graph = import_graph()
    assert {"fedapp", "fedapp.runtime.client_base", "strategies.fedgh.maths", "client_models.base",
            "fedapp.cli.flower"} <= set(modules)
    assert "fedapp.runtime.client_base" in graph["strategies.fedgh.maths"]
    assert "fedapp.seeding" in graph["fedapp.data.setup"]
    assert "fedapp.data.setup" in graph["fedapp.cli.run"]  # an import inside a function
    assert "client_models.base" in graph["client_models.registry"]  # a relative import


def test_no_import_circle():
    _, graph = import_graph()
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_every_module_is_in_a_room():
    modules, _ = import_graph()
    homeless = [m for m in modules if layer(m) is None]
    assert not homeless, f"modules in no room (add them to ROOMS): {homeless}"


def test_no_module_imports_a_higher_room():
    _, graph = import_graph()
    offences = [f"{module} (room {layer(module)}) -> {target} (room {layer(target)})"
                for module, targets in sorted(graph.items()) for target in sorted(targets)
                if layer(target) is not None and layer(module) is not None
                and layer(target) > layer(module)]
    assert not offences, "imports of a higher room:\n" + "\n".join(offences)


def test_every_module_has_a_docstring():
    modules, _ = import_graph()
    missing = [str(path.relative_to(ROOT)) for path in modules.values()
               if not (ast.get_docstring(parse(path)) or "").strip()]
    assert not missing, f"modules without a docstring: {missing}"
