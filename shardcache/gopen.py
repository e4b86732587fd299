"""Open a shard URL as a byte stream: local paths, ``file://``, ``http(s)://`` and ``pipe:``.

Every failure is a :class:`~shardcache.errors.GopenError` naming the URL and the cause
(an HTTP error status is a :class:`~shardcache.errors.HTTPStatusError`). Streams never
hide a failure as a clean end of file:

- HTTP bodies are streamed (never buffered whole); a body that ends before its
  Content-Length, or a broken chunked body, raises on read;
- a ``pipe:`` command that exits with a non-zero status raises when its output ends (or
  when the stream is closed), except for SIGPIPE after the reader closed it early.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from typing import IO, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from shardcache._version import __version__
from shardcache.errors import GopenError, HTTPStatusError

__all__ = ["gopen", "Pipe", "HTTPStream", "DEFAULT_TIMEOUT"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
"""Seconds to wait for an HTTP connection or for any single read from it."""

_SIGPIPE_STATUSES = (141, -getattr(signal, "SIGPIPE", 13))
_USER_AGENT = f"shardcache/{__version__}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------------------
# HTTP


class HTTPStream(io.RawIOBase):
    """A readable stream over an HTTP response that raises on a truncated body.

    ``http.client`` returns ``b""`` from ``read(n)`` when the connection closes before
    Content-Length bytes arrived; here that is a :class:`GopenError`, as are timeouts,
    resets and broken chunked encoding during the body.
    """

    def __init__(self, url: str, response: http.client.HTTPResponse, timeout: float) -> None:
        super().__init__()
        self.url = url
        self.name = url
        self.response = response
        self.timeout = timeout
        self.status = response.status
        self.headers = response.headers
        length = response.getheader("Content-Length")
        self.content_length: int | None = (
            int(length) if length and length.isdigit() and not response.chunked else None
        )
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed HTTP stream")
        try:
            # read1: return what has arrived (one socket read) instead of waiting to fill b
            data = self.response.read1(len(b))
            n = len(data)
            b[:n] = data
        except http.client.IncompleteRead as exc:
            raise GopenError(
                self.url,
                f"connection closed mid-body after {self.received + len(exc.partial)} bytes"
                + (f" of {self.content_length}" if self.content_length is not None else ""),
            ) from exc
        except TimeoutError as exc:
            raise GopenError(
                self.url, f"read timed out after {self.timeout:g}s ({self.received} bytes read)"
            ) from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise GopenError(
                self.url, f"read failed after {self.received} bytes: {_describe(exc)}"
            ) from exc
        if n == 0 and len(b) > 0:
            # http.client signals a body shorter than Content-Length as a plain b""
            if self.content_length is not None and self.received < self.content_length:
                raise GopenError(
                    self.url,
                    f"body truncated: got {self.received} of {self.content_length} bytes "
                    "(Content-Length)",
                )
        self.received += n
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self.response.close()
            finally:
                super().close()


def _open_http(url: str, bufsize: int, timeout: float, headers: dict[str, str] | None) -> IO[bytes]:
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT, **(headers or {})})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        status, reason = exc.code, str(exc.reason or "")
        exc.close()
        raise HTTPStatusError(url, status, reason) from exc
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise GopenError(url, f"connection timed out after {timeout:g}s") from exc
        cause = _describe(reason) if isinstance(reason, BaseException) else str(reason)
        raise GopenError(url, f"cannot connect: {cause}") from exc
    except TimeoutError as exc:
        raise GopenError(url, f"timed out after {timeout:g}s waiting for the response") from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise GopenError(url, f"request failed: {_describe(exc)}") from exc
    return io.BufferedReader(HTTPStream(url, response, timeout), buffer_size=max(bufsize, 8192))


# ---------------------------------------------------------------------------
# pipe:


class Pipe(io.RawIOBase):
    """A stream reading from (or writing to) a shell command, checking its exit status.

    Reading: when the output ends, the command's exit status is checked; a non-zero one
    raises :class:`GopenError` naming the command and the status. Closing before the end
    closes the pipe: a command that then dies of SIGPIPE (status 141 from a shell, or
    the signal itself) is not an error; one still running after ``timeout`` seconds is
    killed. Writing: the status is checked at :meth:`close`.
    """

    def __init__(self, url: str, cmd: str, mode: str, bufsize: int, timeout: float) -> None:
        super().__init__()
        self.url = url
        self.name = url
        self.cmd = cmd
        self.mode = mode
        self.timeout = timeout
        self.status: int | None = None
        self._eof = False
        try:
            if mode == "rb":
                self.proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, bufsize=0)
                self._stream: Any = self.proc.stdout
            else:
                self.proc = subprocess.Popen(cmd, shell=True, stdin=subprocess.PIPE, bufsize=0)
                self._stream = self.proc.stdin
        except OSError as exc:
            raise GopenError(url, f"cannot start command {cmd!r}: {_describe(exc)}") from exc

    def readable(self) -> bool:
        return self.mode == "rb"

    def writable(self) -> bool:
        return self.mode == "wb"

    def fileno(self) -> int:
        return self._stream.fileno()

    def _check(self, status: int, *, early: bool = False) -> None:
        self.status = status
        if status == 0 or (early and status in _SIGPIPE_STATUSES):
            return
        raise GopenError(self.url, f"command {self.cmd!r} exited with status {status}")

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed pipe")
        if self._eof:
            return 0
        n = self._stream.readinto(b)
        if n == 0 and len(b) > 0 and not self._eof:
            self._eof = True
            self._stream.close()
            self._check(self.proc.wait())
        return n

    def write(self, b: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed pipe")
        try:
            return self._stream.write(b)
        except BrokenPipeError as exc:
            status = self.proc.wait()
            raise GopenError(
                self.url, f"command {self.cmd!r} stopped reading (exit status {status})"
            ) from exc

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.status is not None:
                return
            early = self.mode == "rb" and not self._eof
            try:
                self._stream.close()
            except BrokenPipeError:
                pass
            try:
                # a reader that closed early does not wait long: the output is not wanted
                status = self.proc.wait(min(self.timeout, 5.0) if early else self.timeout)
            except subprocess.TimeoutExpired:
                if not early:
                    self.proc.kill()
                    self.proc.wait()
                    raise GopenError(
                        self.url,
                        f"command {self.cmd!r} still running {self.timeout:g}s after close",
                    ) from None
                log.debug("killing %r: reader closed early", self.cmd)
                self.proc.kill()
                self.status = self.proc.wait()
                return
            self._check(status, early=early)
        finally:
            super().close()


# ---------------------------------------------------------------------------


def _local_path(url: str) -> str:
    pr = urlparse(url)
    if pr.scheme == "file":
        return url2pathname(pr.path)
    return url


def gopen(
    url: str,
    mode: str = "rb",
    bufsize: int = 8192,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    headers: dict[str, str] | None = None,
    proxy_cache_dir: str | os.PathLike | None = None,
) -> IO[bytes]:
    """Open ``url`` for reading (``"rb"``) or writing (``"wb"``) and return a byte stream.

    - a plain path or ``file://`` URL: a local file (reading or writing);
    - ``http://``, ``https://``: reading only, streamed; ``timeout`` bounds the connection
      and every read (seconds), ``headers`` adds request headers; an error status raises
      :class:`HTTPStatusError`, a body shorter than Content-Length raises on read;
      ``proxy_cache_dir``, for a URL of a shardcache proxy whose ``--cache-dir`` this
      process can see (same node, shared volume): a committed entry is opened straight
      from that directory, anything else goes through the proxy
      (:mod:`shardcache.direct`);
    - ``pipe:CMD``: the output (``"rb"``) or input (``"wb"``) of the shell command CMD;
      a non-zero exit raises (see :class:`Pipe`); ``timeout`` bounds the wait at close;
    - ``s3://bucket/key``: reading only, directly with boto3 (the ``s3`` extra:
      ``pip install '.[s3]'`` in a checkout); endpoint, region and credentials from the standard
      AWS chain (``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``...). To
      read through a proxy, rewrite the URL with :func:`shardcache.proxied` first;
    - ``-``: standard input or output.

    Every error is a :class:`GopenError` (alias ``GopenException``) naming the URL.
    """
    if mode not in ("rb", "wb"):
        raise GopenError(url, f"unsupported mode {mode!r} (use 'rb' or 'wb')")
    if url == "-":
        return sys.stdin.buffer if mode == "rb" else sys.stdout.buffer
    scheme = urlparse(url).scheme.lower()
    if scheme in ("", "file"):
        path = _local_path(url)
        try:
            return open(path, mode, buffering=bufsize if bufsize > 0 else -1)
        except FileNotFoundError as exc:
            raise GopenError(url, f"no such file: {path}") from exc
        except IsADirectoryError as exc:
            raise GopenError(url, f"is a directory: {path}") from exc
        except OSError as exc:
            raise GopenError(url, f"cannot open {path}: {_describe(exc)}") from exc
    if scheme in ("http", "https"):
        if mode != "rb":
            raise GopenError(url, "HTTP URLs can only be opened for reading ('rb')")
        if proxy_cache_dir is not None:
            from shardcache.direct import direct_reader

            hit = direct_reader(url, proxy_cache_dir).open(url, headers)
            if hit is not None:
                return hit
        return _open_http(url, bufsize, timeout, headers)
    if scheme == "pipe":
        pipe = Pipe(url, url[5:], mode, bufsize, timeout)
        size = max(bufsize, 8192)
        if mode == "rb":
            return io.BufferedReader(pipe, size)
        return io.BufferedWriter(pipe, size)
    if scheme == "s3":
        from shardcache.s3 import open_s3

        try:
            return open_s3(url, mode, bufsize)
        except ImportError as exc:
            raise GopenError(url, str(exc)) from exc
    raise GopenError(
        url, f"no handler for URL scheme {scheme!r} (use a path, file, http, https, s3 or pipe:)"
    )
