"""The agent's side of KV migration (issue 40): it serves its host pages to peers and pulls a
routed call's pages from the holder the router named (CallRouted.kv_from) before the call
is scheduled. The control is the page protocol over TCP (memory/page_*.py); the page bytes
move by Mooncake's transfer engine where it imports and starts (memory/mooncake_transport.py),
else inline over the same TCP stream: chosen at start and logged (`kv page transport`).

A drain pushes a session ahead of its call (`push`, KvPushRequested): the agent lists the
session's host prefix at the holder, pulls it the same way and keeps what arrived as
`pushed`, so the session's next call here reports `kv_source = migrated` with those bytes.
Engine state is touched on the engine thread only (EngineThread.call). A pull is bounded
(MAX_BYTES, a timeout from the measured link); what arrives verified is imported as the
session's host prefix, the rest recomputed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from talaria.services.instance_agent.engine.contract import PageStore
from talaria.services.instance_agent.engine.device_model import EMA
from talaria.services.instance_agent.memory.mooncake_transport import open_transport
from talaria.services.instance_agent.memory.page_client import list_pages, pull
from talaria.services.instance_agent.memory.page_server import STALL_ENV, PageServer, stall_fault
from talaria.shared.events import CallRouted, KvPushed, KvPushRequested
from talaria.shared.stats import ewma

MAX_BYTES = 8 << 30  # one pull moves at most this much (a 1M-token context of a mid-size model)
MAX_PUSHED = 4096  # pushes remembered for their session's next call (its kv_source)
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
        self.server = PageServer(self._export, host, port, listing=self._listing, stall_after=stall_fault(),
                                 on_stall=lambda sent: log.warning("kv page server stalled (fault injected)",
                                                                   fault=STALL_ENV, pages_sent=sent))
        # (session, model) -> a drain's push that landed here, until the session's next call uses it
        self.pushed: dict[tuple[str, str], Migrated] = {}
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

    async def _listing(self, model: str, session_id: str) -> list[int]:
        return await self.thread.call(self.store.session_hashes, model, session_id)

    async def pull_into(self, routed: CallRouted) -> Migrated:
        """Pull the routed call's prefix pages from `routed.kv_from_address` into the host registry."""
        call = routed.call
        hashes = self.store.page_hashes(call.model, call.prompt_ids[: len(call.prompt_ids) - 1], call.kv_scope)
        if not hashes:
            return Migrated(why="no full page to pull")
        got, tokens = await self._pull(routed.kv_from_address, call.session_id, call.model, hashes)
        self.log.info("kv pulled", call_id=call.call_id, holder=routed.kv_from, tokens=tokens, bytes=got.bytes,
                      seconds=round(got.seconds, 4), transport=got.transport, why=got.why)
        return Migrated(tokens, got.bytes if tokens else 0, got.seconds, got.why, got.transport)

    async def push(self, ask: KvPushRequested) -> KvPushed:
        """A drain's push: list the session's host prefix at the holder, pull it, keep it here."""
        hashes, why = await list_pages(ask.holder_address, ask.session_id, ask.model, timeout_s=MIN_TIMEOUT_S)
        got, tokens = None, 0
        if hashes:
            got, tokens = await self._pull(ask.holder_address, ask.session_id, ask.model, hashes)
            why = got.why
        pages = len(got.hashes) if got is not None and tokens else 0
        done = KvPushed(ask.instance_id, ask.session_id, ask.model, ask.holder, time.time(), listed=len(hashes),
                        pages=pages, tokens=tokens, bytes=got.bytes if pages else 0,
                        seconds=got.seconds if got is not None else 0.0,
                        transport=got.transport if got is not None else "tcp", why=why)
        if pages:
            if len(self.pushed) >= MAX_PUSHED:  # sessions that never came back: the oldest go
                del self.pushed[next(iter(self.pushed))]
            self.pushed[(ask.session_id, ask.model)] = Migrated(tokens, done.bytes, done.seconds, why, done.transport)
        self.log.info("kv pushed here", session_id=ask.session_id, holder=ask.holder, listed=len(hashes),
                      pages=pages, tokens=tokens, bytes=done.bytes, seconds=round(done.seconds, 4),
                      transport=done.transport, why=why)
        return done

    async def _pull(self, address: str, session_id: str, model: str, hashes: list[int]):
        """(what arrived, the tokens now restorable here): pulled and imported as the host prefix."""
        ps = self.store.page_size
        rate = self.link_bytes_s or 0.0
        size = len(hashes) * ps * self.store.kv_bytes_per_token(model)
        timeout = max(MIN_TIMEOUT_S, 4 * size / rate) if rate > 0 else MIN_TIMEOUT_S
        got = await pull(address, session_id, model, hashes, timeout_s=timeout,
                         max_bytes=MAX_BYTES, transport=self.mooncake)
        if not got.hashes and got.why.startswith("mooncake read"):  # its segment unreachable: the bytes inline
            self.log.warning("kv pull over mooncake failed, again over tcp", session_id=session_id, why=got.why)
            got = await pull(address, session_id, model, hashes, timeout_s=timeout, max_bytes=MAX_BYTES)
        tokens = 0
        if got.hashes and got.layout is not None:
            lay = got.layout
            tokens = await self.thread.call(self.store.import_pages, model, session_id, got.hashes,
                                            got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
            self.setup_s = ewma(self.setup_s, got.setup_s, EMA)
            if got.seconds > got.setup_s:
                self.link_bytes_s = ewma(self.link_bytes_s, got.bytes / (got.seconds - got.setup_s), EMA)
        return got, tokens
