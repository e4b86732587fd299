"""An origin pair that behaves like the Hugging Face Hub, on two loopback addresses.

- the hub (127.0.0.1): ``/datasets/ORG/NAME/resolve/REV/PATH`` answers ``302`` to the
  CDN with a signed query that expires (``Expires``, ``Signature``), and the file's
  metadata as the Hub states it: ``X-Repo-Commit``, ``X-Linked-Etag`` (the sha256,
  quoted), ``X-Linked-Size``, ``ETag``. ``/datasets/OLD/NAME/...`` (a renamed repo)
  answers a relative ``307`` to the new name. ``/evil/<kind>`` answers redirects an
  attacker would try (see :data:`EVIL`).
- the CDN (127.0.0.2): ``/blob/SHA256?Expires=…&Signature=…`` serves the bytes with
  ETag, Last-Modified and Range; an expired or wrong signature answers 403, as CDNs do.

Both count their requests (``hub.log``, ``cdn.log``) for the tests' assertions.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlencode

from aiohttp import web

SECRET = b"cdn-signing-key"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LM = "Mon, 01 Jan 2024 00:00:00 GMT"


def hf_env(endpoint: str) -> dict[str, str]:
    """This process's environment for a huggingface_hub client that reads the Hub at
    ``endpoint`` (``HF_ENDPOINT``): plain HTTP downloads (no Xet), no telemetry, online,
    and no token of the machine's."""
    env = dict(
        os.environ,
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_OFFLINE="0",
    )
    env.pop("HF_TOKEN", None)
    return env


def sign(blob: str, expires: int) -> str:
    return hmac.new(SECRET, f"{blob}:{expires}".encode(), hashlib.sha256).hexdigest()[:32]


@dataclass
class Server:
    """One aiohttp app on ``host`` in a thread of its own."""

    host: str
    handler: object
    port: int = 0
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, range

    def start(self) -> Server:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self.handler)  # type: ignore[arg-type]
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, self.host, 0).start())
            self.port = self._runner.addresses[0][1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name=f"server {self.host}")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("server did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Hub:
    """The hub and its CDN. ``files``: repo path (``ORG/NAME/PATH``) -> bytes;
    ``ttl``: seconds a signed CDN URL stays valid."""

    def __init__(self, files: dict[str, bytes], ttl: float = 60.0) -> None:
        self.files = dict(files)
        self.ttl = ttl
        self.blobs = {hashlib.sha256(d).hexdigest(): d for d in self.files.values()}
        self.hub = Server("127.0.0.1", self._hub)
        self.cdn = Server("127.0.0.2", self._cdn)
        self.evil: dict[str, str] = {}  # kind -> Location, set once the ports are known
        self.commit = COMMIT  # the revision the API reports (tests move it)
        self.hub_auth: list[str | None] = []  # the Authorization of each hub request

    def __enter__(self) -> Hub:
        self.cdn.start()
        self.hub.start()
        c = self.cdn.port
        self.evil = {
            "metadata": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            "other-host": f"http://127.0.0.3:{c}/blob/x",
            "file": "file:///etc/passwd",
            "userinfo": f"http://user:secret@127.0.0.2:{c}/blob/x",
            "hex-ip": f"http://0x7f000002:{c}/blob/x",
            "gopher": f"gopher://127.0.0.2:{c}/",
            "loop": "/evil/loop",
        }
        return self

    def __exit__(self, *exc: object) -> None:
        self.hub.stop()
        self.cdn.stop()

    def cdn_gets(self, sha: str | None = None) -> list[tuple[str, str, str | None]]:
        return [e for e in self.cdn.log if e[0] == "GET" and (sha is None or sha in e[1])]

    async def _hub(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hub.log.append((request.method, path, request.headers.get("Range")))
        self.hub_auth.append(request.headers.get("Authorization"))
        m = re.fullmatch(r"/evil/([\w-]+)", path)
        if m:
            return web.Response(status=302, headers={"Location": self.evil[m.group(1)]})
        if path.startswith("/api/"):
            return await self._api(request)
        m = re.fullmatch(r"/datasets/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)
        if not m:
            return web.Response(status=404, text="Entry not found")
        org, name, _rev, file = m.groups()
        if org == "old-org":  # a renamed repo: a relative redirect to the new name
            return web.Response(
                status=307, headers={"Location": f"/datasets/org/{name}/resolve/{_rev}/{file}"}
            )
        data = self.files.get(f"{org}/{name}/{file}")
        if data is None:
            return web.Response(status=404, text="Entry not found")
        sha = hashlib.sha256(data).hexdigest()
        expires = int(time.time() + self.ttl)
        query = urlencode({"Expires": expires, "Signature": sign(sha, expires)})
        return web.Response(
            status=302,
            headers={
                "Location": f"{self.cdn.url}/blob/{sha}?{query}",
                "X-Repo-Commit": self.commit,
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
                "ETag": f'"{sha}"',
            },
            text="Found. Redirecting",
        )

    def _entries(self, repo: str, prefix: str, recursive: bool) -> list[dict]:
        """The Hub's tree entries (files and directories) of ``repo`` under ``prefix``."""
        out: dict[str, dict] = {}
        for key, data in sorted(self.files.items()):
            org, name, file = key.split("/", 2)
            if f"{org}/{name}" != repo or not file.startswith(prefix):
                continue
            rest = file[len(prefix) :]
            if "/" in rest and not recursive:
                sub = prefix + rest.split("/", 1)[0]
                out.setdefault(sub, {"type": "directory", "oid": "0" * 40, "path": sub})
                continue
            sha = hashlib.sha256(data).hexdigest()
            out[file] = {
                "type": "file",
                "oid": hashlib.sha1(data).hexdigest(),
                "size": len(data),
                "path": file,
                "lfs": {"oid": sha, "size": len(data), "pointerSize": 134},
            }
        return list(out.values())

    async def _api(self, request: web.Request) -> web.StreamResponse:
        """The few API routes ``HfFileSystem`` uses: repo info at a revision, a tree
        listing, and paths-info (a POST with a form body). Answers change with
        ``self.commit`` (a branch moving), so a cache must never keep them."""
        path = request.path
        m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m and request.method == "GET":
            repo = m.group(1)
            files = [k.split("/", 2)[2] for k in self.files if k.startswith(repo + "/")]
            if not files:
                return web.json_response({"error": "Repository not found"}, status=404)
            return web.json_response(
                {
                    "_id": "0" * 24,
                    "id": repo,
                    "sha": self.commit,
                    "private": False,
                    "lastModified": "2024-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": f} for f in sorted(files)],
                }
            )
        m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/tree/([^/]+)/?(.*)", path)
        if m and request.method == "GET":
            repo, _rev, sub = m.groups()
            prefix = sub.strip("/") + "/" if sub.strip("/") else ""
            recursive = request.query.get("recursive", "").lower() in ("1", "true")
            return web.json_response(self._entries(repo, prefix, recursive))
        m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/paths-info/([^/]+)", path)
        if m and request.method == "POST":
            form = await request.post()
            wanted = form.getall("paths", [])
            everything = {e["path"]: e for e in self._entries(m.group(1), "", True)}
            return web.json_response([everything[p] for p in wanted if p in everything])
        return web.json_response({"error": f"no API route {request.method} {path}"}, status=404)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.cdn.log.append((request.method, path, request.headers.get("Range")))
        m = re.fullmatch(r"/blob/([0-9a-f]{64})", path)
        if not m or m.group(1) not in self.blobs:
            return web.Response(status=404, text="NoSuchKey")
        sha = m.group(1)
        try:
            expires = int(request.query.get("Expires", "0"))
        except ValueError:
            expires = 0
        if request.query.get("Signature") != sign(sha, expires) or expires < time.time():
            return web.Response(status=403, text="AccessDenied: Request has expired")
        data = self.blobs[sha]
        headers = {
            "ETag": f'"{sha}"',
            "Last-Modified": LM,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/x-tar",
        }
        rng = request.headers.get("Range")
        start, stop, status = 0, len(data), 200
        if rng:
            mr = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if mr:
                a, b = mr.groups()
                if a:
                    start, stop = int(a), (min(len(data), int(b) + 1) if b else len(data))
                else:
                    start = max(0, len(data) - int(b))
                if start >= len(data):
                    return web.Response(
                        status=416, headers={"Content-Range": f"bytes */{len(data)}"}
                    )
                status = 206
                headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
        if request.method == "HEAD":
            headers["Content-Length"] = str(stop - start)
            return web.Response(status=status, headers=headers)
        return web.Response(status=status, body=data[start:stop], headers=headers)
