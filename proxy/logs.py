"""What the daemon's log may say about a request: no credential, and no flood from a
client.

Two logging filters, installed once where the daemon sets up logging (:func:`install`):

- :class:`Redact`, on every handler: any line, at any level, with its traceback, has
  credentials replaced by ``[REDACTED]`` before it is written. It knows the secrets the
  proxy was given (``--admin-token``, ``--s3-front-secret-key``, the password of an
  upstream URL, the AWS secret of the environment) and the shapes credentials take in
  requests: ``Authorization`` and other credential header fields, ``Bearer`` tokens,
  SigV4 ``Credential=``/``Signature=``, the signature and token parameters of presigned
  URLs (``X-Amz-Signature``, ``X-Goog-Signature``, ``sig``, ...) and passwords in URLs.
  The access log writes every request's raw target, so a presigned query is redacted
  there too.
- :class:`ClientErrors`, on aiohttp's ``aiohttp.server`` logger: aiohttp logs a request
  it cannot parse (a bad request line, a header too large, a NUL or CR in a header
  value) at ERROR with a traceback whose message quotes the offending bytes, so any
  client could flood the log at ERROR and have its headers (a token among them) written
  out. Such a line becomes one INFO line without the bytes, at most :data:`PER_SECOND`
  a second per kind of error, the rest counted and the count given on the next line.
  What is not a client's malformed request (an exception in a handler: a bug) stays
  at ERROR with its traceback.

The daemon's handler, :class:`BufferedStreamHandler`, writes the access log as nginx
does with ``access_log ... buffer= flush=``: its lines are kept in memory and written
together (:data:`BUFFER_BYTES` gathered, or :data:`FLUSH_SECONDS` after the first of
them), and at once, after every line before it, for any other line: a system call
(and a flush) per request saved.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Any
from urllib.parse import quote, quote_plus, unquote_plus, urlsplit

__all__ = [
    "ACCESS_LOGGER",
    "BUFFER_BYTES",
    "FLUSH_SECONDS",
    "PER_SECOND",
    "AccessLines",
    "BufferedStreamHandler",
    "DAEMON_FORMAT",
    "QuickRecords",
    "ClientErrors",
    "Formatter",
    "Redact",
    "SecretsRedactor",
    "clip",
    "install",
    "redact",
    "url_secrets",
]

REDACTED = "[REDACTED]"
PER_SECOND = 5  # lines a second per kind of malformed request; the rest are counted
MAX_LOGGED = 2048  # characters of a request target the access log writes
ACCESS_LOGGER = "shardcache.access"  # the logger of the access-log lines
BUFFER_BYTES = 64 << 10  # access-log lines kept before they are written (nginx's buffer=)
FLUSH_SECONDS = 1.0  # the longest an access-log line waits to be written (nginx's flush=)
WRITE_BYTES = 4096  # the most written at once: PIPE_BUF, a pipe's atomic write (see below)
MIN_SECRET = 4  # shorter secrets are only caught by their shape (a 1-char token would
# otherwise blank that character everywhere)

# header fields whose whole value is a credential, as a header line, a repr of one, or
# a dict item: ``Authorization: x``, ``b'Authorization: x'``, ``'authorization': 'x'``
_FIELDS = (
    r"authorization|proxy-authorization|x-amz-security-token|x-goog-api-key|x-api-key"
    r"|api-key|cookie|set-cookie|x-auth-token"
)
# query and attribute parameters whose value is a credential (presigned URLs of S3, GCS
# and Azure, CloudFront signed URLs, SigV4 Authorization attributes, OAuth-style tokens)
_PARAMS = (
    r"x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature"
    r"|x-goog-credential|signature|sig|credential|awsaccesskeyid|googleaccessid"
    r"|key-pair-id|policy|token|access_token|id_token|refresh_token|api_key|apikey"
    r"|api-key|password|passwd|secret|client_secret|x-auth-token"
)
# of those, the fields whose value is one token, also query parameters by that name
_TOKEN_FIELDS = r"x-amz-security-token|x-goog-api-key|x-api-key|api-key|x-auth-token"
_FIELD_RE = re.compile(
    # a credential header field and its value, up to a quote or the line's end (an
    # Authorization or Cookie value has spaces and separators of its own) ...
    rf"\b(?!(?:{_TOKEN_FIELDS})['\"]?\s*=)(?:{_FIELDS})['\"]?\s*[:=]\s*['\"]?[^'\"\r\n]+"
    # ... but a one-token field as a parameter (``?X-Amz-Security-Token=...&n=1``) up
    # to the parameter's end, so the rest of a URL stays readable
    rf"|\b(?:{_TOKEN_FIELDS})['\"]?\s*=\s*['\"]?[^&;,\s'\"]+",
    re.IGNORECASE,
)
_BEARER_RE = re.compile(r"(?P<keep>\bbearer\s+)[^\s'\",]+", re.IGNORECASE)
_PARAM_NAMES = frozenset(_PARAMS.split("|"))
# any parameter (at the start, after ?&; or a comma or space) and its value; the name is
# looked up in _PARAM_NAMES (one pass over the line, not one per name)
_PARAM_RE = re.compile(r"(?<![^?&;,\s])(?P<name>[A-Za-z][\w-]*)=(?P<value>[^&;,\s'\"]*)")
# the password of a URL: scheme://user:password@host
_USERINFO_RE = re.compile(r"(?P<keep>://[^/\s:@'\"]*:)[^/\s@'\"]+(?=@)")


def _keep_name(m: re.Match[str]) -> str:
    return m.group("keep") + REDACTED


def _keep_field(m: re.Match[str]) -> str:
    """A credential field's name and separator, its value redacted."""
    whole = m.group(0)
    name = re.match(r"[^:=]*[:=]\s*['\"]?", whole)
    return (name.group(0) if name else "") + REDACTED


def _param(m: re.Match[str]) -> str:
    name = m.group("name")
    return f"{name}={REDACTED}" if name.lower() in _PARAM_NAMES else m.group(0)


_FIELD_NAMES = tuple(_FIELDS.split("|"))


def redact(text: str) -> str:
    """``text`` with credentials of a known shape replaced (no secret values known).

    Each shape's regex runs only when the line holds its literal trigger: most lines,
    the access log's among them, hold none, and testing for them costs a small part of
    what the regexes would."""
    lower = text.lower()
    equals, colon = "=" in lower, ":" in lower
    if (equals or colon) and any(name in lower for name in _FIELD_NAMES):
        text = _FIELD_RE.sub(_keep_field, text)
    if "bearer" in lower:
        text = _BEARER_RE.sub(_keep_name, text)
    if equals:
        text = _PARAM_RE.sub(_param, text)
    if "://" in lower and "@" in lower:
        text = _USERINFO_RE.sub(_keep_name, text)
    return text


def clip(text: str, limit: int = MAX_LOGGED) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: a client's 8 KiB
    request target costs the log (and its redaction) no more than a long URL does."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


class Redactor:
    """Replaces credentials in text: the known ``secrets`` wherever they appear (also
    percent-encoded), and anything in a credential's shape."""

    def __init__(self, secrets: Iterable[str | None] = (), fields: Iterable[str] = ()) -> None:
        forms: set[str] = set()
        for secret in secrets:
            if secret and len(secret) >= MIN_SECRET:
                forms.update({secret, quote(secret, safe=""), quote_plus(secret)})
        self.secrets = sorted(forms, key=len, reverse=True)  # longest first
        # header fields of the operator's own (--upstream-header) beside the known ones
        self.fields = tuple(sorted({f.lower() for f in fields} - set(_FIELD_NAMES)))
        self._fields_re = (
            re.compile(
                rf"(?P<keep>\b(?:{'|'.join(map(re.escape, self.fields))})['\"]?\s*[:=]\s*['\"]?)"
                r"[^'\"\r\n]+",
                re.IGNORECASE,
            )
            if self.fields
            else None
        )

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        if self._fields_re is not None:
            lower = text.lower()
            if any(f in lower for f in self.fields):
                text = self._fields_re.sub(_keep_name, text)
        return redact(text)


class Redact(logging.Filter):
    """A handler filter: the record's message, traceback and stack, redacted.

    The message is formatted here (arguments merged) so that a credential inside an
    argument is caught, and the traceback is formatted here so that the exception's
    text (aiohttp quotes a bad header line in it) is redacted before any formatter
    writes it."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: log what there is
            message = f"{record.msg!r} {record.args!r}"
        record.msg, record.args = self.redactor(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        record.exc_info = None  # the text below is what gets written
        if record.exc_text:
            record.exc_text = self.redactor(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redactor(record.stack_info)
        return True


class Formatter(logging.Formatter):
    """``logging.Formatter`` with the date and time of a line made once a second, as
    nginx keeps its time string: ``time.strftime`` for every access-log line was a fifth
    of what the line cost. The text is the base class's, to the millisecond.

    A record without traceback or stack (an access line) is formatted in one step: the
    ``%``-style format applied to the record as ``logging.Formatter`` applies it,
    without the five calls it takes there to get to it."""

    _second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        style = self._style
        if (
            type(style) is not logging.PercentStyle
            or style._defaults  # type: ignore[attr-defined]
            or record.exc_info
            or record.exc_text
            or record.stack_info
        ):
            return super().format(record)
        record.message = record.getMessage()
        fmt = style._fmt
        if "%(asctime)" in fmt:  # PercentStyle.usesTime
            record.asctime = self.formatTime(record, self.datefmt)
        try:
            return fmt % record.__dict__
        except KeyError as e:  # as PercentStyle.format
            raise ValueError(f"Formatting field not found in record: {e}") from None

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None or self.default_msec_format is None:
            return super().formatTime(record, datefmt)
        return self.time_text(record.created, record.msecs)

    def time_text(self, created: float, msecs: float) -> str:
        """``asctime`` of a record made at ``created`` (``msecs`` its milliseconds),
        without ``datefmt``."""
        second = int(created)
        seen, text = self._second
        if second != seen:
            text = time.strftime(self.default_time_format, self.converter(created))
            self._second = (second, text)
        return self.default_msec_format % (text, msecs)  # type: ignore[operator]


class RateLimit:
    """At most ``per_second`` events a second per kind; counts what it refuses."""

    def __init__(
        self, per_second: int = PER_SECOND, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_second = per_second
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind -> start, used, refused

    def allow(self, kind: str) -> tuple[bool, int]:
        """(whether to log this one, how many of this kind were refused since the last
        one logged)."""
        now = self.clock()
        with self._lock:
            start, used, refused = self._windows.get(kind, (now, 0, 0))
            if now - start >= 1.0:
                start, used = now, 0
            if used >= self.per_second:
                self._windows[kind] = (start, used, refused + 1)
                return False, 0
            self._windows[kind] = (start, used + 1, 0)
            return True, refused


class ClientErrors(logging.Filter):
    """A filter on the ``aiohttp.server`` logger: a request aiohttp could not parse is
    the client's error, so it is logged as one INFO line without traceback and without
    the request's bytes, rate-limited per kind; every other record passes unchanged."""

    def __init__(self, limit: RateLimit | None = None) -> None:
        super().__init__()
        self.limit = limit or RateLimit()

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # not a malformed request: a handler's bug stays an ERROR
        level = min(record.levelno, logging.INFO)
        if not logging.getLogger(record.name).isEnabledFor(level):
            return False
        kind = type(exc).__name__
        allowed, refused = self.limit.allow(kind)
        if not allowed:
            return False
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        more = f" ({refused} more like it not logged)" if refused else ""
        record.msg = "malformed request from %s: %s: %s%s"
        record.args = (remote, kind, _reason(exc), more)
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _reason(exc: BaseException) -> str:
    """What the parser found wrong, without the bytes it quotes: the first line of its
    message, cut before a quoted ``b'...'``, at most 100 characters."""
    text = str(getattr(exc, "message", "") or exc).strip().splitlines()
    first = text[0] if text else ""
    for quoted in ("b'", 'b"', "bytearray("):
        first = first.partition(quoted)[0]
    return first.rstrip(" :.")[:100] or "unparsable"


def secrets_of(settings: object) -> list[str]:
    """The secret values among the daemon's settings and environment: the admin token,
    the S3 front's secret key, passwords in upstream URLs, the AWS secrets the S3
    upstreams sign with and the upstream credentials (``--upstream-auth``,
    ``--upstream-header``) as they read now."""
    found: list[str] = []
    for name in ("admin_token", "s3_front_secret_key"):
        value = getattr(settings, name, None)
        if isinstance(value, str):
            found.append(value)
    for upstream in getattr(settings, "upstreams", None) or ():
        try:
            password = urlsplit(getattr(upstream, "base", str(upstream))).password
        except ValueError:
            password = None
        if password:
            found.append(password)
    for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        if os.environ.get(var):
            found.append(os.environ[var])
    for credential in _upstream_credentials(settings):
        try:
            found.append(credential.source.read())
        except (ValueError, AttributeError):  # unreadable now: its shape still redacts it
            pass
    return found


def url_secrets(url: str) -> list[str]:
    """The credential values ``url`` carries: the password of its userinfo and the
    values of its credential parameters (a presigned URL's signature, credential and
    token...), as written and decoded, so that a message naming them apart from their
    parameter (an origin echoing its query) can have them redacted by value."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return []
    found = [password, unquote_plus(password)] if password else []
    for pair in re.split(r"[&;]", parts.query):
        name, eq, value = pair.partition("=")
        if eq and value and unquote_plus(name).lower() in _PARAM_NAMES:
            found += [value, unquote_plus(value)]
    return found


class SecretsRedactor:
    """A :class:`Redactor` for messages the daemon keeps and shows (``/-/stats``,
    ``/-/healthz``): the secrets of ``settings`` as they read now (a credential file
    rotated since startup included, unlike the log filter's, which reads them once),
    plus the ``extra`` values of each call (those of the URL a message is about), each
    redacted by value wherever it appears, and every credential's shape. Remade only
    when the secrets change; meant for failures, not for every request."""

    def __init__(self, settings: object) -> None:
        self.settings = settings
        self.fields = [str(getattr(c, "header", "")) for c in _upstream_credentials(settings)]
        self._key: tuple[str, ...] | None = None
        self._redactor = Redactor()
        self._lock = threading.Lock()

    def _current(self, extra: Iterable[str] = ()) -> Redactor:
        key = (*secrets_of(self.settings), *extra)
        with self._lock:
            if key != self._key:
                self._redactor = Redactor(key, [f for f in self.fields if f])
                self._key = key
            return self._redactor

    def __call__(self, text: str, extra: Iterable[str] = ()) -> str:
        return self._current(extra)(text)

    def names_secret(self, data: bytes) -> bool:
        """Whether ``data`` holds a configured secret's value (as is or percent-encoded):
        an upstream's error body that echoes what the proxy sent it."""
        return any(s.encode() in data for s in self._current().secrets)


def _upstream_credentials(settings: object) -> list[Any]:
    """The ``--upstream-auth`` and ``--upstream-header`` credentials of ``settings``."""
    return [
        *(getattr(settings, "upstream_auth", None) or ()),
        *(getattr(settings, "upstream_headers", None) or ()),
    ]


def install(settings: object, extra_secrets: Iterable[str] = ()) -> None:
    """Put :class:`Redact` on every handler of the root logger and :class:`ClientErrors`
    on ``aiohttp.server``; once per process (a second call replaces the first's).

    The secrets are those of the settings at startup (a credential file rotated later is
    caught by its shape: its header field, or ``Bearer``)."""
    fields = [str(getattr(c, "header", "")) for c in _upstream_credentials(settings)]
    redactor = Redactor([*secrets_of(settings), *extra_secrets], [f for f in fields if f])
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, Redact)]:
            handler.removeFilter(old)
        handler.addFilter(Redact(redactor))
    server = logging.getLogger("aiohttp.server")
    for old in [f for f in server.filters if isinstance(f, ClientErrors)]:
        server.removeFilter(old)
    server.addFilter(ClientErrors())


class BufferedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` that keeps the lines of the ``buffered`` loggers below WARNING
    (the access log's) in memory and writes them together: once ``size`` characters have
    gathered, ``interval`` seconds after the first of them (a thread of its own writes
    them when the proxy is idle), before any other line (which is written at once, so
    the order of the lines is kept), at :meth:`flush` (``logging.shutdown`` at exit, the
    ``--workers`` processes and the exit guard before ``os._exit``) and before a
    ``fork``. A line waits at most ``interval`` seconds; a process killed with SIGKILL
    loses the lines it had not written, at most ``size`` characters or ``interval``
    seconds of them. ``interval`` 0: every line written at once, as ``StreamHandler``.

    Lines are written :data:`WRITE_BYTES` at most at a time, whole: several processes
    (``--workers``) writing to one pipe (a container's log) do not interleave within a
    line, as pipes keep writes up to PIPE_BUF whole."""

    def __init__(
        self,
        stream: Any = None,
        *,
        buffered: Collection[str] = (ACCESS_LOGGER,),
        size: int = BUFFER_BYTES,
        interval: float = FLUSH_SECONDS,
    ) -> None:
        super().__init__(stream)
        self.buffered = frozenset(buffered) if interval > 0 else frozenset()
        self.size = size
        self.interval = interval
        self._lines: list[str] = []
        self._chars = 0
        self._pending = threading.Event()  # set while lines wait for the flusher
        self._closing = threading.Event()
        self._flusher_pid = 0  # the process whose flusher thread runs (none in a fork)
        _BUFFERED.add(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + self.terminator
            self._put(text, record.name in self.buffered and record.levelno < logging.WARNING)
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as logging.StreamHandler: reported, not raised
            self.handleError(record)

    def emit_line(self, name: str, level: int, line: str) -> None:
        """Write ``line`` (formatted, without terminator) of logger ``name`` at ``level``
        as :meth:`emit` writes a record's (:class:`AccessLines`)."""
        with self.lock:  # type: ignore[union-attr]
            try:
                self._put(line + self.terminator, name in self.buffered and level < logging.WARNING)
            except RecursionError:
                raise
            except Exception:  # noqa: BLE001 - as logging.StreamHandler: reported, not raised
                self.handleError(logging.makeLogRecord({"name": name, "msg": line}))

    def _put(self, text: str, keep: bool) -> None:
        """Keep ``text`` or write it (after what is kept); the handler's lock is held."""
        if keep:
            lines = self._lines
            if not lines:
                self._arm()
            lines.append(text)
            self._chars += len(text)
            if self._chars < self.size:
                return
            text = ""
        self._write_out(text)

    def plain(self) -> Redact | None:
        """This handler's :class:`Redact` when it is the daemon's own: that filter alone
        and the daemon's format (:data:`DAEMON_FORMAT` through :class:`Formatter`,
        without ``datefmt`` or defaults), so that a line made as :class:`AccessLines`
        makes it is the line :meth:`emit` would write; None otherwise."""
        filters, formatter = self.filters, self.formatter
        if len(filters) != 1 or type(filters[0]) is not Redact or type(formatter) is not Formatter:
            return None
        style = formatter._style
        if (
            type(style) is not logging.PercentStyle
            or style._fmt != DAEMON_FORMAT
            or style._defaults  # type: ignore[attr-defined]
            or formatter.datefmt is not None
            or formatter.default_msec_format is None
        ):
            return None
        return filters[0]

    def flush(self) -> None:
        """Write the lines kept, then flush the stream."""
        with self.lock:  # type: ignore[union-attr]
            if self._lines:
                try:
                    self._write_out("")
                except Exception:  # noqa: BLE001 - as logging.StreamHandler
                    self.handleError(
                        logging.makeLogRecord({"msg": "the access-log lines kept in memory"})
                    )
            elif self.stream and hasattr(self.stream, "flush"):
                self.stream.flush()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._closing.set()
            self._pending.set()  # the flusher sees it is closing, and ends
            super().close()

    def _arm(self) -> None:
        """The first line kept: the flusher thread writes it ``interval`` seconds from
        now at the latest (started in each process that keeps lines: a forked child has
        none of its parent's threads)."""
        if self._flusher_pid != os.getpid():
            self._flusher_pid = os.getpid()
            threading.Thread(
                target=self._flush_every, args=(self._pending, self._closing),
                name="log flusher", daemon=True,
            ).start()  # fmt: skip
        self._pending.set()

    def _flush_every(self, pending: threading.Event, closing: threading.Event) -> None:
        while True:
            pending.wait()
            if closing.wait(self.interval):
                return  # closed: close() wrote what was kept
            self.flush()

    def _write_out(self, text: str) -> None:
        """Write the lines kept, then ``text``; the handler's lock is held."""
        lines, self._lines, self._chars = self._lines, [], 0
        self._pending.clear()
        if text:
            lines.append(text)
        stream = self.stream
        chunk: list[str] = []
        size = 0
        for line in lines:
            n = len(line) if line.isascii() else len(line.encode("utf-8", "replace"))
            if chunk and size + n > WRITE_BYTES:
                stream.write("".join(chunk))
                stream.flush()
                chunk, size = [], 0
            chunk.append(line)
            size += n
        if chunk:
            stream.write("".join(chunk))
            stream.flush()


_BUFFERED: weakref.WeakSet[BufferedStreamHandler] = weakref.WeakSet()
DAEMON_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # proxy.config's


if sys.version_info >= (3, 13):

    def _record_times() -> tuple[float, float, float]:
        """``created``, ``msecs`` and ``relativeCreated`` as ``LogRecord`` sets them."""
        ct = time.time_ns()
        created = ct / 1e9
        msecs = (ct % 1_000_000_000) // 1_000_000 + 0.0
        if msecs == 999.0 and int(created) != ct // 1_000_000_000:
            msecs = 0.0
        return created, msecs, (ct - logging._startTime) / 1e6  # type: ignore[attr-defined]

else:

    def _record_times() -> tuple[float, float, float]:
        """``created``, ``msecs`` and ``relativeCreated`` as ``LogRecord`` sets them."""
        ct = time.time()
        return ct, int((ct - int(ct)) * 1000) + 0.0, (ct - logging._startTime) * 1000  # type: ignore[attr-defined]


class QuickRecords:
    """The ``LogRecord`` of one call site of ``logger`` with message ``msg`` (the access
    log's), made as a copy of the first one the thread made at that level with its time
    and arguments replaced: ``LogRecord`` works out for every record the file name and
    module of the caller, the thread's name, the process's name and id (a system call),
    the same for every access-log line of a thread, and that was a third of the line's
    cost. The record is the one ``logger.makeRecord`` makes, with every attribute, for
    any handler or formatter; with another record factory
    (``logging.setLogRecordFactory``) that factory makes it."""

    def __init__(self, logger: logging.Logger, msg: str, pathname: str) -> None:
        self.logger, self.msg, self.pathname = logger, msg, pathname
        self._firsts: dict[tuple[int, int], dict[str, Any]] = {}  # (level, thread) ->
        _QUICK.add(self)

    def make(self, level: int, args: tuple[Any, ...]) -> logging.LogRecord:
        """The record of ``msg % args`` at ``level``, made now."""
        first = self._firsts.get((level, _get_ident()))
        if first is None or logging.getLogRecordFactory() is not logging.LogRecord:
            return self._first(level, args)
        record = _new_record(logging.LogRecord)
        attrs = first.copy()
        attrs["created"], attrs["msecs"], attrs["relativeCreated"] = _record_times()
        attrs["args"] = args
        if "taskName" in attrs:  # Python 3.12+
            attrs["taskName"] = _task_name()
        record.__dict__ = attrs
        return record

    def _first(self, level: int, args: tuple[Any, ...]) -> logging.LogRecord:
        logger = self.logger
        record = logger.makeRecord(logger.name, level, self.pathname, 0, self.msg, args, None)
        if type(record) is logging.LogRecord and len(self._firsts) < 64:
            self._firsts[(level, _get_ident())] = record.__dict__.copy()
        return record

    def forget(self) -> None:
        """Make the next records anew (in a forked child: another process id)."""
        self._firsts = {}


_get_ident = threading.get_ident
_new_record = object.__new__


def _task_name() -> str | None:
    """The record's ``taskName`` as ``LogRecord`` finds it (Python 3.12+)."""
    if not getattr(logging, "logAsyncioTasks", False):
        return None
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.current_task().get_name()  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - as LogRecord: no task, no name
        return None


_QUICK: weakref.WeakSet[QuickRecords] = weakref.WeakSet()


class AccessLines:
    """The access log's lines of one call site (``logger``, ``msg``): written straight
    to the daemon's handler when the logging set up is the daemon's own, otherwise
    logged as any record (:class:`QuickRecords`).

    The daemon's own: ``logger`` without filters, whose records reach one handler, a
    :class:`BufferedStreamHandler` with the daemon's filter and format
    (:meth:`BufferedStreamHandler.plain`), and the standard record factory. Then the
    line is what that handler would write for the record (the message formatted with
    ``msg % args``, redacted by its :class:`Redact`, after the time, level and logger's
    name, as :data:`DAEMON_FORMAT` lays them out), without the record and the nine calls
    of ``Logger.handle``, ``Handler.handle``, the filter and the formatter it takes to
    get there. Anything else (a test's ``caplog``, another handler, a filter on the
    logger) sees the record as before: checked for every line."""

    def __init__(self, logger: logging.Logger, msg: str, pathname: str) -> None:
        self.logger, self.msg = logger, msg
        self.records = QuickRecords(logger, msg, pathname)

    def log(self, level: int, args: tuple[Any, ...]) -> None:
        """Log ``msg % args`` at ``level`` (enabled: the caller asked ``isEnabledFor``)."""
        logger = self.logger
        handler = None if logger.filters else _only_handler(logger)
        redact = handler.plain() if handler is not None and level >= handler.level else None
        if redact is None or logging.getLogRecordFactory() is not logging.LogRecord:
            logger.handle(self.records.make(level, args))
            return
        try:
            message = self.msg % args
        except Exception:  # noqa: BLE001 - the record's own way with a bad argument
            logger.handle(self.records.make(level, args))
            return
        created, msecs, _ = _record_times()
        when = handler.formatter.time_text(created, msecs)  # type: ignore[union-attr]
        name = logger.name
        line = f"{when} {logging.getLevelName(level)} {name}: {redact.redactor(message)}"
        handler.emit_line(name, level, line)  # type: ignore[union-attr]


def _only_handler(logger: logging.Logger) -> BufferedStreamHandler | None:
    """The one handler a record of ``logger`` reaches, when that is all it reaches and
    it is a :class:`BufferedStreamHandler` (as ``Logger.callHandlers`` walks)."""
    found = None
    c: logging.Logger | None = logger
    while c is not None:
        for h in c.handlers:
            if found is not None or type(h) is not BufferedStreamHandler:
                return None
            found = h
        if not c.propagate:
            break
        c = c.parent
    return found


def _flush_before_fork() -> None:
    """Nothing kept is written twice (by the parent and by the child)."""
    for handler in list(_BUFFERED):
        handler.flush()


def _forget_in_child() -> None:
    """The child starts with nothing kept and no flusher (threads do not survive a fork;
    an event the parent's flusher held would stay held), and makes its own records."""
    for quick in list(_QUICK):
        quick.forget()
    for handler in list(_BUFFERED):
        handler._lines, handler._chars = [], 0
        handler._pending, handler._closing = threading.Event(), threading.Event()
        handler._flusher_pid = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_flush_before_fork, after_in_child=_forget_in_child)


def flush_handlers() -> None:
    """Write what the root logger's handlers keep: before ``os._exit``, which skips
    ``logging.shutdown``."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001, S110 - exiting: nothing else to do with it
            pass
