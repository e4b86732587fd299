"""Upstream redirects, followed inside the proxy to safe targets only.

The Hugging Face Hub answers a file's ``resolve`` URL with a 302 to a CDN host and a
short-lived signed query; other origins redirect renamed paths or hand out presigned
URLs. A caching proxy that passed those on would cache nothing (the client fetches the
target itself) and hand signed URLs to clients. :class:`RedirectingTransport` wraps the
http(s) transports: every request (a download, its parts and resumes, a HEAD, a range, a
revalidation) follows redirects itself, and the bytes are cached under the URL the
client asked for.

Redirects are an attack surface, so a target is followed only when :func:`check_target`
allows it: http(s); no userinfo; the upstream's own host or a host the operator allowed
(``--redirect-host``, with ``*.domain`` patterns; the Hub's CDN hosts by default); host
names checked on the parsed URL at every hop; IP literals only in their canonical form,
and link-local or cloud-metadata addresses never, unless named exactly; at most
``max_hops`` hops. Credentials a request carries are not sent to another origin (another
host, another port, or from https to http).

A target that worked is remembered for its first URL (so parts and resumes do not ask
for a new redirect each time); when it answers 400, 401, 403 or 410 — an expired
signature — the first URL is asked again for a fresh redirect. The Hub's metadata of the
file (``X-Repo-Commit``, ``X-Linked-Etag``, ``X-Linked-Size``) arrives on the redirect,
not on the CDN's answer: it is carried over to the final answer, so it is stored with
the entry and served.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from multidict import CIMultiDict

from proxy.policy import DEFAULT_REDIRECT_HOSTS
from proxy.upstream.transport import Response, Transport
from shardcache.errors import UpstreamError

__all__ = [
    "DEFAULT_REDIRECT_HOSTS",
    "RedirectPolicy",
    "RedirectRefused",
    "RedirectingTransport",
    "Target",
    "check_target",
]

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# metadata an origin states on the redirect itself, kept with the final answer
CARRIED = ("X-Repo-Commit", "X-Linked-Etag", "X-Linked-Size")
# never sent to a host other than the upstream's own
CREDENTIALS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "x-amz-security-token", "x-api-key"}
)
# a remembered target answering one of these has most likely expired: redirect afresh
EXPIRED = frozenset({400, 401, 403, 410})
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog"})
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)
TARGET_TTL = 600.0  # seconds a target that worked is reused for its first URL
TARGETS_KEPT = 4096


class RedirectRefused(UpstreamError):
    """An upstream redirected to a target the proxy will not follow."""


@dataclass(frozen=True)
class RedirectPolicy:
    """Which redirect targets are followed: ``hosts`` (names, ``*.domain`` patterns,
    or exact IP addresses) besides the upstream's own host, and how many hops."""

    hosts: tuple[str, ...] = DEFAULT_REDIRECT_HOSTS
    max_hops: int = 5

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for pattern in self.hosts:
            p = pattern.lower().rstrip(".")
            if p.startswith("*."):
                if host.endswith(p[1:]) and host != p[2:]:
                    return True
            elif host == p:
                return True
        return False

    def named_exactly(self, host: str) -> bool:
        return host.lower() in {p.lower() for p in self.hosts if not p.startswith("*.")}


def _ip_of(host: str) -> tuple[Any, bool]:
    """(the address a host literal names or None, whether it is written canonically).
    ``0x7f000001``, ``2130706433`` and ``0177.0.0.1`` name 127.0.0.1 for many resolvers:
    such forms are recognised (and not canonical)."""
    try:
        ip = ipaddress.ip_address(host)
        return ip, str(ip) == host
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefx." for c in host) and any(c.isdigit() for c in host):
        try:
            return ipaddress.ip_address(socket.inet_aton(host)), False
        except OSError:
            return None, True
    return None, True


def check_target(current: str, location: str, origin_host: str, policy: RedirectPolicy) -> str:
    """The absolute URL a redirect from ``current`` to ``location`` leads to, when the
    proxy may follow it; RedirectRefused naming the target and the setting otherwise."""
    target = urljoin(current, location.strip())
    try:
        parts = urlsplit(target)
        host = (parts.hostname or "").lower()
        _ = parts.port  # a malformed port raises here
    except ValueError as exc:
        raise RedirectRefused(
            f"upstream {_redact(current)} redirects to a malformed URL: {exc}"
        ) from None
    shown = _redact(target)

    def refuse(why: str) -> RedirectRefused:
        return RedirectRefused(f"upstream {_redact(current)} redirects to {shown}: {why}")

    if parts.scheme.lower() not in ("http", "https"):
        raise refuse(f"scheme {parts.scheme or '(none)'!r} is never followed (http and https are)")
    if parts.username is not None or parts.password is not None:
        raise refuse("a target with user information is never followed")
    if not host:
        raise refuse("no host")
    ip, canonical = _ip_of(host)
    if ip is not None and not canonical:
        raise refuse(f"the address {ip} written as {host!r} is never followed")
    if host in METADATA_NAMES or (
        ip is not None and (ip in METADATA_ADDRESSES or ip.is_link_local)
    ):
        if not policy.named_exactly(host):
            raise refuse(
                f"{host} is a link-local or cloud-metadata address; name it exactly with "
                "--redirect-host to allow it"
            )
    if host != origin_host.lower() and not policy.allows(host):
        raise refuse(
            f"host {host} is neither the upstream's ({origin_host}) nor allowed by --redirect-host"
        )
    return target


def _redact(url: str) -> str:
    """A URL fit for a log line or an error: no query (signatures live there), no
    user information."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "(malformed URL)"
    netloc = p.netloc.rpartition("@")[2]
    return f"{p.scheme}://{netloc}{p.path}" + ("?…" if p.query else "")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``url``, the port made explicit."""
    p = urlsplit(url)
    scheme = p.scheme.lower()
    try:
        port = p.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        port = None
    return scheme, (p.hostname or "").lower(), port


def _may_carry_credentials(first: str, current: str) -> bool:
    """Whether a request to ``current``, reached by redirects from ``first`` (a URL of
    the upstream), may carry the credentials meant for the upstream: the same origin
    (scheme, host and port), or the upgrade of the same host from http to https. A
    redirect to another port of the host is another service, and one from https to http
    would send them in the clear."""
    a, b = _origin(first), _origin(current)
    if a == b:
        return True
    return a[1] == b[1] and a == ("http", a[1], 80) and b == ("https", b[1], 443)


@dataclass(frozen=True)
class Target:
    """Where a first URL led: the target that answered (until ``expires``, monotonic)
    and the metadata its redirects stated."""

    expires: float
    url: str
    carried: tuple[tuple[str, str], ...] = ()


class _Carried:
    """An answer with header fields carried over from the redirects before it."""

    def __init__(self, resp: Response, carried: Mapping[str, str]) -> None:
        self._resp = resp
        headers: CIMultiDict[str] = CIMultiDict(resp.headers)
        for k, v in carried.items():
            if k not in headers:
                headers[k] = v
        self.headers = headers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resp, name)


class RedirectingTransport:
    """A :class:`~proxy.upstream.transport.Transport` for http(s) URLs that follows
    redirects (GET and HEAD) to targets :func:`check_target` allows, over the transport
    ``pick(url)`` chooses for each hop."""

    def __init__(
        self,
        pick: Callable[[str], Transport],
        policy: RedirectPolicy,
        targets: OrderedDict[str, Target],
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        self.pick = pick
        self.policy = policy
        self.targets = targets  # first URL -> where it led last
        # header fields the operator configured for this upstream: its own host only
        self.credentials = credentials or {}

    async def request(self, method: str, url: str, headers: Mapping[str, str]) -> Response:
        # A target that worked is reused only by requests pinned to the version it served
        # (a resume or a later part: If-Match / If-Range). A first request or a
        # revalidation asks the first URL, which may lead elsewhere now (a Hub branch
        # moved to a commit whose file is another blob).
        pinned = any(k.lower() in ("if-match", "if-range") for k in headers)
        known = self.targets.get(url) if pinned else None
        if known is not None and known.expires > time.monotonic():
            resp = await self._follow(method, url, known.url, headers, dict(known.carried))
            if resp.status not in EXPIRED:
                return resp
            resp.close()  # most likely an expired signature: a fresh redirect
            self.targets.pop(url, None)
        return await self._follow(method, url, url, headers, {})

    async def _follow(
        self,
        method: str,
        url: str,
        start: str,
        headers: Mapping[str, str],
        carried: dict[str, str],
    ) -> Response:
        origin_host = (urlsplit(url).hostname or "").lower()
        current = start
        hops = 0
        while True:
            if _may_carry_credentials(url, current):
                sent = {**headers, **self.credentials} if self.credentials else headers
            else:
                mine = {k.lower() for k in self.credentials}
                sent = {
                    k: v
                    for k, v in headers.items()
                    if k.lower() not in CREDENTIALS and k.lower() not in mine
                }
            resp = await self.pick(current).request(method, current, sent)
            location = resp.headers.get("Location")
            if (
                resp.status not in REDIRECT_STATUSES
                or not location
                or method not in ("GET", "HEAD")
            ):
                break
            for name in CARRIED:
                value = resp.headers.get(name)
                if value is not None and name not in carried:
                    carried[name] = value
            resp.close()
            hops += 1
            if hops > self.policy.max_hops:
                raise RedirectRefused(
                    f"upstream {_redact(url)}: more than {self.policy.max_hops} redirects"
                )
            current = check_target(current, location, origin_host, self.policy)
        if current != url and resp.status < 300:
            self.targets[url] = Target(
                time.monotonic() + TARGET_TTL, current, tuple(carried.items())
            )
            self.targets.move_to_end(url)
            while len(self.targets) > TARGETS_KEPT:
                self.targets.popitem(last=False)
        return _Carried(resp, carried) if carried else resp  # type: ignore[return-value]

    async def close(self) -> None:
        pass
