"""Credentials the proxy sends to an http(s) upstream: a bearer token (a Hub token for a
private or gated dataset) or any header, per upstream, read from the environment or from
a file (a Kubernetes Secret mounted as a file; re-read when it changes, so a rotated
secret is used without a restart).

A secret never appears in a log line, an error, ``/-/stats`` or a ``repr``; it is sent
only to its upstream's own host, never across a redirect to another host (see
:mod:`proxy.upstream.redirects`). Literal values are not accepted on the command line:
they would show in the process list.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["Credential", "Credentials", "SecretSource", "parse_credential"]


@dataclass(frozen=True)
class SecretSource:
    """Where a secret is read: ``env:VAR`` or ``file:PATH``."""

    kind: str  # "env" or "file"
    where: str
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> SecretSource:
        kind, sep, where = text.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in ("env", "file") or not where.strip():
            raise ValueError(
                f"a secret is read from env:VARIABLE or file:PATH, not {text.split(':')[0]!r}"
                " (literal values would show in the process list)"
            )
        return cls(kind, where.strip())

    def __str__(self) -> str:
        return f"{self.kind}:{self.where}"

    def check(self, environ: Mapping[str, str] | None = None) -> None:
        """Raise ValueError when the secret cannot be read now."""
        self.read(environ)

    def read(self, environ: Mapping[str, str] | None = None) -> str:
        """The secret's value (a file re-read when its size or mtime changed)."""
        if self.kind == "env":
            value = (environ if environ is not None else os.environ).get(self.where)
            if not value:
                raise ValueError(f"environment variable {self.where} is not set")
            return value.strip()
        try:
            st = os.stat(self.where)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            with self._lock:
                if self._cache.get("stamp") != stamp:
                    with open(self.where, encoding="utf-8") as f:
                        self._cache["value"] = f.read().strip()
                    self._cache["stamp"] = stamp
                value = self._cache["value"]
        except OSError as exc:
            raise ValueError(f"cannot read {self.where}: {exc.strerror or exc}") from None
        if not value:
            raise ValueError(f"{self.where} is empty")
        return value


@dataclass(frozen=True)
class Credential:
    """Header ``header`` with the secret from ``source`` (as ``Bearer <secret>`` when
    ``bearer``), for the upstream named ``upstream`` (None: the unnamed one)."""

    upstream: str | None
    header: str
    source: SecretSource
    bearer: bool = False

    def __str__(self) -> str:  # never the value
        who = f"{self.upstream}=" if self.upstream else ""
        return f"{who}{self.header} from {self.source}"

    def value(self) -> str:
        secret = self.source.read()
        return f"Bearer {secret}" if self.bearer else secret


def parse_credential(text: str, *, bearer: bool) -> Credential:
    """``[NAME=]SOURCE`` (a bearer token) or ``[NAME=]HEADER:SOURCE`` (any header), where
    SOURCE is ``env:VAR`` or ``file:PATH``; ValueError with a message otherwise."""
    name: str | None = None
    head, eq, rest = text.partition("=")
    if eq and ":" not in head:
        name, text = head.strip() or None, rest
    if bearer:
        return Credential(name, "Authorization", SecretSource.parse(text), bearer=True)
    header, sep, source = text.partition(":")
    header = header.strip()
    if not sep or not header or any(c in header for c in ' \t()<>@,;\\"/[]?={}'):
        raise ValueError(f"expected [NAME=]HEADER:env:VAR or [NAME=]HEADER:file:PATH, got {text!r}")
    return Credential(name, header, SecretSource.parse(source))


class Credentials:
    """The credentials of each upstream, by base URL: what a request to a URL under it
    carries (to that upstream's own host only)."""

    def __init__(self, by_base: Mapping[str, Sequence[Credential]] | None = None) -> None:
        # longest base first: a named upstream under another's path wins
        self._rules = sorted((by_base or {}).items(), key=lambda kv: -len(kv[0]))

    def __bool__(self) -> bool:
        return bool(self._rules)

    def __repr__(self) -> str:
        return f"Credentials({[str(c) for _, cs in self._rules for c in cs]})"

    def headers_for(self, url: str) -> dict[str, str]:
        """The header fields a request for ``url`` carries (empty when none applies)."""
        for base, creds in self._rules:
            if url == base or url.startswith(base.rstrip("/") + "/"):
                return {c.header: c.value() for c in creds}
        return {}

    @staticmethod
    def host_of(url: str) -> str:
        return (urlsplit(url).hostname or "").lower()
