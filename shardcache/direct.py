"""Same-node direct reads: open a proxy's committed entries straight from its cache directory.

A trainer and its shardcache sidecar on one node may mount the same cache directory. A
reader of the proxy's URLs that is given that directory (``proxy_cache_dir=`` of
:func:`~shardcache.gopen.gopen` and :class:`~shardcache.ShardDataset`, or
``SHARDCACHE_PROXY_CACHE_DIR`` read by ``ShardDataset``) opens a *committed* entry
from disk, without an HTTP request; everything else (a miss, a download in flight, an
entry the proxy must revalidate, a URL whose key cannot be known here, a directory it
cannot read) goes through the proxy as before, so coalescing, admission and read plans
hold.

What is trusted, and why:

- The mapping of a proxy URL to its cache key is the proxy's: its upstreams and its
  revalidation rule are learned once per proxy (``GET /-/where``), and the first URL of
  each upstream is checked against the key the proxy itself reports for it
  (``GET /-/where?url=``). Only plain paths (no query string, no percent escapes, no
  absolute-URL form) are mapped here; the rest goes through the proxy, so the
  signature stripping of ``--strip-signatures`` never has to be repeated in the library.
- Only a committed entry is read: an index row whose file has exactly the row's size
  (:meth:`~shardcache.store.Store.open_hit`). Entry files are only ever replaced by a
  rename and evicted by a rename then an unlink, never rewritten in place, so an open
  file keeps the bytes of the version it opened.
- Direct reads are used only when the proxy never revalidates (``--revalidate never``,
  the default) and the entry does not demand revalidation on each use
  (``Cache-Control: no-cache``).
- A hit counts for the proxy's LRU: it is recorded in memory and written in one
  transaction per second at most (and at exit), as the library's own hits are. A hit
  read for a read plan (a request carrying ``X-Shardcache-Plan``) is announced to the
  proxy by a ``HEAD`` request with that header, sent from a background thread: the plan's
  position moves, so its lookahead and eviction stay right, at the cost of a request
  without a body per shard.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from pathlib import Path
from typing import BinaryIO

from shardcache.errors import CacheError
from shardcache.urls import shard_uuid

__all__ = ["DirectReader", "direct_reader", "PROXY_CACHE_DIR_ENV"]

log = logging.getLogger(__name__)

PROXY_CACHE_DIR_ENV = "SHARDCACHE_PROXY_CACHE_DIR"
"""The environment variable ``ShardDataset`` reads for ``proxy_cache_dir``."""

FLUSH_EVERY = 1.0  # seconds between writes of the recorded accesses
NOTIFY_QUEUE = 1024  # plan notifications waiting at most (more are dropped, logged)
_TIMEOUT = 10.0

# A path segment the proxy keeps as it is: no percent escape to decode, only characters
# its re-quoting leaves alone, not "." or "..".
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9_.~!$&'()*+,;=:@-]+")
_INDEX_NAME = ".shardcache.sqlite"


class _Off(Exception):
    """Direct reads cannot be used (the message says why)."""


class DirectReader:
    """Direct reads of one proxy's committed entries from its cache directory ``cache_dir``.

    :meth:`open` returns the entry file of a proxy URL, or None when the request must go
    through the proxy. The first problem that rules out direct reads altogether (the
    directory or its index cannot be read, the proxy cannot be asked, it revalidates)
    is logged once, and every later :meth:`open` returns None.
    """

    def __init__(self, proxy: str, cache_dir: str | os.PathLike, *, timeout: float = _TIMEOUT):
        self.proxy = proxy.rstrip("/")
        self.cache_dir = Path(cache_dir)
        self.timeout = timeout
        self.off: str | None = None  # why direct reads are off, once they are
        self._lock = threading.Lock()
        self._store = None
        self._rules: dict[str, str] | None = None  # upstream name ("" unnamed) -> base
        self._checked: dict[str, bool] = {}  # upstream name -> its key mapping confirmed
        self._pid = -1
        self._wake: threading.Event | None = None
        self._notes: queue.Queue[tuple[str, dict[str, str]]] = queue.Queue(NOTIFY_QUEUE)
        self._last_flush = 0.0
        self.hits = 0  # direct reads served by this process
        self.notified = 0  # plan notifications sent by this process

    def __repr__(self) -> str:
        return f"DirectReader({self.proxy!r}, {str(self.cache_dir)!r}, off={self.off!r})"

    # -- the public calls ---------------------------------------------------------------

    def open(self, url: str, headers: dict[str, str] | None = None) -> BinaryIO | None:
        """The committed entry of the proxy URL ``url`` opened for reading, or None: the
        request goes through the proxy (a miss, or direct reads do not apply)."""
        if self.off is not None:
            return None
        try:
            with self._lock:
                self._setup()
                key_url = self._canonical(url)
            if key_url is None:
                return None
            hit = self._store.open_hit(key_url)  # type: ignore[union-attr]
        except _Off as exc:
            self._turn_off(str(exc))
            return None
        except CacheError as exc:
            self._turn_off(f"its index cannot be read ({exc})")
            return None
        if hit is None:
            return None
        entry, stream = hit
        cc = entry.meta
        if any(
            "no-cache" in (v or "").lower()
            for v in (cc.cache_control, cc.field("CDN-Cache-Control"))
        ):
            stream.close()  # the proxy asks the upstream before every use of this one
            return None
        self.hits += 1
        self._background()
        plan = _plan_header(headers)
        if plan is not None:
            try:
                self._notes.put_nowait((url, plan))
            except queue.Full:
                log.warning("%s: too many plan notifications waiting, %s not sent", self, url)
        return stream

    def flush(self) -> None:
        """Write the accesses recorded so far to the index, and send the plan
        notifications waiting (both are otherwise done in the background)."""
        self._send_notes()
        store = self._store
        if store is not None:
            try:
                store.flush_access()
            except CacheError as exc:
                log.warning("%s: cannot record the accesses of direct reads: %s", self, exc)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flush, stop the background thread and close the index."""
        wake = self._wake
        if wake is not None and self._pid == os.getpid():
            self._wake = None
            wake.set()
        self.flush()
        if self._store is not None:
            self._store.close()

    # -- setup -------------------------------------------------------------------------

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self.off is None:
                self.off = why
                log.warning(
                    "direct reads from %s are off, reading through the proxy %s: %s",
                    self.cache_dir,
                    self.proxy,
                    why,
                )

    def _setup(self) -> None:
        if self._rules is not None:
            return
        index = self.cache_dir / _INDEX_NAME
        if not self.cache_dir.is_dir():
            raise _Off(f"{self.cache_dir} is not a directory here (mount the proxy's --cache-dir)")
        if not index.is_file():
            raise _Off(f"{self.cache_dir} holds no shardcache index ({_INDEX_NAME})")
        if not os.access(index, os.R_OK | os.W_OK) or not os.access(
            self.cache_dir, os.R_OK | os.W_OK | os.X_OK
        ):
            raise _Off(
                f"{self.cache_dir} or its index is not readable and writable by uid "
                f"{os.getuid()} (SQLite needs both to read an index in WAL mode)"
            )
        answer = self._ask("/-/where")
        revalidate = answer.get("revalidate")
        if revalidate is None:
            raise _Off("the proxy does not say how it revalidates (a shardcache older than this)")
        if revalidate != "never":
            raise _Off(f"the proxy revalidates entries (--revalidate {revalidate})")
        from shardcache.store import Store

        try:
            # never creates, repairs or evicts anything: the proxy owns the directory
            store = Store(self.cache_dir, reconcile=False, min_free=0)
            store.lookup("")  # opens the index now: a broken one turns direct reads off here
        except CacheError as exc:
            raise _Off(f"its index cannot be read ({exc})") from exc
        rules: dict[str, str] = {}
        for spec in answer.get("upstreams") or []:
            name, sep, rest = str(spec).partition("=")
            if sep and "://" in rest and "://" not in name:
                rules[name] = rest.rstrip("/")
            else:
                rules[""] = str(spec).rstrip("/")
        self._store = store
        self._rules = rules

    def _ask(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(self.proxy + path, timeout=self.timeout) as resp:
                data = json.loads(resp.read(1 << 20))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = getattr(exc, "reason", exc)
            raise _Off(f"cannot ask the proxy ({path}: {why})") from None
        if not isinstance(data, dict):
            raise _Off(f"{path}: not a shardcache answer")
        return data

    def _canonical(self, url: str) -> str | None:
        """The upstream URL the proxy keys ``url`` by, or None when it is not known here."""
        assert self._rules is not None
        if not url.startswith(self.proxy + "/"):
            return None
        rest = url[len(self.proxy) :]
        if "?" in rest or "#" in rest or len(rest) > 1024:
            return None
        segments = rest[1:].split("/")
        if (
            not segments
            or ":" in segments[0]  # the absolute-URL form (/https://host/...)
            or segments[0] == "-"  # the proxy's own routes
            or any(s in (".", "..") or not _PLAIN_SEGMENT.fullmatch(s) for s in segments)
        ):
            return None
        if segments[0] in self._rules and segments[0] and len(segments) > 1:
            name, path = segments[0], segments[1:]
        elif "" in self._rules:
            name, path = "", segments
        else:
            return None
        canonical = self._rules[name] + "/" + "/".join(path)
        ok = self._checked.get(name)
        if ok is None:
            answer = self._ask("/-/where?url=" + urllib.parse.quote(url, safe=""))
            ok = answer.get("key") == shard_uuid(canonical)
            self._checked[name] = ok
            if not ok:
                log.warning(
                    "direct reads: %s maps to key %s on the proxy, not %s as computed here; "
                    "URLs of upstream %r go through the proxy",
                    url,
                    answer.get("key"),
                    shard_uuid(canonical),
                    name or "(unnamed)",
                )
        return canonical if ok else None

    # -- background: access batches and plan notifications ---------------------------------

    def _background(self) -> None:
        if self._pid == os.getpid() and self._wake is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._wake is not None:
                return
            self._pid = os.getpid()  # a forked worker starts its own thread
            self._notes = queue.Queue(NOTIFY_QUEUE)
            wake = self._wake = threading.Event()
            ref = weakref.ref(self)
            threading.Thread(
                target=_run, args=(ref, wake), name="shardcache-direct", daemon=True
            ).start()
            _at_exit.add(self)
            _flush_at_process_exit()

    def _send_notes(self) -> None:
        for _ in range(NOTIFY_QUEUE):
            try:
                url, plan = self._notes.get_nowait()
            except queue.Empty:
                return
            req = urllib.request.Request(url, method="HEAD", headers=plan)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout):
                    pass
                self.notified += 1
            except (urllib.error.URLError, OSError, ValueError) as exc:
                log.debug("%s: plan notification for %s failed: %s", self, url, exc)


def _plan_header(headers: dict[str, str] | None) -> dict[str, str] | None:
    from shardcache.plans import PLAN_HEADER

    for k, v in (headers or {}).items():
        if k.lower() == PLAN_HEADER.lower():
            return {PLAN_HEADER: v}
    return None


def _run(ref: weakref.ref, wake: threading.Event) -> None:
    """The background loop of one reader in one process: plan notifications as they
    come, accesses once per :data:`FLUSH_EVERY` seconds; ends with the reader."""
    while True:
        stop = wake.wait(0.05)
        reader = ref()
        if reader is None or reader._wake is not wake:
            return
        reader._send_notes()
        if stop or time.monotonic() - reader._last_flush >= FLUSH_EVERY:
            store = reader._store
            if store is not None and store.pending_access():
                reader.flush()
            reader._last_flush = time.monotonic()
        del reader
        if stop:
            return


_at_exit: weakref.WeakSet[DirectReader] = weakref.WeakSet()
_finalizer_pid = -1


@atexit.register
def _flush_all() -> None:
    for reader in list(_at_exit):
        if reader._pid == os.getpid():
            reader.flush()


def _flush_at_process_exit() -> None:
    """Flush at the exit of a ``multiprocessing`` child too (a DataLoader worker), which
    ends without running ``atexit`` handlers."""
    global _finalizer_pid
    if _finalizer_pid == os.getpid():
        return
    _finalizer_pid = os.getpid()
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _flush_all, exitpriority=10)


_readers: dict[tuple[str, str], DirectReader] = {}
_readers_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked process (a DataLoader worker) starts with readers of its own: the
    parent's may hold locks taken by its background thread at the moment of the fork."""
    global _readers_lock
    _readers.clear()
    _readers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def direct_reader(url: str, cache_dir: str | os.PathLike) -> DirectReader:
    """The :class:`DirectReader` of the proxy serving ``url`` (its scheme and host) and
    of ``cache_dir``, one per process and pair."""
    parts = urllib.parse.urlsplit(url)
    proxy = f"{parts.scheme}://{parts.netloc}"
    key = (proxy, os.path.abspath(os.fspath(cache_dir)))
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = DirectReader(proxy, key[1])
        return reader
