"""The package layout: only the public entry points at the root, no import cycle, no import that runs
upward, no private name imported from another room (docs/structure.md). Imports under `TYPE_CHECKING`
count like any other: a type-only import that runs upward, or closes a cycle, is a dependency all the
same (the module cannot be read without the one above it)."""

from __future__ import annotations

import ast
from pathlib import Path

import transformers_cb

PACKAGE = Path(transformers_cb.__file__).parent
# The public entry points and the data every room shares (docs/structure.md).
ROOT_MODULES = {
    "__init__",
    "plugin",
    "requests",
    "status",
    "outputs",
    "invariants",
    "import_noise",  # run first by __init__ (what `import transformers_cb` does before importing transformers)
    "patches",
    "conformance_check",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["transformers_cb", *parts])


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) of every import of the package's modules, lazy ones and those
    under `TYPE_CHECKING` included."""
    tree = ast.parse(path.read_text())
    package = name if is_package(path) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("transformers_cb")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("transformers_cb"):
                continue
            names = [alias.name for alias in node.names]
            found.append((target, names))
            # `from package import submodule` imports the submodule too.
            found += [(f"{target}.{n}", []) for n in names if f"{target}.{n}" in modules]
    return found


def room_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_root_holds_only_the_public_entry_points():
    root = {path.stem for path in PACKAGE.glob("*.py")}
    assert root <= ROOT_MODULES, f"modules at the package root beyond the entry points: {root - ROOT_MODULES}"
    for folder in PACKAGE.iterdir():
        if folder.is_dir() and folder.name != "__pycache__":
            assert (folder / "__init__.py").exists(), f"{folder.name}/ has no __init__.py"
            assert ast.get_docstring(ast.parse((folder / "__init__.py").read_text())), (
                f"{folder.name}/__init__.py does not say what the room owns"
            )


def test_every_module_has_a_docstring():
    for name, path in all_modules().items():
        if is_package(path) and not path.read_text().strip():
            continue
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no module docstring"


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (type-only imports included)."""
    modules = all_modules()
    return {
        name: {
            target for target, _ in imports_of(name, path, modules) if target in modules and target != name
        }
        for name, path in modules.items()
    }


def test_no_import_cycle():
    graph = import_graph()
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles (through TYPE_CHECKING imports too): {cycles}"


def test_type_only_imports_are_read(tmp_path: Path):
    """An import under `TYPE_CHECKING` counts: a cycle or an upward import closed by one is found."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .engine import Engine\n"
    )
    assert ("transformers_cb.engine.engine", ["Engine"]) in imports_of("transformers_cb.engine.m", module, {})


def test_no_private_name_imported_from_another_room():
    modules = all_modules()
    offences = []
    for name, path in modules.items():
        for target, names in imports_of(name, path, modules):
            if room_of(target) == room_of(name):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                offences.append(f"{name} imports {private} from {target}")
    assert not offences, offences


# The rooms from the bottom up (docs/structure.md, "Direction of imports"): a module imports only from its
# own room or from rooms before it. Rooms on one rung are peers that never import each other.
IMPORT_ORDER: list[set[str]] = [
    {"invariants", "patches", "import_noise"},
    {"status"},
    {"outputs"},
    {"requests"},
    {"config"},
    {"kv"},
    {"memory"},
    {"attention"},
    {"sampling"},
    {"scheduler"},
    {"runner"},
    {"distributed"},
    {"model_check"},  # whether a model can run: the support check and its probes, read by resolve_settings
    {"engine"},
    {"manager"},
    {"api"},
    {"plugin"},
    {"__init__"},  # the public names; `import transformers_cb` installs the plugin
    {"models", "jobs", "parity"},
    {"serve"},
    {"scale_out"},
    {"cli", "conformance_check"},
]


def rung_of(room: str) -> int:
    for rung, rooms in enumerate(IMPORT_ORDER):
        if room in rooms:
            return rung
    raise AssertionError(f"room {room!r} is not in IMPORT_ORDER (add it where docs/structure.md puts it)")


def test_no_import_runs_upward():
    modules = all_modules()
    offences = []
    for name, path in modules.items():
        room = room_of(name)
        for target, _ in imports_of(name, path, modules):
            if target not in modules or room_of(target) == room:
                continue
            if rung_of(room_of(target)) >= rung_of(room):
                offences.append(f"{name} ({room}) imports {target} ({room_of(target)})")
    assert not offences, "imports that run upward or across peers:\n" + "\n".join(sorted(set(offences)))
