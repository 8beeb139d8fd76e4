"""What the package's docstrings and comments quote exists: every file path (`room/module.py`, `module.py`,
`docs/x.md`) and every dotted name in backticks (`module.function`, `Class.method`, `room.module.Name`,
`request.family`).

A dotted name is read the way a reader would: `Class.member` for a class of the package; `module.name` for a
module (by its file name, its `room.module` path, or a room and one of its modules); `variable.member` for a
lowercase name that reads as an instance of a package class (`request` a `Request`, `batch` a
`ScheduledBatch`, `state` a `ManagerState`: the class's snake-case name ends with it). A quote that reads as
none of these (`torch.compile`, `model.generate()`, `tokenizer.decode`) is not the package's and is not
checked; a room followed by something that is not one of its modules (`config.sliding_window`) reads as a
variable.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import transformers_cb
from tests.support.paths import REPO_ROOT

PACKAGE = Path(transformers_cb.__file__).parent
FILE = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*\.(?:py|md))(:\d+(?:-\d+)?)?(?![\w/])")
QUOTE = re.compile(r"`+([^`]+)`+")
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?")
NOT_NAMES = (".py", ".md", ".txt", ".json", ".toml", ".so", ".cpp")


# -- what the package quotes ----------------------------------------------------------------------------
@cache
def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (any string statement) and comment of one module."""
    source = path.read_text()
    found = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def quoted_files(text: str) -> Iterator[tuple[str, str | None]]:
    for match in FILE.finditer(text):
        yield match.group(1), match.group(2)


def quoted_names(text: str) -> Iterator[list[str]]:
    for quote in QUOTE.finditer(text):
        match = DOTTED.fullmatch(quote.group(1).strip())
        if match and not match.group(1).endswith(NOT_NAMES):
            yield match.group(1).split(".")


# -- files ----------------------------------------------------------------------------------------------
@cache
def file_names() -> frozenset[str]:
    return frozenset(path.name for path in PACKAGE.rglob("*.py"))


def file_exists(quoted: str, quoting: Path) -> bool:
    """A path from the repository root, the package root or the quoting module's room; a bare file name
    anywhere in the package or at the repository root."""
    if any((base / quoted).is_file() for base in (REPO_ROOT, PACKAGE, quoting.parent)):
        return True
    return "/" not in quoted and quoted in file_names()


# -- names ----------------------------------------------------------------------------------------------
@dataclass
class ClassInfo:
    name: str
    module: str
    bases: list[str]
    members: set[str] = field(default_factory=set)


@dataclass
class ModuleInfo:
    name: str  # dotted, below the package: "kv.offload", "kv" for a room
    names: set[str] = field(default_factory=set)
    classes: dict[str, ClassInfo] = field(default_factory=dict)


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        yield from node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        yield node.target


def _class_info(node: ast.ClassDef, module: str) -> ClassInfo:
    info = ClassInfo(node.name, module, [ast.unparse(base).rpartition(".")[2] for base in node.bases])
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.members.add(statement.name)
        for target in _targets(statement):
            if isinstance(target, ast.Name):
                info.members.add(target.id)
    # Instance attributes: `self.x = ...` anywhere in the class's methods.
    for inner in ast.walk(node):
        for target in _targets(inner):
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                info.members.add(target.attr)
    return info


@cache
def modules() -> dict[str, ModuleInfo]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        info = ModuleInfo(".".join(parts))
        for statement in ast.parse(path.read_text()).body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.names.add(statement.name)
            elif isinstance(statement, ast.ClassDef):
                info.names.add(statement.name)
                info.classes[statement.name] = _class_info(statement, info.name)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                info.names.update((alias.asname or alias.name).split(".")[0] for alias in statement.names)
            for target in _targets(statement):
                if isinstance(target, ast.Name):
                    info.names.add(target.id)
        found[info.name] = info
    for name in list(found):  # a room's modules are names of the room
        room, _, module = name.rpartition(".")
        if room in found:
            found[room].names.add(module)
    return found


@cache
def classes() -> dict[str, list[ClassInfo]]:
    by_name: dict[str, list[ClassInfo]] = {}
    for module in modules().values():
        for info in module.classes.values():
            by_name.setdefault(info.name, []).append(info)
    return by_name


def has_member(info: ClassInfo, member: str) -> bool:
    """`member` is defined by the class or one of its bases; a base from outside the package (transformers,
    torch, the standard library) may define anything, so it is asked at run time."""
    if member in info.members:
        return True
    for base in info.bases:
        if base in classes():
            if any(has_member(base_info, member) for base_info in classes()[base]):
                return True
        elif base not in ("object", "Generic", "Protocol") and _runtime_member(info, member):
            return True
    return False


def _runtime_member(info: ClassInfo, member: str) -> bool:
    import importlib

    module = importlib.import_module(f"transformers_cb.{info.module}" if info.module else "transformers_cb")
    return hasattr(getattr(module, info.name), member)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def modules_named(name: str) -> list[ModuleInfo]:
    """Modules a quote's first part(s) can name: the `room.module` path, or a module's file name."""
    return [m for m in modules().values() if m.name == name or m.name.rpartition(".")[2] == name]


@cache
def names_used_in(path: Path) -> frozenset[str]:
    """Every name a module defines or imports, at any depth (the classes its variables can be)."""
    tree = ast.parse(path.read_text())
    names = {node.name for node in ast.walk(tree) if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.rpartition(".")[2] for alias in node.names)
    return frozenset(names)


def resolves(parts: list[str], quoting: Path) -> bool | None:
    """True / False for a name of the package quoted in module `quoting`; None when the quote is not one of
    the package's names (not checked)."""
    if parts[0] == "transformers_cb":
        parts = parts[1:] or ["__init__"]
        return any(_in_module(parts[:i], parts[i:]) for i in range(1, len(parts) + 1)) or parts == [""]
    first, rest = parts[0], parts[1:]
    if first in classes():
        return any(has_member(info, rest[0]) for info in classes()[first])
    if first[0].isupper():
        return None  # not a class of the package
    readings: list[bool] = []
    # A module: the longest prefix of the quote that names one.
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if modules_named(prefix):
            is_room = any("." not in m.name and (PACKAGE / m.name).is_dir() for m in modules_named(prefix))
            if i == 1 and is_room and rest[0] not in set().union(*(m.names for m in modules_named(prefix))):
                return None  # `config.sliding_window`: a variable named like the room
            readings.append(_in_module(parts[:i], parts[i:]))
            break
    # An instance of a package class whose snake-case name ends with the quote's first part: one the quoting
    # module works with (defines or imports), or any when the first part is also a module's name (`params`
    # for a `SamplingParams`: the quote is the package's either way).
    instances = [
        info
        for name, infos in classes().items()
        if readings or name in names_used_in(quoting)
        for info in infos
        if _snake(info.name) == first or _snake(info.name).endswith("_" + first)
    ]
    if instances:
        readings.append(any(has_member(info, rest[0]) for info in instances))
    return any(readings) if readings else None


def _in_module(module_parts: list[str], rest: list[str]) -> bool:
    targets = modules_named(".".join(module_parts))
    if not targets:
        return False
    if not rest:
        return True
    for module in targets:
        if rest[0] not in module.names:
            continue
        if len(rest) == 1 or rest[0] not in module.classes:
            return True  # a function's or variable's attributes are not followed
        if has_member(module.classes[rest[0]], rest[1]):
            return True
    return False


# -- the tests ------------------------------------------------------------------------------------------
def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


def test_quoted_files_exist() -> None:
    missing = [
        f"{_where(path, line)}: {quoted}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in prose(path)
        for quoted, _ in quoted_files(text)
        if not file_exists(quoted, path)
    ]
    assert not missing, "docstrings or comments quote files that do not exist:\n" + "\n".join(missing)


def test_no_line_numbers_quoted() -> None:
    """`engine.py:101` goes stale with the next edit above it; quote the name instead."""
    quoted = [
        f"{_where(path, line)}: {name}{lines}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in prose(path)
        for name, lines in quoted_files(text)
        if lines
    ]
    assert not quoted, quoted


def test_quoted_names_exist() -> None:
    missing = [
        f"{_where(path, line)}: {'.'.join(parts)}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in prose(path)
        for parts in quoted_names(text)
        if resolves(parts, path) is False
    ]
    assert not missing, "docstrings or comments quote names that do not exist:\n" + "\n".join(missing)


# -- the checker itself: what it must catch and what it must let through --------------------------------
ENGINE = PACKAGE / "engine" / "engine.py"


def test_the_checker_catches_stale_quotes() -> None:
    assert not file_exists("cache/layer_groups.py", PACKAGE / "requests.py")  # the room is kv/
    assert not file_exists("sampling_params.py", ENGINE)
    assert resolves(["Engine", "no_such_method"], ENGINE) is False
    assert resolves(["model_support", "check_model_is_supported"], ENGINE) is False
    assert resolves(["kv", "offload", "NoSuchClass"], ENGINE) is False
    assert resolves(["request", "no_such_field"], ENGINE) is False  # engine.py works with `Request`s
    assert list(quoted_files("see `engine/engine.py:101`")) == [("engine/engine.py", ":101")]


def test_the_checker_passes_what_exists() -> None:
    assert file_exists("kv/layer_groups.py", PACKAGE / "requests.py")
    assert file_exists("layer_groups.py", PACKAGE / "memory" / "kv_cache.py")
    assert file_exists("docs/structure.md", PACKAGE / "requests.py")
    assert resolves(["Engine", "snapshot"], ENGINE) is True
    assert resolves(["Request", "siblings"], ENGINE) is True  # a dataclass field
    assert resolves(["request", "family"], ENGINE) is True  # a property, on an instance
    assert resolves(["params", "do_sample"], PACKAGE / "sampling" / "sampler.py") is True  # a module's name
    assert resolves(["model_support", "check_model_supported"], ENGINE) is True
    assert resolves(["memory", "host_cache", "HostKVCache"], ENGINE) is True
    assert resolves(["transformers_cb", "conformance_check", "run_check"], ENGINE) is True
    assert resolves(["torch", "compile"], ENGINE) is None
    assert resolves(["GenerationConfig", "max_new_tokens"], ENGINE) is None
    assert resolves(["config", "sliding_window"], ENGINE) is None  # a variable named like the room
    assert resolves(["lock", "notify_all"], PACKAGE / "manager" / "state.py") is None  # a threading lock
