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

import bz2
import gzip
import io
import logging
import lzma
import re
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any
from urllib.parse import urlparse

from shardcache.errors import GopenError, ShardcacheError, ShardFormatError
from shardcache.gopen import gopen
from shardcache.handlers import reraise_exception

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

Handler = Callable[[BaseException], bool]

BLOCKSIZE = 512
_ZERO_BLOCK = bytes(BLOCKSIZE)
_DRAIN_LIMIT = 1 << 20  # bytes read after the end-of-archive block, to let a source finish
_SKIP_CHUNK = 1 << 20

_REGULAR_TYPES = frozenset(tarfile.REGULAR_TYPES)
_SUPPORTED_TYPES = frozenset(tarfile.SUPPORTED_TYPES)
_GNU_TYPES = frozenset(tarfile.GNU_TYPES)
_PAX_TYPES = frozenset((tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE))
_LONG_TYPES = frozenset((tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK))
_AREGTYPE = tarfile.AREGTYPE
_DIRTYPE = tarfile.DIRTYPE
_ENCODING = tarfile.ENCODING
_ERRORS = "surrogateescape"
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_PAX_HDRCHARSET = re.compile(rb"\d+ hdrcharset=([^\n]+)\n")
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = r"__[^/]*__($|/)"
_META_PREFIX = "__"
_META_SUFFIX = "__"

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


# ---------------------------------------------------------------------------
# Reading tar streams


class _Unsupported(ShardFormatError):
    pass


def _nti(field: bytes, url: str, offset: int, what: str) -> int:
    try:
        return tarfile.nti(field)
    except (tarfile.HeaderError, ValueError) as exc:
        raise ShardFormatError(
            f"{url}: corrupt tar header at offset {offset}: invalid {what} field {field!r}"
        ) from exc


def _nts(field: bytes) -> str:
    return tarfile.nts(field, _ENCODING, _ERRORS)


def _block(count: int) -> int:
    return (count + BLOCKSIZE - 1) // BLOCKSIZE * BLOCKSIZE


def _comptype(head: bytes) -> str:
    """The compression of a stream from its first bytes, as tarfile's ``r|*`` decides."""
    if head.startswith(b"\x1f\x8b\x08"):
        return "gz"
    if head[0:3] == b"BZh" and head[4:10] == b"1AY&SY":
        return "bz2"
    if head.startswith((b"\x5d\x00\x00\x80", b"\xfd7zXZ")):
        return "xz"
    return "tar"


class _Prefixed(io.RawIOBase):
    """``head`` (bytes already read from ``f``) followed by the rest of ``f``."""

    def __init__(self, head: bytes, f: Any) -> None:
        super().__init__()
        self._head = head
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        return n


class _TarReader:
    """Reads tar headers and data from a byte stream, checking every length.

    Header interpretation follows :class:`tarfile.TarInfo` (``frombuf``, ``_proc_*``), so
    member names and sizes are those ``tarfile`` reports.
    """

    def __init__(self, fileobj: Any, url: str) -> None:
        self.url = url
        self.fileobj = fileobj
        self.read = fileobj.read
        self.pos = 0
        self.compressed = False
        self.global_pax: dict[str, str] = {}

    # -- raw reads -------------------------------------------------------

    def start(self) -> bytes | None:
        """Read the first block, switching to a decompressor if the stream is compressed."""
        head = self._read_some(BLOCKSIZE)
        if not head:
            raise ShardFormatError(f"{self.url}: empty file, not a tar archive")
        comp = _comptype(head)
        if comp != "tar":
            raw = _Prefixed(head, self.fileobj)
            if comp == "gz":
                f: Any = gzip.GzipFile(fileobj=raw, mode="rb")
            elif comp == "bz2":
                f = bz2.BZ2File(raw, mode="rb")
            else:
                f = lzma.LZMAFile(raw, mode="rb")
            self.read = f.read
            self.compressed = True
            head = self._read_some(BLOCKSIZE)
            if not head:
                raise ShardFormatError(f"{self.url}: empty {comp} stream, not a tar archive")
        if len(head) != BLOCKSIZE:
            raise ShardFormatError(
                f"{self.url}: truncated tar: stream ended after {len(head)} bytes, "
                "inside the first header"
            )
        self.pos = BLOCKSIZE
        return head

    def _read_some(self, n: int) -> bytes:
        """Read up to ``n`` bytes, fewer only at the end of the stream."""
        try:
            data = self.read(n)
            if len(data) < n and data:
                parts = [data]
                got = len(data)
                while got < n:
                    more = self.read(n - got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
            return data
        except ShardcacheError:
            raise
        except Exception as exc:
            err = self.translate(exc)
            if err is exc:
                raise
            raise err from exc

    def translate(self, exc: BaseException) -> BaseException:
        """The shardcache error for a failure of the underlying (or decompressed) stream."""
        if isinstance(exc, (EOFError, zlib.error, lzma.LZMAError)) or (
            self.compressed and isinstance(exc, OSError)
        ):
            return ShardFormatError(
                f"{self.url}: corrupt or truncated compressed stream near tar offset "
                f"{self.pos}: {exc}"
            )
        if isinstance(exc, OSError):
            return GopenError(self.url, f"read failed at offset {self.pos}: {exc}")
        return exc

    def exact(self, n: int, what: str) -> bytes:
        """Read exactly ``n`` bytes or raise ShardFormatError naming ``what`` was cut."""
        data = self.read(n) if not self.compressed else self._read_some(n)
        if len(data) != n:
            data += self._read_some(n - len(data)) if data else self._read_some(n)
            if len(data) != n:
                raise ShardFormatError(
                    f"{self.url}: truncated tar: {what} at offset {self.pos} needs {n} bytes, "
                    f"stream ended after {len(data)}"
                )
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        while n > 0:
            k = min(n, _SKIP_CHUNK)
            self.exact(k, what)
            n -= k

    def drain(self) -> None:
        """Read a bounded remainder after the end-of-archive block (padding), so pipes and
        HTTP bodies finish and report their own errors."""
        left = _DRAIN_LIMIT
        while left > 0:
            data = self._read_some(min(left, 65536))
            if not data:
                return
            left -= len(data)

    # -- headers ---------------------------------------------------------

    def header(self, buf: bytes, offset: int) -> tuple[str, int, bytes, int]:
        """Interpret the header ``buf`` (and any extension headers after it).

        Returns ``(name, size, type, data_blocks)``: the data of the member is ``size``
        bytes inside ``data_blocks`` bytes that follow.
        """
        url = self.url
        chksum = _nti(buf[148:156], url, offset, "checksum")
        if chksum != 256 + sum(buf) - sum(buf[148:156]) and chksum not in tarfile.calc_chksums(buf):
            raise ShardFormatError(f"{url}: corrupt tar header at offset {offset}: bad checksum")
        size = _nti(buf[124:136], url, offset, "size")
        typ = buf[156:157]
        name = _nts(buf[0:100])
        if typ == _AREGTYPE and name.endswith("/"):
            typ = _DIRTYPE  # old V7 tar: a directory is a regular file with a trailing "/"
        if typ == _DIRTYPE:
            name = name.rstrip("/")
        if buf[345] and typ not in _GNU_TYPES:
            prefix = _nts(buf[345:500])
            if prefix:
                name = prefix + "/" + name

        if typ in _LONG_TYPES:
            data = self.exact(_block(size), "GNU long name")
            name2, size2, typ2, blocks2 = self.next_header("the header after a GNU long name")
            if typ == tarfile.GNUTYPE_LONGNAME:
                name2 = _nts(data)
                if typ2 == _DIRTYPE:
                    name2 = name2.removesuffix("/")
            return name2, size2, typ2, blocks2
        if typ == tarfile.GNUTYPE_SPARSE:
            raise _Unsupported(
                f"{url}: GNU sparse member {name!r} at offset {offset} is not supported"
            )
        if typ in _PAX_TYPES:
            return self._pax(typ, size, offset)

        blocks = _block(size) if (typ in _REGULAR_TYPES or typ not in _SUPPORTED_TYPES) else 0
        if self.global_pax:
            name, size = self._apply_pax(self.global_pax, name, size, offset)
            if typ == _DIRTYPE:
                name = name.rstrip("/")
        return name, size, typ, blocks

    def next_header(self, what: str) -> tuple[str, int, bytes, int]:
        offset = self.pos
        buf = self.exact(BLOCKSIZE, what)
        if buf == _ZERO_BLOCK:
            raise ShardFormatError(f"{self.url}: corrupt tar: {what} at offset {offset} is empty")
        return self.header(buf, offset)

    def _pax(self, typ: bytes, size: int, offset: int) -> tuple[str, int, bytes, int]:
        buf = self.exact(_block(size), "PAX header")
        pax = self.global_pax if typ == tarfile.XGLTYPE else self.global_pax.copy()
        match = _PAX_HDRCHARSET.search(buf)
        if match is not None:
            pax["hdrcharset"] = match.group(1).decode("utf-8")
        encoding = _ENCODING if pax.get("hdrcharset") == "BINARY" else "utf-8"
        pos = 0
        while True:
            match = _PAX_RECORD.match(buf, pos)
            if not match:
                break
            length_b, keyword_b = match.groups()
            length = int(length_b)
            if length == 0:
                raise ShardFormatError(
                    f"{self.url}: corrupt tar: PAX header at offset {offset} has a zero-length record"
                )
            value_b = buf[match.end(2) + 1 : match.start(1) + length - 1]
            keyword = _decode_pax(keyword_b, "utf-8", "utf-8")
            if keyword in tarfile.PAX_NAME_FIELDS:
                value = _decode_pax(value_b, encoding, _ENCODING)
            else:
                value = _decode_pax(value_b, "utf-8", "utf-8")
            pax[keyword] = value
            pos += length

        name, nsize, ntyp, blocks = self.next_header("the header after a PAX header")
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise _Unsupported(f"{self.url}: GNU sparse member {name!r} is not supported")
        if typ != tarfile.XGLTYPE:
            name, nsize = self._apply_pax(pax, name, nsize, offset)
            if "size" in pax:
                blocks = (
                    _block(nsize) if (ntyp in _REGULAR_TYPES or ntyp not in _SUPPORTED_TYPES) else 0
                )
        return name, nsize, ntyp, blocks

    def _apply_pax(self, pax: dict[str, str], name: str, size: int, offset: int) -> tuple[str, int]:
        path = pax.get("path")
        if path is not None:
            name = path.rstrip("/")
        value = pax.get("size")
        if value is not None:
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 0:
                raise ShardFormatError(
                    f"{self.url}: corrupt tar: negative PAX size for {name!r} at offset {offset}"
                )
        return name, size


def _decode_pax(value: bytes, encoding: str, fallback: str) -> str:
    try:
        return value.decode(encoding, "strict")
    except UnicodeDecodeError:
        return value.decode(fallback, _ERRORS)


def _tar_members(
    fileobj: Any,
    url: str,
    skip_meta: str | None,
    handler: Handler,
    select_files: Callable[[str], bool] | None,
    rename_files: Callable[[str], str] | None,
    extra: dict[str, Any] | None,
) -> Iterator[dict[str, Any]]:
    """Yield ``dict(fname=, data=, **extra)`` for each regular member; raise on damage.

    Errors of the stream (truncation, corruption) raise; errors of ``select_files`` /
    ``rename_files`` go to ``handler`` (True: skip the member, False: stop).
    """
    reader = _TarReader(fileobj, url)
    skip_re = re.compile(skip_meta) if skip_meta is not None else None
    try:
        buf: bytes | None = reader.start()
        offset = 0
        while True:
            if buf is None:
                offset = reader.pos
                buf = reader.read(BLOCKSIZE)
                if len(buf) != BLOCKSIZE:
                    buf += reader._read_some(BLOCKSIZE - len(buf))
                    if len(buf) != BLOCKSIZE:
                        raise ShardFormatError(
                            f"{url}: truncated tar: stream ended at offset {offset + len(buf)} "
                            + ("without the end-of-archive block" if not buf else "inside a header")
                        )
                reader.pos += BLOCKSIZE
            if buf == _ZERO_BLOCK:
                break
            name, size, typ, blocks = reader.header(buf, offset)
            buf = None
            wanted = typ in _REGULAR_TYPES and not (
                "/" not in name and name.startswith(_META_PREFIX) and name.endswith(_META_SUFFIX)
            )
            if wanted and skip_re is not None and skip_re.match(name):
                wanted = False
            if wanted and (rename_files is not None or select_files is not None):
                try:
                    if rename_files is not None:
                        name = rename_files(name)
                    if select_files is not None and not select_files(name):
                        wanted = False
                except Exception as exn:
                    if not handler(exn):
                        return
                    wanted = False
            if not wanted:
                reader.skip(blocks, f"data of {name!r}")
                continue
            if blocks < size:
                raise ShardFormatError(
                    f"{url}: corrupt tar: member {name!r} at offset {offset} has inconsistent sizes"
                )
            data = reader.exact(size, f"data of {name!r}") if size else b""
            if blocks != size:
                reader.skip(blocks - size, f"padding of {name!r}")
            if extra is None:
                yield {"fname": name, "data": data}
            else:
                yield {"fname": name, "data": data, **extra}
        reader.drain()
    except ShardcacheError:
        raise
    except Exception as exc:
        err = reader.translate(exc)
        if err is exc:
            raise
        raise err from exc


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
) -> Iterator[dict[str, Any]]:
    """Expand ``dict(url=, stream=[, local_path=])`` items into the files of each tar.

    Yields ``dict(fname=, data=, __url__=[, __local_path__=])`` per member, then
    ``eof_value`` (``{}``) after each shard so that samples never span two shards. Each
    stream is closed once read (a ``pipe:`` exit status is checked then). When a shard
    fails, ``handler`` decides: raise, continue with the next shard (True) or stop
    (False); before going on, a ``{BAD_SHARD: True}`` marker tells
    :func:`group_by_keys` to drop the shard's unfinished sample.
    """
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
