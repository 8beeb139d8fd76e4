"""The scheduler is torch-free (docs/structure.md): no module that `scheduler/` reaches through the
package's own imports imports torch (or transformers, which imports torch). Read from the source
(AST), so a lazy import inside a function counts too; imports under `TYPE_CHECKING` do not run."""

from __future__ import annotations

import ast
from pathlib import Path

import transformers_cb

PACKAGE = Path(transformers_cb.__file__).parent
HEAVY = {"torch", "transformers"}


def _path_of(module: str) -> Path | None:
    parts = module.split(".")[1:]
    folder = PACKAGE.joinpath(*parts)
    if (folder / "__init__.py").exists():
        return folder / "__init__.py"
    file = PACKAGE.joinpath(*parts[:-1], f"{parts[-1]}.py") if parts else None
    return file if file is not None and file.exists() else None


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(module: str, path: Path) -> list[str]:
    """Every module name an import of `module` names (relative ones resolved), `from x import y`
    giving both `x` and `x.y` (y may be a submodule)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        found.append(target)
        found += [f"{target}.{alias.name}" for alias in node.names]
    return found


def heavy_imports_reachable_from(room: str) -> dict[str, list[str]]:
    """module -> the torch / transformers imports it makes, over every package module that the
    modules of `room` reach (with the rooms' `__init__.py` that importing them runs; the package root's
    `__init__.py`, the plugin's entry point, is not followed)."""
    start = [f"transformers_cb.{room}"] + [
        ".".join(("transformers_cb", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in (PACKAGE / room).rglob("*.py")
    ]
    seen: set[str] = set()
    todo = list(start)
    offences: dict[str, list[str]] = {}
    while todo:
        module = todo.pop()
        if module in seen or module == "transformers_cb":
            continue
        seen.add(module)
        path = _path_of(module)
        if path is None:  # a name imported from a module, not a module
            continue
        parent = module.rpartition(".")[0]
        if parent != "transformers_cb":
            todo.append(parent)
        for name in _imports(module, path):
            if name.split(".")[0] in HEAVY:
                offences.setdefault(module, []).append(name)
            elif name.startswith("transformers_cb."):
                todo.append(name)
    return offences


def test_nothing_the_scheduler_reaches_imports_torch() -> None:
    offences = heavy_imports_reachable_from("scheduler")
    assert not offences, f"scheduler/ reaches torch or transformers through: {offences}"


def test_the_check_sees_torch_where_it_is() -> None:
    # The runner runs the forward: the same walk must find torch there, or the check above proves nothing.
    offences = heavy_imports_reachable_from("runner")
    assert "transformers_cb.runner.model_runner" in offences
    assert "transformers_cb.memory.kv_cache" in offences  # reached through the runner's imports
