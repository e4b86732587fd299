"""The ``shardcache`` command line.

Each subcommand lives beside the code it drives; this module only knows where to find
them. A subcommand module exposes ``register(subparsers)``, which adds its parser(s) and
sets ``func`` (taking the parsed ``argparse.Namespace`` and returning an exit code).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from shardcache._version import __version__
from shardcache.cli.argtree import actions, is_subcommands, subcommands
from shardcache.compat import HintingParser
from shardcache.errors import ShardcacheError

# Modules that contribute subcommands, in the order they appear in --help.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "proxy.cli",  # serve
    "shardcache.cli.check",  # check: the store's check and the stray files
    "shardcache.cli.demo",  # demo
    "dbcache.cli",  # dbcache build|info|export
    "shardcache.cli.prefetch",  # prefetch
    "shardcache.cli.plan",  # plan
    "shardcache.cli.stats",  # stats, ls
    "shardcache.cli.where",  # where
    "shardcache.cli.completion",  # completion
)

log = logging.getLogger("shardcache")


def closest_command(word: str, commands: Sequence[str]) -> str:
    """What to say about ``word``, which names none of ``commands``: the closest one
    (``prefech`` → ``did you mean 'prefetch'?``), else the list."""
    close = difflib.get_close_matches(word, list(commands), n=1, cutoff=0.6)
    if close:
        return f"unknown command {word!r}; did you mean {close[0]!r}?"
    return f"unknown command {word!r} (choose from {', '.join(commands)})"


def closest_option(word: str, options: Sequence[str]) -> str | None:
    """The option of ``options`` that ``word`` (``--cache-sise`` or ``--cache-sise=5G``)
    was probably meant to be, or None."""
    if not word.startswith("-"):
        return None
    close = difflib.get_close_matches(word.partition("=")[0], list(options), n=1, cutoff=0.6)
    return close[0] if close else None


def chosen_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The (sub)parser that ``args`` came from: down through each chosen subcommand."""
    while True:
        subs = [a for a in actions(parser) if is_subcommands(a)]
        name = getattr(args, subs[0].dest, None) if subs else None
        chosen = subcommands(parser)
        if name not in chosen:
            return parser
        parser = chosen[name]


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The error for arguments that ``parser`` does not take, the closest option first:
    ``did you mean --cache-size? (unrecognized arguments: --cache-sise 5G)``."""
    options = [o for a in actions(parser) for o in a.option_strings]
    message = f"unrecognized arguments: {' '.join(extras)}"
    for word in extras:
        close = closest_option(word, options)
        if close:
            return f"did you mean {close}? ({message})"
    return message


def short_usage(parser: argparse.ArgumentParser, width: int = 100) -> str:
    """The usage line an error shows: argparse's own when it fits on one line, else
    ``usage: PROG [OPTION ...] POSITIONAL ...`` and where the options are listed."""
    usage = parser.format_usage().strip()
    if "\n" not in usage and len(usage) <= width:
        return usage
    words = [parser.prog, "[OPTION ...]"]
    for a in actions(parser):
        if a.option_strings or a.help == argparse.SUPPRESS:
            continue
        name = a.metavar or a.dest.upper()
        words.append(f"{name} ..." if is_subcommands(a) or a.nargs in ("+", "*") else str(name))
    return f"usage: {' '.join(words)}  ({parser.prog} --help lists the options)"


class _Parser(HintingParser):
    """An ArgumentParser whose subcommand errors name the closest subcommand; the
    subparsers it makes are of this class too."""

    def unknown_subcommand(self, value: str, choices: Sequence[str]) -> str | None:
        return closest_command(value, list(choices))

    def error(self, message: str) -> NoReturn:
        """One short usage line and the error, not the whole usage of every flag."""
        self.exit(2, f"{short_usage(self)}\n{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardcache",
        description="A shard cache and caching proxy for WebDataset-style tar shards.",
    )
    parser.add_argument("--version", action="version", version=f"shardcache {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only skip modules that do not exist; a broken import is a bug to surface.
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # the subcommand's usage and options, not the top level's
        sub = chosen_parser(parser, args)
        sub.error(unrecognized(sub, extras))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`shardcache stats | head`): stop quietly. Python's own
        # flush at exit would fail again, so stdout goes to devnull (Python docs, "Note
        # on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except ShardcacheError as exc:
        print(f"shardcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
