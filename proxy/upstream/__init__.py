"""The upstream layer: bytes of one version of an object, from any backend, verified.

The application uses :class:`Fetcher`; nothing here knows the proxy's routes.
"""

from proxy.upstream.errors import UpstreamRedirect
from proxy.upstream.fetcher import Fetcher, RangeAnswer, origin_of
from proxy.upstream.s3 import S3Upstream
from proxy.upstream.stream import UpstreamBody
from shardcache.meta import ObjectMeta

__all__ = [
    "Fetcher",
    "ObjectMeta",
    "RangeAnswer",
    "S3Upstream",
    "UpstreamBody",
    "UpstreamRedirect",
    "origin_of",
]
