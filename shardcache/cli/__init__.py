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
import sys
from collections.abc import Sequence

from shardcache._version import __version__
from shardcache.errors import ShardcacheError

# Modules that contribute subcommands, in the order they appear in --help.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "proxy.cli",  # serve, check
    "shardcache.cli.check",  # check: also the stray files of a cache directory
    "shardcache.cli.demo",  # demo
    "dbcache.cli",  # dbcache build|info|export
    "shardcache.cli.prefetch",  # prefetch
    "shardcache.cli.plan",  # plan
    "shardcache.cli.stats",  # stats, ls
)

log = logging.getLogger("shardcache")


def closest_command(word: str, commands: Sequence[str]) -> str:
    """What to say about ``word``, which names none of ``commands``: the closest one
    (``prefech`` → ``did you mean 'prefetch'?``), else the list."""
    close = difflib.get_close_matches(word, list(commands), n=1, cutoff=0.6)
    if close:
        return f"unknown command {word!r}; did you mean {close[0]!r}?"
    return f"unknown command {word!r} (choose from {', '.join(commands)})"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommand errors name the closest subcommand; the
    subparsers it makes are of this class too."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if (
            isinstance(action, argparse._SubParsersAction)
            and isinstance(value, str)
            and value not in action.choices
        ):
            raise argparse.ArgumentError(action, closest_command(value, list(action.choices)))
        super()._check_value(action, value)


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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ShardcacheError as exc:
        print(f"shardcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
