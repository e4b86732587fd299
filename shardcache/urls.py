"""Shard URLs: naming, brace expansion, shard lists and rewriting for a shardcache proxy.

Everything here is pure string work, with one exception: :func:`proxied` called without
``upstream=`` asks the proxy once for its upstreams (``GET /-/where``). The only
environment variable, ``SHARDCACHE_PROXY``, is read by :func:`proxied` when it is called
without ``proxy=``.
"""

from __future__ import annotations

import functools
import os
import random
import re
import uuid
from collections.abc import Collection, Iterable, Iterator, Sequence

import braceexpand

from shardcache.errors import ProxyURLError

__all__ = [
    "ProxyURLError",
    "shard_uuid",
    "guess_shard",
    "expand_urls",
    "shardlist",
    "proxied",
    "proxy_upstreams",
]

PROXY_ENV = "SHARDCACHE_PROXY"

_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


@functools.lru_cache(maxsize=4096)  # a hit asks twice (downloads, index): MD5 and a UUID
def shard_uuid(path: str) -> str:
    """Return the stable cache name of a shard: ``str(uuid.uuid3(uuid.NAMESPACE_URL, path))``.

    Use the full URL: two URLs with the same base name get different names.
    """
    return str(uuid.uuid3(uuid.NAMESPACE_URL, path))


def guess_shard(path: str) -> str:
    """Return the last path component of ``path`` (a URL or file name), query stripped.

    >>> guess_shard("https://host/data/shard-000001.tar?X-Amz-Signature=abc")
    'shard-000001.tar'
    """
    return path.split("?", 1)[0].rsplit("/", 1)[-1]


def _expand_one(url: str) -> list[str]:
    result: list[str] = []
    for part in url.split("::"):
        result.extend(braceexpand.braceexpand(part))
    return result


def expand_urls(urls: str | Iterable[str]) -> list[str]:
    """Expand a shard spec into a list of URLs.

    A string may hold several specs separated by ``::`` (as webdataset accepts); each is
    brace-expanded (``shard-{000..009}.tar``). An iterable of strings is expanded element
    by element. Unlike webdataset, ``WDS_*`` environment variables are not substituted.
    """
    if isinstance(urls, str):
        return _expand_one(urls)
    result: list[str] = []
    for url in urls:
        if not isinstance(url, str):
            raise TypeError(f"shard URLs must be strings, got {type(url).__name__}: {url!r}")
        result.extend(_expand_one(url))
    return result


def shardlist(
    urls: str | Iterable[str], *, shuffle: bool = False, seed: int | None = None
) -> Iterator[dict[str, str]]:
    """Yield ``dict(url=...)`` for each shard of ``urls`` (see :func:`expand_urls`).

    With ``shuffle=True`` the order is shuffled by ``random.Random(seed)`` (a fixed
    ``seed`` gives a reproducible order), like webdataset's ``SimpleShardList``.
    """
    expanded = expand_urls(urls)
    if shuffle:
        random.Random(seed).shuffle(expanded)
    for url in expanded:
        yield dict(url=url)


# ---------------------------------------------------------------------------
# proxied(): rewriting URLs to go through a shardcache proxy


def _parse_upstreams(upstream: str | Sequence[str] | None) -> list[tuple[str, str]]:
    """Parse ``--upstream`` specs into ``(name, base)`` pairs (name ``""`` for unnamed)."""
    if upstream is None:
        return []
    specs = [upstream] if isinstance(upstream, str) else list(upstream)
    rules: list[tuple[str, str]] = []
    for spec in specs:
        if not isinstance(spec, str):
            raise ProxyURLError(f"upstream: expected a string, got {spec!r}")
        name, sep, rest = spec.partition("=")
        if sep and _NAME_RE.match(name) and _SCHEME_RE.match(rest):
            base = rest
        else:
            name, base = "", spec
        if not _SCHEME_RE.match(base):
            raise ProxyURLError(f"upstream {spec!r}: expected URL or NAME=URL with an absolute URL")
        rules.append((name, base.rstrip("/")))
    names = [n for n, _ in rules]
    if names.count("") > 1:
        raise ProxyURLError(f"upstream: at most one unnamed upstream URL, got {specs!r}")
    return rules


def _proxy_base(proxy: str | None) -> str:
    if proxy is None:
        proxy = os.environ.get(PROXY_ENV)
        if not proxy:
            raise ProxyURLError(f"no proxy given: pass proxy='http://host:port' or set {PROXY_ENV}")
    if not _SCHEME_RE.match(proxy):
        proxy = "http://" + proxy
    if not proxy.lower().startswith(("http://", "https://")):
        raise ProxyURLError(f"proxy {proxy!r}: expected an http:// or https:// address")
    return proxy.rstrip("/")


def _match_rule(url: str, rules: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The upstream rule whose base is the longest prefix of ``url`` (at a ``/``)."""
    best: tuple[str, str] | None = None
    for name, base in rules:
        if url.startswith(base + "/") and (best is None or len(base) > len(best[1])):
            best = (name, base)
    return best


def _not_under(url: str, rules: list[tuple[str, str]]) -> ProxyURLError:
    """The error for an absolute URL under none of the upstreams, when the absolute form
    was not asked for."""
    absolute = (
        "absolute=True for the proxy's absolute-URL form (served only for hosts named "
        "with --allow-host)"
    )
    if not rules:
        return ProxyURLError(
            f"{url!r}: no upstream given; pass the proxy's --upstream values as "
            f"upstream=..., or {absolute}"
        )
    names = ", ".join(f"{name}={ubase}" if name else ubase for name, ubase in rules)
    return ProxyURLError(
        f"{url!r} is under none of the upstreams ({names}); check both for a typo, "
        f"or pass {absolute}"
    )


def _absolute_ok(url: str, absolute: bool | frozenset[str]) -> bool:
    """Whether ``url`` may take the absolute-URL form: always, never, or when its host
    (``host`` or ``host:port``) is one the proxy allows (``--allow-host``)."""
    if isinstance(absolute, bool):
        return absolute
    rest = url.partition("://")[2]
    netloc = rest.split("/", 1)[0].rpartition("@")[2].lower()
    if not url.lower().startswith(("http://", "https://")):
        return False
    return netloc in absolute or netloc.rsplit(":", 1)[0] in absolute


def _map_prefix(
    url: str, base: str, rules: list[tuple[str, str]], absolute: bool | frozenset[str]
) -> str:
    """Map one URL (or the fixed prefix of a pattern) to its proxy URL."""
    rule = _match_rule(url, rules)
    if rule is not None:
        name, ubase = rule
        rest = url[len(ubase) + 1 :]
        if name:
            return f"{base}/{name}/{rest}"
        first = rest.split("/", 1)[0]
        if any(first == n for n, _ in rules if n) or _SCHEME_RE.match(rest):
            # the proxy would read /<first>/... as another upstream's path
            raise ProxyURLError(
                f"{url!r}: its short path /{rest} under upstream {ubase!r} would reach the "
                "proxy as a named upstream's path or an absolute URL; name the upstream"
            )
        return f"{base}/{rest}"
    if _SCHEME_RE.match(url):
        if url.startswith(base + "/"):
            return url  # already a URL of the proxy
        if not _absolute_ok(url, absolute):
            raise _not_under(url, rules)
        return f"{base}/{url}"
    raise ProxyURLError(
        f"{url!r}: only absolute URLs (scheme://host/path) can be proxied (a path is a "
        "local file; for a path on the proxy, write the proxy's URL)"
    )


def _fixed_prefix(pattern: str) -> str:
    """The part of a brace pattern before its first ``{`` or escape: shared by all expansions."""
    cut = len(pattern)
    for ch in "{\\":
        i = pattern.find(ch)
        if i != -1:
            cut = min(cut, i)
    return pattern[:cut]


def _map_pattern(
    pattern: str, base: str, rules: list[tuple[str, str]], absolute: bool | frozenset[str]
) -> str:
    """Rewrite one ``::``-free spec, keeping its braces when the mapping allows it."""
    if "{" not in pattern and "\\" not in pattern:
        return _map_prefix(pattern, base, rules, absolute)
    fixed = _fixed_prefix(pattern)
    # The fixed prefix decides the rule for every expansion only if no upstream base could
    # still match differently once the braces are filled in, and the prefix already shows
    # which rule applies (an upstream base and its "/", or an absolute URL's scheme).
    ambiguous = any(
        (ubase + "/").startswith(fixed) and len(ubase) + 1 > len(fixed) for _, ubase in rules
    )
    rule = _match_rule(fixed, rules)
    decided = rule is not None or _SCHEME_RE.match(fixed)
    if rule is None and not isinstance(absolute, bool) and "/" not in fixed.partition("://")[2]:
        decided = False  # the host is not known before the braces are filled in
    if rule is not None and not rule[0] and any(n for n, _ in rules):
        # an unnamed upstream's short path must not start like a named one: that needs
        # the whole first path segment, which braces may still change
        if "/" not in fixed[len(rule[1]) + 1 :]:
            decided = False
    if decided and not ambiguous:
        if rule is None and not fixed.startswith(base + "/") and not _absolute_ok(fixed, absolute):
            raise _not_under(pattern, rules)
        return _map_prefix(fixed, base, rules, absolute) + pattern[len(fixed) :]
    # Fall back to mapping every expansion (still one string, as a ``::`` list).
    return "::".join(
        _map_prefix(u, base, rules, absolute) for u in braceexpand.braceexpand(pattern)
    )


def proxied(
    urls: str | Sequence[str],
    proxy: str | None = None,
    *,
    upstream: str | Sequence[str] | None = None,
    absolute: bool | Collection[str] = False,
) -> str | list[str]:
    """Rewrite a URL, a list of URLs or a brace pattern to go through a shardcache proxy.

    ``proxy`` is the proxy's address (``http://127.0.0.1:8080``; ``host:port`` is taken as
    http). It defaults to the ``SHARDCACHE_PROXY`` environment variable, read when called.

    ``upstream`` repeats the proxy's ``--upstream`` flags (a string or a list of them), so
    URLs get the proxy's short paths. Without it (and without ``absolute=True``) the
    proxy is asked once for its upstreams and allowed hosts (``GET /-/where``), so
    ``proxied(urls, "http://127.0.0.1:8080")`` maps URLs exactly as the running proxy
    does, and a URL of a host it allows (``--allow-host``) takes the absolute-URL form;
    ``upstream=()`` means no upstream without asking. The mapping:

    - ``URL``: the proxy serves ``/<path>`` from ``URL/<path>``, so
      ``URL/<path>`` becomes ``<proxy>/<path>``;
    - ``NAME=URL``: the proxy serves ``/NAME/<path>`` from ``URL/<path>``, so
      ``URL/<path>`` becomes ``<proxy>/NAME/<path>``.

    The longest matching upstream wins. A URL under none of them raises
    :class:`ProxyURLError` naming the URL and the upstreams (a mistyped upstream would
    otherwise surface later as a 403 from the proxy), unless ``absolute=True`` asks for the
    proxy's absolute-URL form: ``scheme://host/path`` becomes ``<proxy>/scheme://host/path``,
    which the proxy serves only for hosts named with ``--allow-host``; ``absolute`` may
    name those hosts (``host`` or ``host:port``), for the form for them only. ``s3://bucket/key``
    follows the same rules (an upstream may be ``s3://bucket``). A URL of the proxy itself
    is kept as it is. Local paths cannot be proxied (a path names a local file).

    A string stays a string: ``::`` lists keep their parts, and a brace pattern keeps its
    braces when its fixed prefix decides the mapping (otherwise its expansions are listed
    with ``::``). So ``webdataset.WebDataset(proxied("https://h/d/s-{000..009}.tar"))``
    works unmodified. A list gives a list.

    Raises :class:`ProxyURLError` (a ``ValueError``) naming what cannot be rewritten, or
    the proxy that could not be asked for its upstreams.
    """
    base = _proxy_base(proxy)
    allowed = absolute if isinstance(absolute, bool) else frozenset(h.lower() for h in absolute)
    specs = [urls] if isinstance(urls, str) else [u for u in urls if isinstance(u, str)]
    parts = [p for spec in specs for p in spec.split("::")]
    # the proxy is asked only when some URL is neither a local path nor already its own
    ask = any(_SCHEME_RE.match(p) and not p.startswith(base + "/") for p in parts)
    if upstream is None and absolute is False and ask:
        learned, hosts = proxy_upstreams(base)
        rules = _parse_upstreams(learned)
        allowed = frozenset(h.lower() for h in hosts)
    else:
        rules = _parse_upstreams(upstream)
    if isinstance(urls, str):
        return "::".join(_map_pattern(part, base, rules, allowed) for part in urls.split("::"))
    result: list[str] = []
    for url in urls:
        if not isinstance(url, str):
            raise ProxyURLError(f"shard URLs must be strings, got {url!r}")
        result.append("::".join(_map_pattern(p, base, rules, allowed) for p in url.split("::")))
    return result


def proxy_upstreams(proxy: str, timeout: float = 10.0) -> tuple[list[str], list[str]]:
    """The ``--upstream`` values (``NAME=URL`` or ``URL``, without ``user:password@``)
    and ``--allow-host`` values of the proxy at ``proxy``, from its read-only
    ``GET /-/where``. :class:`ProxyURLError` naming the proxy when it cannot be asked."""
    import json
    import urllib.error
    import urllib.request

    base = _proxy_base(proxy)
    try:
        with urllib.request.urlopen(f"{base}/-/where", timeout=timeout) as resp:
            data = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as exc:
        raise ProxyURLError(
            f"the proxy at {base} did not list its upstreams (HTTP {exc.code} from "
            "/-/where: a shardcache older than this library?); pass upstream=[...]"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", exc)
        raise ProxyURLError(
            f"cannot ask the proxy at {base} for its upstreams ({why}); start it, fix "
            f"proxy= (or {PROXY_ENV}), or pass upstream=[...]"
        ) from None
    ups, hosts = data.get("upstreams"), data.get("allow_hosts")
    if not isinstance(ups, list) or not isinstance(hosts, list):
        raise ProxyURLError(f"{base}/-/where: not a shardcache answer (no upstreams list)")
    return [str(u) for u in ups], [str(h) for h in hosts]
