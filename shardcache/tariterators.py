"""The tar pipeline: shard URLs → byte streams → tar members → samples.

The samples are the same as webdataset 1.0.2's ``WebDataset(urls, shardshuffle=False)``
(without decoding): dicts with ``__key__``, ``__url__``, ``__local_path__`` for local
files, and one ``bytes`` value per (lower-cased) extension. Member names are read as
Python's :mod:`tarfile` reads them (GNU and PAX long names, ustar prefixes, global PAX
headers), and members are filtered the same way (only regular files; ``__meta__`` names
skipped).

Unlike a ``tarfile`` stream, a truncated or corrupt tar never ends quietly: a short
member, a stream that stops at a member boundary without the end-of-archive block, a
header with a bad checksum or a broken compressed stream raises
:class:`~shardcache.errors.ShardFormatError` naming the URL (or goes to the handler).
After an error the shard's partly assembled sample is dropped, never yielded short.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any
from urllib.parse import urlparse

from shardcache.errors import ShardFormatError
from shardcache.gopen import gopen
from shardcache.handlers import reraise_exception
from shardcache.readahead import ReadAhead, regular_file
from shardcache.tarreader import Handler, _tar_members

__all__ = [
    "base_plus_ext",
    "valid_sample",
    "tar_file_iterator",
    "tar_file_expander",
    "group_by_keys",
    "url_opener",
    "tarfile_samples",
    "BAD_SHARD",
]

log = logging.getLogger(__name__)

_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = r"__[^/]*__($|/)"

BAD_SHARD = "__bad__"
"""Key of the marker :func:`tar_file_expander` yields after a shard failed part way
(when the handler chose to go on): :func:`group_by_keys` drops its unfinished sample."""


def base_plus_ext(path: str) -> tuple[str, str] | tuple[None, None]:
    """Split ``path`` at the first dot of its last component: ``("dir/key", "ext.ext2")``.

    Returns ``(None, None)`` when the last component has no dot (or starts with one).
    """
    match = _BASE_PLUS_EXT.match(path)
    if not match:
        return None, None
    return match.group(1), match.group(2)


def valid_sample(sample: Any) -> bool:
    """True for a non-empty dict sample not marked ``__bad__``."""
    return (
        sample is not None
        and isinstance(sample, dict)
        and len(sample) > 0
        and not sample.get("__bad__", False)
    )


def _stream_name(fileobj: Any) -> str:
    name = getattr(fileobj, "name", None)
    return name if isinstance(name, str) else repr(fileobj)


def tar_file_iterator(
    fileobj: IO[bytes],
    skip_meta: str | None = r"__[^/]*__($|/)",
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    *,
    url: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield ``dict(fname=..., data=...)`` for each regular file of the tar stream ``fileobj``.

    Members whose name matches ``skip_meta`` (and top-level ``__name__`` members) are
    skipped, as are members ``select_files`` rejects; ``rename_files`` renames first.
    A truncated or corrupt stream raises :class:`ShardFormatError` naming ``url`` (default:
    the stream's name) unless ``handler`` returns; either way the stream is not read
    further. ``fileobj`` may be gzip, bzip2 or xz compressed (detected as tarfile does).
    """
    name = url if url is not None else _stream_name(fileobj)
    try:
        yield from _tar_members(fileobj, name, skip_meta, handler, select_files, rename_files, None)
    except Exception as exn:
        handler(exn)


def _close_stream(stream: Any) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _close_quietly(stream: Any, url: str) -> None:
    try:
        _close_stream(stream)
    except Exception as exc:  # the shard already failed or was abandoned
        log.debug("%s: error closing stream: %s", url, exc)


def tar_file_expander(
    data: Iterable[dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    eof_value: dict[str, Any] | None = {},  # noqa: B006 - a marker, never mutated
    *,
    read_ahead: int = 0,
) -> Iterator[dict[str, Any]]:
    """Expand ``dict(url=, stream=[, local_path=])`` items into the files of each tar.

    Yields ``dict(fname=, data=, __url__=[, __local_path__=])`` per member, then
    ``eof_value`` (``{}``) after each shard so that samples never span two shards. Each
    stream is closed once read (a ``pipe:`` exit status is checked then). When a shard
    fails, ``handler`` decides: raise, continue with the next shard (True) or stop
    (False); before going on, a ``{BAD_SHARD: True}`` marker tells
    :func:`group_by_keys` to drop the shard's unfinished sample.

    ``read_ahead`` (bytes, default 0: off): a shard that is a local regular file is read
    by a thread, at most that many bytes of member data ahead of the consumer
    (:class:`shardcache.readahead.ReadAhead`); once it is read to its end, the next
    shard is asked for from ``data`` (which may close the one read) and its reading
    starts while the last files of the previous one are yielded. The files, errors and
    their order are the same. Not with ``select_files`` or ``rename_files`` (they are
    called as the members are read, and stay in the consumer's thread).
    """
    if read_ahead > 0 and select_files is None and rename_files is None:
        yield from _expand_ahead(data, handler, eof_value, read_ahead)
        return
    for source in data:
        url = source["url"]
        stream = source["stream"]
        extra = {"__url__": url}
        local_path = source.get("local_path")
        if local_path is not None:
            extra["__local_path__"] = local_path
        try:
            try:
                yield from _tar_members(
                    stream, url, _SKIP_META, handler, select_files, rename_files, extra
                )
            except BaseException:
                _close_quietly(stream, url)
                raise
            _close_stream(stream)
        except Exception as exn:
            go_on = handler(exn)
            yield {BAD_SHARD: True, "__url__": url}
            if go_on:
                continue
            break
        if eof_value is not None:
            yield eof_value


_END = object()  # no shard after this one


def _extra(source: dict[str, Any]) -> dict[str, Any]:
    extra = {"__url__": source["url"]}
    local_path = source.get("local_path")
    if local_path is not None:
        extra["__local_path__"] = local_path
    return extra


def _start(source: dict[str, Any], limit: int) -> ReadAhead | None:
    """A :class:`ReadAhead` over the members of ``source``'s stream when it is a local
    regular file and a thread can be started, else None (read where it is consumed)."""
    stream = source["stream"]
    if not regular_file(stream):
        return None
    members = _tar_members(
        stream, source["url"], _SKIP_META, reraise_exception, None, None, _extra(source)
    )
    try:
        return ReadAhead(members, limit)
    except RuntimeError as exc:  # no thread to be had: read it here
        log.debug("%s: read without read-ahead: %s", source["url"], exc)
        return None


def _expand_ahead(
    data: Iterable[dict[str, Any]],
    handler: Handler,
    eof_value: dict[str, Any] | None,
    limit: int,
) -> Iterator[dict[str, Any]]:
    """:func:`tar_file_expander` with read-ahead: the same files, markers and errors in
    the same order. A shard's next one is taken from ``data`` (and its read-ahead
    started) once the shard is read to its end; what ``data`` raises then is raised
    where the loop would have taken it."""
    sources = iter(data)
    early: Any = None  # (source, ReadAhead or None), _END, or what next(sources) raised
    reader: ReadAhead | None = None
    try:
        while True:
            if early is None:
                try:
                    source = next(sources)
                except StopIteration:
                    return
                reader = None
            else:
                got, early = early, None
                if got is _END:
                    return
                if isinstance(got, Exception):
                    raise got
                source, reader = got
            url = source["url"]
            stream = source["stream"]
            try:
                try:
                    if reader is None:
                        reader = _start(source, limit)
                    if reader is None:
                        yield from _tar_members(
                            stream, url, _SKIP_META, handler, None, None, _extra(source)
                        )
                    else:
                        for member in reader.items():
                            yield member
                            if early is None and reader.read_all:
                                early = _take_next(sources, limit)
                except BaseException:
                    if reader is not None:
                        reader.close()  # the thread is done with the stream
                    _close_quietly(stream, url)
                    raise
                _close_stream(stream)
            except Exception as exn:
                go_on = handler(exn)
                yield {BAD_SHARD: True, "__url__": url}
                if go_on:
                    continue
                break
            if eof_value is not None:
                yield eof_value
    finally:
        if isinstance(early, tuple):  # abandoned with a shard taken ahead: not read
            source, ahead = early
            if ahead is not None:
                ahead.close()
            _close_quietly(source["stream"], source["url"])


def _take_next(sources: Iterator[dict[str, Any]], limit: int) -> Any:
    """The next source of ``sources`` and its read-ahead, started; _END; or the
    exception taking it raised."""
    try:
        source = next(sources)
    except StopIteration:
        return _END
    except Exception as exc:
        return exc
    return source, _start(source, limit)


def group_by_keys(
    data: Iterable[dict[str, Any]],
    keys: Callable[[str], tuple[Any, Any]] = base_plus_ext,
    lcase: bool = True,
    suffixes: set[str] | None = None,
    handler: Handler | None = None,
) -> Iterator[dict[str, Any]]:
    """Group consecutive files with the same key into samples.

    ``keys`` splits a file name into ``(key, extension)``; files without a key are
    skipped. Extensions are lower-cased (``lcase``) and, with ``suffixes``, filtered. An
    empty dict ends the current sample (end of a shard); a ``BAD_SHARD`` marker drops it.
    A repeated extension within one sample is a :class:`ShardFormatError` (to ``handler``).
    """
    if handler is None:
        handler = reraise_exception
    current: dict[str, Any] | None = None
    for filesample in data:
        try:
            if not filesample:
                if current is not None and valid_sample(current):
                    yield current
                current = None
                continue
            if BAD_SHARD in filesample:
                current = None
                continue
            fname = filesample["fname"]
            prefix, suffix = keys(fname)
            if prefix is None:
                continue
            if lcase:
                suffix = suffix.lower()
            if current is None or prefix != current["__key__"]:
                if current is not None and valid_sample(current):
                    yield current
                current = {"__key__": prefix, "__url__": filesample["__url__"]}
            if suffix in current:
                raise ShardFormatError(
                    f"{filesample['__url__']}: duplicate file name {fname!r} in tar file "
                    f"(sample {prefix!r} already has {suffix!r})"
                )
            if suffixes is None or suffix in suffixes:
                current[suffix] = filesample["data"]
            local_path = filesample.get("__local_path__")
            if local_path is not None:
                current["__local_path__"] = local_path
        except Exception as exn:
            if handler(exn):
                continue
            break
    if current is not None and valid_sample(current):
        yield current


def url_opener(
    data: Iterable[dict[str, Any]], handler: Handler = reraise_exception, **kw: Any
) -> Iterator[dict[str, Any]]:
    """Open each ``dict(url=...)`` with :func:`~shardcache.gopen.gopen` (``**kw`` passed on).

    Yields the dict with ``stream=`` added, and ``local_path=`` for local files (as
    webdataset's streaming opener does). Open errors go to ``handler``.
    """
    for sample in data:
        try:
            if not isinstance(sample, dict) or not isinstance(sample.get("url"), str):
                raise ValueError(f"url_opener expects dict(url=str), got {sample!r}")
            url = sample["url"]
            stream = gopen(url, "rb", **kw)
        except Exception as exn:
            if handler(exn):
                continue
            break
        result = dict(sample, stream=stream)
        parsed = urlparse(url)
        if parsed.scheme in ("", "file"):
            result["local_path"] = parsed.path
        yield result


def tarfile_samples(
    src: Iterable[dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Turn ``dict(url=...)`` items (see :func:`~shardcache.urls.shardlist`) into samples."""
    streams = url_opener(src, handler=handler)
    files = tar_file_expander(
        streams, handler=handler, select_files=select_files, rename_files=rename_files
    )
    return group_by_keys(files, handler=handler)
