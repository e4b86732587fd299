"""Parts written at their offsets (``parts_pump``) against a real ranged origin."""

from __future__ import annotations

import asyncio
import os

import pytest
from aiohttp import web

from proxy.upstream.aio import AioTransport
from proxy.upstream.parts import parts_pump
from proxy.upstream.stream import Policy
from shardcache.meta import ObjectMeta

pytestmark = pytest.mark.fast

PART = 64 << 10


async def test_parts_finishing_while_the_reader_holds_a_batch_complete_the_object(tmp_path):
    """A reader slower than the parts (the proxy's client, a busy event loop): every part
    ends while the reader still holds the first batch. The object is complete, so the
    pump must report the rest, not fail with "parts ended at byte N"."""
    data = os.urandom(8 * PART + 123)
    src = tmp_path / "object.bin"
    src.write_bytes(data)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(src)

    app = web.Application()
    app.router.add_get("/object.bin", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/object.bin"
    transport = AioTransport(connect_timeout=5, read_timeout=5, chunk_size=16 << 10)
    head = await transport.request("HEAD", url, {})
    head.close()
    meta = ObjectMeta.from_headers(head.headers, 200)
    out = tmp_path / "out.part"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        reported = 0
        pump = parts_pump(
            transport, url, meta, fd, part_size=PART, parallel=4, policy=Policy(1, 0.01)
        )
        async for n in pump:
            if reported == 0:
                await asyncio.sleep(0.5)  # every part finishes meanwhile
            reported += n
    finally:
        os.close(fd)
        await transport.close()
        await runner.cleanup()
    assert reported == len(data)
    assert out.read_bytes() == data
