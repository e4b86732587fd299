"""What the demos read: sample tar shards, and a loopback HTTP origin that counts what it
serves. Shared by the library demo (:mod:`shardcache.cli.demo`) and the proxy demo
(:mod:`shardcache.cli.proxydemo`)."""

from __future__ import annotations

import io
import random
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["make_shards", "origin"]


def make_shards(
    directory: Path, shards: int, samples: int, *, seed: int = 0, size: int = 2048
) -> list[Path]:
    """Write ``shards`` tar files of ``samples`` samples each (``.txt`` + ``.bin``)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = directory / f"demo-{s:06d}.tar"
        with tarfile.open(path, "w") as tf:
            for i in range(samples):
                key = f"sample{s:06d}_{i:06d}"
                for ext, data in (
                    ("txt", f"sample {i} of shard {s}".encode()),
                    ("bin", rng.randbytes(rng.randint(size // 2, size))),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


@contextmanager
def origin(directory: Path) -> Iterator[tuple[str, dict[str, int]]]:
    """A local HTTP server for ``directory`` on 127.0.0.1.

    Yields (base URL, counts), where ``counts["requests"]`` and ``counts["bytes"]`` are
    the GET requests answered and the body bytes sent so far.
    """
    counts = {"requests": 0, "bytes": 0}
    lock = threading.Lock()

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def copyfile(self, source, outputfile) -> None:  # type: ignore[override]
            pos = source.tell()
            super().copyfile(source, outputfile)
            with lock:
                counts["requests"] += 1
                counts["bytes"] += source.tell() - pos

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(directory)))
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
