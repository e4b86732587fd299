"""A small real HTTP origin on 127.0.0.1 for tests: serves bytes, counts requests, and can
misbehave on purpose (drop the connection mid-body, trickle small writes)."""

from __future__ import annotations

import collections
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Origin:
    """Serve ``files`` (path -> bytes) at ``http://127.0.0.1:<port>/<path>``.

    ``drop_after[path] = n`` sends a full Content-Length but only ``n`` body bytes, then
    closes the connection. ``trickle`` writes bodies in 7-byte pieces with flushes, so
    readers see many short reads.
    """

    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.drop_after: dict[str, int] = {}
        self.trickle = False
        self.requests: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                path = self.path.lstrip("/")
                with origin._lock:
                    origin.requests[path] += 1
                data = origin.files.get(path)
                if data is None:
                    self.send_error(404, "no such shard")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-tar")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                cut = origin.drop_after.get(path)
                body = data if cut is None else data[:cut]
                if origin.trickle:
                    for i in range(0, len(body), 7):
                        self.wfile.write(body[i : i + 7])
                        self.wfile.flush()
                else:
                    self.wfile.write(body)
                self.wfile.flush()
                if cut is not None:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # clients that hang up early are part of the tests

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def __enter__(self) -> Origin:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
