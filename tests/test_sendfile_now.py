"""``proxy.sendfile.send_now`` and ``send_rest``: a hit's file sent on the event loop
without asyncio's ``loop.sendfile`` machinery, over real loopback TCP connections.

- what the socket takes goes out at once; a client that reads slowly gets the rest from
  ``send_rest``, byte for byte;
- a file shorter than asked says so (``ended``), so the caller never ends cleanly;
- a transport with bytes still buffered, or a TLS one, is refused (None), nothing sent;
- a client gone midway is a ``ConnectionError``, not a clean return.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import pytest

from proxy.sendfile import send_now, send_rest

pytestmark = pytest.mark.fast

DATA = bytes(range(256)) * 4096 * 4  # 4 MiB: more than a loopback socket takes at once


async def _pair(rcvbuf: int | None = None) -> tuple[asyncio.Transport, socket.socket, object]:
    """A server transport (what the proxy sends on) and the client's blocking socket."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[asyncio.Transport] = loop.create_future()

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)  # type: ignore[arg-type]

    server = await loop.create_server(Proto, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = socket.socket()
    if rcvbuf is not None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client.setblocking(False)
    await loop.sock_connect(client, ("127.0.0.1", port))
    transport = await asyncio.wait_for(accepted, 5)
    return transport, client, server


async def _read(client: socket.socket, n: int, pause: float = 0.0) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(client, 65536), 10)
        if not chunk:
            break
        got += chunk
        if pause:
            await asyncio.sleep(pause)
    return bytes(got)


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "entry"
    path.write_bytes(DATA)
    return path


async def test_sends_at_once_and_the_rest_as_a_slow_client_reads(data_file: Path) -> None:
    transport, client, server = await _pair(rcvbuf=16384)
    try:
        with data_file.open("rb") as fobj:
            now = send_now(transport, fobj, 100, len(DATA) - 100)
            assert now is not None
            sent, ended = now
            assert not ended
            assert 0 < sent < len(DATA) - 100  # the socket did not take 4 MiB at once
            reader = asyncio.ensure_future(_read(client, len(DATA) - 100, pause=0.001))
            rest = await send_rest(transport, fobj, 100 + sent, len(DATA) - 100 - sent)
            assert sent + rest == len(DATA) - 100
            assert await reader == DATA[100:]
    finally:
        transport.close()
        client.close()
        server.close()  # type: ignore[attr-defined]


async def test_a_file_shorter_than_asked_says_it_ended(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(DATA[:1000])
    transport, client, server = await _pair()
    try:
        with path.open("rb") as fobj:
            assert send_now(transport, fobj, 0, 5000) == (1000, True)
            assert await _read(client, 1000) == DATA[:1000]
    finally:
        transport.close()
        client.close()
        server.close()  # type: ignore[attr-defined]


async def test_the_rest_of_a_file_cut_short_meanwhile_is_short(data_file: Path) -> None:
    transport, client, server = await _pair(rcvbuf=16384)
    try:
        with data_file.open("rb") as fobj:
            now = send_now(transport, fobj, 0, len(DATA))
            assert now is not None and not now[1]
            os.truncate(data_file, now[0] + 1000)  # the entry replaced under the hit
            reader = asyncio.ensure_future(_read(client, now[0] + 1000))
            rest = await send_rest(transport, fobj, now[0], len(DATA) - now[0])
            assert rest == 1000  # fewer than asked: the caller aborts the connection
            await reader
    finally:
        transport.close()
        client.close()
        server.close()  # type: ignore[attr-defined]


async def test_buffered_bytes_or_tls_refuse(data_file: Path, tmp_path: Path) -> None:
    transport, client, server = await _pair(rcvbuf=4096)
    try:
        with data_file.open("rb") as fobj:
            transport.write(DATA)  # more than the socket takes: some stay buffered
            assert transport.get_write_buffer_size() > 0
            assert send_now(transport, fobj, 0, len(DATA)) is None
    finally:
        transport.abort()
        client.close()
        server.close()  # type: ignore[attr-defined]

    a, b = socket.socketpair()

    class TLSLike:  # an SSL transport as send_now sees it: all but its sslcontext plain
        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            return 0

        def get_extra_info(self, name: str) -> object:
            if name == "socket":
                return a
            return ssl.create_default_context() if name == "sslcontext" else None

        def _make_empty_waiter(self) -> None: ...

        def _reset_empty_waiter(self) -> None: ...

    try:
        with data_file.open("rb") as fobj:
            assert send_now(TLSLike(), fobj, 0, 10) is None
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(10)  # nothing went around the TLS layer
    finally:
        a.close()
        b.close()


async def test_a_client_gone_midway_is_an_error(data_file: Path) -> None:
    transport, client, server = await _pair(rcvbuf=16384)
    try:
        with data_file.open("rb") as fobj:
            now = send_now(transport, fobj, 0, len(DATA))
            assert now is not None and now[0] < len(DATA)
            client.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            client.close()  # a reset
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(send_rest(transport, fobj, now[0], len(DATA) - now[0]), 10)
    finally:
        transport.close()
        server.close()  # type: ignore[attr-defined]
