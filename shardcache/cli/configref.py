"""The configuration reference (docs/configuration.md): the ``serve`` section is written
from the settings table (``proxy.config.SETTINGS``), the tools' sections from their
parsers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from shardcache.cli.common import OptionDoc, ToolError
from shardcache.compat import AppendAction, HelpAction, SubParsersAction, parser_actions

# --------------------------------------------------------------------------- configuration


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser_actions(parser):
        if isinstance(action, SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise ToolError(f"no {name!r} subcommand in the CLI")


def setting_rows(group: str | None = None) -> list[tuple[str, str, str, str]]:
    """(flag, environment variable, default, meaning) for each setting of ``serve`` (of
    one section of ``proxy.config.GROUPS`` when ``group`` is given; ``""``: the settings
    of no section), read from the settings table itself."""
    from proxy.config import CONFIG_FILE, SETTINGS

    rows = []
    for s in (CONFIG_FILE, *SETTINGS):
        if s.flag is None or (group is not None and s.group != group):  # set by code only
            continue
        rows.append(
            (f"{s.flag} {s.metavar or s.name.upper()}", s.env, s.default_text(), s.meaning())
        )
    return rows


def grouped_setting_tables() -> list[str]:
    """The ``serve`` settings as one markdown table per section, in the order of
    ``serve --help``."""
    from proxy.config import GROUPS

    parts = [_md_table(setting_rows("")), ""]
    for key, text in GROUPS:
        rows = setting_rows(key)
        if rows:
            parts += [f"### {key}", "", text[:1].upper() + text[1:] + ".", "", _md_table(rows), ""]
    return parts


def option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(flag, environment variable, default, meaning) for each option of a tool's
    ``parser``: what :func:`~shardcache.cli.common.add_option` recorded of it (its help,
    variable and default, kept apart from the ``--help`` line), else the argparse help
    and default as they are. A help line that names a default or a variable without
    that record is an error: the reference does not parse help text."""
    rows = []
    for action in parser_actions(parser):
        if isinstance(action, HelpAction) or not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = " / ".join(action.option_strings)  # --watch / --no-watch
        elif action.nargs != 0:
            flag += " " + (action.metavar or action.dest.upper())
        doc: OptionDoc | None = getattr(action, "doc", None)
        if doc is None:
            text = (action.help or "").replace("%%", "%")  # argparse escapes
            if "(default" in text or "[env " in text:
                raise ToolError(f"{flag}: declare it with add_option(), not in its help text")
            default = ""
            if action.default not in (None, False, argparse.SUPPRESS):
                default = str(action.default)
            env = ""
        else:
            text, env, default = doc.help, doc.env, doc.default
        if action.required:
            default = "required"
        if action.choices:
            text += " (one of: " + ", ".join(map(str, action.choices)) + ")"
        if isinstance(action, AppendAction):
            text += " (repeatable)" if "repeatable" not in text else ""
        rows.append((flag, env, default, " ".join(text.split())))
    return rows


def _md_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    def cell(s: str, code: bool = False) -> str:
        s = s.replace("|", "\\|")
        return f"`{s}`" if code and s else (s or "—")

    out = ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for flag, env, default, text in rows:
        out.append(
            f"| {cell(flag, True)} | {cell(env, True)} | {cell(default, True)} | {cell(text)} |"
        )
    return "\n".join(out)


def configuration_reference() -> str:
    """The configuration reference (markdown), generated from the settings table and the
    tools' parsers."""
    from proxy.config import SIZE_UNITS
    from shardcache.cli import build_parser

    parser = build_parser()

    parts = [
        "# Configuration reference",
        "",
        "<!-- Generated from the code by `python docs/gen_configuration.py`; do not edit by "
        "hand. tests/test_configuration_doc.py fails when this file and the code disagree. -->",
        "",
        "## `shardcache serve`",
        "",
        "Every flag can also be given as an environment variable, or as a key of a TOML file "
        "named by `--config`. A flag on the command line wins over the variable, the variable "
        "over the file, and the file over the default. Settings are read and validated once "
        "at startup, and a bad value stops the proxy with a message naming the flag (or, for "
        "an unknown key of the file, the key).",
        "",
        SIZE_UNITS,
        "",
        "Lists in an environment variable (`SHARDCACHE_UPSTREAM`, `SHARDCACHE_ALLOW_HOST`) "
        "are separated by commas or spaces; in the file they are TOML arrays. The keys of the "
        "file are the setting names: the flag without its dashes, with underscores, and "
        "plural for the lists (`upstreams`, `allow_hosts`, `s3_domains`):",
        "",
        "```toml",
        'cache_dir = "/var/cache/shardcache"',
        'cache_size = "500G"',
        'upstreams = ["https://data.example.com/shards", "s3data=s3://bucket/prefix"]',
        "port = 8080",
        "http_parts = true",
        "```",
        "",
        *grouped_setting_tables(),
    ]
    for name in ("prefetch", "plan", "stats", "ls", "check"):
        sub = _subparser(parser, name)
        parts += [
            f"## `shardcache {name}`",
            "",
            " ".join((sub.description or getattr(sub, "help", "") or "").split()) or "",
            "",
            _md_table(option_rows(sub)),
            "",
        ]
    return "\n".join(p for p in parts if p is not None).rstrip() + "\n"


# --------------------------------------------------------------------------- example file


def _toml_value(value: object) -> str:
    """A default as TOML, in the form the file is read back (sizes as text, lists as
    arrays of text)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(json.dumps(str(v)) for v in value) + "]"
    return json.dumps(str(value))


def _wrap(text: str, width: int = 88) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width - 2, break_on_hyphens=False, break_long_words=False)


def example_config() -> str:
    """An example ``shardcache.toml`` with every setting of ``serve`` commented out: its
    meaning, flag, variable and default, then the key with its default as a value (or
    ``""`` where the default is computed or none). Uncommenting a line gives the default;
    the file is generated from the settings table, like the configuration reference."""
    from proxy.config import GROUPS, SIZE_UNITS, in_groups

    out = [
        "# shardcache.toml: every setting of `shardcache serve`, commented out.",
        "# Generated from the settings table by `python docs/gen_configuration.py`; do not",
        "# edit by hand. Use it with `shardcache serve --config shardcache.toml` (or",
        "# SHARDCACHE_CONFIG); a flag or an environment variable wins over the file.",
        "#",
        *("# " + line for line in _wrap(SIZE_UNITS)),
        "# An empty string leaves a setting at its default.",
    ]
    titles = dict(GROUPS)
    group = None
    for s in in_groups():
        if s.flag is None:  # set by code only
            continue
        if s.group != group:
            group = s.group
            if group:
                rule = f"# ---- {group}: {titles[group]} "
                out += ["", rule + "-" * max(4, 88 - len(rule))]
        out.append("")
        out += ["# " + line for line in _wrap(s.meaning())]
        default = s.default_text()
        where = f"{s.flag}, env {s.env}" + (f"; default: {default}" if default else "")
        out += ["# " + line for line in _wrap(where)]
        if s.required:
            value = '"/var/cache/shardcache"'  # an example: there is no default
        elif s.default is None:
            value = '""'
        elif s.show is not None:
            value = _toml_value(s.show(s.default))
        else:
            value = _toml_value(s.default)
        out.append(f"# {s.name} = {value}")
    return "\n".join(out) + "\n"
