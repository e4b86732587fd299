"""Settings of the proxy: one table, :data:`SETTINGS`, declares each setting once.

A :class:`Setting` gives the field of :class:`Settings`, its flag (``--cache-size``), its
environment variable (``SHARDCACHE_CACHE_SIZE``), how a value is parsed and bounded, its
default and its help. Everything else is derived from the table: the ``serve`` flags
(help with the default and the variable appended), the reading of the environment and of
a ``--config`` TOML file, the defaults of :class:`Settings`, and docs/configuration.md.

Settings are read once, at startup. Precedence: flag > environment variable > config
file > default. A bad value raises :class:`~shardcache.errors.ConfigError` naming the
flag; checks that involve several settings live in :func:`_check_together`.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import re
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from proxy.credentials import Credential, parse_credential
from proxy.policy import (
    DEFAULT_REDIRECT_HOSTS,
    Upstream,
    parse_bound,
    parse_min_free,
    parse_revalidate,
    parse_size,
)
from proxy.upstream.options import DEFAULT_OPTIONS as UPSTREAM
from proxy.upstream.s3url import parse_s3_url
from shardcache.errors import S3_EXTRA_HINT, BadRequest, ConfigError
from shardcache.store import (
    DEFAULT_MIN_FREE_CAP,
    DEFAULT_MIN_FREE_FRACTION,
    DEFAULT_POLICY,
    POLICIES,
)

__all__ = [
    "CONFIG_FILE",
    "DEFAULTS",
    "ENV_PREFIX",
    "SETTINGS",
    "SIZE_UNITS",
    "Setting",
    "Settings",
    "add_serve_arguments",
    "parse_settings",
    "settings_from_args",
    "tls_context",
]

ENV_PREFIX = "SHARDCACHE_"
EVICTION_POLICIES = POLICIES  # the store's
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SIZE_UNITS = (
    "Sizes are bytes, or a number with a unit: K, M, G, T, P are powers of 1000 "
    "(G = 10^9 bytes), KiB, MiB, GiB, TiB, PiB powers of 1024 (GiB = 2^30 bytes); "
    "the B and the case are optional, so 500G, 1.5T and 10MiB all work. A bound without "
    "a unit below 1 MiB (--cache-size 10) is refused as a forgotten unit; write 10B for bytes."
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DOMAIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Setting:
    """One setting: the single place its name, flag, variable, parser and default live.

    ``parse`` turns the text of a value (for a ``many`` setting: the list of texts) into
    the value, raising ValueError with a message; ``choices`` (compared in lower case),
    ``minimum`` and ``maximum`` are checked after it. ``flag=None`` marks a setting that
    only code sets (tests, embedding): no flag, no variable, no file key.
    """

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any] = str
    flag: str | None = ""  # "": "--" + name with dashes
    env: str = ""  # "": ENV_PREFIX + NAME
    metavar: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    many: bool = False  # a list: repeatable flag; comma or space separated elsewhere
    split_flag: bool = True  # a many setting: split each flag value on commas too
    required: bool = False
    none_means: str = ""  # what a default of None does, for the help
    show: Callable[[Any], str] | None = None  # how the default reads in the help

    def __post_init__(self) -> None:
        if self.flag == "":
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))
        if self.env == "" and self.flag is not None:
            object.__setattr__(self, "env", ENV_PREFIX + self.name.upper())

    def default_text(self) -> str:
        """The default as the help and the docs show it; "" when there is none."""
        if self.required:
            return "required"
        if self.default is None:
            return self.none_means
        if self.show is not None:
            return self.show(self.default)
        return _show(self.default)

    def meaning(self) -> str:
        """The help text with the accepted choices, as plain text."""
        if self.choices:
            return f"{self.help} (one of {', '.join(self.choices)})"
        return self.help

    def help_line(self) -> str:
        """The ``--help`` text: the meaning, the default and the variable."""
        notes = [f"one of {', '.join(self.choices)}"] if self.choices else []
        default = self.default_text()
        if default:
            notes.append(default if self.required else f"default {default}")
        text = self.help + (f" ({'; '.join(notes)})" if notes else "")
        return text + f" [env {self.env}" + (", comma or space separated]" if self.many else "]")

    def convert(self, raw: Any, source: str = "") -> Any:
        """The value of ``raw`` (text, or a list of texts), checked; ConfigError naming
        the flag (and ``source``, where the value came from, when not the command line)."""
        where = f" (from {source})" if source else ""
        flag = self.flag or self.name
        if self.choices:
            value = str(raw).strip().lower()
            if value not in self.choices:
                raise ConfigError(
                    flag, f"must be one of {', '.join(self.choices)} (got {raw!r}){where}"
                )
            return value
        try:
            value = self.parse(raw)
        except ValueError as exc:
            raise ConfigError(flag, f"{exc}{where}") from None
        if self.minimum is not None and not value >= self.minimum:
            raise ConfigError(flag, f"must be at least {self.minimum:g} (got {raw!r}){where}")
        if self.maximum is not None and not value <= self.maximum:
            raise ConfigError(flag, f"must be at most {self.maximum:g} (got {raw!r}){where}")
        return value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ", ".join(map(str, value))
    return str(value)


def _show_size(n: int) -> str:
    """``100G`` for 100 * 10^9, ``8MiB`` for 8 * 2^20: how a size default reads."""
    for i in range(6, 0, -1):
        if n and n % 1000**i == 0:
            return f"{n // 1000**i}{'KMGTPE'[i - 1]}"
        if n and n % 1024**i == 0:
            return f"{n // 1024**i}{'KMGTPE'[i - 1]}iB"
    return str(n)


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


def _redirect_hosts(values: list[str] | str) -> tuple[str, ...]:
    items = _split_list(values) if isinstance(values, str) else values
    hosts = tuple(h.strip().lower() for h in items if h.strip())
    for h in hosts:
        if not _DOMAIN_RE.match(h.removeprefix("*.")) and not _is_ip(h.strip("[]")):
            raise ValueError(f"not a host name, *.DOMAIN pattern or IP address: {h!r}")
    return hosts


# the Hugging Face Hub's API (repository info, trees, paths-info): JSON that changes when a
# branch moves, never an object to keep (see proxy.passthrough)
DEFAULT_UNCACHED_PATHS: tuple[str, ...] = ("api/*",)


def _patterns(values: list[str] | str) -> tuple[str, ...]:
    items = _split_list(values) if isinstance(values, str) else values
    out = tuple(p.strip().lstrip("/") for p in items if p.strip())
    for p in out:
        if any(c in p for c in "?#\x00"):
            raise ValueError(f"a path pattern has no query or control characters: {p!r}")
    return out


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


def _hosts(values: list[str]) -> tuple[str, ...]:
    return tuple(h.lower() for h in values)


def _min_free_default() -> str:
    return f"{DEFAULT_MIN_FREE_FRACTION * 100:g}%, at most {_show_size(DEFAULT_MIN_FREE_CAP)}"


# The order here is the order of ``serve --help`` and of docs/configuration.md.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "upstreams",
        (),
        "upstream base URL (http, https, file, s3, gs, az); NAME=URL mounts it under /NAME/; repeatable",
        _upstreams,
        flag="--upstream",
        env=ENV_PREFIX + "UPSTREAM",
        metavar="[NAME=]URL",
        many=True,
        split_flag=False,
    ),
    Setting(
        "allow_hosts",
        (),
        "host that /http(s)://HOST/... may fetch from; repeatable",
        _hosts,
        flag="--allow-host",
        env=ENV_PREFIX + "ALLOW_HOST",
        metavar="HOST[:PORT]",
        many=True,
    ),
    Setting(
        "redirect_hosts",
        DEFAULT_REDIRECT_HOSTS,
        "host an upstream may redirect to besides its own (redirects are followed inside "
        "the proxy; *.DOMAIN matches its subdomains; link-local and metadata addresses only "
        "when named exactly); repeatable",
        _redirect_hosts,
        flag="--redirect-host",
        env=ENV_PREFIX + "REDIRECT_HOSTS",
        metavar="HOST",
        many=True,
    ),
    Setting("max_redirects", 5, "upstream redirects followed for one request", _int, minimum=0),
    Setting(
        "uncached_paths",
        DEFAULT_UNCACHED_PATHS,
        "path under an upstream that is an API, not objects (a shell pattern relative to the "
        "upstream; * crosses /): forwarded for every request with GET, HEAD or POST and "
        "never cached; the default is the Hugging Face Hub's API; repeatable",
        _patterns,
        flag="--uncached-path",
        env=ENV_PREFIX + "UNCACHED_PATHS",
        metavar="PATTERN",
        many=True,
    ),
    Setting(
        "strip_signatures",
        "auto",
        "cache key of a signed URL (AWS, CloudFront, GCS, Azure SAS): on drops its signature "
        "and expiry parameters, so the same object signed afresh is a hit (the request "
        "still uses the URL given) and anyone who can reach the proxy reads what it cached "
        "without a valid signature; auto: on when listening on loopback only",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "upstream_auth",
        (),
        "bearer token sent to an http(s) upstream (NAME: a named upstream's; none: the "
        "unnamed one's), read from env:VARIABLE or file:PATH (re-read when it changes), "
        "never logged, never sent to another host; repeatable",
        _bearer_credentials,
        metavar="[NAME=]env:VAR|file:PATH",
        many=True,
        split_flag=False,
    ),
    Setting(
        "upstream_headers",
        (),
        "a header sent to an http(s) upstream, its value read from env:VARIABLE or "
        "file:PATH, as for --upstream-auth; repeatable",
        _header_credentials,
        flag="--upstream-header",
        env=ENV_PREFIX + "UPSTREAM_HEADERS",
        metavar="[NAME=]HEADER:env:VAR|file:PATH",
        many=True,
        split_flag=False,
    ),
    Setting("cache_dir", None, "directory of the on-disk store", _cache_dir, required=True),
    Setting(
        "cache_size",
        100 * 1000**3,
        "bound on cached bytes, e.g. 500G (G = 10^9 bytes), 1.5T, 10GiB (GiB = 2^30 bytes); "
        "a number without a unit below 1MiB is refused as a forgotten unit",
        parse_bound,
        minimum=1,
        show=_show_size,
    ),
    Setting("host", "127.0.0.1", "address to listen on"),
    Setting("port", 8080, "port to listen on; 0 picks a free one", _int, minimum=0, maximum=65535),
    Setting(
        "workers",
        1,
        "processes serving the port, one store; a miss still costs one upstream GET",
        _int,
        minimum=1,
        maximum=64,
    ),
    Setting("admin_token", None, "bearer token required by mutating admin routes"),
    Setting("log_level", "info", "lowest level of the messages logged", choices=LOG_LEVELS),
    Setting(
        "eviction",
        DEFAULT_POLICY,
        "what makes room once the cache is full: evict the least recently used or the "
        "oldest entries, or keep them all and stop admitting new ones",
        choices=EVICTION_POLICIES,
    ),
    Setting(
        "min_free",
        None,
        "space always kept free on the cache filesystem: bytes (2G) or a percentage (10%)",
        parse_min_free,
        none_means=_min_free_default(),
    ),
    Setting(
        "revalidate",
        None,
        "never (shards are immutable), always, or an age such as 10m after which a hit asks "
        "the upstream whether it changed",
        parse_revalidate,
        none_means="never",
    ),
    Setting(
        "store_probe_interval",
        5.0,
        "seconds between checks whether an unwritable store takes writes again",
        _float,
        minimum=0.05,
    ),
    Setting(
        "connect_timeout",
        UPSTREAM.connect_timeout,
        "upstream connect timeout, seconds",
        _float,
        minimum=0.001,
    ),
    Setting(
        "read_timeout",
        UPSTREAM.read_timeout,
        "upstream idle read timeout, seconds",
        _float,
        minimum=0.001,
    ),
    Setting(
        "retries",
        UPSTREAM.retries,
        "resume attempts after an upstream fails mid-body",
        _int,
        minimum=0,
    ),
    Setting("grace_period", 30.0, "seconds to let responses finish on SIGTERM", _float, minimum=0),
    Setting(
        "max_path_length",
        8000,
        "longest accepted request path and query (presigned URLs with a session token "
        "take 1,500 characters and more)",
        _int,
        minimum=16,
    ),
    Setting(
        "prefetch_concurrency",
        4,
        "parallel background downloads for read plans and prefetch",
        _int,
        minimum=1,
    ),
    Setting(
        "plan_ttl",
        600.0,
        "seconds a read plan lives after its reader's last request",
        _float,
        minimum=1,
    ),
    Setting(
        "plan_lookahead",
        8,
        "shards a read plan keeps downloading ahead of its reader, at most",
        _int,
        minimum=1,
    ),
    Setting("max_plans", 64, "read plans registered at once, at most", _int, minimum=1),
    Setting(
        "max_plan_shards",
        100_000,
        "shards in one read plan, at most (a plan costs about 250 bytes of memory a shard)",
        _int,
        minimum=1,
    ),
    Setting(
        "part_size",
        UPSTREAM.part_size,
        "ranged part size for large objects, e.g. 8MiB; at least 64KiB, 0 disables",
        _part_size,
        show=_show_size,
    ),
    Setting("parallel", UPSTREAM.parallel, "concurrent ranged parts per object", _int, minimum=1),
    Setting(
        "http_parts",
        UPSTREAM.http_parts,
        "on: also fetch large http(s) shards in parallel ranged parts (s3:// always are); "
        "for origins that limit each connection",
        _on_off,
    ),
    Setting(
        "cold_range",
        "fast",
        "a Range starting 4 MiB or more into an object neither cached nor downloading, "
        "over one stream: fast answers it from a ranged upstream GET beside the object's "
        "download (first byte at ranged-GET latency; the range's bytes cross the network "
        "twice, counted in shardcache_upstream_extra_bytes_total), once from the download "
        "when it reaches the range (every byte once; the wait is the bytes before it). "
        "fast by default: a reader seeking into a cold shard (a tar index, a resumed "
        "transfer) is not held up by the whole prefix, and the extra bytes are the "
        "range's only. With parts (s3://, --http-parts on) either way the download "
        "fetches the part holding the range first and no byte crosses twice",
        choices=("fast", "once"),
    ),
    Setting(
        "http_transport",
        UPSTREAM.http_transport,
        "how one http(s) stream is received: threads receives on blocking sockets in "
        "worker threads and splices into the file, aiohttp on the event loop",
        choices=("threads", "aiohttp"),
    ),
    Setting(
        "s3_endpoint_url",
        None,
        "S3-compatible endpoint for s3:// upstreams",
        _http_url,
        none_means="AWS",
    ),
    Setting("s3_region", None, "S3 region", none_means="from the AWS config"),
    Setting("s3_profile", None, "AWS shared-config profile for s3:// upstreams"),
    Setting(
        "gcs_endpoint_url",
        None,
        "Google Cloud Storage endpoint for gs:// upstreams (an emulator)",
        _http_url,
        none_means="storage.googleapis.com",
    ),
    Setting(
        "azure_endpoint_url",
        None,
        "Azure Blob endpoint for az:// upstreams; {account} stands for the URL's account "
        "(Azurite: http://127.0.0.1:10000/{account})",
        _http_url,
        none_means="https://{account}.blob.core.windows.net",
    ),
    Setting("s3_front_access_key", None, "access key S3 clients must sign with"),
    Setting("s3_front_secret_key", None, "secret key S3 clients must sign with"),
    Setting(
        "s3_domains",
        ("localhost",),
        "domains under which the S3 front answers virtual-hosted requests (Host: "
        "BUCKET.DOMAIN), comma separated",
        _domains,
        flag="--s3-domain",
    ),
    Setting("tls_cert", None, "PEM certificate chain: serve HTTPS instead of HTTP", _readable_file),
    Setting("tls_key", None, "PEM private key of --tls-cert", _readable_file),
    # set by code only (tests, benchmarks)
    Setting(
        "retry_backoff",
        UPSTREAM.retry_backoff,
        "first pause between upstream retries, seconds",
        _float,
        flag=None,
    ),
    Setting(
        "chunk_size", UPSTREAM.chunk_size, "bytes read from an upstream at a time", _int, flag=None
    ),
)

CONFIG_FILE = Setting(
    "config",
    None,
    'TOML file of settings keyed by setting name: cache_size = "500G", upstreams = '
    '["http://a"], allow_hosts, s3_domains...; flags and environment variables win over it',
    _readable_file,
    metavar="FILE.toml",
)

BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {s.name: s.default for s in SETTINGS if not s.required}
)


@dataclass(frozen=True)
class Settings:
    """Everything the proxy needs to know, validated. Defaults come from :data:`SETTINGS`."""

    cache_dir: Path
    upstreams: tuple[Upstream, ...] = DEFAULTS["upstreams"]
    cache_size: int = DEFAULTS["cache_size"]
    host: str = DEFAULTS["host"]
    port: int = DEFAULTS["port"]
    admin_token: str | None = DEFAULTS["admin_token"]
    allow_hosts: tuple[str, ...] = DEFAULTS["allow_hosts"]
    redirect_hosts: tuple[str, ...] = DEFAULTS["redirect_hosts"]
    max_redirects: int = DEFAULTS["max_redirects"]
    uncached_paths: tuple[str, ...] = DEFAULTS["uncached_paths"]
    strip_signatures: str = DEFAULTS["strip_signatures"]
    upstream_auth: tuple[Credential, ...] = DEFAULTS["upstream_auth"]
    upstream_headers: tuple[Credential, ...] = DEFAULTS["upstream_headers"]
    log_level: str = DEFAULTS["log_level"]
    eviction: str = DEFAULTS["eviction"]
    connect_timeout: float = DEFAULTS["connect_timeout"]
    read_timeout: float = DEFAULTS["read_timeout"]
    retries: int = DEFAULTS["retries"]
    retry_backoff: float = DEFAULTS["retry_backoff"]
    grace_period: float = DEFAULTS["grace_period"]
    max_path_length: int = DEFAULTS["max_path_length"]
    prefetch_concurrency: int = DEFAULTS["prefetch_concurrency"]
    plan_ttl: float = DEFAULTS["plan_ttl"]
    plan_lookahead: int = DEFAULTS["plan_lookahead"]
    max_plans: int = DEFAULTS["max_plans"]
    max_plan_shards: int = DEFAULTS["max_plan_shards"]
    chunk_size: int = DEFAULTS["chunk_size"]
    part_size: int = DEFAULTS["part_size"]
    parallel: int = DEFAULTS["parallel"]
    http_parts: bool = DEFAULTS["http_parts"]
    cold_range: str = DEFAULTS["cold_range"]
    http_transport: str = DEFAULTS["http_transport"]
    s3_endpoint_url: str | None = DEFAULTS["s3_endpoint_url"]
    s3_region: str | None = DEFAULTS["s3_region"]
    s3_profile: str | None = DEFAULTS["s3_profile"]
    gcs_endpoint_url: str | None = DEFAULTS["gcs_endpoint_url"]
    azure_endpoint_url: str | None = DEFAULTS["azure_endpoint_url"]
    s3_front_access_key: str | None = DEFAULTS["s3_front_access_key"]
    s3_front_secret_key: str | None = DEFAULTS["s3_front_secret_key"]
    s3_domains: tuple[str, ...] = DEFAULTS["s3_domains"]
    tls_cert: Path | None = DEFAULTS["tls_cert"]
    tls_key: Path | None = DEFAULTS["tls_key"]
    min_free: int | float | None = DEFAULTS["min_free"]  # bytes, a fraction, or None
    revalidate: float | None = DEFAULTS["revalidate"]  # None: never; 0: always; else max age
    store_probe_interval: float = DEFAULTS["store_probe_interval"]
    workers: int = DEFAULTS["workers"]


# --------------------------------------------------------------------------- reading


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a flag for each setting of the table; defaults are None so that environment
    variables and the config file can fill in."""
    # A value such as -5G would otherwise be taken for an unknown option, and the error
    # ("expected one argument") would hide the real one; no serve flag starts with a digit.
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\.?\d")
    for s in (CONFIG_FILE, *SETTINGS):
        if s.flag is None:
            continue
        parser.add_argument(
            s.flag,
            dest=s.name,
            default=None,
            metavar=s.metavar,
            action="append" if s.many else "store",
            help=s.help_line().replace("%", "%%"),  # argparse %-formats help
        )


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _file_text(s: Setting, value: Any) -> Any:
    """A TOML value as the text (or list of texts) a flag would give."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value] if s.many else ",".join(map(str, value))
    raise ConfigError(s.flag or s.name, f"expected a string, a number or a list (got {value!r})")


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings of a TOML file, by name; ConfigError for a file that cannot be read
    or a key that names no setting."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(
                "--config", "reading TOML needs Python 3.11 or the tomli package"
            ) from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None
    known = [s.name for s in SETTINGS if s.flag is not None]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(key, f"not a setting (in {path}){hint}")
    return data


def _given(
    s: Setting,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    file: Mapping[str, Any],
    file_name: str,
) -> tuple[Any, str] | None:
    """The raw value of ``s`` and where it came from, by precedence; None if not given."""
    value = getattr(args, s.name, None)
    if s.many and value:
        items: list[str] = []
        for v in value:
            items.extend(_split_list(v) if s.split_flag else [v])
        return items, ""
    if not s.many and value is not None:
        return value, ""
    value = environ.get(s.env) if s.env else None
    if not _blank(value):
        return (_split_list(value) if s.many else value), s.env  # type: ignore[arg-type]
    if s.name in file and not _blank(file[s.name]):
        text = _file_text(s, file[s.name])
        if s.many and isinstance(text, str):
            text = _split_list(text)
        return text, file_name
    return None


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The server-side TLS context of ``--tls-cert``/``--tls-key`` (TLS 1.2 or later), or
    None to serve plain HTTP. ConfigError naming ``--tls-cert`` when the pair cannot be
    loaded (a file replaced or unreadable since the settings were checked)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # never ask a terminal for a passphrase: an encrypted key is an error
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            "--tls-cert",
            f"cannot load the certificate {settings.tls_cert} with the key {settings.tls_key} "
            f"(PEM, the key unencrypted and matching the certificate): {exc}",
        ) from None
    return ctx


def _check_together(s: Settings) -> None:
    """The checks that involve more than one setting."""
    if not s.upstreams and not s.allow_hosts:
        raise ConfigError("--upstream", "at least one upstream is required (or --allow-host)")
    if (s.tls_cert is None) != (s.tls_key is None):
        raise ConfigError("--tls-key", "give both --tls-cert and --tls-key, or neither")
    tls_context(s)  # loads the pair once, to fail here rather than when listening
    for flag, creds in (
        ("--upstream-auth", s.upstream_auth),
        ("--upstream-header", s.upstream_headers),
    ):
        for c in creds:
            ups = [u for u in s.upstreams if u.name == c.upstream]
            if not ups:
                names = ", ".join(u.name or "(unnamed)" for u in s.upstreams) or "none"
                raise ConfigError(
                    flag, f"{c}: no upstream named {c.upstream or '(unnamed)'} (upstreams: {names})"
                )
            if not ups[0].base.startswith(("http://", "https://")):
                raise ConfigError(flag, f"{c}: only http(s) upstreams take these credentials")
            try:
                c.source.check()
            except ValueError as exc:
                raise ConfigError(flag, f"{c}: {exc}") from None
    if s.s3_front_access_key and not s.s3_front_secret_key:
        raise ConfigError("--s3-front-secret-key", "required with --s3-front-access-key")
    if s.s3_front_secret_key and not s.s3_front_access_key:
        raise ConfigError("--s3-front-access-key", "required with --s3-front-secret-key")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Build validated Settings from parsed flags, falling back to ``environ``, then to the
    ``--config`` file (or ``SHARDCACHE_CONFIG``), then to the table's defaults."""
    file: Mapping[str, Any] = {}
    file_name = ""
    config = _given(CONFIG_FILE, args, environ, {}, "")
    if config is not None:
        path = CONFIG_FILE.convert(*config)
        file, file_name = read_config_file(path), str(path)
    kw: dict[str, Any] = {}
    for s in SETTINGS:
        given = _given(s, args, environ, file, file_name)
        if given is not None:
            kw[s.name] = s.convert(*given)
        elif s.required:
            raise ConfigError(s.flag or s.name, f"required (or set {s.env})")
    settings = Settings(**kw)
    _check_together(settings)
    return settings


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Parse ``serve`` flags (without the subcommand) into Settings; for tests and embedding."""
    parser = argparse.ArgumentParser(prog="shardcache serve", exit_on_error=False)
    add_serve_arguments(parser)
    try:
        args = parser.parse_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ConfigError(exc.argument_name or "serve", exc.message) from None
    return settings_from_args(args, os.environ if environ is None else environ)


def configure_logging(level: str) -> None:
    """Set up plain logging to stderr at ``level``."""
    from proxy.logs import Formatter  # the time of a line made once a second

    handler = logging.StreamHandler()
    handler.setFormatter(Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
