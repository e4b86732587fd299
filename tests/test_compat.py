"""Other libraries' internals, behind ``shardcache.compat``: every probe succeeds on the
versions installed, a missing internal fails with a message that says what to install
(or the caller falls back), no other module touches one, and the proxy serves a miss
and a hit. ``make test-compat`` runs this module with the lowest aiohttp that
pyproject.toml allows."""

from __future__ import annotations

import ast
import asyncio
import re
import socket
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from proxy_helpers import Origin, ProxyProcess

from shardcache import compat

ROOT = Path(__file__).resolve().parent.parent

# the private names of other libraries that only shardcache/compat.py may use
INTERNALS = frozenset(
    {
        "_payload",
        "_factory",
        "_length_check",
        "_loop",
        "_server",
        "_add_writer",
        "_remove_writer",
        "_make_empty_waiter",
        "_reset_empty_waiter",
        "_read_status",
        "_read_headers",
        "_actions",
        "_option_string_actions",
        "_check_value",
        "_SubParsersAction",
        "_HelpAction",
        "_AppendAction",
        "_negative_number_matcher",
    }
)
PRIVATE_MODULES = ("aiohttp.client_proto", "aiohttp.web_protocol", "aiohttp._http_parser")
# not yet behind compat: argparse's negative-number pattern, set where the settings
# table builds its parser
KNOWN: set[tuple[str, str]] = set()


def test_every_probe_succeeds_on_the_installed_versions():
    assert set(compat.PROBES) >= {
        "aiohttp ResponseHandler",
        "aiohttp connector protocol",
        "aiohttp close-delimited answers",
        "asyncio sendfile hooks",
        "http.client interim answers",
        "argparse internals",
    }
    assert compat.probe_all() == {}, f"aiohttp {aiohttp.__version__}, Python {sys.version}"


def test_the_declared_aiohttp_range_is_the_one_compat_names():
    text = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'"aiohttp([^"]*)"', text)
    assert declared is not None
    assert declared.group(1).replace(" ", "") == compat.AIOHTTP_RANGE


def test_a_missing_aiohttp_internal_fails_naming_it_and_what_to_install():
    class Connector:  # an aiohttp whose connector builds its protocol otherwise
        pass

    with pytest.raises(compat.CompatError) as ei:
        compat.use_protocol(Connector(), lambda loop: None)
    message = str(ei.value)
    assert "BaseConnector._factory" in message and aiohttp.__version__ in message
    assert f"install aiohttp{compat.AIOHTTP_RANGE}" in message


def test_without_the_asyncio_hooks_sendfile_falls_back():
    from proxy.sendfile import send_file

    class Transport:  # a transport without asyncio's private waiters
        def get_extra_info(self, name: str) -> object:
            return a if name == "socket" else None

    a, b = socket.socketpair()
    try:
        assert not compat.threaded_sendfile_hooks(asyncio.new_event_loop(), Transport())
        with open(__file__, "rb") as f:
            assert asyncio.run(send_file(Transport(), f, 0, 10)) is None
    finally:
        a.close()
        b.close()


def test_the_closest_subcommand_is_named(capsys):
    from shardcache.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefech"])
    assert "did you mean 'prefetch'?" in capsys.readouterr().err


def _internals_used(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    rel = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue  # the project's own attribute of that name
            if (rel, node.attr) not in KNOWN:
                found.append(f"{rel}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in PRIVATE_MODULES:
            found.append(f"{rel}:{node.lineno} {node.module}")
        elif isinstance(node, ast.FunctionDef) and node.name in INTERNALS:
            found.append(f"{rel}:{node.lineno} def {node.name}")
        elif (
            isinstance(node, ast.Constant)
            and node.value in INTERNALS
            and (rel, node.value) not in KNOWN
        ):
            found.append(f"{rel}:{node.lineno} {node.value!r}")  # getattr, hasattr
    return found


def test_no_module_but_compat_touches_another_librarys_internals():
    offenders = [
        where
        for package in ("proxy", "shardcache", "dbcache")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "shardcache" / "compat.py"
        for where in _internals_used(path)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("transport", ["aiohttp", "threads"])
def test_the_proxy_serves_a_miss_then_a_hit(tmp_path, transport):
    data = bytes(range(256)) * 4096
    origin = Origin(files={"a.tar": data}).start()
    proxy = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--http-transport", transport
    )
    try:
        proxy.start()
        seen = []
        for _ in range(2):
            with urllib.request.urlopen(f"{proxy.url}/a.tar", timeout=30) as resp:
                seen.append((resp.headers["X-Cache"], resp.read()))
        assert seen == [("MISS", data), ("HIT", data)]
        assert origin.gets["a.tar"] == 1
    finally:
        proxy.stop()
        origin.stop()
