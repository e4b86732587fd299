"""The one place the command line reads argparse's parser tree (its actions and
subcommands), which argparse keeps in private attributes: short usage lines, the
closest-flag hints and the shell completion scripts all walk the tree through here."""

from __future__ import annotations

import argparse

__all__ = ["actions", "is_subcommands", "subcommands"]


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` (options, positionals, subcommands), in the order added."""
    return list(parser._actions)


def is_subcommands(action: argparse.Action) -> bool:
    """Whether ``action`` is the subcommand chooser of its parser."""
    return isinstance(action, argparse._SubParsersAction)


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
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}
