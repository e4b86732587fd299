"""``shardcache check``: the store's check of a cache directory (and repair with
``--fix``), which also lists stray files: names in the cache directory that the
store did not make (not an entry, the index or a download or eviction in progress).

The store's own check reconciles its index with its files and ignores every other name,
so a file copied into the cache directory by hand (or a second tool writing there) takes
disk space that ``--cache-size`` never counts. They are reported, never removed: they are
not the cache's to delete.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Iterable

from shardcache.cli.common import CACHE_DIR_ENV, add_option, cache_dir_arg
from shardcache.compat import SubParsersAction
from shardcache.sizes import format_size
from shardcache.store import DEL_SUFFIX, FANOUT, FLAT, INDEX_NAME, PART_SUFFIX, Store
from shardcache.store.names import FANOUT_DIRS

# the index and SQLite's files beside it
INDEX_FILES = frozenset(INDEX_NAME + suffix for suffix in ("", "-wal", "-shm", "-journal"))
# work files: downloads in progress, evicted entries waiting to be unlinked, the
# writability probe of a starting proxy
WORK_SUFFIXES = (PART_SUFFIX, DEL_SUFFIX)
WORK_PREFIXES = (".probe.",)


def is_entry_name(name: str) -> bool:
    """Whether ``name`` is an entry's name: a canonical UUID, as ``shard_uuid`` makes."""
    try:
        return str(uuid.UUID(name)) == name
    except ValueError:
        return False


def is_cache_name(name: str) -> bool:
    """Whether the store may have made a file called ``name``."""
    return (
        name in INDEX_FILES
        or is_entry_name(name)
        or name.endswith(WORK_SUFFIXES)
        or name.startswith(WORK_PREFIXES)
    )


def stray_names(names: Iterable[str]) -> list[str]:
    """The names, sorted, that are not the store's (pure: no I/O)."""
    return sorted(name for name in names if not is_cache_name(name))


def stray_names_fanout(names: Iterable[str], subdir: str = "") -> list[str]:
    """The names, sorted, that are not the store's in the fan-out layout (pure): at the
    top (``subdir`` empty) the index, the probe and the 256 subdirectories; in a
    subdirectory the entry and work files whose key starts with its name."""
    if not subdir:
        return sorted(
            n
            for n in names
            if n not in INDEX_FILES and not n.startswith(WORK_PREFIXES) and n not in FANOUT_DIRS
        )
    return sorted(
        n
        for n in names
        if not (n.startswith(subdir) and (is_entry_name(n) or n.endswith(WORK_SUFFIXES)))
    )


def _sizes(path: str, names: list[str], found: dict) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for name in names:
        entry = found[name]
        try:
            size = None if entry.is_dir(follow_symlinks=False) else entry.stat().st_size
        except OSError:
            size = None
        out.append((os.path.join(path, name) if path else name, size))
    return out


def stray_files(
    cache_dir: str | os.PathLike[str], layout: str = FLAT
) -> list[tuple[str, int | None]]:
    """``(name, bytes)`` of each stray in ``cache_dir`` (in the fan-out layout, inside
    its subdirectories too, named ``ab/name``); bytes is None for a directory (or a name
    gone since the listing)."""
    with os.scandir(cache_dir) as it:
        found = {e.name: e for e in it}
    if layout != FANOUT:
        return _sizes("", stray_names(found), found)
    out = _sizes("", stray_names_fanout(found), found)
    for sub in FANOUT_DIRS:
        if sub not in found or not found[sub].is_dir(follow_symlinks=False):
            continue
        with os.scandir(os.path.join(cache_dir, sub)) as it:
            inner = {e.name: e for e in it}
        out += _sizes(sub, stray_names_fanout(inner, sub), inner)
    return out


def store_check(args: argparse.Namespace) -> int:
    """The store's own check (and repair with ``--fix``) of ``args.cache_dir``: exit 0
    when nothing is left wrong, 1 otherwise."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cache_dir = args.cache_dir = cache_dir_arg(args.cache_dir)
    store = Store(cache_dir, reconcile=False)  # report first; repair only with --fix
    args.layout = store.layout  # as the index records it
    try:
        report = store.check(fix=args.fix, verify=getattr(args, "verify", False))
    finally:
        store.close()
    size = f"{report.bytes} bytes"
    if report.bytes >= 1024:
        size = f"{format_size(report.bytes)} ({size})"
    layout = " (fanout layout)" if args.layout == FANOUT else ""
    print(f"cache directory {os.path.abspath(cache_dir)}{layout}: {report.entries} entries, {size}")
    if getattr(args, "verify", False):
        print(f"verified {report.verified} entries, {report.digest_mismatch} changed on disk")
    for line in report.problems:
        print(f"problem: {line}")
    for line in report.fixed:
        print(f"fixed: {line}")
    if report.ok:
        print("ok")
        return 0
    if args.fix and report.fixed and len(report.fixed) >= len(report.problems):
        print("repaired")
        return 0
    return 1


def cmd_check(args: argparse.Namespace) -> int:
    """The store's check, then the stray files (reported; the exit status is the store's)."""
    status = store_check(args)
    strays = stray_files(args.cache_dir, getattr(args, "layout", FLAT))
    for name, size in strays:
        what = "a directory" if size is None else f"{size} bytes"
        print(f"stray: {name} ({what}): not a cache file; left alone, outside --cache-size")
    if strays:
        print(f"{len(strays)} stray name(s) in {args.cache_dir}")
    return status


def register(subparsers: SubParsersAction) -> None:
    """Add the ``check`` subcommand."""
    c = subparsers.add_parser(
        "check",
        help="check (and repair) a cache directory",
        description="Reconcile the store's index with its directory and report problems; "
        "exit 1 if any remain. Also lists stray files: names in the directory that are not "
        "the cache's (left alone).",
    )
    add_option(c, "--cache-dir", default=None, help="the cache directory", env=CACHE_DIR_ENV)
    c.add_argument("--fix", action="store_true", help="repair what can be repaired")
    c.add_argument(
        "--verify",
        action="store_true",
        help="also read every entry and compare its bytes with the digests recorded when "
        "it was written (reads the whole cache); with --fix, entries that differ are removed",
    )
    c.set_defaults(func=cmd_check)
