"""``shardcache plan PATTERN``: register a read plan at a running proxy, print its id and
(on a terminal, or with ``--watch``) follow it until the reader is done; ``--list`` shows
the proxy's plans, ``--delete ID`` removes one. The proxy address comes from ``--proxy``,
else ``SHARDCACHE_PROXY``, else ``http://127.0.0.1:8080``; mutating requests send
``SHARDCACHE_ADMIN_TOKEN`` as a bearer token when it is set."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from shardcache.cli.common import (
    ToolError,
    _positive_float,
    _resolve_proxy,
    _rich_console,
    add_option,
    add_proxy_option,
    admin_token_error,
    human_bytes,
    no_proxy_error,
    print_table,
)
from shardcache.compat import SubParsersAction
from shardcache.plans import TOKEN_ENV, Plan, PlanError, delete_plan, list_plans

# --------------------------------------------------------------------------- pure helpers


def _num(status: Mapping[str, Any], key: str) -> float:
    value = status.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def status_line(status: Mapping[str, Any]) -> str:
    """One line about a plan: position, shards ready ahead, downloading, stall seconds."""
    shards = int(_num(status, "shards"))
    position = int(_num(status, "position"))
    ready = int(_num(status, "ready_ahead_shards"))
    ready_bytes = _num(status, "ready_ahead_bytes")
    parts = [
        f"{position}/{shards} shards read",
        f"{ready} ready ahead ({human_bytes(ready_bytes)})",
        f"{int(_num(status, 'downloading'))} downloading",
        f"stalled {_num(status, 'wait_seconds'):.1f} s",
    ]
    if status.get("done"):
        parts.append("done")
    return ", ".join(parts)


def plan_rows(plans: list[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows of the ``--list`` table."""
    rows = []
    for p in plans:
        rows.append(
            (
                p.get("id", "?"),
                p.get("name") or "",
                f"{int(_num(p, 'position'))}/{int(_num(p, 'shards'))}",
                f"{int(_num(p, 'ready_ahead_shards'))} ({human_bytes(_num(p, 'ready_ahead_bytes'))})",
                int(_num(p, "downloading")),
                f"{_num(p, 'wait_seconds'):.1f}",
                f"{_num(p, 'idle_seconds'):.0f}",
                "yes" if p.get("done") else "no",
            )
        )
    return rows


def _lookahead(text: str | None) -> int | str | None:
    """``--lookahead``: a whole number is a shard count, anything else a size."""
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else text


def is_done(status: Mapping[str, Any]) -> bool:
    shards = _num(status, "shards")
    return bool(status.get("done")) or (shards > 0 and _num(status, "position") >= shards)


# --------------------------------------------------------------------------- commands


def _unreachable(proxy: str, exc: PlanError) -> ToolError:
    """A proxy that does not answer gets the tools' one message, a refused admin token
    names the variable to set; other errors keep theirs."""
    import urllib.error

    cause = exc.__cause__
    if (
        exc.status is None
        and isinstance(cause, urllib.error.URLError)
        and not isinstance(cause, urllib.error.HTTPError)
    ):
        return no_proxy_error(proxy, cause)
    return admin_token_error(exc.status, str(exc)) or ToolError(str(exc))


def _watch(plan: Plan, interval: float, out: IO[str]) -> int:
    """Follow ``plan`` until its reader is done; 0 when done, 1 when the plan vanished."""
    console = _rich_console(out)
    if console is not None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
        )
        task = bar.add_task(plan.name or plan.id, total=plan.shards, detail="")

        def show(status: Mapping[str, Any]) -> None:
            bar.update(
                task,
                completed=int(_num(status, "position")),
                total=int(_num(status, "shards")) or plan.shards,
                detail=(
                    f"{int(_num(status, 'ready_ahead_shards'))} ready ahead "
                    f"({human_bytes(_num(status, 'ready_ahead_bytes'))}), "
                    f"{int(_num(status, 'downloading'))} downloading, "
                    f"stalled {_num(status, 'wait_seconds'):.1f} s"
                ),
            )

        with bar:
            return _poll(plan, interval, show)
    last = [""]

    def show_plain(status: Mapping[str, Any]) -> None:
        line = status_line(status)
        if line != last[0]:
            last[0] = line
            print(line, file=out, flush=True)

    return _poll(plan, interval, show_plain)


def _poll(plan: Plan, interval: float, show: Callable[[Mapping[str, Any]], None]) -> int:
    while True:
        try:
            status = plan.status()
        except PlanError as exc:
            if exc.status == 404:
                plan.closed = True  # nothing left to delete
                print(
                    f"plan {plan.id} is gone (deleted, or dropped after the proxy's "
                    "--plan-ttl without requests)",
                    file=sys.stderr,
                )
                return 1
            raise _unreachable(plan.proxy, exc) from exc
        show(status)
        if is_done(status):
            return 0
        time.sleep(interval)


def cmd_plan(args: argparse.Namespace) -> int:
    """``shardcache plan``: register, list or delete read plans."""
    proxy = _resolve_proxy(args.proxy)
    try:
        if args.list:
            return _list(proxy, args.json)
        if args.delete:
            delete_plan(args.delete, proxy)
            print(f"deleted plan {args.delete}")
            return 0
    except PlanError as exc:
        if exc.status == 404 and args.delete:
            raise ToolError(f"no plan {args.delete} at {proxy}") from exc
        raise _unreachable(proxy, exc) from exc
    if not args.pattern:
        args.parser.error("PATTERN is required (or use --list or --delete ID)")
    watch = args.watch if args.watch is not None else sys.stdout.isatty()
    try:
        plan = Plan(
            args.pattern, proxy, args.name, _lookahead(args.lookahead), replace=args.replace
        )
    except PlanError as exc:
        raise _unreachable(proxy, exc) from exc
    except ValueError as exc:
        raise ToolError(str(exc)) from exc
    try:
        print(plan.id, flush=True)
        return _watch(plan, args.interval, sys.stdout) if watch else 0
    except KeyboardInterrupt:
        return 130
    finally:
        if watch and not args.keep:
            plan.close()


def _list(proxy: str, as_json: bool) -> int:
    plans = list_plans(proxy)
    if as_json:
        json.dump(plans, sys.stdout, indent=2, sort_keys=True)
        print()
        return 0
    print_table(
        f"read plans at {proxy}: {len(plans)}",
        ["id", "name", "read", "ready ahead", "downloading", "stall s", "idle s", "done"],
        plan_rows(plans),
        right=(2, 3, 4, 5, 6),
    )
    return 0


def register(subparsers: SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="register a read plan at a running proxy and follow it",
        description="Tell the proxy the order in which PATTERN's shards will be read, so it "
        "keeps the next ones downloading ahead and evicts the ones needed last. Prints the "
        "plan id; on a terminal (or with --watch) shows the reader's progress until it is "
        "done or Ctrl-C, then deletes the plan (unless --keep). PATTERN is a brace pattern "
        "of paths on the proxy ('/data/train-{000000..000099}.tar'), of upstream URLs, or "
        "of s3://bucket/key names for the S3 front.",
        epilog="Registering and deleting plans are admin requests: when the proxy has an "
        f"--admin-token, set {TOKEN_ENV} to that token (sent as Authorization: Bearer). "
        "Listing needs no token.",
    )
    p.add_argument("pattern", nargs="?", metavar="PATTERN", help="brace pattern of shards")
    add_proxy_option(p)
    p.add_argument("--name", default=None, help="a name shown in listings (e.g. job-a)")
    add_option(
        p,
        "--lookahead",
        default=None,
        metavar="L",
        help="shards to keep ready ahead (a count), or bytes ('2GiB')",
        shown_default="the proxy's --plan-lookahead",
    )
    add_option(
        p,
        "--watch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="follow the plan until it is done",
        shown_default="when stdout is a terminal",
    )
    p.add_argument(
        "--keep", action="store_true", help="leave the plan at the proxy when watching ends"
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="end the plans named --name once this one is registered (a job's next plan "
        "taking over from its last)",
    )
    add_option(
        p,
        "--interval",
        type=_positive_float,
        default=1.0,
        help="seconds between status requests while watching",
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true", help="list the proxy's plans")
    action.add_argument("--delete", metavar="ID", default=None, help="delete plan ID")
    p.add_argument("--json", action="store_true", help="with --list: the proxy's JSON")
    p.set_defaults(func=cmd_plan, parser=p)
