"""The settings table: one :class:`~proxy.setting.Setting` per setting of the proxy, in
the order ``serve --help`` and docs/configuration.md list them within their sections,
the ``--config`` file setting, and the defaults derived from the table. The flags, the
environment, the TOML file, :class:`~proxy.config.Settings` and the docs all follow it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from proxy.policy import (
    DEFAULT_REDIRECT_HOSTS,
    parse_bound,
    parse_min_free,
    parse_revalidate,
    parse_size,
)
from proxy.setting import ENV_PREFIX, GROUPS, Setting, _show_size
from proxy.setting_values import (
    DEFAULT_UNCACHED_PATHS,
    DEFAULT_UNCACHED_POST_PATHS,
    _bearer_credentials,
    _cache_dir,
    _domains,
    _float,
    _header_credentials,
    _hosts,
    _http_url,
    _int,
    _min_free_default,
    _on_off,
    _part_size,
    _patterns,
    _readable_file,
    _redirect_hosts,
    _upstream_names,
    _upstreams,
)
from proxy.upstream.options import DEFAULT_OPTIONS as UPSTREAM
from shardcache.store import DEFAULT_POLICY, LAYOUTS, POLICIES


def _ram_tier(text: str) -> int:
    """``--ram-tier``: a size, 0 for none."""
    return parse_size(text)


EVICTION_POLICIES = POLICIES  # the store's
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# The order here is the order of ``serve --help`` and of docs/configuration.md.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "upstreams",
        (),
        "upstream base URL (http, https, file, s3, gs, az); NAME=URL mounts it under /NAME/; s3:// alone serves every bucket of the S3 store as /BUCKET/KEY; repeatable",
        _upstreams,
        flag="--upstream",
        env=ENV_PREFIX + "UPSTREAM",
        metavar="[NAME=]URL",
        many=True,
        split_flag=False,
        group="upstreams",
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
        group="upstreams",
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
        group="upstreams",
    ),
    Setting(
        "max_redirects",
        5,
        "upstream redirects followed for one request",
        _int,
        minimum=0,
        metavar="N",
        group="upstreams",
    ),
    Setting(
        "uncached_paths",
        DEFAULT_UNCACHED_PATHS,
        "path under an http(s) upstream that is an API, not objects (a shell pattern "
        "relative to the upstream; * crosses /): forwarded for every request with GET, HEAD or POST and "
        "never cached; the default is the Hugging Face Hub's API; repeatable",
        _patterns,
        flag="--uncached-path",
        env=ENV_PREFIX + "UNCACHED_PATHS",
        metavar="PATTERN",
        many=True,
        group="upstreams",
    ),
    Setting(
        "uncached_post_paths",
        DEFAULT_UNCACHED_POST_PATHS,
        "uncached path a POST is forwarded to, with the proxy's credentials for the "
        "upstream (a shell pattern as for --uncached-path); a POST elsewhere is 405; the "
        "default is the Hub's read-only paths-info; repeatable",
        _patterns,
        flag="--uncached-post-path",
        env=ENV_PREFIX + "UNCACHED_POST_PATHS",
        metavar="PATTERN",
        many=True,
        group="upstreams",
    ),
    Setting(
        "strip_signatures",
        "auto",
        "cache key of a signed URL (AWS, CloudFront, GCS, Azure SAS): on drops its signature "
        "and expiry parameters, so the same object signed afresh is a hit (the request "
        "still uses the URL given) and anyone who can reach the proxy reads what it cached "
        "without a valid signature; auto: on when listening on loopback only",
        choices=("auto", "on", "off"),
        group="upstreams",
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
        group="upstreams",
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
        group="upstreams",
    ),
    Setting(
        "forward_credentials",
        (),
        "upstream (NAME, - for the unnamed one, * for all) that gets clients' Authorization "
        "and Cookie; a request carrying them is then answered by the upstream for that "
        "client alone, never stored or shared (a stored entry still serves it); repeatable",
        _upstream_names,
        metavar="NAME",
        many=True,
        group="upstreams",
    ),
    Setting(
        "cache_dir",
        None,
        "directory of the on-disk store",
        _cache_dir,
        required=True,
        metavar="PATH",
        group="cache",
    ),
    Setting(
        "cache_size",
        100 * 1000**3,
        "bound on cached bytes, e.g. 500G (G = 10^9 bytes), 1.5T, 10GiB (GiB = 2^30 bytes); "
        "a number without a unit below 1MiB is refused as a forgotten unit",
        parse_bound,
        minimum=1,
        show=_show_size,
        metavar="SIZE",
        group="cache",
    ),
    Setting(
        "cache_layout",
        None,
        "where entry files go: flat, all in --cache-dir, or fanout, in 256 subdirectories "
        "by the first two hex digits of the key; chosen when the cache directory is created "
        "and recorded in its index (a different value later is refused); choose fanout "
        "above a few million entries on ext4 without large_dir (one directory holds ~9.4M "
        "names)",
        choices=LAYOUTS,
        none_means="as the cache directory records it; flat for a new one",
        group="cache",
    ),
    Setting("host", "127.0.0.1", "address to listen on", metavar="HOST", group="fronts"),
    Setting(
        "port",
        8080,
        "port to listen on; 0 picks a free one",
        _int,
        minimum=0,
        maximum=65535,
        metavar="PORT",
        group="fronts",
    ),
    Setting(
        "workers",
        1,
        "processes serving the port, one store; a miss still costs one upstream GET",
        _int,
        minimum=1,
        maximum=64,
        metavar="N",
        group="performance",
    ),
    Setting(
        "ram_tier",
        32 << 20,
        "bytes of small hit entries (up to 256KiB each) kept in RAM, e.g. 256MiB, shared out "
        "among the workers; an entry read twice while it is full goes in (least recently "
        "used out), one read once does not; 0: every hit reads the entry file",
        _ram_tier,
        show=_show_size,
        metavar="SIZE",
        group="performance",
    ),
    Setting(
        "fast_hits",
        True,
        "on: plain GET/HEAD cache hits over HTTP are answered by a lean server in front of "
        "the application (httptools), everything else is handed to it unchanged; off: the "
        "application serves every request (HTTPS always is)",
        _on_off,
        metavar="on|off",
        group="performance",
    ),
    Setting(
        "admin_token",
        None,
        "bearer token required by mutating admin routes",
        metavar="TOKEN",
        group="admin",
    ),
    Setting(
        "log_level",
        "info",
        "lowest level of the messages logged",
        choices=LOG_LEVELS,
        group="logging",
    ),
    Setting(
        "access_log",
        "buffered",
        "the access log, a line per request: buffered (lines kept in memory and written "
        "together once 64 KiB gather or a second after the first of them, and before any "
        "other line; a SIGKILL loses what is kept), on (each line written at once), off",
        choices=("buffered", "on", "off"),
        group="logging",
    ),
    Setting(
        "eviction",
        DEFAULT_POLICY,
        "what makes room once the cache is full: evict the least recently used or the "
        "oldest entries, or keep them all and stop admitting new ones",
        choices=EVICTION_POLICIES,
        group="cache",
    ),
    Setting(
        "min_free",
        None,
        "space always kept free on the cache filesystem: bytes (2G) or a percentage (10%)",
        parse_min_free,
        none_means=_min_free_default(),
        metavar="SIZE|PERCENT",
        group="cache",
    ),
    Setting(
        "revalidate",
        None,
        "never (shards are immutable), always, http (reuse while fresh by the upstream's "
        "Cache-Control, Expires or Last-Modified, RFC 9111), or an age such as 10m after "
        "which a hit asks the upstream whether it changed",
        parse_revalidate,
        none_means="never",
        metavar="never|always|http|AGE",
        group="cache",
    ),
    Setting(
        "store_probe_interval",
        5.0,
        "seconds between checks whether an unwritable store takes writes again",
        _float,
        minimum=0.05,
        metavar="SECONDS",
        group="cache",
    ),
    Setting(
        "connect_timeout",
        UPSTREAM.connect_timeout,
        "upstream connect timeout, seconds",
        _float,
        minimum=0.001,
        metavar="SECONDS",
        group="upstreams",
    ),
    Setting(
        "read_timeout",
        UPSTREAM.read_timeout,
        "upstream idle read timeout, seconds",
        _float,
        minimum=0.001,
        metavar="SECONDS",
        group="upstreams",
    ),
    Setting(
        "retries",
        UPSTREAM.retries,
        "resume attempts after an upstream fails mid-body",
        _int,
        minimum=0,
        metavar="N",
        group="upstreams",
    ),
    Setting(
        "grace_period",
        30.0,
        "seconds in all to finish on SIGTERM/SIGINT",
        _float,
        minimum=0,
        metavar="SECONDS",
        group="admin",
    ),
    Setting(
        "max_path_length",
        8000,
        "longest accepted request path and query (presigned URLs with a session token "
        "take 1,500 characters and more)",
        _int,
        minimum=16,
        metavar="N",
        group="fronts",
    ),
    Setting(
        "prefetch_concurrency",
        4,
        "parallel background downloads for read plans and prefetch",
        _int,
        minimum=1,
        metavar="N",
        group="performance",
    ),
    Setting(
        "plan_ttl",
        600.0,
        "seconds a read plan lives after its reader's last request",
        _float,
        minimum=1,
        metavar="SECONDS",
        group="admin",
    ),
    Setting(
        "plan_lookahead",
        8,
        "shards a read plan keeps downloading ahead of its reader, at most",
        _int,
        minimum=1,
        metavar="N",
        group="performance",
    ),
    Setting(
        "max_plans",
        64,
        "read plans registered at once, at most",
        _int,
        minimum=1,
        metavar="N",
        group="admin",
    ),
    Setting(
        "max_plan_shards",
        100_000,
        "shards in one read plan, at most (a plan costs about 250 bytes of memory a shard)",
        _int,
        minimum=1,
        metavar="N",
        group="admin",
    ),
    Setting(
        "part_size",
        UPSTREAM.part_size,
        "ranged part size for large objects, e.g. 8MiB; at least 64KiB, 0 disables",
        _part_size,
        show=_show_size,
        metavar="SIZE",
        group="performance",
    ),
    Setting(
        "parallel",
        UPSTREAM.parallel,
        "concurrent ranged parts per object",
        _int,
        minimum=1,
        metavar="N",
        group="performance",
    ),
    Setting(
        "http_parts",
        UPSTREAM.http_parts,
        "on: also fetch large http(s) shards in parallel ranged parts (s3:// always are); "
        "for origins that limit each connection. off still fetches in parts the shard a "
        "read plan's reader asks for next, where the origin allows",
        _on_off,
        metavar="on|off",
        group="performance",
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
        group="performance",
    ),
    Setting(
        "http_transport",
        UPSTREAM.http_transport,
        "how one http(s) stream is received: threads receives on blocking sockets in "
        "worker threads and splices into the file, aiohttp on the event loop",
        choices=("threads", "aiohttp"),
        group="performance",
    ),
    Setting(
        "s3_endpoint_url",
        None,
        "S3-compatible endpoint for s3:// upstreams",
        _http_url,
        none_means="AWS",
        metavar="URL",
        group="upstreams",
    ),
    Setting(
        "s3_region",
        None,
        "S3 region",
        none_means="from the AWS config",
        metavar="REGION",
        group="upstreams",
    ),
    Setting(
        "s3_profile",
        None,
        "AWS shared-config profile for s3:// upstreams",
        metavar="PROFILE",
        group="upstreams",
    ),
    Setting(
        "gcs_endpoint_url",
        None,
        "Google Cloud Storage endpoint for gs:// upstreams (an emulator)",
        _http_url,
        none_means="storage.googleapis.com",
        metavar="URL",
        group="upstreams",
    ),
    Setting(
        "azure_endpoint_url",
        None,
        "Azure Blob endpoint for az:// upstreams; {account} stands for the URL's account "
        "(Azurite: http://127.0.0.1:10000/{account})",
        _http_url,
        none_means="https://{account}.blob.core.windows.net",
        metavar="URL",
        group="upstreams",
    ),
    Setting(
        "s3_front_access_key",
        None,
        "access key S3 clients must sign with",
        metavar="KEY",
        group="fronts",
    ),
    Setting(
        "s3_front_secret_key",
        None,
        "secret key S3 clients must sign with",
        metavar="KEY",
        group="fronts",
    ),
    Setting(
        "s3_domains",
        ("localhost",),
        "domains under which the S3 front answers virtual-hosted requests (Host: "
        "BUCKET.DOMAIN), comma separated",
        _domains,
        flag="--s3-domain",
        metavar="DOMAIN",
        group="fronts",
    ),
    Setting(
        "tls_cert",
        None,
        "PEM certificate chain: serve HTTPS instead of HTTP",
        _readable_file,
        metavar="PATH",
        group="fronts",
    ),
    Setting(
        "tls_key",
        None,
        "PEM private key of --tls-cert",
        _readable_file,
        metavar="PATH",
        group="fronts",
    ),
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


def in_groups(settings: Sequence[Setting] = SETTINGS) -> list[Setting]:
    """``settings`` in the order ``serve --help`` and the docs list them: those of no
    group first, then group by group as in :data:`GROUPS`, the table's order within."""
    order = {key: i for i, (key, _) in enumerate(GROUPS)}
    return sorted(settings, key=lambda s: order.get(s.group, -1))


BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {s.name: s.default for s in SETTINGS if not s.required}
)
