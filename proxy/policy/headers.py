"""Header fields and admission: which request fields go on to an upstream, which answer
fields are hop-by-hop, and whether an answer may be stored at all (``Cache-Control:
no-store``/``private``, ``Vary``, size). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from proxy.policy.urls import Upstream

__all__ = [
    "CONFINED",
    "CREDENTIALS",
    "HARMLESS_VARY",
    "HOP_BY_HOP",
    "NOT_FORWARDED",
    "cache_control_forbids",
    "carries_credentials",
    "confine",
    "credentials_forwarded",
    "end_to_end_headers",
    "forwarded_fields",
    "should_admit",
    "vary_forbids",
]

# Request fields the proxy does not pass to an upstream: hop-by-hop fields, those the
# cache manages itself (ranges and conditionals: a shared download must be the whole
# object), the framing of this connection, the compression it asks for (identity), its
# own, and credentials (a client's Authorization or Cookie must not fetch an object that
# other clients are then served).
NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        "range",
        "if-range",
        "if-match",
        "if-none-match",
        "if-modified-since",
        "if-unmodified-since",
        "accept-encoding",
        "authorization",
        "cookie",
        "x-amz-security-token",
    }
)


# A client's credentials: forwarded only to an upstream the operator names in
# ``--forward-credentials``, and then the answer is that client's alone (never stored,
# never shared: RFC 9111 3.5).
CREDENTIALS = frozenset({"authorization", "cookie"})


def forwarded_fields(headers: Mapping[str, str], *, credentials: bool = False) -> dict[str, str]:
    """The end-to-end fields of a client's request that go on to the upstream with a
    miss (see :data:`NOT_FORWARDED`; also those its ``Connection`` names, the proxy's
    own ``X-Shardcache-*`` fields and the S3 front's SigV4 fields). ``credentials``:
    the client's ``Authorization`` and ``Cookie`` go too (:data:`CREDENTIALS`)."""
    named = {t.strip().lower() for t in (headers.get("Connection") or "").split(",")}
    out: dict[str, str] = {}
    for k, v in headers.items():
        low = k.lower()
        if credentials and low in CREDENTIALS and low not in named:
            if not _s3_signature(low, v):
                out[k] = f"{out[k]}, {v}" if k in out else v
            continue
        if low in NOT_FORWARDED or low in named or low.startswith(("x-shardcache-", "x-amz-")):
            continue
        out[k] = f"{out[k]}, {v}" if k in out else v
    return out


def _s3_signature(name: str, value: str) -> bool:
    """An ``Authorization`` that signs the request for the S3 front (SigV4, SigV2): made
    for the proxy's host, it is no credential of the upstream's and never goes there."""
    return name == "authorization" and value.lstrip().startswith(("AWS4-", "AWS "))


def carries_credentials(headers: Mapping[str, str]) -> bool:
    """Whether a client's request carries credentials for the upstream
    (:data:`CREDENTIALS`; an S3 front signature is not one)."""
    return any(
        k.lower() in CREDENTIALS and not _s3_signature(k.lower(), v) for k, v in headers.items()
    )


def credentials_forwarded(url: str, upstreams: Iterable[Upstream], allowed: Iterable[str]) -> bool:
    """Whether clients' credentials go on to the upstream serving ``url``: its name is in
    ``allowed`` (``--forward-credentials``), ``-`` naming the unnamed upstream and ``*``
    every upstream."""
    allowed = set(allowed)
    if not allowed:
        return False
    if "*" in allowed:
        return True
    best: Upstream | None = None
    for u in upstreams:
        if url == u.base or url.startswith(u.root):
            if best is None or len(u.base) > len(best.base):
                best = u
    return best is not None and (best.name or "-") in allowed


def vary_forbids(vary: str | None, content_encoding: str | None) -> bool:
    """Whether an answer with this ``Vary`` cannot be stored: this cache keys entries by
    URL alone, so an answer chosen by request fields is stored only when any client may
    have it. ``Vary: *`` never; ``Vary: Accept-Encoding`` on an unencoded answer (the
    proxy asks for identity, which every client accepts) is fine, and so are the CORS
    fields (:data:`HARMLESS_VARY`); any other field is not stored (each client is
    answered by the upstream, uncached)."""
    if not vary:
        return False
    fields = {f.strip().lower() for f in vary.split(",") if f.strip()}
    if not fields:
        return False
    if "*" in fields:
        return True
    encoded = (content_encoding or "identity").strip().lower() != "identity"
    return bool(fields - HARMLESS_VARY) or (encoded and "accept-encoding" in fields)


# request fields whose variation leaves the body alone: CORS (object stores answer
# ``Vary: Origin`` on every GET; only the Access-Control-* fields follow the Origin)
HARMLESS_VARY = frozenset(
    {"accept-encoding", "origin", "access-control-request-method", "access-control-request-headers"}
)


def cache_control_forbids(value: str | None) -> bool:
    """Whether an upstream ``Cache-Control`` forbids a shared cache to store the answer
    (``no-store`` or ``private``)."""
    if not value:
        return False
    for directive in value.split(","):
        name = directive.split("=", 1)[0].strip().lower()
        if name in ("no-store", "private"):
            return True
    return False


HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def end_to_end_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop hop-by-hop headers (RFC 9110 §7.6.1), including those named in Connection."""
    items = list(headers)
    named = {
        token.strip().lower()
        for k, v in items
        if k.lower() == "connection"
        for token in v.split(",")
        if token.strip()
    }
    return [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def should_admit(expected_size: int | None, cache_size: int) -> bool:
    """May a download of ``expected_size`` bytes become an entry at all?

    A shard larger than the whole cache is streamed through uncached. Whether there is
    room right now (eviction, the ``keep`` policy) is the store's decision.
    """
    return expected_size is None or expected_size <= cache_size


# The proxy's own fields on every answer whose bytes come from an upstream (an object, a
# passed-on error or API answer): such bytes are served from the proxy's origin, where
# the status page (``/-/``) and the admin routes live, and must never run there as a
# page. ``sandbox`` gives the document an opaque origin of its own and no scripts;
# ``nosniff`` keeps a browser from reading a mislabelled body as HTML or script.
CONFINED = (("Content-Security-Policy", "sandbox"), ("X-Content-Type-Options", "nosniff"))


class _Fields(Protocol):
    def __contains__(self, key: object) -> bool: ...
    def add(self, key: str, value: str) -> None: ...
    def __setitem__(self, key: str, value: str) -> None: ...


def confine(headers: _Fields) -> None:
    """Add :data:`CONFINED` to an answer's ``headers`` (a multidict). An origin that
    states its own ``Content-Security-Policy`` is taken at its word: its field goes on
    unchanged and alone (what the origin said reaches the client as it said it, and
    the HTTP cache test suite checks that it does); ``X-Content-Type-Options`` has one
    meaningful value and is set to it."""
    if CONFINED[0][0] not in headers:
        headers.add(*CONFINED[0])
    headers[CONFINED[1][0]] = CONFINED[1][1]
