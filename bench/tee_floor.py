"""The floor of a cold miss: a bare program that does only the tee, by the proxy's means.

    python bench/tee_floor.py serve --upstream URL --cache-dir DIR --port PORT [...]

It takes the proxy's ``serve`` flags (the others are ignored), so ``bench/proxy.py`` can
run it as a variant through an ``@PYTHON`` wrapper (see bench/README.md) and measure it
with the same clients and CPU accounting as the proxy. Per object, one download thread
receives the body as the proxy's threaded transport does (socket -> pipe -> file with
``splice`` in batches of up to 1 MiB or 50 ms, each batch read back with ``pread`` by a
thread of its own for the crc32c, ``sync_file_range`` every 16 MiB, ``fsync`` and
``rename`` before the last byte), and each client has a thread that sends the written
prefix of the partial file with blocking ``sendfile``, waking once per batch. No event
loop, no HTTP framework, no index, no metrics: what remains is the kernel's copies and
one wake-up per batch, which is what the proxy's cold path cannot go below by these
means. Not a server to use: no error handling beyond cutting the connection.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from urllib.parse import urlsplit

import google_crc32c

BATCH_BYTES = 1 << 20
BATCH_SECONDS = 0.05
WRITEBACK_STEP = 16 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_sync_file_range = _libc.sync_file_range
_sync_file_range.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)


class Download:
    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.cond = threading.Condition()
        self.size: int | None = None
        self.written = 0
        self.done = False
        self.failed = False
        self.rfd: int | None = None


class Floor:
    def __init__(self, upstream: str, cache_dir: str) -> None:
        u = urlsplit(upstream)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.cache_dir = cache_dir
        self.lock = threading.Lock()
        self.downloads: dict[str, Download] = {}

    # -- the download: socket -> pipe -> file, crc32c read back, commit ----------------

    def download(self, dl: Download) -> None:
        try:
            self._download(dl)
        except Exception:
            with dl.cond:
                dl.failed = True
                dl.cond.notify_all()

    def _download(self, dl: Download) -> None:
        sock = socket.create_connection((self.host, self.port))
        req = f"GET /{dl.name} HTTP/1.1\r\nHost: {self.host}\r\nAccept-Encoding: identity\r\n\r\n"
        sock.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError("closed in headers")
            head += more
        head, _, rest = head.partition(b"\r\n\r\n")
        size = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                size = int(v)
        part = f"{dl.path}.{uuid.uuid4().hex}.part"
        wfd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        rfd = os.open(part, os.O_RDONLY)
        crc = [0]
        batches: queue.SimpleQueue[int | None] = queue.SimpleQueue()

        def rehash() -> None:  # as proxy.upstream.threaded._Rehash
            pos = 0
            while (n := batches.get()) is not None:
                end = pos + n
                while pos < end:
                    data = os.pread(rfd, min(BATCH_BYTES, end - pos), pos)
                    crc[0] = google_crc32c.extend(crc[0], data)
                    pos += len(data)

        hasher = threading.Thread(target=rehash, daemon=True)
        hasher.start()
        flushed = 0

        def wrote(n: int) -> None:
            nonlocal flushed
            batches.put(n)
            with dl.cond:
                dl.written += n
                dl.cond.notify_all()
            if dl.written - flushed >= WRITEBACK_STEP:
                _sync_file_range(wfd, flushed, dl.written - flushed, 2)
                flushed = dl.written

        with dl.cond:
            dl.size, dl.rfd = size, rfd
            dl.cond.notify_all()
        rest = rest[:size]
        if rest:
            os.write(wfd, rest)
            wrote(len(rest))
        remaining = size - len(rest)
        sock.setblocking(False)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        r, w = os.pipe()
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, BATCH_BYTES)
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        sfd = sock.fileno()
        while remaining:
            n = 0
            t0 = 0.0
            while remaining and n < BATCH_BYTES:
                try:
                    k = os.splice(sfd, w, min(BATCH_BYTES - n, remaining), flags=flags)
                except BlockingIOError:
                    if n:
                        left = BATCH_SECONDS - (time.monotonic() - t0)
                        # the pipe may be full, or the socket empty: flush if either
                        if left <= 0 or not poller.poll(int(left * 1000)):
                            break
                        try:
                            k = os.splice(sfd, w, min(BATCH_BYTES - n, remaining), flags=flags)
                        except BlockingIOError:
                            break  # readable but the pipe is full
                    else:
                        poller.poll(60_000)
                        continue
                if not k:
                    raise ConnectionError("upstream closed early")
                if not n:
                    t0 = time.monotonic()
                n += k
                remaining -= k
            left = n
            while left:
                left -= os.splice(r, wfd, left)
            wrote(n)
        os.close(r)
        os.close(w)
        sock.close()
        batches.put(None)
        hasher.join()
        os.fsync(wfd)
        os.close(wfd)
        os.rename(part, dl.path)
        with dl.cond:
            dl.done = True
            dl.cond.notify_all()
        with self.lock:
            self.downloads.pop(dl.name, None)

    # -- a client ------------------------------------------------------------------------

    def client(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    more = conn.recv(65536)
                    if not more:
                        return
                    buf += more
                head, _, buf = buf.partition(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                if path.startswith("/-/"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    continue
                if not self.serve(conn, path.lstrip("/")):
                    return

    def serve(self, conn: socket.socket, name: str) -> bool:
        path = os.path.join(self.cache_dir, name)
        with self.lock:
            dl = self.downloads.get(name)
            if dl is None and not os.path.exists(path):
                dl = self.downloads[name] = Download(name, path)
                threading.Thread(target=self.download, args=(dl,), daemon=True).start()
        if dl is None:  # a hit
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                conn.sendall(_head(size))
                pos = 0
                while pos < size:
                    pos += os.sendfile(conn.fileno(), f.fileno(), pos, size - pos)
            return True
        with dl.cond:
            while dl.size is None and not dl.failed:
                dl.cond.wait()
        if dl.failed:
            return False
        size = dl.size
        assert size is not None
        conn.sendall(_head(size))
        pos = 0
        fd = os.dup(dl.rfd)  # type: ignore[arg-type]
        try:
            while pos < size:
                with dl.cond:
                    while True:  # the last byte waits for the commit
                        if dl.failed:
                            return False
                        stop = size if dl.done else min(dl.written, size - 1)
                        if stop > pos:
                            break
                        dl.cond.wait()
                while pos < stop:
                    pos += os.sendfile(conn.fileno(), fd, pos, stop - pos)
        finally:
            os.close(fd)
        return True


def _head(size: int) -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/x-tar\r\nContent-Length: {size}\r\n\r\n"
    ).encode()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["serve"])
    p.add_argument("--upstream", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    args, _ = p.parse_known_args(argv)
    os.makedirs(args.cache_dir, exist_ok=True)
    floor = Floor(args.upstream, args.cache_dir)
    lsock = socket.create_server((args.host, args.port), backlog=128)
    while True:
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=floor.client, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
