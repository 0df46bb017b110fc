"""Pull a session's KV pages from the agent holding them (issue 40; page_protocol.py).

`pull` returns the verified leading pages only: a page whose hash is not the next one asked
for, whose size or digest is wrong, or that never arrives (the holder died, the time or
byte bound ran out) ends the prefix, and the caller recomputes the rest. Cancelling the
awaiting task (the call was cancelled) closes the connection. Given a Mooncake `transport`
and a holder that has one, the page bytes are read from the holder's staging slots.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from talaria.services.instance_agent.memory.mooncake_transport import MooncakeTransport
from talaria.services.instance_agent.memory.page_protocol import (
    ACK, HEADER, MAX_JSON, PageFrame, PageLayout, PageRequest, frame, page_ok, slab_bytes)


@dataclass
class Pulled:
    hashes: list[int] = field(default_factory=list)
    # per page, each rank's bytes; out of the repr, which a log line, a task's repr or
    # asyncio.run's exit (Python < 3.13) would otherwise spend seconds formatting (1.4 s for 32 MB)
    slabs: list[list[bytes]] = field(default_factory=list, repr=False)
    layout: PageLayout | None = None
    bytes: int = 0
    seconds: float = 0.0
    setup_s: float = 0.0  # connect + request + the holder's layout answer
    why: str = ""  # why fewer pages than asked came back ("" when all did)
    transport: str = "tcp"  # how the page bytes moved: tcp | mooncake


async def pull(address: str, session_id: str, model: str, hashes: list[int], *, timeout_s: float,
               max_bytes: int, transport: MooncakeTransport | None = None) -> Pulled:
    out = Pulled()
    segment = transport.segment if transport is not None else ""
    t0 = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(frame(PageRequest(session_id, model, hashes, max_bytes, segment,
                                           transport.slot_bytes if segment else 0)))
            await writer.drain()
            layout = await _read(reader, PageLayout)
            out.layout, out.setup_s = layout, time.perf_counter() - t0
            if layout.error or layout.pages == 0:
                out.why = layout.error or "the holder has none of these pages"
                return out
            size = slab_bytes(layout)
            if layout.segment and transport is not None:
                out.transport = "mooncake"
                await _staged(reader, writer, layout, hashes, transport, out)
                return out
            for want in hashes[:layout.pages]:
                f = await _read(reader, PageFrame)
                if f.hash == 0 or len(f.sizes) != layout.ranks or any(s != size for s in f.sizes):
                    out.why = "the holder sent fewer or different pages"
                    break
                slabs = [await reader.readexactly(s) for s in f.sizes]
                if not page_ok(f, want, layout, slabs):
                    out.why = f"page {len(out.hashes)} failed its hash check"
                    break
                out.hashes.append(want)
                out.slabs.append(slabs)
                out.bytes += size * layout.ranks
            else:
                if layout.pages < len(hashes):
                    out.why = f"the holder had {layout.pages} of {len(hashes)} pages"
    except TimeoutError:
        out.why = f"timed out after {timeout_s:g} s"
    except (OSError, asyncio.IncompleteReadError, msgspec.DecodeError, ValueError) as exc:
        out.why = f"transfer broke: {type(exc).__name__}"
    finally:
        if writer is not None:
            writer.close()
        out.seconds = time.perf_counter() - t0
    return out


async def _staged(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, layout: PageLayout,
                  hashes: list[int], transport: MooncakeTransport, out: Pulled) -> None:
    """Mooncake: collect a chunk's frames, read its bytes from the holder's slot in one
    transfer, keep its pages while they check, ack; until the end frame or the first failure."""
    size, wants, chunk = slab_bytes(layout), iter(hashes[:layout.pages]), []
    while True:
        f = await _read(reader, PageFrame)
        if f.hash == 0:
            if len(out.hashes) < min(layout.pages, len(hashes)) and not out.why:
                out.why = "the holder sent fewer pages than it announced"
            elif layout.pages < len(hashes):
                out.why = f"the holder had {layout.pages} of {len(hashes)} pages"
            return
        if len(f.sizes) != layout.ranks or any(s != size for s in f.sizes) or f.hash != next(wants, None):
            out.why = "the holder sent fewer or different pages"
            return
        chunk.append(f)
        if not f.flush:
            continue
        lo = chunk[0].addr
        n = chunk[-1].addr + size * layout.ranks - lo
        data = await transport.read(layout.segment, lo, n) if n > 0 else None
        if data is None:
            out.why = f"mooncake read of {n} bytes from {layout.segment} failed"
            return
        for g in chunk:
            at = g.addr - lo
            slabs = [data[at + r * size: at + (r + 1) * size] for r in range(layout.ranks)]
            if at < 0 or not page_ok(g, g.hash, layout, slabs):
                out.why = f"page {len(out.hashes)} failed its hash check"
                return
            out.hashes.append(g.hash)
            out.slabs.append(slabs)
            out.bytes += size * layout.ranks
        chunk = []
        writer.write(ACK)
        await writer.drain()


async def _read(reader: asyncio.StreamReader, kind):
    n = int.from_bytes(await reader.readexactly(HEADER), "big")
    if n > MAX_JSON:
        raise ValueError(f"a {n}-byte header")
    return msgspec.json.decode(await reader.readexactly(n), type=kind)


async def list_pages(address: str, session_id: str, model: str, *, timeout_s: float) -> tuple[list[int], str]:
    """(the session's host prefix hashes the holder lists, '' or why none): a drain's push
    asks this first, then `pull`s those hashes (checked on arrival as any pull's)."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(frame(PageRequest(session_id, model, [], 1, listing=True)))
            await writer.drain()
            layout = await _read(reader, PageLayout)
            return list(layout.hashes), layout.error
    except TimeoutError:
        return [], f"listing timed out after {timeout_s:g} s"
    except (OSError, asyncio.IncompleteReadError, msgspec.DecodeError, ValueError) as exc:
        return [], f"listing broke: {type(exc).__name__}"
    finally:
        if writer is not None:
            writer.close()
