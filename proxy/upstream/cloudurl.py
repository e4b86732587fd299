"""``gs://`` and ``az://`` URLs: parsing into a store and a key. Pure, no client.

``gs://BUCKET/KEY`` names an object of a Google Cloud Storage bucket, as ``gsutil`` and
``gcloud storage`` write it. ``az://ACCOUNT/CONTAINER/KEY`` names a blob of an Azure
storage account: the account is part of the URL (it is in Azure's own
``https://ACCOUNT.blob.core.windows.net/CONTAINER/KEY``) so that one proxy can front
containers of several accounts. fsspec's ``az://CONTAINER/KEY``, which takes the account
from the environment, is not this form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from shardcache.errors import BadRequest

__all__ = ["CLOUD_SCHEMES", "CloudLocation", "parse_cloud_url"]

CLOUD_SCHEMES = ("gs", "az")

# GCS: 3-63 characters (dotted names up to 222), lowercase letters, digits, - _ .
_GCS_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,221}[a-z0-9]$")
# Azure: account 3-24 lowercase letters and digits; container 3-63, letters digits and -
_AZ_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_AZ_CONTAINER_RE = re.compile(r"^(\$root|[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62})$")


@dataclass(frozen=True)
class CloudLocation:
    """A store (a GCS bucket, or an Azure account and container) and a key in it."""

    scheme: str  # "gs" or "az"
    bucket: str  # GCS bucket or Azure container
    key: str
    account: str | None = None  # Azure only

    @property
    def store_url(self) -> str:
        """The URL of the bucket or container, without a key."""
        if self.scheme == "az":
            return f"az://{self.account}/{self.bucket}"
        return f"gs://{self.bucket}"


def parse_cloud_url(url: str, *, quoted: bool = False) -> CloudLocation:
    """Split ``gs://BUCKET/KEY`` or ``az://ACCOUNT/CONTAINER/KEY`` (the key may be empty
    or a prefix). ``quoted=True`` percent-decodes the key (the proxy's canonical URLs
    quote each path segment) and drops a query. Raises BadRequest naming the URL."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in CLOUD_SCHEMES:
        raise BadRequest(f"{url!r}: not a gs:// or az:// URL")
    if quoted:
        rest = rest.partition("?")[0]
    account = None
    if scheme == "az":
        account, _, rest = rest.partition("/")
        if not _AZ_ACCOUNT_RE.match(account):
            raise BadRequest(
                f"{url!r}: bad Azure storage account {account!r} (az://ACCOUNT/CONTAINER/KEY)"
            )
    bucket, _, key = rest.partition("/")
    if scheme == "az" and not _AZ_CONTAINER_RE.match(bucket):
        raise BadRequest(f"{url!r}: bad Azure container name {bucket!r}")
    if scheme == "gs" and not _GCS_BUCKET_RE.match(bucket):
        raise BadRequest(f"{url!r}: bad GCS bucket name {bucket!r}")
    if quoted:
        try:
            key = unquote(key, errors="strict")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"{url!r}: key is not valid percent-encoded UTF-8") from exc
    if "\x00" in key:
        raise BadRequest(f"{url!r}: NUL in key")
    return CloudLocation(scheme, bucket, key, account)
