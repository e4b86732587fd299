"""One upstream download per shard, teed to a ``.part`` file that every client follows.

The first request for a URL that is not cached starts a :class:`Download` (a background
task); requests for the same URL while it runs join it. The task writes upstream bytes to
the store's ``.part`` file; every client — the first, later joiners, Range requests —
follows the growing file through one shared descriptor and is woken by an event each time
bytes arrive. A client sends the written prefix with ``sendfile`` when its connection
allows (else ``pread`` and write). No client waits for the whole shard, and a slow client
never slows the download.

Completeness: a response that reaches the end of the object sends its last bytes only
after the download has been verified and committed (byte count against Content-Length, MD5 when the
upstream sent one). On an unrecoverable failure every client of the download gets
:class:`DownloadFailed`, upon which the handler aborts the connection: a truncated body
never looks like a clean end. The partial file is deleted, never committed.

Admission: when the store refuses the shard (bigger than the cache, or ``keep`` and full,
or the upstream said ``Cache-Control: no-store``/``private``, or the store cannot write)
the download turns into *bypass*: its upstream body goes to one client, and every other
client fetches its own, uncached (``X-Cache: BYPASS``).

Store failures: when the disk or index refuses a write mid-download (ENOSPC, EIO, EROFS…)
the download turns into *passthrough*: the partial file is discarded (its reservation
released), and each client sends what it can from the bytes already written, then fetches
the rest of its range from the upstream, verified to be the same version
(:meth:`proxy.upstream.Fetcher.read_range`). An upstream that cannot prove that ends in an
aborted connection, never in a short body or a splice of two versions.
"""

from proxy.inflight.download import READ_CHUNK, Download, State, _next_span  # noqa: F401
from proxy.inflight.registry import (  # noqa: F401
    BYPASS_CLAIM_SECONDS,
    GROW_STEP,
    WRITEBACK_STEP,
    Inflight,
    start_writeback,
)
from shardcache.errors import DownloadFailed

__all__ = ["Download", "DownloadFailed", "Inflight", "State"]
