"""The parsers of setting values: each takes the text of one value (for a list setting,
the list of texts) and raises ValueError saying what is wrong with it. The settings
table (:mod:`proxy.settings_table`) names one per setting."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from proxy.credentials import Credential, parse_credential
from proxy.policy import STORE_BASE, Upstream, parse_size
from proxy.setting import _show_size
from proxy.upstream.s3url import parse_s3_url
from shardcache.errors import S3_EXTRA_HINT, BadRequest
from shardcache.store import DEFAULT_MIN_FREE_CAP, DEFAULT_MIN_FREE_FRACTION

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DOMAIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


# --------------------------------------------------------------------------- parsers
# Each takes the text of one value and raises ValueError saying what is wrong with it.


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


MIN_PART_SIZE = 64 * 1024  # smaller parts cost a request each for little data


def _part_size(text: str) -> int:
    value = parse_size(text)
    if 0 < value < MIN_PART_SIZE:
        raise ValueError(f"must be 0 (off) or at least 64KiB (got {text!r})")
    return value


def _on_off(text: str) -> bool:
    t = text.strip().lower()
    if t in ("on", "true", "yes", "1"):
        return True
    if t in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"must be on or off (got {text!r})")


def _cache_dir(text: str) -> Path:
    if not text.strip():
        raise ValueError("must not be empty")
    path = Path(text).expanduser()
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as exc:  # a parent this uid may not search (e.g. /root/cache)
        uid = os.getuid() if hasattr(os, "getuid") else "?"
        raise ValueError(
            f"{text}: cannot look it up ({exc.strerror or exc}); running as uid {uid}: make "
            "its parent directories searchable by this uid, or choose another --cache-dir"
        ) from None
    if is_file:
        raise ValueError(f"{text} exists and is not a directory")
    return path


def _readable_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ValueError(f"{path} is not a readable file")
    return path


def _http_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL with a host (got {text!r})")
    return text


def _split_list(value: str) -> list[str]:
    return [v for v in re.split(r"[,\s]+", value) if v]


def _domains(text: str) -> tuple[str, ...]:
    domains = tuple(d.strip().strip(".").lower() for d in _split_list(text) if d.strip("."))
    for d in domains:
        if not _DOMAIN_RE.match(d):
            raise ValueError(f"not a domain name: {d!r}")
    return domains


def _have(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _parse_upstream(value: str) -> Upstream:
    name: str | None = None
    url = value.strip()
    head, eq, tail = url.partition("=")
    if eq and "/" not in head and ":" not in head:
        name, url = head, tail
        if not _NAME_RE.match(name):
            raise ValueError(f"bad upstream name {name!r} in {value!r}")
    parts = urlsplit(url)
    if url.rstrip("/") == STORE_BASE.rstrip("/"):
        # every bucket of the S3 store, each under its own name: /BUCKET/KEY
        if name is not None:
            raise ValueError(
                f"{value!r}: s3:// (every bucket of the store) is the unnamed upstream; "
                "name one bucket with NAME=s3://BUCKET[/PREFIX]"
            )
        return Upstream(None, STORE_BASE)
    if parts.scheme == "s3":
        try:
            parse_s3_url(url)
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
        if parts.query or parts.fragment:
            raise ValueError(f"{value!r}: no query or fragment allowed")
        return Upstream(name, url.rstrip("/"))
    if parts.scheme in ("gs", "az"):
        from proxy.upstream.cloudurl import parse_cloud_url

        try:
            parse_cloud_url(url)
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
        if parts.query or parts.fragment:
            raise ValueError(f"{value!r}: no query or fragment allowed")
        return Upstream(name, url.rstrip("/"))
    if parts.scheme not in ("http", "https", "file"):
        raise ValueError(
            f"{value!r}: scheme must be http, https, file, s3, gs or az (got {parts.scheme!r})"
        )
    if parts.scheme in ("http", "https") and not parts.hostname:
        raise ValueError(f"{value!r}: no host")
    if parts.scheme == "file" and not parts.path.startswith("/"):
        raise ValueError(f"{value!r}: file URLs need an absolute path")
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r}: no query or fragment allowed")
    return Upstream(name, url.rstrip("/"))


def _upstreams(values: list[str]) -> tuple[Upstream, ...]:
    upstreams = tuple(_parse_upstream(v) for v in values)
    names = [u.name for u in upstreams]
    if names.count(None) > 1:
        raise ValueError("only one upstream may be unnamed; name the others NAME=URL")
    dup = {n for n in names if n is not None and names.count(n) > 1}
    if dup:
        raise ValueError(f"upstream name used twice: {sorted(dup)[0]}")
    if any(u.base.startswith("s3://") for u in upstreams) and not _have("aiobotocore"):
        raise ValueError(f"s3:// upstreams need aiobotocore: {S3_EXTRA_HINT}")
    if any(u.base.startswith(("gs://", "az://")) for u in upstreams) and not _have("obstore"):
        raise ValueError("gs:// and az:// upstreams need obstore: pip install '.[cloud]'")
    return upstreams


# the Hugging Face Hub's API (repository info, trees, paths-info): JSON that changes when a
# branch moves, never an object to keep (see proxy.passthrough)
DEFAULT_UNCACHED_PATHS: tuple[str, ...] = ("api/*",)
# the uncached paths a POST is forwarded to: the Hub's paths-info (a read, sent as a form)
DEFAULT_UNCACHED_POST_PATHS: tuple[str, ...] = ("api/*/paths-info/*",)


def _patterns(values: list[str] | str) -> tuple[str, ...]:
    items = _split_list(values) if isinstance(values, str) else values
    out = tuple(p.strip().lstrip("/") for p in items if p.strip())
    for p in out:
        if any(c in p for c in "?#\x00"):
            raise ValueError(f"a path pattern has no query or control characters: {p!r}")
    return out


def _redirect_hosts(values: list[str] | str) -> tuple[str, ...]:
    items = _split_list(values) if isinstance(values, str) else values
    hosts = tuple(h.strip().lower() for h in items if h.strip())
    for h in hosts:
        if not _DOMAIN_RE.match(h.removeprefix("*.")) and not _is_ip(h.strip("[]")):
            raise ValueError(f"not a host name, *.DOMAIN pattern or IP address: {h!r}")
    return hosts


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _credential_list(values: list[str] | str, bearer: bool) -> tuple[Credential, ...]:
    items = [v for v in re.split(r"[\s]+", values) if v] if isinstance(values, str) else values
    return tuple(parse_credential(v, bearer=bearer) for v in items)


def _bearer_credentials(values: list[str] | str) -> tuple[Credential, ...]:
    return _credential_list(values, bearer=True)


def _header_credentials(values: list[str] | str) -> tuple[Credential, ...]:
    return _credential_list(values, bearer=False)


def _upstream_names(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for v in values if v.strip())


def _hosts(values: list[str]) -> tuple[str, ...]:
    return tuple(h.lower() for h in values)


def _min_free_default() -> str:
    return f"{DEFAULT_MIN_FREE_FRACTION * 100:g}%, at most {_show_size(DEFAULT_MIN_FREE_CAP)}"
