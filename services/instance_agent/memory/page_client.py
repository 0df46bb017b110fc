"""Pull a session's KV pages from the agent holding them (issue 40; page_protocol.py).

`pull` returns the verified leading pages only: a page whose hash is not the next one asked
for, whose size or digest is wrong, or that never arrives (the holder died, the time or
byte bound ran out) ends the prefix, and the caller recomputes the rest. Cancelling the
awaiting task (the call was cancelled) closes the connection.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from talaria.services.instance_agent.memory.page_protocol import (
    HEADER, MAX_JSON, PageFrame, PageLayout, PageRequest, frame, page_ok, slab_bytes)


@dataclass
class Pulled:
    hashes: list[int] = field(default_factory=list)
    slabs: list[list[bytes]] = field(default_factory=list)  # per page, each rank's bytes
    layout: PageLayout | None = None
    bytes: int = 0
    seconds: float = 0.0
    setup_s: float = 0.0  # connect + request + the holder's layout answer
    why: str = ""  # why fewer pages than asked came back ("" when all did)


async def pull(address: str, session_id: str, model: str, hashes: list[int], *, timeout_s: float,
               max_bytes: int) -> Pulled:
    out = Pulled()
    t0 = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(frame(PageRequest(session_id, model, hashes, max_bytes)))
            await writer.drain()
            layout = await _read(reader, PageLayout)
            out.layout, out.setup_s = layout, time.perf_counter() - t0
            if layout.error or layout.pages == 0:
                out.why = layout.error or "the holder has none of these pages"
                return out
            size = slab_bytes(layout)
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


async def _read(reader: asyncio.StreamReader, kind):
    n = int.from_bytes(await reader.readexactly(HEADER), "big")
    if n > MAX_JSON:
        raise ValueError(f"a {n}-byte header")
    return msgspec.json.decode(await reader.readexactly(n), type=kind)
