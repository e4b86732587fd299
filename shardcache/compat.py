"""The internals of other libraries that shardcache relies on, in one place, each with a
probe.

Some things shardcache must do have no public API: knowing how an aiohttp client
connection ended (a close-delimited body cut by a reset is not a clean end), sending a
file from worker threads around an asyncio transport, skipping interim 1xx answers in
``http.client``, naming the closest subcommand in argparse's errors. Every access to
such an internal goes through this module; nothing else in the project touches one.

Each internal has a probe (:data:`PROBES`) that says whether the installed version
still has it; :func:`probe_all` runs them (a test checks that every one succeeds on
the versions installed). When an internal is missing:

- the aiohttp connection protocol (close-delimited bodies, framing errors): the
  transport refuses to start, naming the internal and the supported versions (its
  checks protect the bytes; there is no working without them);
- the asyncio writer hooks and transport waiters (threaded ``sendfile``): the caller
  falls back to ``sendfile`` on the event loop;
- ``http.client``'s status reading: interim answers other than 100 are then left to
  ``http.client`` (which fails on them as on a bad answer);
- argparse's value check: argparse's own message, without the closest subcommand.

The module imports only the standard library; aiohttp is imported when its part is
used, so the library and the command line do not load it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.client
import re
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardcache.errors import ShardcacheError

__all__ = [
    "AIOHTTP_RANGE",
    "AppendAction",
    "CompatError",
    "HelpAction",
    "HintingParser",
    "InterimSkippingResponse",
    "PROBES",
    "SubParsersAction",
    "add_writer",
    "delimit_by_close",
    "attach_listener",
    "date_function",
    "parser_actions",
    "probe_all",
    "remove_writer",
    "reset_empty_waiter",
    "response_handler_class",
    "response_payload",
    "serialize_headers",
    "threaded_sendfile_hooks",
    "use_protocol",
    "values_may_look_negative",
    "wait_empty",
]

# the aiohttp versions the internals below are known in (as pyproject.toml declares)
AIOHTTP_RANGE = ">=3.14,<4"


class CompatError(ShardcacheError, RuntimeError):
    """An internal of another library that shardcache relies on is missing from the
    installed version. The message names the internal and what to install."""


def _missing(library: str, internal: str, purpose: str, supported: str) -> CompatError:
    version = _version(library)
    return CompatError(
        f"{library} {version} has no {internal}, which shardcache uses {purpose}; "
        f"install {library}{supported}"
    )


def _version(library: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _in_fresh_loop(make: Callable[[asyncio.AbstractEventLoop], Any]) -> Any:
    """Run ``make(loop)`` (a coroutine) to its end in a loop of its own."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(make(loop))
    finally:
        loop.close()


# --------------------------------------------------------------------------- aiohttp

_CONNECTION = "to tell how an upstream connection ended"


@functools.cache
def response_handler_class() -> type:
    """aiohttp's client connection protocol (``aiohttp.client_proto.ResponseHandler``),
    to be subclassed; CompatError when it lacks what shardcache overrides."""
    try:
        from aiohttp.client_proto import ResponseHandler
    except ImportError:
        raise _missing(
            "aiohttp", "aiohttp.client_proto.ResponseHandler", _CONNECTION, AIOHTTP_RANGE
        ) from None
    for name in ("set_response_params", "connection_lost", "set_exception"):
        if not callable(getattr(ResponseHandler, name, None)):
            raise _missing("aiohttp", f"ResponseHandler.{name}", _CONNECTION, AIOHTTP_RANGE)
    return ResponseHandler


def response_payload(handler: Any) -> Any:
    """The body stream a ResponseHandler is feeding (None between answers)."""
    return handler._payload


def use_protocol(connector: Any, factory: Callable[[asyncio.AbstractEventLoop], Any]) -> None:
    """Make aiohttp ``connector`` build its connections' protocol with ``factory(loop)``
    (a :func:`response_handler_class` subclass); CompatError when it cannot."""
    if not hasattr(connector, "_factory") or not hasattr(connector, "_loop"):
        raise _missing("aiohttp", "BaseConnector._factory", _CONNECTION, AIOHTTP_RANGE)
    loop = connector._loop
    connector._factory = lambda: factory(loop)


def _probe_response_handler() -> None:
    cls = response_handler_class()

    async def make(loop: asyncio.AbstractEventLoop) -> None:
        handler = cls(loop=loop)
        if "_payload" not in vars(handler):
            raise _missing("aiohttp", "ResponseHandler._payload", _CONNECTION, AIOHTTP_RANGE)
        response_payload(handler)

    _in_fresh_loop(make)


def _probe_connector_factory() -> None:
    import aiohttp

    async def make(loop: asyncio.AbstractEventLoop) -> None:
        connector = aiohttp.TCPConnector()
        try:
            use_protocol(connector, lambda lp: response_handler_class()(loop=lp))
            if connector._factory().__class__ is not response_handler_class():
                raise _missing("aiohttp", "BaseConnector._factory", _CONNECTION, AIOHTTP_RANGE)
        finally:
            await connector.close()

    _in_fresh_loop(make)


_BY_CLOSE = "to end an answer as its upstream's did, by closing the connection"


def delimit_by_close(resp: Any) -> None:
    """Make ``resp`` (an ``aiohttp.web.StreamResponse`` not yet prepared) a body framed by
    the connection closing, on HTTP/1.1 too: no Content-Length, no chunked framing,
    ``Connection: close``, the connection closed after its end. aiohttp frames a body of
    unknown length so on HTTP/1.0 only; on 1.1 it always chunks, except where its length
    check is off (as for its WebSockets). CompatError when that switch is missing."""
    from aiohttp import web

    if not isinstance(getattr(web.StreamResponse, "_length_check", None), bool):
        raise _missing("aiohttp", "StreamResponse._length_check", _BY_CLOSE, AIOHTTP_RANGE)
    resp._length_check = False
    resp.force_close()


def _probe_delimit_by_close() -> None:
    from aiohttp import web

    resp = web.StreamResponse()
    delimit_by_close(resp)
    if resp.keep_alive is not False or resp.chunked:
        raise _missing("aiohttp", "StreamResponse._length_check", _BY_CLOSE, AIOHTTP_RANGE)
_FAST = "for the fast path of hits (proxy.fastpath); it is off without it"


def serialize_headers(status_line: str, headers: Any) -> bytes:
    """An answer's head as aiohttp writes it (``aiohttp.http_writer._serialize_headers``):
    the status line and ``headers`` in order, each line ending in CRLF, then an empty
    line; ValueError for a CR or LF in a name or value."""
    from aiohttp import http_writer

    try:
        serialize = http_writer._serialize_headers
    except AttributeError:
        raise _missing(
            "aiohttp", "aiohttp.http_writer._serialize_headers", _FAST, AIOHTTP_RANGE
        ) from None
    return serialize(status_line, headers)


def date_function() -> Callable[[], str]:
    """aiohttp's ``Date`` value for an answer made now
    (``aiohttp.helpers.rfc822_formatted_time``, made once a second)."""
    from aiohttp import helpers

    try:
        return helpers.rfc822_formatted_time
    except AttributeError:
        raise _missing(
            "aiohttp", "aiohttp.helpers.rfc822_formatted_time", _FAST, AIOHTTP_RANGE
        ) from None


def attach_listener(site: Any, server: asyncio.AbstractServer) -> None:
    """Make ``server`` the listener of aiohttp ``site`` (a ``web.BaseSite`` subclass
    that starts its own): ``stop()`` closes it, ``runner.addresses`` lists it."""
    if "_server" not in type(site).__slots__ and not hasattr(site, "_server"):
        raise _missing("aiohttp", "BaseSite._server", _FAST, AIOHTTP_RANGE)
    site._server = server


def _probe_fast_path() -> None:
    from aiohttp import web
    from multidict import CIMultiDict

    head = serialize_headers("HTTP/1.1 200 OK", CIMultiDict([("A", "1"), ("B", "2")]))
    if head != b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\n\r\n":
        raise CompatError(f"aiohttp's _serialize_headers wrote {head!r}")
    try:
        serialize_headers("HTTP/1.1 200 OK", CIMultiDict([("A", "1\r\nB: 2")]))
    except ValueError:
        pass
    else:
        raise CompatError("aiohttp's _serialize_headers let a CR LF through")
    if "_server" not in web.BaseSite.__slots__:
        raise _missing("aiohttp", "BaseSite._server", _FAST, AIOHTTP_RANGE)
    date = date_function()()
    if not re.fullmatch(r"\w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} GMT", date):
        raise CompatError(f"aiohttp's rfc822_formatted_time wrote {date!r}")


# --------------------------------------------------------------------------- asyncio

_SENDFILE = "to send files from worker threads"


def threaded_sendfile_hooks(loop: Any, transport: Any) -> bool:
    """Whether ``loop`` and ``transport`` have what :func:`add_writer`,
    :func:`remove_writer`, :func:`wait_empty` and :func:`reset_empty_waiter` use (else
    the caller sends on the event loop)."""
    return (
        hasattr(loop, "_add_writer")
        and hasattr(loop, "_remove_writer")
        and hasattr(transport, "_make_empty_waiter")
        and hasattr(transport, "_reset_empty_waiter")
    )


def add_writer(loop: Any, fd: int, callback: Callable[[], None]) -> None:
    """Call ``callback`` when ``fd`` (a socket a transport owns, which the public
    ``add_writer`` refuses) takes bytes again; as asyncio's own ``sock_sendfile`` does."""
    loop._add_writer(fd, callback)


def remove_writer(loop: Any, fd: int) -> None:
    loop._remove_writer(fd)


async def wait_empty(transport: Any) -> None:
    """Wait until ``transport``'s write buffer is on the wire (asyncio's own
    ``sendfile`` waits the same way); :func:`reset_empty_waiter` after."""
    await transport._make_empty_waiter()


def reset_empty_waiter(transport: Any) -> None:
    transport._reset_empty_waiter()


def _probe_sendfile_hooks() -> None:
    async def make(loop: asyncio.AbstractEventLoop) -> None:
        a, b = socket.socketpair()
        try:
            transport, _ = await loop.create_connection(asyncio.Protocol, sock=a)
            try:
                if not threaded_sendfile_hooks(loop, transport):
                    raise CompatError(
                        f"this Python's asyncio ({type(loop).__name__}, "
                        f"{type(transport).__name__}) lacks the writer hooks and transport "
                        f"waiters shardcache uses {_SENDFILE}; it sends on the event loop"
                    )
            finally:
                transport.close()
                await asyncio.sleep(0)
        finally:
            b.close()

    _in_fresh_loop(make)


# --------------------------------------------------------------------------- http.client


def _interim_hooks() -> bool:
    return hasattr(http.client.HTTPResponse, "_read_status") and hasattr(
        http.client, "_read_headers"
    )


class InterimSkippingResponse(http.client.HTTPResponse):
    """An ``http.client`` response that skips every interim 1xx answer (103 Early
    Hints, 102 Processing), as HTTP requires of a client; http.client itself skips only
    100 (through its private ``_read_status``)."""

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if 100 < status < 200 and status != 101 and _interim_hooks():
                http.client._read_headers(self.fp)  # type: ignore[attr-defined]
                continue
            return version, status, reason


def _probe_interim() -> None:
    if not _interim_hooks():
        raise CompatError(
            "this Python's http.client has no HTTPResponse._read_status or _read_headers, "
            "which shardcache uses to skip interim 1xx answers"
        )


# --------------------------------------------------------------------------- argparse


class _Absent(argparse.Action):
    """Stands for an argparse class a later Python no longer has: nothing is one."""


if TYPE_CHECKING:
    from argparse import _AppendAction as AppendAction
    from argparse import _HelpAction as HelpAction
    from argparse import _SubParsersAction as SubParsersAction
else:
    # the class of ``add_subparsers()`` (what a subcommand module's ``register`` gets),
    # of the ``-h`` option and of ``action="append"``
    SubParsersAction = getattr(argparse, "_SubParsersAction", _Absent)
    HelpAction = getattr(argparse, "_HelpAction", _Absent)
    AppendAction = getattr(argparse, "_AppendAction", _Absent)


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions (options, positionals, subcommands) ``parser`` was given."""
    return list(parser._actions)


def subcommand_help(action: argparse.Action) -> dict[str, str]:
    """The one-line help of each subcommand of a subcommand chooser ``action``."""
    return {a.dest: a.help or "" for a in getattr(action, "_choices_actions", ())}


def values_may_look_negative(parser: argparse.ArgumentParser) -> None:
    """Let an option's value start with ``-`` and a digit (``-5G``: argparse would take
    it for an unknown option and hide the real error); for parsers none of whose
    options starts with a digit. Without argparse's private pattern, argparse as it is."""
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\.?\d")


class HintingParser(argparse.ArgumentParser):
    """An ArgumentParser that asks :meth:`unknown_subcommand` what to say of a
    subcommand it does not have (through argparse's private value check; without it,
    argparse's own message)."""

    def unknown_subcommand(self, value: str, choices: Sequence[str]) -> str | None:
        return None

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if (
            isinstance(action, SubParsersAction)
            and isinstance(value, str)
            and action.choices is not None
            and value not in action.choices
        ):
            message = self.unknown_subcommand(value, list(action.choices))
            if message:
                raise argparse.ArgumentError(action, message)
        super()._check_value(action, value)  # type: ignore[misc]


def _probe_argparse() -> None:
    parser = HintingParser(prog="probe")
    subs = parser.add_subparsers(dest="cmd")
    subs.add_parser("one")
    actions = parser_actions(parser)
    if not any(isinstance(a, SubParsersAction) for a in actions):
        raise CompatError("argparse's _SubParsersAction is not the class of add_subparsers()")
    if not any(isinstance(a, HelpAction) for a in actions):
        raise CompatError("argparse's _HelpAction is not the class of the -h option")
    if not isinstance(parser.add_argument("--many", action="append"), AppendAction):
        raise CompatError("argparse's _AppendAction is not the class of action='append'")
    if not callable(getattr(argparse.ArgumentParser, "_check_value", None)):
        raise CompatError("argparse has no ArgumentParser._check_value to name subcommands")
    parser.add_argument("--size")
    values_may_look_negative(parser)
    try:
        size = parser.parse_known_args(["--size", "-5G"])[0].size
    except (SystemExit, argparse.ArgumentError):
        size = None
    if size != "-5G":
        raise CompatError("argparse has no _negative_number_matcher: -5G reads as an option")


# --------------------------------------------------------------------------- probes

PROBES: dict[str, Callable[[], None]] = {
    "aiohttp ResponseHandler": _probe_response_handler,
    "aiohttp connector protocol": _probe_connector_factory,
    "aiohttp close-delimited answers": _probe_delimit_by_close,
    "asyncio sendfile hooks": _probe_sendfile_hooks,
    "http.client interim answers": _probe_interim,
    "argparse internals": _probe_argparse,
    "aiohttp answer heads and sites": _probe_fast_path,
}


def probe_all() -> dict[str, str]:
    """Run every probe (outside a running event loop); the failures, by probe name."""
    failed = {}
    for name, probe in PROBES.items():
        try:
            probe()
        except Exception as exc:  # noqa: BLE001 - each failure reported, by name
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed
