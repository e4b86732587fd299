"""A misbehaving HTTP/1.1 origin at the socket level, for the upstream fault tests.

:class:`BadOrigin` is a threaded raw-socket server on 127.0.0.1 (``socketserver``, not
aiohttp: the faults below need control of every byte and of how the connection ends).
Each path has a :class:`Scenario`: a list of :class:`Version` objects (bytes and
validators; the object "changes" when the scenario moves to the next version) and the
faults to inject:

- a normal answer: 200 with Content-Length, ETag / Last-Modified of the version,
  ``Accept-Ranges: bytes``; ``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` answered
  206 with a correct Content-Range (416 with ``bytes */SIZE`` when unsatisfiable);
  ``If-Match``, ``If-Unmodified-Since``, ``If-Range`` and ``If-None-Match`` honoured or,
  per option, ignored; HEAD answered with the headers only;
- a cut: the body stops at an object offset (orderly close, or RST: ``SO_LINGER`` (1, 0)
  then close), on the first GET, on every GET, or on full / ranged GETs only;
- 206 answers that lie: a Content-Range starting elsewhere than asked (with the bytes of
  what it claims);
- framing that disagrees with itself: a Content-Length other than the bytes sent, a
  Content-Range total other than the size (``length_skew``, ``total_skew``); ranges not
  fitted to the object (``sloppy_ranges``: a 206 naming bytes past its end);
- framing: Content-Length, close-delimited (no length, no chunking, ``Connection:
  close``), or chunked, with a malformed chunk-size line (``zz``) at an object offset;
- a fixed error status (401, 403, ...), with an S3 XML error body in S3 mode;
- a per-connection rate limit and a first-byte delay.

Every request is recorded (:class:`Request`: method, path, headers, and what was
answered) for the tests' assertions. In S3 mode (``BadOrigin(s3=True)``) the paths are
path-style ``/bucket/key`` and errors, including 404 for unknown keys, are S3 XML.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import re
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

__all__ = ["BadOrigin", "Request", "Scenario", "Version"]

REASONS = {
    200: "OK",
    206: "Partial Content",
    304: "Not Modified",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    412: "Precondition Failed",
    416: "Range Not Satisfiable",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
S3_CODES = {
    401: "AccessDenied",
    403: "AccessDenied",
    404: "NoSuchKey",
    405: "MethodNotAllowed",
    412: "PreconditionFailed",
    416: "InvalidRange",
    500: "InternalError",
    503: "SlowDown",
}
SEND_PIECE = 16 << 10  # bytes per send() call
SETTLE = 0.05  # seconds between the last byte of a cut and the close, so the peer reads it


@dataclass
class Version:
    """One version of an object: its bytes and validators (full header values: an ETag
    with its quotes, ``W/`` for a weak one; Last-Modified as an HTTP-date)."""

    data: bytes
    etag: str | None = None
    last_modified: str | None = None
    content_type: str = "application/x-tar"
    # more header fields of every answer of this version (Content-Encoding, user metadata...)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class Scenario:
    """How one path is answered. Object offsets (``cut_at``, ``bad_chunk_at``) are
    absolute: a resumed request starting past them fails at once, so a fault on "all"
    GETs can never be got around."""

    versions: list[Version]
    current: int = 0  # index of the version answered now
    # after the GET with this ordinal (1-based, per path) has taken its version, the
    # next version becomes current: (1,) = "the object is replaced after the first GET"
    advance_after: tuple[int, ...] = ()
    status: int | None = None  # answer every request with this error status
    error_code: str | None = None  # S3 <Code> for ``status`` (S3 mode)
    head_allowed: bool = True  # False: HEAD is answered 405
    # framing of 200 answers and (when set) of 206 answers: "length", "close", "chunked"
    framing: str = "length"
    ranged_framing: str | None = None
    chunk_size: int = 64 << 10  # payload of each chunk (chunked framing)
    # a cut: the body stops at this object offset, then the connection ends
    cut_at: int | None = None
    cut_on: str = "first"  # "first" GET, "all" GETs, "full" (no Range) or "ranged" GETs
    cut_mode: str = "close"  # "close" (FIN) or "rst"
    # a malformed chunk-size line in place of the chunk at this object offset (chunked)
    bad_chunk_at: int | None = None
    bad_chunk_on: str = "all"  # as cut_on
    # seconds between the bytes before the bad line (the last good chunk, or the
    # headers) and the bad line; 0: they go out in one send()
    bad_chunk_delay: float = 0.0
    # preconditions and ranges: honoured, or ignored (the request answered as without)
    honor_range: bool = True
    honor_if_match: bool = True
    honor_if_unmodified_since: bool = True
    honor_if_range: bool = True
    honor_if_none_match: bool = True
    # 206 answers that claim (and send) a range starting this far from the one asked
    range_shift: int = 0
    # ranges not fitted to the object: a 206 whose Content-Range is the range asked even
    # where it ends past the object (its body and Content-Length what there is), a
    # range starting at or past the end answered 206 with no body instead of 416
    sloppy_ranges: bool = False
    # framing that disagrees with itself, on the answers ``length_skew_on`` selects (as
    # cut_on): a Content-Length this far from the body's true length (the body is still
    # the bytes claimed, every one of them sent: an origin that sends more, or fewer,
    # bytes than it declared); and a Content-Range total this far from the size
    length_skew: int = 0
    length_skew_on: str = "ranged"
    length_skew_close: bool = True  # False: the connection is kept after a length that lied
    total_skew: int = 0
    total_skew_on: str = "later-ranged"
    # pacing, per connection: bytes per second (None: unlimited; each answer is paced
    # from its first byte), and a delay before the status line of every answer
    rate: float | None = None
    first_byte_delay: float = 0.0
    # digests: extra header fields on every answer (x-goog-hash, X-Linked-Etag, ...);
    # Content-MD5 of the whole object ("object", on 206s too) or of each answer's bytes
    # ("body", as RFC 2616 says of a 206); the byte at this object offset sent inverted
    # (on every answer that covers it), the declared digests being of the right bytes
    headers: dict[str, str] = field(default_factory=dict)
    content_md5: str | None = None
    flip_at: int | None = None
    gets: int = 0  # GETs seen so far (the ordinal of the last one)
    interim: tuple[int, ...] = ()  # 1xx answers (103 Early Hints...) sent before each answer

    @property
    def version(self) -> Version:
        return self.versions[self.current]

    def heal(self) -> None:
        """Stop misbehaving: no error status, cut, bad chunk or lie, every precondition
        and Range honoured. The current version and the framing stay."""
        self.status = None
        self.error_code = None
        self.cut_at = None
        self.bad_chunk_at = None
        self.range_shift = 0
        self.length_skew = self.total_skew = 0
        self.advance_after = ()
        self.honor_range = self.honor_if_match = self.honor_if_range = True
        self.honor_if_unmodified_since = self.honor_if_none_match = True


@dataclass
class Request:
    """One request the origin received, and what it answered."""

    method: str
    path: str  # without the query
    target: str  # the request target as sent
    headers: dict[str, str]  # names lower-cased
    ordinal: int = 0  # the GET's ordinal for its path (0: not a GET, or unknown path)
    status: int = 0
    version: int | None = None  # index of the version answered
    content_range: str | None = None
    sent: int = 0  # body bytes sent
    ended: str = ""  # "complete", "cut-close", "cut-rst", "bad-chunk", "error: ..."
    at: float = field(default_factory=time.monotonic)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def range(self) -> str | None:
        return self.header("range")

    @property
    def range_start(self) -> int | None:
        """The first byte of a ``bytes=a-[b]`` Range (None without one, or a suffix)."""
        m = re.fullmatch(r"\s*bytes=(\d+)-\d*\s*", self.range or "")
        return int(m.group(1)) if m else None


def _applies(rule: str, ordinal: int, ranged: bool) -> bool:
    if rule == "first":
        return ordinal == 1
    if rule == "all":
        return True
    if rule == "full":
        return not ranged
    if rule == "ranged":
        return ranged
    if rule == "later-ranged":  # a resume or a later part, not a first ranged GET
        return ranged and ordinal > 1
    if rule == "second-ranged":  # once: the second GET, when ranged
        return ranged and ordinal == 2
    raise ValueError(f"unknown rule {rule!r}")


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def _etag_list(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


class _Sender:
    """Writes to one connection, paced by the scenario's rate. Bytes given to
    :meth:`hold` go out with the next :meth:`send` (one ``sendall``: one segment when
    small), or at :meth:`flush`."""

    def __init__(self, sock: socket.socket, rate: float | None) -> None:
        self.sock = sock
        self.rate = rate
        self.t0 = 0.0
        self.count = 0
        self.pending = b""

    def hold(self, data: bytes) -> None:
        self.pending += data

    def flush(self) -> None:
        if self.pending:
            self.send(b"")

    def send(self, data: bytes) -> None:
        if self.pending:
            data, self.pending = self.pending + data, b""
        view = memoryview(data)
        while view:
            piece = view[:SEND_PIECE]
            if self.rate:
                if not self.t0:
                    self.t0 = time.monotonic()
                ahead = self.t0 + self.count / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            self.sock.sendall(piece)
            self.count += len(piece)
            view = view[len(piece) :]


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        origin = self.server.origin
        origin._track(sock, True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(30)
        rfile = sock.makefile("rb")
        end = "close"
        try:
            while True:
                head = _read_head(rfile)
                if head is None:
                    break
                end = origin._answer(sock, rfile, *head)
                if end != "keep":
                    break
        except OSError:
            end = "close"
        finally:
            rfile.close()
            origin._track(sock, False)
            if end == "rst":
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    origin: BadOrigin


def _read_head(rfile) -> tuple[str, str, dict[str, str]] | None:
    """The request line and headers, or None when the peer closed between requests."""
    line = rfile.readline(65537)
    while line in (b"\r\n", b"\n"):  # tolerated before a request line
        line = rfile.readline(65537)
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3:
        raise OSError(f"bad request line {line!r}")
    method, target, _ = parts
    headers: dict[str, str] = {}
    while True:
        h = rfile.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length") or 0)
    if length:
        rfile.read(length)  # a request body: never expected, read and dropped
    return method, target, headers


class BadOrigin:
    """The misbehaving origin. ``scenarios`` maps a path (``/name``, or ``/bucket/key`` in
    S3 mode; percent-decoded) to its :class:`Scenario`; ``requests`` records every
    request. Use as a context manager, or :meth:`start` / :meth:`stop`."""

    def __init__(self, *, s3: bool = False) -> None:
        self.s3 = s3
        self.scenarios: dict[str, Scenario] = {}
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._socks: set[socket.socket] = set()
        self.port = 0

    # -- setup and inspection

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, path: str, scenario: Scenario | None = None, **kw) -> Scenario:
        """Serve ``scenario`` (or ``Scenario(**kw)``) at ``path``."""
        sc = scenario if scenario is not None else Scenario(**kw)
        self.scenarios["/" + path.lstrip("/")] = sc
        return sc

    def log(self, path: str, method: str | None = None) -> list[Request]:
        """The requests for ``path`` (of ``method`` when given), in arrival order."""
        path = "/" + path.lstrip("/")
        with self.lock:
            return [
                r
                for r in self.requests
                if r.path == path and (method is None or r.method == method)
            ]

    def start(self) -> BadOrigin:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.origin = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self.lock:
            socks = list(self._socks)
        for s in socks:  # wake handlers blocked on a kept-alive connection
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(5)
        self._server = None

    def __enter__(self) -> BadOrigin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self.lock:
            if add:
                self._socks.add(sock)
            else:
                self._socks.discard(sock)

    # -- answering

    def _answer(self, sock: socket.socket, rfile, method: str, target: str, headers) -> str:
        """Answer one request; returns "keep", "close" or "rst" (how the connection
        goes on)."""
        path = unquote(urlsplit(target).path)
        rec = Request(method=method, path=path, target=target, headers=headers)
        with self.lock:
            self.requests.append(rec)
            sc = self.scenarios.get(path)
            index = 0
            if sc is not None:
                index = sc.current
                if method == "GET":
                    sc.gets += 1
                    rec.ordinal = sc.gets
                    if sc.gets in sc.advance_after:
                        sc.current = min(sc.current + 1, len(sc.versions) - 1)
        rate = sc.rate if sc is not None else None
        out = _Sender(sock, rate)
        if sc is not None and sc.first_byte_delay:
            time.sleep(sc.first_byte_delay)
        if sc is None:
            return self._error(out, rec, 404, None, "no such object")
        for code in sc.interim:
            out.send(f"HTTP/1.1 {code} Interim\r\nLink: </style.css>; rel=preload\r\n\r\n".encode())
        if method not in ("GET", "HEAD") or (method == "HEAD" and not sc.head_allowed):
            return self._error(out, rec, 405, None, f"method {method} not allowed", allow=True)
        if sc.status is not None:
            return self._error(out, rec, sc.status, sc.error_code, "denied by the fault plan")
        v = sc.versions[index]
        rec.version = index
        size = v.size
        base = {"Accept-Ranges": "bytes", "Content-Type": v.content_type}
        if v.etag:
            base["ETag"] = v.etag
        if v.last_modified:
            base["Last-Modified"] = v.last_modified
        if self.s3:
            base["x-amz-request-id"] = f"BAD{len(self.requests):013d}"
        base.update(v.headers)
        # preconditions, in the order of RFC 9110 section 13.2.2
        im = headers.get("if-match")
        ius = headers.get("if-unmodified-since")
        if im is not None and sc.honor_if_match:
            tags = _etag_list(im)
            strong = v.etag is not None and not v.etag.startswith("W/")
            if not ("*" in tags or (strong and v.etag in tags)):
                return self._error(out, rec, 412, None, "If-Match failed", extra=base)
        elif ius is not None and sc.honor_if_unmodified_since:
            lm, since = _http_date(v.last_modified), _http_date(ius)
            if lm is not None and since is not None and lm > since:
                return self._error(out, rec, 412, None, "If-Unmodified-Since failed", extra=base)
        inm = headers.get("if-none-match")
        if inm is not None and sc.honor_if_none_match and v.etag:
            weak = [t.removeprefix("W/") for t in _etag_list(inm)]
            if "*" in weak or v.etag.removeprefix("W/") in weak:
                rec.status = 304
                out.send(self._head(304, base))
                rec.ended = "complete"
                return "keep"
        start, stop, status = 0, size, 200
        rng = headers.get("range") if sc.honor_range else None
        if rng is not None and sc.honor_if_range and headers.get("if-range") is not None:
            ir = headers["if-range"]
            if ir.startswith(('"', "W/")):
                fresh = v.etag is not None and not v.etag.startswith("W/") and ir == v.etag
            else:
                fresh = v.last_modified is not None and ir == v.last_modified
            if not fresh:
                rng = None  # the representation changed: the whole new one, 200
        if rng is not None:
            m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", rng)
            if m and (m.group(1) or m.group(2)):
                a, b = m.group(1), m.group(2)
                if a:
                    start = int(a)
                    stop = min(size, int(b) + 1) if b else size
                else:
                    start, stop = max(0, size - int(b)), size
                if sc.sloppy_ranges and a:
                    claimed = (int(b) if b else max(size, start + 1) - 1) + 1
                    return self._sloppy(out, rec, v.data, start, claimed, base)
                if start >= size or stop <= start:
                    extra = dict(base, **{"Content-Range": f"bytes */{size}"})
                    return self._error(out, rec, 416, None, "range not satisfiable", extra=extra)
                status = 206
            # a malformed Range is ignored (200), as RFC 9110 allows
        ranged = status == 206
        if ranged and sc.range_shift:
            start = max(0, min(size - 1, start + sc.range_shift))
            stop = max(start + 1, min(size, stop + sc.range_shift))
        headers_out = dict(base)
        if ranged:
            total = size
            if sc.total_skew and _applies(sc.total_skew_on, rec.ordinal, ranged):
                total += sc.total_skew
            rec.content_range = f"bytes {start}-{stop - 1}/{total}"
            headers_out["Content-Range"] = rec.content_range
        headers_out.update(sc.headers)
        if sc.content_md5 is not None:
            body_md5 = v.data if sc.content_md5 == "object" else v.data[start:stop]
            headers_out["Content-MD5"] = base64.b64encode(hashlib.md5(body_md5).digest()).decode()
        framing = (sc.ranged_framing or sc.framing) if ranged else sc.framing
        declared = stop - start
        if framing == "length":
            if sc.length_skew and _applies(sc.length_skew_on, rec.ordinal, ranged):
                declared = max(0, declared + sc.length_skew)
            headers_out["Content-Length"] = str(declared)
        elif framing == "close":
            headers_out["Connection"] = "close"
        elif framing == "chunked":
            headers_out["Transfer-Encoding"] = "chunked"
        else:
            raise ValueError(f"unknown framing {framing!r}")
        rec.status = status
        if method == "HEAD":
            out.send(self._head(status, headers_out))
            rec.ended = "complete"
            return "close" if framing == "close" else "keep"
        cut = None
        if sc.cut_at is not None and _applies(sc.cut_on, rec.ordinal, ranged):
            cut = sc.cut_at
        bad = None
        if (
            framing == "chunked"
            and sc.bad_chunk_at is not None
            and _applies(sc.bad_chunk_on, rec.ordinal, ranged)
        ):
            bad = sc.bad_chunk_at
        try:
            out.hold(self._head(status, headers_out))  # with the first bytes of the body
            data = v.data
            if sc.flip_at is not None and start <= sc.flip_at < stop:
                data = bytearray(data)
                data[sc.flip_at] ^= 0xFF
                data = bytes(data)
            end = self._body(out, rec, data, start, stop, framing, sc.chunk_size, cut, bad, sc)
            # a length that lied: the connection cannot carry another answer
            lied = framing == "length" and declared != stop - start
            return "close" if lied and sc.length_skew_close else end
        except OSError as exc:  # the peer let go (a part taken, a client gone)
            rec.ended = f"peer gone: {exc!r}"
            return "close"

    def _body(
        self,
        out: _Sender,
        rec: Request,
        data: bytes,
        start: int,
        stop: int,
        framing: str,
        chunk: int,
        cut: int | None,
        bad: int | None,
        sc: Scenario,
    ) -> str:
        pos = start
        limit = stop if cut is None else max(start, min(stop, cut))
        bad_line = framing == "chunked" and bad is not None and max(start, bad) < limit
        if bad_line:
            limit = max(start, bad)
        step = chunk if framing == "chunked" else SEND_PIECE
        while pos < limit:
            end = min(limit, pos + step)
            piece = data[pos:end]
            if framing == "chunked":
                frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
                if bad_line and end == limit and not sc.bad_chunk_delay:
                    out.hold(frame)  # the last good chunk and the bad line: one send()
                else:
                    out.send(frame)
            else:
                out.send(piece)
            rec.sent += len(piece)
            pos = end
        if bad_line:
            if sc.bad_chunk_delay:
                out.flush()
                time.sleep(sc.bad_chunk_delay)
            out.send(b"zz\r\n" + b"this is not a chunk\r\n")
            rec.ended = "bad-chunk"
            time.sleep(0.2)  # the peer fails on the parse, not on the close
            return "close"
        if pos < stop:  # cut
            out.flush()
            time.sleep(SETTLE)  # the peer reads what was sent before the end
            rec.ended = "cut-rst" if sc.cut_mode == "rst" else "cut-close"
            return "rst" if sc.cut_mode == "rst" else "close"
        if framing == "chunked":
            out.send(b"0\r\n\r\n")
        out.flush()
        rec.ended = "complete"
        return "close" if framing == "close" else "keep"

    def _sloppy(
        self, out: _Sender, rec: Request, data: bytes, start: int, claimed: int, base: dict
    ) -> str:
        """A 206 for bytes ``[start, claimed)`` as asked, whatever the object's size: the
        bytes there are (perhaps none) and a Content-Length that counts them."""
        body = data[start:claimed]
        rec.status = 206
        rec.content_range = f"bytes {start}-{claimed - 1}/{len(data)}"
        headers = dict(base, **{"Content-Range": rec.content_range})
        headers["Content-Length"] = str(len(body))
        out.send(self._head(206, headers) + (b"" if rec.method == "HEAD" else body))
        rec.sent = len(body)
        rec.ended = "complete"
        return "keep"

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Whatever')}"]
        lines.append("Date: " + email.utils.formatdate(usegmt=True))
        lines.append("Server: badorigin")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _error(
        self,
        out: _Sender,
        rec: Request,
        status: int,
        code: str | None,
        message: str,
        *,
        extra: dict[str, str] | None = None,
        allow: bool = False,
    ) -> str:
        rec.status = status
        headers = {}
        if extra:  # validators and Content-Range, not the body's framing
            headers.update(
                {k: v for k, v in extra.items() if k in ("ETag", "Last-Modified", "Content-Range")}
            )
        if allow:
            headers["Allow"] = "GET, HEAD"
        if status == 401 and not self.s3:
            headers["WWW-Authenticate"] = 'Basic realm="badorigin"'
        if self.s3:
            code = code or S3_CODES.get(status, "InternalError")
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<Resource>{rec.path}</Resource><RequestId>BAD</RequestId></Error>"
            ).encode()
            headers["Content-Type"] = "application/xml"
            headers["x-amz-request-id"] = "BAD"
        else:
            body = (message + "\n").encode()
            headers["Content-Type"] = "text/plain"
        if status == 304 or (status == 416 and not self.s3):
            body = b""
        headers["Content-Length"] = str(len(body))
        out.send(self._head(status, headers) + (b"" if rec.method == "HEAD" else body))
        rec.ended = "complete"
        return "keep"
