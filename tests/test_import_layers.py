"""Imports go one way: the library core never loads the daemon, DBCache or aiohttp, and
neither the daemon nor DBCache loads the command line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
