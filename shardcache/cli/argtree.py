"""The command line's view of argparse's parser tree (its actions and subcommands):
short usage lines, the closest-flag hints and the shell completion scripts walk the tree
through here; the private attributes behind it are read in :mod:`shardcache.compat`."""

from __future__ import annotations

import argparse

from shardcache import compat

__all__ = ["actions", "is_subcommands", "subcommands"]


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` (options, positionals, subcommands), in the order added."""
    return compat.parser_actions(parser)


def is_subcommands(action: argparse.Action) -> bool:
    """Whether ``action`` is the subcommand chooser of its parser."""
    return isinstance(action, compat.SubParsersAction)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser`` by name (aliases included), in the order added."""
    for action in actions(parser):
        if is_subcommands(action):
            return dict(action.choices)  # type: ignore[arg-type]
    return {}


def subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The one-line help of each subcommand of ``parser``."""
    for action in actions(parser):
        if is_subcommands(action):
            return compat.subcommand_help(action)
    return {}
