"""Writes the disk or the index refused (ENOSPC, EDQUOT, EIO, EROFS...), as
:class:`~shardcache.errors.StoreWriteError`: a state to degrade through, not a bug."""

from __future__ import annotations

import errno
import sqlite3

from shardcache.errors import CacheError, StoreWriteError

# errnos that mean "the disk or index cannot take this write", not a bug or a network error
STORE_ERRNOS = frozenset(
    e
    for e in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", None),
        errno.EIO,
        errno.EROFS,
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
    )
    if e is not None
)
FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e)
_SQLITE_ERRNO = {
    "SQLITE_FULL": errno.ENOSPC,
    "SQLITE_READONLY": errno.EROFS,
    "SQLITE_READONLY_DBMOVED": errno.EROFS,
    "SQLITE_READONLY_RECOVERY": errno.EROFS,
    "SQLITE_READONLY_CANTLOCK": errno.EROFS,
    "SQLITE_READONLY_ROLLBACK": errno.EROFS,
    "SQLITE_IOERR": errno.EIO,
    "SQLITE_CANTOPEN": errno.EACCES,
    "SQLITE_PERM": errno.EPERM,
}


def store_write_error(op: str, path: object, exc: BaseException) -> StoreWriteError | None:
    """The :class:`StoreWriteError` for ``exc`` if it is a write refusal (disk full, quota,
    I/O error, read-only, permission), else None. Knows OSError and sqlite3.Error."""
    if isinstance(exc, StoreWriteError):
        return exc
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""
        code = _SQLITE_ERRNO.get(name)
        if code is None:
            code = next((v for k, v in _SQLITE_ERRNO.items() if name.startswith(k)), None)
        if code is None:
            text = str(exc).lower()
            if "disk is full" in text or "database or disk is full" in text:
                code = errno.ENOSPC
            elif "readonly" in text or "read-only" in text:
                code = errno.EROFS
            elif "disk i/o error" in text:
                code = errno.EIO
        if code is None:
            return None
        return StoreWriteError(op, str(path), code, f"{exc} ({errno.errorcode[code]})")
    if isinstance(exc, OSError) and not isinstance(exc, CacheError):
        if exc.errno in STORE_ERRNOS:
            return StoreWriteError(op, str(path), exc.errno, exc.strerror or str(exc))
    return None


def disk_full(exc: BaseException) -> StoreWriteError | None:
    """The ENOSPC/EDQUOT error behind ``exc`` (following its causes), else None: a full
    disk is a state to wait out, not a misconfiguration."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return StoreWriteError(
                "write",
                getattr(seen, "filename", None) or "cache",
                seen.errno,
                seen.strerror or str(seen),
            )
        seen = seen.__cause__ or seen.__context__
    return None
