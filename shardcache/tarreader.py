"""Reading a tar stream member by member (:func:`_tar_members`), every length checked.

Headers are parsed directly, as :class:`tarfile.TarInfo` interprets them (GNU and PAX
long names, ustar prefixes, global PAX headers); gzip, bzip2 and xz streams are detected
as tarfile's ``r|*`` does. A truncated or corrupt stream raises
:class:`~shardcache.errors.ShardFormatError` naming the URL, a failed read
:class:`~shardcache.errors.GopenError`.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from shardcache.errors import GopenError, ShardcacheError, ShardFormatError

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
_META_PREFIX = "__"
_META_SUFFIX = "__"

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


def _byte_sum(block: bytes) -> int:
    """``sum(block)`` computed in C for a header block: the low half of zlib's Adler-32
    is 1 + the sum of the bytes modulo 65521, and the sum of 256 bytes (65280 at most)
    is below that modulus. A sixth of the time of ``sum`` on a 512-byte block."""
    if len(block) != BLOCKSIZE:
        return sum(block)
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


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
        unsigned = 256 + _byte_sum(buf) - sum(buf[148:156])  # the checksum field as spaces
        if chksum != unsigned and chksum not in tarfile.calc_chksums(buf):
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
