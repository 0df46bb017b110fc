"""Mooncake's transfer engine as the bulk path of the KV page protocol (issue 40).

The control part (which pages, hashes, tenant, bounds, cancellation) stays in page_*.py over
TCP; only the page bytes move by Mooncake. The holder copies a pull's pages into a bounded,
registered staging slot (never its host pool: a registered segment is readable by any peer
engine, so only pages already granted to a pull are ever in it, and no peer reads engine state
off the engine thread); the puller reads the slot into its own registered receive slot with
one `transfer_sync_read`, checks each page as over TCP, and acks so the slot is reused.
`open_transport` returns (None, why) where the package does not import or the engine does not
initialise: the caller then streams the bytes over TCP.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

SLOT_BYTES = 32 << 20  # one staged chunk of pages (the ack round trip is paid per slot)
SLOTS = 2  # concurrent pulls served (and pulls made) at once; more wait for a slot


class _Slots:
    """`count` registered buffers of `size` bytes, leased one per pull."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count
        self.buffer = mmap.mmap(-1, size * count)  # anonymous: memory is taken as slots are used, not up front
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.free: asyncio.Queue[int] | None = None

    def queue(self) -> asyncio.Queue[int]:
        if self.free is None:  # made on the loop that first leases
            self.free = asyncio.Queue()
            for i in range(self.count):
                self.free.put_nowait(self.base + i * self.size)
        return self.free


class MooncakeTransport:
    def __init__(self, engine, host: str, protocol: str, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> None:
        self.engine, self.protocol, self.slot_bytes = engine, protocol, slot_bytes
        self.segment = f"{host}:{engine.get_rpc_port()}"  # P2PHANDSHAKE: peers name us by host:rpc port
        self.staging, self.receive = _Slots(slot_bytes, slots), _Slots(slot_bytes, slots)
        for part in (self.staging, self.receive):
            if engine.register_memory(part.base, slot_bytes * slots) != 0:
                raise RuntimeError("register_memory failed")
        self._reads = ThreadPoolExecutor(slots, thread_name_prefix="mooncake-read")

    # -- the holder --------------------------------------------------------------------------

    async def lease(self) -> int:
        """A staging slot's address; give it back with `release` once the peer acked or left."""
        return await self.staging.queue().get()

    def release(self, slot: int) -> None:
        self.staging.queue().put_nowait(slot)

    @staticmethod
    def stage(slot: int, offset: int, slabs: list[bytes]) -> int:
        """Copy one page's slabs into the slot at `offset`; their address there."""
        at = slot + offset
        for s in slabs:
            ctypes.memmove(at, s, len(s))
            at += len(s)
        return slot + offset

    # -- the puller --------------------------------------------------------------------------

    async def read(self, segment: str, remote: int, n: int) -> bytes | None:
        """`n` bytes at `remote` in the peer's segment, or None where the transfer failed. The
        receive slot is leased until the engine is done writing into it, even if the awaiting
        call is cancelled first."""
        if not 0 < n <= self.slot_bytes:
            return None
        loop = asyncio.get_running_loop()
        free = self.receive.queue()
        slot = await free.get()

        def give_back(_) -> None:
            try:
                loop.call_soon_threadsafe(free.put_nowait, slot)
            except RuntimeError:
                pass  # the loop is gone: so is every pull that could lease the slot

        job = self._reads.submit(self._read, segment, slot, remote, n)
        job.add_done_callback(give_back)
        return await asyncio.wrap_future(job)

    def _read(self, segment: str, slot: int, remote: int, n: int) -> bytes | None:
        if self.engine.transfer_sync_read(segment, slot, remote, n) != 0:
            return None
        return ctypes.string_at(slot, n)

    def close(self) -> None:
        # not waiting for a read still in flight: it holds this object, so its buffers outlive it
        self._reads.shutdown(wait=False)
        for part in (self.staging, self.receive):
            self.engine.unregister_memory(part.base)


def open_transport(host: str, protocol: str = "tcp", device: str = "", slot_bytes: int = SLOT_BYTES
                   ) -> tuple[MooncakeTransport | None, str]:
    """A started transport, or (None, why not) in one line."""
    if host in ("", "0.0.0.0", "::"):
        return None, f"the page host {host!r} is no address a peer can read a segment from"
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the engine logs each connection at INFO otherwise
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:
        return None, f"mooncake does not import: {exc}"
    try:
        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            return None, f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed"
        return MooncakeTransport(engine, host, protocol, slot_bytes), ""
    except (RuntimeError, OSError, ValueError, TypeError) as exc:
        return None, f"mooncake transfer engine failed to start: {exc}"
