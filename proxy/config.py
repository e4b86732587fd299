"""Settings of the proxy: one table, :data:`SETTINGS`, declares each setting once.

A :class:`Setting` gives the field of :class:`Settings`, its flag (``--cache-size``), its
environment variable (``SHARDCACHE_CACHE_SIZE``), how a value is parsed and bounded, its
default and its help. Everything else is derived from the table: the ``serve`` flags
(help with the default and the variable appended), the reading of the environment and of
a ``--config`` TOML file, the defaults of :class:`Settings`, and docs/configuration.md.

Settings are read once, at startup. Precedence: flag > environment variable > config
file > default. A bad value raises :class:`~shardcache.errors.ConfigError` naming the
flag; checks that involve several settings live in :func:`_check_together`.

This module holds :class:`Settings` and the reading; the table is
:mod:`proxy.settings_table`, one setting :mod:`proxy.setting`, the value parsers
:mod:`proxy.setting_values`. Their public names are importable from here too.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from proxy.credentials import Credential
from proxy.policy import Upstream
from proxy.setting import ENV_PREFIX as ENV_PREFIX
from proxy.setting import GROUPS as GROUPS
from proxy.setting import SIZE_UNITS as SIZE_UNITS
from proxy.setting import Setting as Setting
from proxy.setting_values import _split_list
from proxy.settings_table import BY_NAME as BY_NAME
from proxy.settings_table import CONFIG_FILE, DEFAULTS, SETTINGS
from proxy.settings_table import EVICTION_POLICIES as EVICTION_POLICIES
from proxy.settings_table import LOG_LEVELS as LOG_LEVELS
from proxy.settings_table import in_groups as in_groups
from proxy.upstream.options import UpstreamOptions
from shardcache.compat import values_may_look_negative
from shardcache.errors import ConfigError

__all__ = [
    "CONFIG_FILE",
    "DEFAULTS",
    "ENV_PREFIX",
    "GROUPS",
    "SETTINGS",
    "SIZE_UNITS",
    "Setting",
    "Settings",
    "add_serve_arguments",
    "in_groups",
    "parse_settings",
    "settings_from_args",
    "tls_context",
]


@dataclass(frozen=True)
class Settings:
    """Everything the proxy needs to know, validated. Defaults come from :data:`SETTINGS`."""

    cache_dir: Path
    upstreams: tuple[Upstream, ...] = DEFAULTS["upstreams"]
    cache_size: int = DEFAULTS["cache_size"]
    cache_layout: str | None = DEFAULTS["cache_layout"]  # None: as the directory records
    host: str = DEFAULTS["host"]
    port: int = DEFAULTS["port"]
    admin_token: str | None = DEFAULTS["admin_token"]
    allow_hosts: tuple[str, ...] = DEFAULTS["allow_hosts"]
    redirect_hosts: tuple[str, ...] = DEFAULTS["redirect_hosts"]
    max_redirects: int = DEFAULTS["max_redirects"]
    uncached_paths: tuple[str, ...] = DEFAULTS["uncached_paths"]
    uncached_post_paths: tuple[str, ...] = DEFAULTS["uncached_post_paths"]
    strip_signatures: str = DEFAULTS["strip_signatures"]
    upstream_auth: tuple[Credential, ...] = DEFAULTS["upstream_auth"]
    upstream_headers: tuple[Credential, ...] = DEFAULTS["upstream_headers"]
    forward_credentials: tuple[str, ...] = DEFAULTS["forward_credentials"]
    log_level: str = DEFAULTS["log_level"]
    access_log: str = DEFAULTS["access_log"]
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
    # None: never; 0: always; "http": RFC 9111 freshness; else max age
    revalidate: float | str | None = DEFAULTS["revalidate"]
    store_probe_interval: float = DEFAULTS["store_probe_interval"]
    workers: int = DEFAULTS["workers"]
    fast_hits: bool = DEFAULTS["fast_hits"]
    ram_tier: int = DEFAULTS["ram_tier"]

    @property
    def upstream_options(self) -> UpstreamOptions:
        """The upstream layer's tunables, as these settings give them (same names)."""
        return UpstreamOptions(**{f.name: getattr(self, f.name) for f in fields(UpstreamOptions)})


# --------------------------------------------------------------------------- reading


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a flag for each setting of the table, in an argument group per section of
    :data:`GROUPS`; defaults are None so that environment variables and the config file
    can fill in."""
    # A value such as -5G would otherwise be taken for an unknown option, and the error
    # ("expected one argument") would hide the real one; no serve flag starts with a digit.
    values_may_look_negative(parser)
    sections = {key: parser.add_argument_group(key, text) for key, text in GROUPS}
    for s in (CONFIG_FILE, *SETTINGS):
        if s.flag is None:
            continue
        sections.get(s.group, parser).add_argument(
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
    known = {u.name or "-" for u in s.upstreams} | {"*"}
    for name in s.forward_credentials:
        if name not in known:
            raise ConfigError("--forward-credentials", f"no upstream named {name}")
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


def configure_logging(level: str, access_log: str = DEFAULTS["access_log"]) -> None:
    """Set up plain logging to stderr at ``level``; the access log's lines ``buffered``
    (written together, :class:`proxy.logs.BufferedStreamHandler`), written one by one
    (``on``), or not at all (``off``)."""
    from proxy.logs import (
        ACCESS_LOGGER,
        DAEMON_FORMAT,
        FLUSH_SECONDS,
        BufferedStreamHandler,
        Formatter,
    )

    # on: every line written at once (the handler's interval 0), still without a record
    # (proxy.logs.AccessLines)
    handler = BufferedStreamHandler(interval=FLUSH_SECONDS if access_log == "buffered" else 0)
    handler.setFormatter(Formatter(DAEMON_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    # off: no line below WARNING (an access line is INFO, or DEBUG for a passing probe)
    logging.getLogger(ACCESS_LOGGER).setLevel(
        logging.WARNING if access_log == "off" else logging.NOTSET
    )
