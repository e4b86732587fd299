"""Pure decisions of the proxy: no I/O, no clock, no event loop.

Everything the request handlers must *decide* lives here, by concern, and is tested
directly; the handlers only carry out the answers:

* :mod:`proxy.policy.sizes` — sizes in settings (``500G``, ``10MiB``, ``5%``);
* :mod:`proxy.policy.urls` — a request path to its upstream URL, signed-URL cache keys,
  redirect hosts;
* :mod:`proxy.policy.ranges` — Range parsing and clipping (RFC 9110 §14), conditional
  requests (RFC 9110 §13);
* :mod:`proxy.policy.headers` — forwarded request fields, hop-by-hop fields, admission
  (``no-store``/``private``, ``Vary``, size);
* :mod:`proxy.policy.freshness` — ``--revalidate`` and RFC 9111 freshness.

Every name is importable from ``proxy.policy`` itself.
"""

from __future__ import annotations

from proxy.policy.freshness import (
    REVALIDATE_HTTP,
    current_age,
    describe_revalidate,
    freshness_lifetime,
    is_fresh,
    must_revalidate_each_use,
    needs_revalidation,
    parse_revalidate,
    stale_needs_upstream,
    stale_while_revalidate,
)
from proxy.policy.headers import (
    CONFINED,
    CREDENTIALS,
    HARMLESS_VARY,
    HOP_BY_HOP,
    NOT_FORWARDED,
    cache_control_forbids,
    carries_credentials,
    confine,
    credentials_forwarded,
    end_to_end_headers,
    forwarded_fields,
    should_admit,
    vary_forbids,
)
from proxy.policy.ranges import (
    ByteRange,
    conditional_status,
    parse_range,
    range_applies,
    range_start,
)
from proxy.policy.sizes import (
    BARE_SIZE_MIN,
    format_size,
    parse_bound,
    parse_min_free,
    parse_size,
)
from proxy.policy.urls import (
    DEFAULT_REDIRECT_HOSTS,
    SIGNATURE_FAMILIES,
    STORE_BASE,
    Upstream,
    map_request,
    map_url,
    unsigned_url,
)

__all__ = [
    "BARE_SIZE_MIN",
    "CONFINED",
    "CREDENTIALS",
    "DEFAULT_REDIRECT_HOSTS",
    "HARMLESS_VARY",
    "HOP_BY_HOP",
    "NOT_FORWARDED",
    "REVALIDATE_HTTP",
    "SIGNATURE_FAMILIES",
    "STORE_BASE",
    "ByteRange",
    "Upstream",
    "cache_control_forbids",
    "carries_credentials",
    "confine",
    "credentials_forwarded",
    "conditional_status",
    "current_age",
    "describe_revalidate",
    "end_to_end_headers",
    "format_size",
    "forwarded_fields",
    "freshness_lifetime",
    "is_fresh",
    "map_request",
    "map_url",
    "must_revalidate_each_use",
    "needs_revalidation",
    "parse_bound",
    "parse_min_free",
    "parse_range",
    "parse_revalidate",
    "parse_size",
    "range_applies",
    "range_start",
    "should_admit",
    "stale_needs_upstream",
    "stale_while_revalidate",
    "unsigned_url",
    "vary_forbids",
]
