"""``shardcache completion bash|zsh``: a shell completion script generated from the
command line's own parser tree, so that it knows every subcommand, flag and choice the
installed version has. Values of flags whose metavar names a file (``PATH``,
``FILE...``) complete as file names; flags with choices complete their choices.

Install (bash): ``shardcache completion bash > ~/.local/share/bash-completion/completions/shardcache``
or ``source <(shardcache completion bash)`` in ``~/.bashrc``. Install (zsh):
``shardcache completion zsh > "${fpath[1]}/_shardcache"`` or
``source <(shardcache completion zsh)`` in ``~/.zshrc`` after ``compinit``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shardcache.cli.argtree import actions, is_subcommands, subcommand_help, subcommands
from shardcache.compat import SubParsersAction

SHELLS = ("bash", "zsh")
_FILE_METAVAR = re.compile(r"(^|[^A-Z])(PATH|FILE|DIR)([^A-Z]|$)")
_CHOICES_METAVAR = re.compile(r"^[a-z0-9][a-z0-9-]*(\|[a-z0-9][a-z0-9-]*)+$")
_SAFE = re.compile(r"^[A-Za-z0-9_.,:+=@%/-]+$")


@dataclass(frozen=True)
class Command:
    """What completion needs of one (sub)command: its words, flags and their values."""

    path: str  # "" for the top level, "dbcache build" for a nested subcommand
    subcommands: tuple[tuple[str, str], ...]  # (name, one-line help); positionals' choices
    flags: tuple[str, ...]
    values: tuple[tuple[str, str], ...]  # (flag, "@file" | "@any" | "choice choice ...")
    file_positionals: bool  # a positional names a file: complete file names there


def _value_kind(action: argparse.Action) -> str:
    """How a flag's value completes: its choices (argparse's, or a metavar that lists
    them: ``on|off``), file names (a metavar naming a file), or anything."""
    if action.choices:
        return " ".join(map(str, action.choices))
    metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    if _CHOICES_METAVAR.match(metavar):
        return " ".join(metavar.split("|"))
    return "@file" if _FILE_METAVAR.search(metavar) else "@any"


def command_tree(parser: argparse.ArgumentParser, path: str = "") -> Iterator[Command]:
    """Every command of ``parser`` (itself first), depth first, in the order of --help."""
    flags: list[str] = []
    values: list[tuple[str, str]] = []
    file_positionals = False
    words: list[tuple[str, str]] = []  # the choices of positionals
    for action in actions(parser):
        if action.help == argparse.SUPPRESS or is_subcommands(action):
            continue
        if not action.option_strings:
            metavar = action.metavar if isinstance(action.metavar, str) else action.dest
            file_positionals |= bool(_FILE_METAVAR.search(metavar.upper()))
            words += [(str(c), "") for c in action.choices or ()]
            continue
        flags += action.option_strings
        if action.nargs != 0:
            values += [(flag, _value_kind(action)) for flag in action.option_strings]
    subs = subcommands(parser)
    helps = subcommand_help(parser)
    yield Command(
        path,
        tuple((name, helps.get(name, "")) for name in subs) + tuple(words),
        tuple(flags),
        tuple(values),
        file_positionals,
    )
    for name, sub in subs.items():
        yield from command_tree(sub, f"{path} {name}".strip())


def _word(text: str) -> str:
    """``text`` as one shell word (single-quoted unless plainly safe)."""
    if _SAFE.match(text):
        return text
    return "'" + text.replace("'", "'\\''") + "'"


def _key(path: str) -> str:
    """A command's path as a ``case`` pattern (``""`` for the top level)."""
    return _word(path) if path else '""'


def _cases(commands: list[Command], body: Callable[[Command], str | None]) -> list[str]:
    lines = []
    for c in commands:
        out = body(c)
        if out is not None:
            lines.append(f"        {_key(c.path)}) {out} ;;")
    return lines


def _data_functions(prog: str, commands: list[Command]) -> list[str]:
    """The shell functions both scripts share: the tree as ``case`` tables (the same
    syntax in bash and zsh)."""
    fn = "_" + prog.replace("-", "_")
    out = [f"{fn}_subcommands() {{", '    case "$1" in']
    out += _cases(
        commands,
        lambda c: "echo " + _word(" ".join(n for n, _ in c.subcommands)) if c.subcommands else None,
    )
    out += ["    esac", "}", "", f"{fn}_described() {{", '    case "$1" in']
    for c in commands:
        if c.subcommands:
            lines = "\n".join(f"{n}:{' '.join(h.split())}" for n, h in c.subcommands)
            out.append(f"        {_key(c.path)}) printf '%s\\n' {_word(lines)} ;;")
    out += ["    esac", "}", "", f"{fn}_flags() {{", '    case "$1" in']
    out += _cases(commands, lambda c: "echo " + _word(" ".join(c.flags)) if c.flags else None)
    out += ["    esac", "}", "", f"{fn}_value() {{", '    case "$1|$2" in']
    for c in commands:
        for flag, kind in c.values:
            out.append(f"        {_word(c.path + '|' + flag)}) echo {_word(kind)} ;;")
    out += ["    esac", "}", "", f"{fn}_files_here() {{", '    case "$1" in']
    out += _cases(commands, lambda c: "return 0" if c.file_positionals else None)
    out += ["    esac", "    return 1", "}", ""]
    # the command a line has reached: its words before the cursor, flag values skipped
    out += [
        f"{fn}_command() {{",
        '    local key="" skip=0 w s',
        "    shift  # the program",
        "    while (($# > 1)); do  # the last word is the one being completed",
        '        w="$1"; shift',
        "        if ((skip)); then skip=0; continue; fi",
        '        case "$w" in',
        "            --*=*) continue ;;",
        f'            -*) [[ -n "$({fn}_value "$key" "$w")" ]] && skip=1; continue ;;',
        "        esac",
        f'        for s in $({fn}_subcommands "$key"); do',
        '            if [[ "$s" == "$w" ]]; then key="${key:+$key }$w"; break; fi',
        "        done",
        "    done",
        '    echo "$key"',
        "}",
        "",
    ]
    return out


def bash_script(parser: argparse.ArgumentParser) -> str:
    """The bash completion script for ``parser``'s program."""
    prog = parser.prog
    fn = "_" + prog.replace("-", "_")
    commands = list(command_tree(parser))
    lines = [
        f"# bash completion for {prog}, generated by `{prog} completion bash`.",
        f"# Install: {prog} completion bash > ~/.local/share/bash-completion/completions/{prog}",
        f"#      or: source <({prog} completion bash)",
        "",
        *_data_functions(prog, commands),
        f"{fn}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="" key kind',
        "    COMPREPLY=()",
        f'    key="$({fn}_command "${{COMP_WORDS[@]:0:COMP_CWORD+1}}")"',
        '    ((COMP_CWORD > 1)) && prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '    if [[ "$prev" == -* && "$cur" != -* ]]; then',
        f'        kind="$({fn}_value "$key" "$prev")"',
        '        case "$kind" in',
        '            "") ;;',
        "            @file) compopt -o filenames 2>/dev/null"
        '; COMPREPLY=($(compgen -f -- "$cur")); return 0 ;;',
        "            @any) return 0 ;;",
        '            *) COMPREPLY=($(compgen -W "$kind" -- "$cur")); return 0 ;;',
        "        esac",
        "    fi",
        '    if [[ "$cur" == -* ]]; then',
        f'        COMPREPLY=($(compgen -W "$({fn}_flags "$key")" -- "$cur"))',
        "        return 0",
        "    fi",
        f'    COMPREPLY=($(compgen -W "$({fn}_subcommands "$key")" -- "$cur"))',
        f'    if ((${{#COMPREPLY[@]}} == 0)) && {fn}_files_here "$key"; then',
        '        compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- "$cur"))',
        "    fi",
        "    return 0",
        "}",
        "",
        f"complete -F {fn} {prog}",
        "",
    ]
    return "\n".join(lines)


def zsh_script(parser: argparse.ArgumentParser) -> str:
    """The zsh completion script for ``parser``'s program: an autoloadable ``#compdef``
    file that also works when sourced."""
    prog = parser.prog
    fn = "_" + prog.replace("-", "_")
    commands = list(command_tree(parser))
    lines = [
        f"#compdef {prog}",
        f"# zsh completion for {prog}, generated by `{prog} completion zsh`.",
        f'# Install: {prog} completion zsh > "${{fpath[1]}}/_{prog}"',
        f"#      or: source <({prog} completion zsh)   (after compinit)",
        "",
        *_data_functions(prog, commands),
        f"{fn}() {{",
        '    local cur="${words[CURRENT]}" prev="${words[CURRENT-1]}" key kind',
        "    local -a described",
        f'    key="$({fn}_command "${{(@)words[1,CURRENT]}}")"',
        '    if [[ "$prev" == -* && "$cur" != -* ]] && ((CURRENT > 2)); then',
        f'        kind="$({fn}_value "$key" "$prev")"',
        '        case "$kind" in',
        '            ("") ;;',
        "            (@file) _files; return ;;",
        "            (@any) _message 'value'; return ;;",
        "            (*) compadd -- ${=kind}; return ;;",
        "        esac",
        "    fi",
        '    if [[ "$cur" == -* ]]; then',
        f'        compadd -- ${{=$({fn}_flags "$key")}}',
        "        return",
        "    fi",
        f'    described=("${{(@f)$({fn}_described "$key")}}")',
        '    if (( ${#described} )) && [[ -n "${described[1]}" ]]; then',
        "        _describe 'command' described",
        f'    elif {fn}_files_here "$key"; then',
        "        _files",
        "    fi",
        "}",
        "",
        'if [[ "${zsh_eval_context[-1]}" == loadautofunc ]]; then',
        f'    {fn} "$@"',
        "else",
        f"    compdef {fn} {prog}",
        "fi",
        "",
    ]
    return "\n".join(lines)


def cmd_completion(args: argparse.Namespace) -> int:
    """``shardcache completion SHELL``: print the script."""
    from shardcache.cli import build_parser

    parser = build_parser()
    script = bash_script(parser) if args.shell == "bash" else zsh_script(parser)
    print(script, end="")
    return 0


def register(subparsers: SubParsersAction) -> None:
    """Add the ``completion`` subcommand."""
    p = subparsers.add_parser(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description="Print a completion script for bash or zsh, generated from this "
        "version's commands and flags. bash: `source <(shardcache completion bash)` in "
        "~/.bashrc, or save it as ~/.local/share/bash-completion/completions/shardcache. "
        'zsh: `shardcache completion zsh > "${fpath[1]}/_shardcache"`, or '
        "`source <(shardcache completion zsh)` in ~/.zshrc after compinit.",
    )
    p.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash or zsh")
    p.set_defaults(func=cmd_completion)
