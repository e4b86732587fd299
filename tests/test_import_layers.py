"""Imports go one way: the library core never loads the daemon, DBCache or aiohttp,
neither the daemon nor DBCache loads the command line, and no module of the project takes
part in an import cycle (counting the imports made lazily inside functions)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "shardcache", "dbcache")


def loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return set(out.split())


def test_import_shardcache_loads_no_daemon_no_dbcache_no_aiohttp():
    mods = loaded_after("import shardcache")
    top = {m.split(".")[0] for m in mods}
    assert not top & {"proxy", "dbcache", "aiohttp", "sqlite_utils", "torch"}, sorted(
        top & {"proxy", "dbcache", "aiohttp", "sqlite_utils", "torch"}
    )


def test_the_daemon_does_not_load_the_command_line():
    mods = loaded_after("import proxy.app, proxy.cli, dbcache")
    assert not {m for m in mods if m.startswith("shardcache.cli")}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_module_of_proxy_or_dbcache_imports_the_command_line():
    """Also the imports made lazily inside functions."""
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for package in ("proxy", "dbcache")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(path)
        if name == "shardcache.cli" or name.startswith("shardcache.cli.")
    ]
    assert not offenders, offenders


def test_the_library_core_imports_neither_the_daemon_nor_the_cli():
    """shardcache/ outside shardcache/cli/ (and ``__main__``, which runs it) may reach
    dbcache lazily for DBCache (a library feature) but never the proxy daemon or the
    command line."""
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "shardcache").rglob("*.py"))
        if "cli" not in path.relative_to(ROOT / "shardcache").parts and path.name != "__main__.py"
        for name in _imports(path)
        if name.split(".")[0] == "proxy" or name.startswith("shardcache.cli")
    ]
    assert not offenders, offenders


# --- cycles ---------------------------------------------------------------------------------


def project_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the project: dotted name -> (file, is a package's ``__init__``)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return mods


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _walk_run(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that may run: all of ``tree`` but the ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imported_names(module: str, path: Path, is_package: bool, mods) -> set[str]:
    """The dotted names ``module`` imports anywhere (module level or inside functions):
    ``import a.b``, ``from a import b`` (``a.b`` when that is a module), relative forms,
    and ``importlib.import_module("a.b")`` with a literal name."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _walk_run(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                names.add(sub if sub in mods else source)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules its imports run. Importing ``a.b.c`` from outside the
    package ``a.b`` also runs ``a/__init__`` and ``a/b/__init__`` (Python initialises a
    package before its modules), so those count too; a module's own packages do not
    (they are being initialised already when it runs)."""
    mods = project_modules()
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in mods.items():
        deps: set[str] = set()
        for name in imported_names(module, path, is_package, mods):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if not name or name == module:
                continue
            deps.add(name)
            parts = name.split(".")
            for i in range(1, len(parts)):
                ancestor = ".".join(parts[:i])
                if not (module == ancestor or module.startswith(ancestor + ".")):
                    deps.add(ancestor)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each with
    the edges that close it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                members = set(component)
                found.append(sorted(f"{a} -> {b}" for a in members for b in graph[a] & members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_scan_counts_lazy_string_and_relative_imports_not_type_only_ones(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from . import store\n"
        "if TYPE_CHECKING:\n"
        "    from proxy.cli import serve\n"
        "def f():\n"
        "    from proxy.upstream import resume\n"
        "    importlib.import_module('dbcache.cli')\n"
    )
    mods = project_modules()
    names = imported_names("shardcache.mod", source, False, mods)
    assert {"shardcache.store", "proxy.upstream.resume", "dbcache.cli"} <= names, names
    assert "proxy.cli" not in names  # for type checkers only: never runs


def test_the_graph_counts_the_packages_an_import_initialises():
    graph = import_graph()
    assert "proxy.upstream" in graph["proxy.settings_table"]  # via proxy.upstream.options
    assert "shardcache" in graph["dbcache._file"]  # via shardcache.errors
    assert "proxy.upstream" not in graph["proxy.upstream.fetcher"]  # its own package


def test_no_import_cycles():
    """No module of proxy/, shardcache/ or dbcache/ imports, even lazily inside a
    function, a module that imports it back (directly or through others): every layer
    can be read, and loaded, without the ones above it. Module names kept in a table and
    imported at run time (the command line's subcommand modules, the lazy public names
    of ``shardcache``, which include ``DBCache``) are outside the scan: the public names
    are pinned by tests/test_exported_members.py."""
    found = cycles(import_graph())
    assert not found, "\n".join(" | ".join(c) for c in found)


# the store's parts, each importing only those before it (docs/design.md, "On-disk store")
STORE_ORDER = (
    "names",
    "diskerrors",
    "entry",
    "index",
    "access",
    "space",
    "downloads",
    "reconcile",
    "facade",
)


def test_the_stores_parts_import_only_the_parts_before_them():
    graph = import_graph()
    parts = {m for m in graph if m.startswith("shardcache.store.")}
    assert parts == {f"shardcache.store.{n}" for n in STORE_ORDER}, sorted(parts)
    for i, name in enumerate(STORE_ORDER):
        deps = graph[f"shardcache.store.{name}"]
        assert not deps & {f"shardcache.store.{n}" for n in STORE_ORDER[i:]}, (name, deps)
        assert "shardcache.store" not in deps, name  # the package imports the parts
    assert not {m for deps in (graph[p] for p in parts) for m in deps if m.startswith("proxy")}
