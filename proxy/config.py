"""Settings of the proxy: parsed once at startup from flags and ``SHARDCACHE_*`` variables.

Every flag has an environment variable named after it (``--cache-size`` ↔
``SHARDCACHE_CACHE_SIZE``); a flag given on the command line wins over the variable. A
bad value raises :class:`~shardcache.errors.ConfigError` naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from proxy.policy import Upstream, parse_min_free, parse_revalidate, parse_size
from proxy.upstream.s3url import parse_s3_url
from shardcache.errors import BadRequest, ConfigError

__all__ = ["Settings", "add_serve_arguments", "settings_from_args", "parse_settings", "ENV_PREFIX"]

ENV_PREFIX = "SHARDCACHE_"
EVICTION_POLICIES = ("lru", "fifo", "keep")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DOMAIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class Settings:
    """Everything the proxy needs to know, validated."""

    cache_dir: Path
    upstreams: tuple[Upstream, ...] = ()
    cache_size: int = 100 * 1000**3
    host: str = "127.0.0.1"
    port: int = 8080
    admin_token: str | None = None
    allow_hosts: tuple[str, ...] = ()
    log_level: str = "info"
    eviction: str = "lru"
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    retries: int = 3
    retry_backoff: float = 0.5
    grace_period: float = 30.0
    max_path_length: int = 1024
    prefetch_concurrency: int = 4
    plan_ttl: float = 600.0
    plan_lookahead: int = 8
    max_plans: int = 64
    max_plan_shards: int = 1_000_000
    chunk_size: int = 1 << 20
    part_size: int = 8 * 1024 * 1024
    parallel: int = 8
    http_parts: bool = False
    http_transport: str = "threads"
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_profile: str | None = None
    s3_front_access_key: str | None = None
    s3_front_secret_key: str | None = None
    s3_domains: tuple[str, ...] = ("localhost",)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    min_free: int | float | None = None  # bytes, a fraction, or None: 5%, at most 1 GiB
    revalidate: float | None = None  # None: never (immutable); 0: always; else max age s
    store_probe_interval: float = 5.0
    workers: int = 1


# (flag, dest, help, default-as-text or None)
_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("--cache-dir", "cache_dir", "directory of the on-disk store (required)"),
    ("--cache-size", "cache_size", "bound on cached bytes, e.g. 500G, 1.5T, 10MiB (default 100G)"),
    ("--host", "host", "address to listen on (default 127.0.0.1)"),
    ("--port", "port", "port to listen on; 0 picks a free one (default 8080)"),
    (
        "--workers",
        "workers",
        "processes serving the port, one store; a miss still costs one upstream GET (default 1)",
    ),
    ("--admin-token", "admin_token", "bearer token required by mutating admin routes"),
    ("--log-level", "log_level", "debug, info, warning, error (default info)"),
    ("--eviction", "eviction", "lru, fifo or keep (stop admitting once full) (default lru)"),
    (
        "--min-free",
        "min_free",
        "space always kept free on the cache filesystem: bytes (2G) or a percentage (10%%) "
        "(default 5%%, at most 1GiB)",
    ),
    (
        "--revalidate",
        "revalidate",
        "never (shards are immutable), always, or an age such as 10m after which a hit asks "
        "the upstream whether it changed (default never)",
    ),
    (
        "--store-probe-interval",
        "store_probe_interval",
        "seconds between checks whether an unwritable store takes writes again (default 5)",
    ),
    ("--connect-timeout", "connect_timeout", "upstream connect timeout, seconds (default 10)"),
    ("--read-timeout", "read_timeout", "upstream idle read timeout, seconds (default 60)"),
    ("--retries", "retries", "resume attempts after an upstream fails mid-body (default 3)"),
    ("--grace-period", "grace_period", "seconds to let responses finish on SIGTERM (default 30)"),
    ("--max-path-length", "max_path_length", "longest accepted request path (default 1024)"),
    (
        "--prefetch-concurrency",
        "prefetch_concurrency",
        "parallel background downloads for read plans and prefetch (default 4)",
    ),
    (
        "--plan-ttl",
        "plan_ttl",
        "seconds a read plan lives after its reader's last request (default 600)",
    ),
    (
        "--plan-lookahead",
        "plan_lookahead",
        "shards a read plan keeps downloading ahead of its reader, at most (default 8)",
    ),
    ("--max-plans", "max_plans", "read plans registered at once, at most (default 64)"),
    ("--max-plan-shards", "max_plan_shards", "shards in one read plan, at most (default 1000000)"),
    (
        "--part-size",
        "part_size",
        "ranged part size for large objects, e.g. 8MiB; 0 disables (default 8MiB)",
    ),
    ("--parallel", "parallel", "concurrent ranged parts per object (default 8)"),
    (
        "--http-parts",
        "http_parts",
        "on: also fetch large http(s) shards in parallel ranged parts (s3:// always are); "
        "for origins that limit each connection (default off)",
    ),
    (
        "--http-transport",
        "http_transport",
        "how one http(s) stream is received: threads (blocking sockets in worker threads, "
        "spliced into the file) or aiohttp (on the event loop) (default threads)",
    ),
    (
        "--s3-endpoint-url",
        "s3_endpoint_url",
        "S3-compatible endpoint for s3:// upstreams (default AWS)",
    ),
    ("--s3-region", "s3_region", "S3 region (default from the AWS config)"),
    ("--s3-profile", "s3_profile", "AWS shared-config profile for s3:// upstreams"),
    ("--s3-front-access-key", "s3_front_access_key", "access key S3 clients must sign with"),
    ("--s3-front-secret-key", "s3_front_secret_key", "secret key S3 clients must sign with"),
    (
        "--s3-domain",
        "s3_domains",
        "domains under which the S3 front answers virtual-hosted requests (Host: "
        "BUCKET.DOMAIN), comma separated (default localhost)",
    ),
    ("--tls-cert", "tls_cert", "PEM certificate chain: serve HTTPS instead of HTTP"),
    ("--tls-key", "tls_key", "PEM private key of --tls-cert"),
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the proxy's flags; defaults are None so environment variables can fill in."""
    parser.add_argument(
        "--upstream",
        action="append",
        default=None,
        metavar="[NAME=]URL",
        help="upstream base URL (http, https, file, s3); NAME=URL mounts it under /NAME/; "
        "repeatable (env SHARDCACHE_UPSTREAM, comma or space separated)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="HOST[:PORT]",
        help="host that /http(s)://HOST/... may fetch from; repeatable",
    )
    for flag, dest, help_text in _OPTIONS:
        env = ENV_PREFIX + dest.upper()
        parser.add_argument(flag, dest=dest, default=None, help=f"{help_text} [env {env}]")


def _have(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _split_list(value: str) -> list[str]:
    return [v for v in re.split(r"[,\s]+", value) if v]


def _parse_upstream(value: str) -> Upstream:
    name: str | None = None
    url = value.strip()
    head, eq, tail = url.partition("=")
    if eq and "/" not in head and ":" not in head:
        name, url = head, tail
        if not _NAME_RE.match(name):
            raise ConfigError("--upstream", f"bad upstream name {name!r} in {value!r}")
    parts = urlsplit(url)
    if parts.scheme == "s3":
        try:
            parse_s3_url(url)
        except BadRequest as exc:
            raise ConfigError("--upstream", str(exc)) from None
        if parts.query or parts.fragment:
            raise ConfigError("--upstream", f"{value!r}: no query or fragment allowed")
        return Upstream(name, url.rstrip("/"))
    if parts.scheme not in ("http", "https", "file"):
        raise ConfigError(
            "--upstream",
            f"{value!r}: scheme must be http, https, file or s3 (got {parts.scheme!r})",
        )
    if parts.scheme in ("http", "https") and not parts.hostname:
        raise ConfigError("--upstream", f"{value!r}: no host")
    if parts.scheme == "file" and not parts.path.startswith("/"):
        raise ConfigError("--upstream", f"{value!r}: file URLs need an absolute path")
    if parts.query or parts.fragment:
        raise ConfigError("--upstream", f"{value!r}: no query or fragment allowed")
    return Upstream(name, url.rstrip("/"))


def _number(flag: str, text: str, kind: type, minimum: float) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(flag, f"not a number: {text!r}") from None
    if not value >= minimum or value == float("inf"):
        raise ConfigError(flag, f"must be at least {minimum} (got {text!r})")
    return value


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Build validated Settings from parsed flags, falling back to ``environ``."""

    def get(dest: str) -> str | None:
        value = getattr(args, dest, None)
        if value is None:
            value = environ.get(ENV_PREFIX + dest.upper())
            if value is not None and value.strip() == "":
                value = None
        return value

    def get_list(dest: str) -> list[str]:
        value = getattr(args, dest, None)
        if value:
            out: list[str] = []
            for v in value:
                out.extend(_split_list(v) if dest == "allow_host" else [v])
            return out
        env = environ.get(ENV_PREFIX + dest.upper())
        return _split_list(env) if env else []

    kw: dict[str, object] = {}
    cache_dir = get("cache_dir")
    if not cache_dir:
        raise ConfigError("--cache-dir", "required (or set SHARDCACHE_CACHE_DIR)")
    kw["cache_dir"] = Path(cache_dir).expanduser()
    if kw["cache_dir"].exists() and not kw["cache_dir"].is_dir():  # type: ignore[union-attr]
        raise ConfigError("--cache-dir", f"{cache_dir} exists and is not a directory")

    upstreams = tuple(_parse_upstream(v) for v in get_list("upstream"))
    names = [u.name for u in upstreams]
    if names.count(None) > 1:
        raise ConfigError(
            "--upstream", "only one upstream may be unnamed; name the others NAME=URL"
        )
    dup = {n for n in names if n is not None and names.count(n) > 1}
    if dup:
        raise ConfigError("--upstream", f"upstream name used twice: {sorted(dup)[0]}")
    allow_hosts = tuple(h.lower() for h in get_list("allow_host"))
    if not upstreams and not allow_hosts:
        raise ConfigError("--upstream", "at least one upstream is required (or --allow-host)")
    if any(u.base.startswith("s3://") for u in upstreams) and not _have("aiobotocore"):
        raise ConfigError(
            "--upstream",
            "s3:// upstreams need the s3 extra (aiobotocore): pip install 'shardcache[s3]', "
            "or from a checkout: pip install '.[s3]'",
        )
    kw["upstreams"] = upstreams
    kw["allow_hosts"] = allow_hosts

    if (v := get("cache_size")) is not None:
        try:
            size = parse_size(v)
        except ValueError as exc:
            raise ConfigError("--cache-size", str(exc)) from None
        if size <= 0:
            raise ConfigError("--cache-size", f"must be positive (got {v!r})")
        kw["cache_size"] = size
    if (v := get("host")) is not None:
        kw["host"] = v
    if (v := get("port")) is not None:
        port = _number("--port", v, int, 0)
        if port > 65535:
            raise ConfigError("--port", f"must be at most 65535 (got {v!r})")
        kw["port"] = port
    if (v := get("admin_token")) is not None:
        kw["admin_token"] = v
    if (v := get("log_level")) is not None:
        if v.lower() not in LOG_LEVELS:
            raise ConfigError("--log-level", f"must be one of {', '.join(LOG_LEVELS)} (got {v!r})")
        kw["log_level"] = v.lower()
    if (v := get("eviction")) is not None:
        if v.lower() not in EVICTION_POLICIES:
            raise ConfigError(
                "--eviction", f"must be one of {', '.join(EVICTION_POLICIES)} (got {v!r})"
            )
        kw["eviction"] = v.lower()
    for flag, dest, kind, minimum in (
        ("--connect-timeout", "connect_timeout", float, 0.001),
        ("--read-timeout", "read_timeout", float, 0.001),
        ("--retries", "retries", int, 0),
        ("--grace-period", "grace_period", float, 0),
        ("--max-path-length", "max_path_length", int, 16),
        ("--prefetch-concurrency", "prefetch_concurrency", int, 1),
        ("--plan-ttl", "plan_ttl", float, 1),
        ("--plan-lookahead", "plan_lookahead", int, 1),
        ("--max-plans", "max_plans", int, 1),
        ("--max-plan-shards", "max_plan_shards", int, 1),
        ("--store-probe-interval", "store_probe_interval", float, 0.05),
        ("--workers", "workers", int, 1),
    ):
        if (v := get(dest)) is not None:
            kw[dest] = _number(flag, v, kind, minimum)
    if (v := get("min_free")) is not None:
        try:
            kw["min_free"] = parse_min_free(v)
        except ValueError as exc:
            raise ConfigError("--min-free", str(exc)) from None
    if (v := get("revalidate")) is not None:
        try:
            kw["revalidate"] = parse_revalidate(v)
        except ValueError as exc:
            raise ConfigError("--revalidate", str(exc)) from None
    if (v := get("part_size")) is not None:
        try:
            kw["part_size"] = parse_size(v)
        except ValueError as exc:
            raise ConfigError("--part-size", str(exc)) from None
    if (v := get("parallel")) is not None:
        kw["parallel"] = _number("--parallel", v, int, 1)
    if (v := get("http_parts")) is not None:
        if v.lower() in ("on", "true", "yes", "1"):
            kw["http_parts"] = True
        elif v.lower() in ("off", "false", "no", "0"):
            kw["http_parts"] = False
        else:
            raise ConfigError("--http-parts", f"must be on or off (got {v!r})")
    if (v := get("http_transport")) is not None:
        if v.lower() not in ("threads", "aiohttp"):
            raise ConfigError("--http-transport", f"must be threads or aiohttp (got {v!r})")
        kw["http_transport"] = v.lower()
    if (v := get("s3_endpoint_url")) is not None:
        ep = urlsplit(v)
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise ConfigError(
                "--s3-endpoint-url", f"must be an http(s) URL with a host (got {v!r})"
            )
        kw["s3_endpoint_url"] = v
    for dest in ("s3_region", "s3_profile", "s3_front_access_key", "s3_front_secret_key"):
        if (v := get(dest)) is not None:
            kw[dest] = v
    if int(kw.get("workers", 1)) > 64:  # type: ignore[call-overload]
        raise ConfigError("--workers", f"must be at most 64 (got {kw['workers']})")
    if (v := get("s3_domains")) is not None:
        domains = tuple(d.strip().strip(".").lower() for d in _split_list(v) if d.strip("."))
        for d in domains:
            if not _DOMAIN_RE.match(d):
                raise ConfigError("--s3-domain", f"not a domain name: {d!r}")
        kw["s3_domains"] = domains
    for dest, flag in (("tls_cert", "--tls-cert"), ("tls_key", "--tls-key")):
        if (v := get(dest)) is not None:
            path = Path(v).expanduser()
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ConfigError(flag, f"{path} is not a readable file")
            kw[dest] = path
    if bool(kw.get("tls_cert")) != bool(kw.get("tls_key")):
        raise ConfigError("--tls-key", "give both --tls-cert and --tls-key, or neither")
    if kw.get("tls_cert"):
        import ssl

        try:
            # never ask a terminal for a passphrase: an encrypted key is an error
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                kw["tls_cert"], kw["tls_key"], password=lambda: b""
            )
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("--tls-cert", f"cannot load the certificate and key: {exc}") from None
    access, secret = kw.get("s3_front_access_key"), kw.get("s3_front_secret_key")
    if access and not secret:
        raise ConfigError("--s3-front-secret-key", "required with --s3-front-access-key")
    if secret and not access:
        raise ConfigError("--s3-front-access-key", "required with --s3-front-secret-key")
    return Settings(**kw)  # type: ignore[arg-type]


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Parse ``serve`` flags (without the subcommand) into Settings; for tests and embedding."""
    parser = argparse.ArgumentParser(prog="shardcache serve", exit_on_error=False)
    add_serve_arguments(parser)
    args = parser.parse_args(list(argv))
    return settings_from_args(args, os.environ if environ is None else environ)


def configure_logging(level: str) -> None:
    """Set up plain logging to stderr at ``level``."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
