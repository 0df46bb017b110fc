"""An agent's KV page server (issue 40): answers peers' pulls of a session's host pages
over TCP (asyncio streams; page_protocol.py). The pages are read by the engine's owner
thread (`export`, e.g. EngineThread.call(engine.export_pages, ...)): never off it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from talaria.services.instance_agent.memory.page_protocol import (
    HEADER, MAX_JSON, PageFrame, PageLayout, PageRequest, check_request, digest, frame)

Export = Callable[[str, str, list[int], int], Awaitable[list]]  # (model, session, hashes, limit) -> pages


class PageServer:
    def __init__(self, export: Export, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> None:
        self.export, self.host, self.port, self.timeout_s = export, host, port, timeout_s
        self._server: asyncio.Server | None = None
        self.served_pages = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):  # a slow or stuck peer holds nothing for long
                await self._answer(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, msgspec.DecodeError):
            pass  # the peer went away, or sent garbage: it recomputes
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = int.from_bytes(await reader.readexactly(HEADER), "big")
        if n > MAX_JSON:
            writer.write(frame(PageLayout(0, error=f"request of {n} bytes refused")))
            return
        req = msgspec.json.decode(await reader.readexactly(n), type=PageRequest)
        problem = check_request(req)
        pages = [] if problem else await self.export(req.model, req.session_id, req.hashes, len(req.hashes))
        if not pages:
            writer.write(frame(PageLayout(0, error=problem)))
            await writer.drain()
            return
        desc = pages[0][1]
        size = desc.nbytes * len(pages[0][2])
        fits = max(0, min(len(pages), req.max_bytes // size))  # the requester's byte bound
        writer.write(frame(PageLayout(fits, len(pages[0][2]), desc.page_size, desc.dtype, list(desc.shape),
                                      desc.itemsize)))
        for h, _, slabs in pages[:fits]:
            writer.write(frame(PageFrame(h, [len(s) for s in slabs], digest(slabs))))
            for s in slabs:
                writer.write(s)
            await writer.drain()
            self.served_pages += 1
        writer.write(frame(PageFrame(0)))
        await writer.drain()
