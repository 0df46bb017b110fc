"""The agent's side of KV migration (issue 40): it serves its host pages to peers and pulls a
routed call's pages from the holder the router named (CallRouted.kv_from) before the call
is scheduled. The control is the page protocol over TCP (memory/page_*.py); the page bytes
move by Mooncake's transfer engine where it imports and starts (memory/mooncake_transport.py),
else inline over the same TCP stream: chosen at start and logged (`kv page transport`).

Engine state is read and written on the engine thread only (EngineThread.call). A pull is
bounded (MAX_BYTES, a timeout from the measured link) and runs as a task cancelled with its
call; whatever arrives verified is imported as the session's host prefix, the rest recomputed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from talaria.services.instance_agent.engine.contract import PageStore
from talaria.services.instance_agent.engine.device_model import EMA
from talaria.services.instance_agent.memory.mooncake_transport import open_transport
from talaria.services.instance_agent.memory.page_client import pull
from talaria.services.instance_agent.memory.page_server import PageServer
from talaria.shared.events import CallRouted
from talaria.shared.stats import ewma
from talaria.shared.tokenizer import block_hashes

MAX_BYTES = 8 << 30  # one pull moves at most this much (a 1M-token context of a mid-size model)
MIN_TIMEOUT_S = 5.0  # a pull's time bound: this, or 4x its bytes at the measured link rate


@dataclass(frozen=True)
class Migrated:
    tokens: int = 0  # prompt tokens now restorable from the pulled pages
    bytes: int = 0
    seconds: float = 0.0
    why: str = ""  # why fewer pages than asked arrived ("" when all did)
    transport: str = "tcp"  # how the page bytes moved: tcp | mooncake


class KvMigration:
    """`transport`: auto (Mooncake where it starts, else TCP) | tcp; `protocol`, `device`:
    Mooncake's (tcp, or rdma with its NIC names where RDMA devices exist)."""

    def __init__(self, store: PageStore, thread, log, host: str = "127.0.0.1", port: int = 0,
                 transport: str = "auto", protocol: str = "tcp", device: str = "") -> None:
        self.store, self.thread, self.log = store, thread, log  # the engine, as a PageStore
        self.mode, self.protocol, self.device = transport, protocol, device
        self.server = PageServer(self._export, host, port)
        self.mooncake = None  # mooncake_transport.MooncakeTransport once started
        self.address = ""
        self.link_bytes_s: float | None = None  # this agent's pulls, measured (EWMA)
        self.setup_s: float | None = None  # connect + the holder's layout answer (EWMA)

    def bytes_per_token(self, model: str) -> int:
        return self.store.kv_bytes_per_token(model)

    async def start(self) -> str:
        why = "TALARIA_PAGE_TRANSPORT=tcp"
        if self.mode != "tcp":
            self.mooncake, why = open_transport(self.server.host, self.protocol, self.device)
        self.server.transport = self.mooncake
        self.address = await self.server.start()
        if self.mooncake is not None:
            self.log.info("kv page transport", transport="mooncake", address=self.address,
                          segment=self.mooncake.segment, protocol=self.protocol)
        else:
            self.log.info("kv page transport", transport="tcp", address=self.address, why=why)
        return self.address

    async def close(self) -> None:
        await self.server.close()
        if self.mooncake is not None:
            self.mooncake.close()

    async def _export(self, model: str, session_id: str, hashes: list[int], limit: int) -> list:
        return await self.thread.call(self.store.export_pages, model, session_id, hashes, limit)

    async def pull_into(self, routed: CallRouted) -> Migrated:
        """Pull the routed call's prefix pages from `routed.kv_from_address` into the host registry."""
        call = routed.call
        ps = self.store.page_size
        hashes = block_hashes(call.prompt_ids[: len(call.prompt_ids) - 1], ps, scope=call.kv_scope)
        if not hashes:
            return Migrated(why="no full page to pull")
        rate = self.link_bytes_s or 0.0
        size = len(hashes) * ps * self.store.kv_bytes_per_token(call.model)
        timeout = max(MIN_TIMEOUT_S, 4 * size / rate) if rate > 0 else MIN_TIMEOUT_S
        got = await pull(routed.kv_from_address, call.session_id, call.model, hashes, timeout_s=timeout,
                         max_bytes=MAX_BYTES, transport=self.mooncake)
        if not got.hashes and got.why.startswith("mooncake read"):  # its segment unreachable: the bytes inline
            self.log.warning("kv pull over mooncake failed, again over tcp", call_id=call.call_id, why=got.why)
            got = await pull(routed.kv_from_address, call.session_id, call.model, hashes, timeout_s=timeout,
                             max_bytes=MAX_BYTES)
        tokens = 0
        if got.hashes and got.layout is not None:
            lay = got.layout
            tokens = await self.thread.call(self.store.import_pages, call.model, call.session_id, got.hashes,
                                            got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
            self.setup_s = ewma(self.setup_s, got.setup_s, EMA)
            if got.seconds > got.setup_s:
                self.link_bytes_s = ewma(self.link_bytes_s, got.bytes / (got.seconds - got.setup_s), EMA)
        self.log.info("kv pulled", call_id=call.call_id, holder=routed.kv_from, tokens=tokens, bytes=got.bytes,
                      seconds=round(got.seconds, 4), transport=got.transport, why=got.why)
        return Migrated(tokens, got.bytes if tokens else 0, got.seconds, got.why, got.transport)
