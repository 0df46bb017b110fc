"""An agent's KV page server (issue 40): answers peers' pulls of a session's host pages
over TCP (asyncio streams; page_protocol.py). The pages are read by the engine's owner
thread (`export`, e.g. EngineThread.call(engine.export_pages, ...)): never off it. With a
Mooncake transport, and a requester that has one too, the page bytes are staged in a
registered slot for the requester to read instead of being streamed.

Fault injection (tests only): with TALARIA_FAULT_PAGE_STALL=K in the holder's environment,
each pull stalls once K pages have left (over Mooncake: after a chunk of K pages was acked),
says so through `on_stall`, and holds the connection until the process is killed or the
serve's timeout closes it, so a test can SIGKILL a holder mid-transfer without sleeping
(tests/integration/test_kv_holder_killed_live.py). Unset, it costs one comparison per page.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from talaria.services.instance_agent.memory.mooncake_transport import MooncakeTransport
from talaria.services.instance_agent.memory.page_protocol import (
    ACK, HEADER, MAX_JSON, PageFrame, PageLayout, PageRequest, check_request, digest, frame)
from talaria.shared.settings import SettingsError

Export = Callable[[str, str, list[int], int], Awaitable[list]]  # (model, session, hashes, limit) -> pages
Listing = Callable[[str, str], Awaitable[list[int]]]  # (model, session) -> its host prefix's hashes
STALL_ENV = "TALARIA_FAULT_PAGE_STALL"


def stall_fault(env: Mapping[str, str] = os.environ) -> int | None:
    """The pages a pull sends before it stalls (STALL_ENV), or None: no fault (the default)."""
    raw = env.get(STALL_ENV, "")
    if raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise SettingsError(STALL_ENV, raw, "a number of pages (0 or more) a pull sends before it stalls")
    return int(raw)


class PageServer:
    def __init__(self, export: Export, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 transport: MooncakeTransport | None = None, listing: Listing | None = None,
                 stall_after: int | None = None, on_stall: Callable[[int], None] = lambda sent: None) -> None:
        self.export, self.host, self.port, self.timeout_s = export, host, port, timeout_s
        self.listing = listing
        self.stall_after, self.on_stall = stall_after, on_stall  # the fault (module docstring); None: off
        self.transport = transport
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
        if req.listing:
            hashes = [] if problem or self.listing is None else await self.listing(req.model, req.session_id)
            writer.write(frame(PageLayout(0, error=problem, hashes=hashes)))
            await writer.drain()
            return
        pages = [] if problem else await self.export(req.model, req.session_id, req.hashes, len(req.hashes))
        if not pages:
            writer.write(frame(PageLayout(0, error=problem)))
            await writer.drain()
            return
        desc = pages[0][1]
        size = desc.nbytes * len(pages[0][2])
        fits = max(0, min(len(pages), req.max_bytes // size))  # the requester's byte bound
        staged = self.transport is not None and req.segment != ""
        writer.write(frame(PageLayout(fits, len(pages[0][2]), desc.page_size, desc.dtype, list(desc.shape),
                                      desc.itemsize, segment=self.transport.segment if staged else "")))
        if staged:
            await self._stage(reader, writer, pages[:fits], min(req.chunk_bytes, self.transport.slot_bytes) // size)
            return
        for i, (h, _, slabs) in enumerate(pages[:fits]):
            if i == self.stall_after:
                await self._stall(i)
            writer.write(frame(PageFrame(h, [len(s) for s in slabs], digest(slabs))))
            for s in slabs:
                writer.write(s)
            await writer.drain()
            self.served_pages += 1
        writer.write(frame(PageFrame(0)))
        await writer.drain()

    async def _stage(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pages: list,
                     per_chunk: int) -> None:
        """Mooncake: stage `per_chunk` pages at a time in a leased slot; the next chunk once the
        requester acked the last (a slot is reused only after its reader is done or gone)."""
        if per_chunk < 1:
            writer.write(frame(PageFrame(0)))  # a page larger than a slot: the requester recomputes
            await writer.drain()
            return
        if self.stall_after is not None:  # the fault's K pages make whole chunks
            per_chunk = max(1, min(per_chunk, self.stall_after))
        slot = await self.transport.lease()
        try:
            for start in range(0, len(pages), per_chunk):
                if self.stall_after is not None and start >= self.stall_after:
                    await self._stall(start)
                chunk, offset = pages[start:start + per_chunk], 0
                for i, (h, _, slabs) in enumerate(chunk):
                    addr = self.transport.stage(slot, offset, slabs)
                    offset += sum(len(s) for s in slabs)
                    writer.write(frame(PageFrame(h, [len(s) for s in slabs], digest(slabs), addr,
                                                 flush=i == len(chunk) - 1)))
                await writer.drain()
                if await reader.readexactly(len(ACK)) != ACK:
                    return
                self.served_pages += len(chunk)
            writer.write(frame(PageFrame(0)))
            await writer.drain()
        finally:
            self.transport.release(slot)

    async def _stall(self, sent: int) -> None:
        """The fault: hold this pull after `sent` pages until killed or the serve times out."""
        self.on_stall(sent)
        await asyncio.Event().wait()
