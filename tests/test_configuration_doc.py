"""docs/configuration.md is generated from the settings table and the tools' parsers and
must match them: CI fails when the file is stale."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import CONFIG_FILE, SETTINGS
from shardcache.cli import build_parser
from shardcache.cli.configref import _subparser, configuration_reference

pytestmark = pytest.mark.fast

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_configuration_doc_is_in_sync_with_the_code():
    assert DOC.read_text() == configuration_reference(), (
        "docs/configuration.md is out of date: run python docs/gen_configuration.py"
    )


def test_every_setting_is_documented_with_its_flag_variable_default_and_help():
    text = configuration_reference()
    documented = [s for s in (CONFIG_FILE, *SETTINGS) if s.flag is not None]
    assert len(documented) >= 30
    for s in documented:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{s.flag} "))
        assert f"`{s.env}`" in row
        assert s.meaning() in row
        if s.default_text():
            assert f"`{s.default_text()}`" in row
    assert "`SHARDCACHE_PROXY`" in text


def test_serve_has_exactly_the_flags_of_the_table():
    """A flag added to ``serve`` outside the table would miss the environment, the file
    and the docs."""
    serve = _subparser(build_parser(), "serve")
    flags = {
        max(a.option_strings, key=len)
        for a in serve._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }
    assert flags == {s.flag for s in (CONFIG_FILE, *SETTINGS) if s.flag is not None}


def test_the_doc_states_the_size_units():
    text = configuration_reference()
    assert "G = 10^9 bytes" in text and "GiB = 2^30 bytes" in text


@pytest.mark.slow  # a subprocess: left to `make test`
def test_check_mode_accepts_the_committed_file():
    script = DOC.parent / "gen_configuration.py"
    res = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(DOC.parent))
    try:
        import gen_configuration
    finally:
        sys.path.remove(str(DOC.parent))
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text().replace("SHARDCACHE_CACHE_SIZE", "SHARDCACHE_SIZE"))
    monkeypatch.setattr(gen_configuration, "TARGET", stale)
    monkeypatch.setattr(gen_configuration, "EXAMPLE", tmp_path / "shardcache.toml")
    (tmp_path / "shardcache.toml").write_text(gen_configuration.example_config())
    assert gen_configuration.main(["--check"]) == 1
    assert gen_configuration.main([]) == 0
    assert gen_configuration.main(["--check"]) == 0


def test_tool_options_are_documented_from_their_declaration_not_their_help_text():
    import pytest

    from shardcache.cli.common import ToolError, add_option
    from shardcache.cli.configref import option_rows

    p = argparse.ArgumentParser()
    add_option(p, "--rate", type=float, default=2.5, help="reads a second", env="X_RATE")
    add_option(p, "--home", default=None, help="where", shown_default="the current directory")
    p.add_argument("--flag", action="store_true", help="a switch")
    assert "reads a second (default: 2.5) [env X_RATE]" in p.format_help()
    assert option_rows(p) == [
        ("--rate RATE", "X_RATE", "2.5", "reads a second"),
        ("--home HOME", "", "the current directory", "where"),
        ("--flag", "", "", "a switch"),
    ]
    # a default or a variable written only in the help text is refused, not parsed
    p.add_argument("--old", default=None, help="something (default: 3)")
    with pytest.raises(ToolError, match="--old"):
        option_rows(p)


EXAMPLE = DOC.parent / "shardcache.toml"


def test_the_example_config_is_in_sync_with_the_table():
    from shardcache.cli.configref import example_config

    assert EXAMPLE.read_text() == example_config(), (
        "docs/shardcache.toml is out of date: run python docs/gen_configuration.py"
    )


def test_the_example_config_names_every_setting_and_reads_back_as_the_defaults(tmp_path):
    """Every setting is in the file, commented out; uncommented, each line gives the
    setting's default (cache_dir, which has none, an example path)."""
    import re

    from proxy.config import Settings, in_groups, parse_settings

    text = EXAMPLE.read_text()
    keys = re.findall(r"^# ([a-z0-9_]+) = ", text, re.MULTILINE)
    assert keys == [s.name for s in in_groups() if s.flag is not None]
    assert not [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    for s in SETTINGS:
        if s.flag is not None:
            assert f"# {s.flag}, env {s.env}" in text, s.name
    live = tmp_path / "shardcache.toml"
    live.write_text(re.sub(r"^# ([a-z0-9_]+ = )", r"\1", text, flags=re.MULTILINE))
    got = parse_settings(["--config", str(live), "--upstream", "http://origin.example"], {})
    want = Settings(cache_dir=Path("/var/cache/shardcache"), upstreams=got.upstreams)
    assert got == want


def test_check_mode_fails_on_a_stale_example(tmp_path, monkeypatch):
    sys.path.insert(0, str(DOC.parent))
    try:
        import gen_configuration
    finally:
        sys.path.remove(str(DOC.parent))
    stale = tmp_path / "shardcache.toml"
    stale.write_text(EXAMPLE.read_text().replace("# cache_size", "# cache_sise"))
    monkeypatch.setattr(gen_configuration, "TARGET", tmp_path / "configuration.md")
    monkeypatch.setattr(gen_configuration, "EXAMPLE", stale)
    (tmp_path / "configuration.md").write_text(DOC.read_text())
    assert gen_configuration.main(["--check"]) == 1
    assert gen_configuration.main([]) == 0
    assert gen_configuration.main(["--check"]) == 0


def test_the_reference_and_the_example_are_grouped_as_serve_help():
    """One section per group of the table, in the order of ``serve --help``, each
    holding exactly the flags of its group."""
    import re

    from proxy.config import GROUPS, SETTINGS

    doc = DOC.read_text()
    serve = doc[doc.index("## `shardcache serve`") : doc.index("## `shardcache prefetch`")]
    heads = re.findall(r"^### (\w+)$", serve, re.MULTILINE)
    assert heads == [key for key, _ in GROUPS]
    for key, _ in GROUPS:
        part = serve.split(f"### {key}\n", 1)[1].split("\n### ", 1)[0]
        flags = re.findall(r"^\| `(--[a-z0-9-]+)", part, re.MULTILINE)
        assert flags == [s.flag for s in SETTINGS if s.group == key and s.flag], key
    example = EXAMPLE.read_text()
    rules = re.findall(r"^# ---- (\w+):", example, re.MULTILINE)
    assert rules == [key for key, _ in GROUPS]


def test_every_setting_with_a_flag_has_a_group_and_a_metavar():
    from proxy.config import GROUPS, SETTINGS

    keys = {key for key, _ in GROUPS}
    for s in SETTINGS:
        if s.flag is not None:
            assert s.group in keys, f"{s.name}: give it a group= of {sorted(keys)}"
            assert s.metavar, f"{s.name}: give it a metavar= saying what a value is"
