"""Helpers for the tar pipeline tests: writing tar shards and serving them over HTTP."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import tarfile
import threading
import warnings
from collections.abc import Iterator, Sequence

import webdataset as wds

Member = tuple  # (name, bytes) for a file, (name, None) for a directory


def write_tar(path, members: Sequence[Member], fmt: int = tarfile.PAX_FORMAT) -> int:
    """Write ``members`` to a tar at ``path``; return the offset of the end-of-archive block."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1700000000
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        end = tf.offset
    return end


def wds_samples(urls, **kw) -> list[dict]:
    """webdataset 1.0.2's samples, without decoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False, **kw))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - signature of the base class
        pass


@contextlib.contextmanager
def serve_directory(directory) -> Iterator[str]:
    """Serve ``directory`` on 127.0.0.1 (an ephemeral port); yield the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
