"""Read plans: tell a shardcache proxy which shards a reader will read, in order.

A proxy that knows a reader's order keeps its next shards downloading ahead, evicts the
entries needed farthest in the future first, and reports how long the reader waited for
bytes. :func:`plan` registers one (``POST /-/plans``) and returns a :class:`Plan`, which
deletes it when closed::

    with shardcache.plan(urls, proxy="http://127.0.0.1:8080", name="job-a"):
        for sample in webdataset.WebDataset(shardcache.proxied(urls, ...)):
            ...

Only the standard library speaks HTTP here (``urllib``), so ``import shardcache`` stays
light. Mutating requests carry ``Authorization: Bearer $SHARDCACHE_ADMIN_TOKEN`` when that
variable is set (the proxy's ``--admin-token``). The proxy address defaults to
``SHARDCACHE_PROXY``, as for :func:`shardcache.proxied`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Iterable
from types import TracebackType
from typing import Any
from urllib.parse import quote

from shardcache._version import __version__
from shardcache.errors import ShardcacheError
from shardcache.urls import _proxy_base, expand_urls

__all__ = [
    "Plan",
    "PlanError",
    "plan",
    "list_plans",
    "get_plan",
    "delete_plan",
    "PLAN_HEADER",
    "TOKEN_ENV",
]

log = logging.getLogger(__name__)

PLAN_HEADER = "X-Shardcache-Plan"
"""The request header that ties a data request to one plan (only that plan advances)."""

TOKEN_ENV = "SHARDCACHE_ADMIN_TOKEN"
"""Environment variable holding the proxy's ``--admin-token``, sent as a bearer token."""

DEFAULT_TIMEOUT = 10.0
_USER_AGENT = f"shardcache/{__version__}"
_MAX_NAME = 200


class PlanError(ShardcacheError):
    """The proxy refused a plan request or could not be reached.

    ``status`` is the HTTP status the proxy answered with (None when it could not be
    reached); the message names the URL and repeats the proxy's own error text.
    """

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        self.url = url
        self.status = status
        self.message = message
        super().__init__(f"{url}: {message}")

    def __reduce__(self):  # picklable across DataLoader worker processes
        return (type(self), (self.url, self.message, self.status))


def _resolve(proxy: str | None) -> str:
    """The proxy's base URL: ``proxy``, else ``SHARDCACHE_PROXY``, else a ValueError."""
    return _proxy_base(proxy)


def _error_text(body: bytes) -> str:
    """The proxy's message: a JSON ``error``/``message`` field, else the first text line."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "message", "detail"):
            if isinstance(data.get(key), str):
                return data[key]
    lines = text.splitlines()
    return lines[0][:500] if lines else ""


def _request(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[int, Any]:
    """Send one JSON request; return ``(status, decoded body)``, raise :class:`PlanError`."""
    headers = {"User-Agent": _USER_AGENT, "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    token = os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        try:
            text = _error_text(exc.read())
        except (OSError, http.client.HTTPException):
            text = ""
        finally:
            exc.close()
        detail = f"HTTP {exc.code}: {text}" if text else f"HTTP {exc.code} {exc.reason}"
        raise PlanError(url, detail, exc.code) from exc
    except urllib.error.URLError as exc:
        cause = str(exc.reason) or type(exc.reason).__name__
        raise PlanError(url, f"cannot reach the proxy ({cause})") from exc
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise PlanError(url, f"request failed ({type(exc).__name__}: {exc})") from exc
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError as exc:
        raise PlanError(url, f"answer is not JSON ({exc})", status) from exc


def _check_lookahead(lookahead: int | str | None) -> int | str | None:
    if lookahead is None:
        return None
    if isinstance(lookahead, bool) or not isinstance(lookahead, (int, str)):
        raise TypeError(f"lookahead: expected a shard count or a size string, got {lookahead!r}")
    if isinstance(lookahead, int) and lookahead < 1:
        raise ValueError(f"lookahead: expected at least 1 shard, got {lookahead}")
    if isinstance(lookahead, str):
        text = lookahead.strip()
        if not text:
            raise ValueError("lookahead: empty size")
        return text
    return lookahead


class Plan:
    """A read plan registered at a proxy; :meth:`close` (or leaving ``with``) deletes it.

    Made by :func:`plan`. ``id`` is the proxy's id for it (send it as the
    ``X-Shardcache-Plan`` header to advance only this plan), ``urls`` the planned order,
    ``shards`` their number, ``proxy`` the proxy's base URL, ``lookahead`` what the proxy
    said it will keep ready ahead.
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        proxy: str | None = None,
        name: str | None = None,
        lookahead: int | str | None = None,
        *,
        replace: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.proxy = _resolve(proxy)
        self.urls: list[str] = expand_urls(urls)
        if not self.urls:
            raise ValueError(f"plan: no shards in {urls!r}")
        if name is not None and len(name) > _MAX_NAME:
            raise ValueError(f"plan: name longer than {_MAX_NAME} characters")
        self.timeout = timeout
        self.closed = False
        self.released = False
        body: dict[str, Any] = {"urls": self.urls}
        if name is not None:
            body["name"] = name
        look = _check_lookahead(lookahead)
        if look is not None:
            body["lookahead"] = look
        if replace:
            if not name:
                raise ValueError("plan: replace=True needs a name (the plans it replaces)")
            body["replace"] = True
        _, answer = _request("POST", f"{self.proxy}/-/plans", body, timeout=timeout)
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), str):
            raise PlanError(f"{self.proxy}/-/plans", f"answer has no plan id: {answer!r}")
        self.id: str = answer["id"]
        self.name: str | None = answer.get("name", name)
        self.shards: int = int(answer.get("shards", len(self.urls)))
        self.lookahead: Any = answer.get("lookahead")

    @property
    def url(self) -> str:
        """This plan's URL on the proxy (``GET`` its status, ``DELETE`` it)."""
        return f"{self.proxy}/-/plans/{quote(self.id, safe='')}"

    @property
    def headers(self) -> dict[str, str]:
        """Headers for data requests that read along this plan."""
        return {PLAN_HEADER: self.id}

    def status(self) -> dict[str, Any]:
        """The proxy's view of this plan (``position``, ``ready_ahead_shards``,
        ``wait_seconds``, ``done``...): ``GET /-/plans/{id}``. Raises :class:`PlanError`
        (status 404) once the plan is gone."""
        _, answer = _request("GET", self.url, timeout=self.timeout)
        if not isinstance(answer, dict):
            raise PlanError(self.url, f"expected a JSON object, got {answer!r}")
        return answer

    def close(self) -> None:
        """Delete the plan at the proxy. Idempotent; a plan already gone (404) or a proxy
        that cannot be reached any more is logged, not raised."""
        if self.closed:
            return
        self.closed = True
        try:
            _request("DELETE", self.url, timeout=self.timeout)
        except PlanError as exc:
            if exc.status == 404:
                log.debug("plan %s was already gone", self.id)
            else:
                log.warning("could not delete read plan %s: %s", self.id, exc)

    def release(self) -> None:
        """Stop managing the plan here without deleting it at the proxy: it ends when a
        plan registered with ``replace=True`` under its name replaces it, when it is
        deleted, or ``--plan-ttl`` seconds after its reader's last request."""
        self.closed = True
        self.released = True

    def __enter__(self) -> Plan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "released" if self.released else "closed" if self.closed else "open"
        return f"Plan({self.id!r}, {self.shards} shards, proxy={self.proxy!r}, {state})"


def plan(
    urls: str | Iterable[str],
    proxy: str | None = None,
    name: str | None = None,
    lookahead: int | str | None = None,
    *,
    replace: bool = False,
) -> Plan:
    """Register the read order ``urls`` at a proxy and return the :class:`Plan`.

    ``urls``: a list of URLs or a brace pattern (``::`` separates several), each as the
    reader requests it: a full proxy URL, a path on the proxy (``/data/shard-000.tar``), an
    upstream URL under one of the proxy's ``--upstream``s, or ``s3://bucket/key`` for the
    S3 front. A shard may appear several times (several epochs). ``proxy``: the proxy's
    address, default ``SHARDCACHE_PROXY`` (a ValueError says so when neither is given).
    ``name``: free text shown in listings. ``lookahead``: shards to keep ready ahead (an
    int) or bytes (``"2GiB"``); default the proxy's ``--plan-lookahead``. ``replace``:
    the proxy ends the plans named ``name`` once this one is registered (needs ``name``).

    Raises :class:`PlanError` with the proxy's message when it refuses the plan or cannot
    be reached. Use it as a context manager, or call :meth:`Plan.close` when done.
    """
    return Plan(urls, proxy, name, lookahead, replace=replace)


def list_plans(proxy: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
    """Every plan the proxy holds (``GET /-/plans``)."""
    base = _resolve(proxy)
    url = f"{base}/-/plans"
    _, answer = _request("GET", url, timeout=timeout)
    if not isinstance(answer, dict) or not isinstance(answer.get("plans"), list):
        raise PlanError(url, f"expected {{'plans': [...]}}, got {answer!r}")
    return answer["plans"]


def get_plan(
    plan_id: str, proxy: str | None = None, *, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, Any]:
    """One plan's status (``GET /-/plans/{id}``); :class:`PlanError` 404 if unknown."""
    url = f"{_resolve(proxy)}/-/plans/{quote(plan_id, safe='')}"
    _, answer = _request("GET", url, timeout=timeout)
    if not isinstance(answer, dict):
        raise PlanError(url, f"expected a JSON object, got {answer!r}")
    return answer


def delete_plan(
    plan_id: str, proxy: str | None = None, *, timeout: float = DEFAULT_TIMEOUT
) -> None:
    """Delete a plan (``DELETE /-/plans/{id}``); :class:`PlanError` 404 if unknown."""
    url = f"{_resolve(proxy)}/-/plans/{quote(plan_id, safe='')}"
    _request("DELETE", url, timeout=timeout)
