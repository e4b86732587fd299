"""What :class:`~proxy.upstream.fetcher.Fetcher` answers besides a body: a client's
range answered straight from the upstream (:class:`RangeAnswer`), what the upstream said
of a cached version (:class:`Revalidation`), and an upstream answer that is not the
object, as it can be passed on to the client (``_passable``)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy import ByteRange
from proxy.upstream.errors import PASS_LIMIT, PassedAnswer
from proxy.upstream.stream import UpstreamBody
from proxy.upstream.transport import Response
from shardcache.errors import ProxyError
from shardcache.meta import ObjectMeta, origin_headers

__all__ = ["RangeAnswer", "Revalidation"]


async def _passable(resp: Response, method: str) -> PassedAnswer | None:
    """``resp`` (an answer the proxy does not serve as the object) as it can be passed
    on to the client: with its whole body when that is at most PASS_LIMIT bytes and
    arrives intact; None otherwise (the client then gets the proxy's own message)."""
    fields = origin_headers(resp.headers)
    for name in ("ETag", "Last-Modified"):  # the answer's own validators, as it sent them
        if resp.headers.get(name):
            fields += ((name, resp.headers[name]),)
    if resp.headers.get("Content-Type"):
        fields += (("Content-Type", resp.headers["Content-Type"]),)
    if resp.status == 206 and resp.headers.get("Content-Range"):
        fields += (("Content-Range", resp.headers["Content-Range"]),)
    body = b""
    if method != "HEAD" and resp.status not in (204, 304):
        try:
            async for chunk in resp.chunks():
                body += chunk
                if len(body) > PASS_LIMIT:
                    return None
        except ProxyError:
            return None  # broken: never passed on as if complete
    return PassedAnswer(resp.status, resp.reason or "", fields, body)


@dataclass
class RangeAnswer:
    """A client's range answered straight from the upstream: the object's version, the
    range (None when the upstream ignored Range and sent the whole object, which the
    caller slices to ``wanted``), and the body."""

    meta: ObjectMeta
    brange: ByteRange | None
    wanted: ByteRange
    body: UpstreamBody


@dataclass
class Revalidation:
    """What the upstream said of a cached version (see :meth:`Fetcher.revalidate`)."""

    result: str  # "fresh", "changed" or "gone"
    fields: tuple[tuple[str, str], ...] = ()
    body: UpstreamBody | None = None
