"""docs/configuration.md is generated from the CLI's parsers and must match them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from shardcache.cli import build_parser
from shardcache.cli.configref import _subparser, configuration_reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_configuration_doc_is_in_sync_with_the_code():
    assert DOC.read_text() == configuration_reference(), (
        "docs/configuration.md is out of date: run python docs/gen_configuration.py"
    )


def test_every_serve_flag_and_env_var_is_documented():
    text = configuration_reference()
    serve = _subparser(build_parser(), "serve")
    flags = [
        a for a in serve._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert len(flags) >= 10
    for action in flags:
        assert f"`{max(action.option_strings, key=len)}" in text
        assert f"`SHARDCACHE_{action.dest.upper()}`" in text
    assert "`SHARDCACHE_PROXY`" in text


def test_check_mode_accepts_the_committed_file():
    script = DOC.parent / "gen_configuration.py"
    res = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
