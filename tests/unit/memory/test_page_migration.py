"""KV page migration between two torch engines over real TCP (issue 40): the holder's page
server reads pages on its engine's thread, the puller checks each page on arrival, and a
return on the other engine gets the same greedy tokens whether its pages migrated, arrived
torn, stopped mid-transfer, or never came (recompute). Tenants' and sessions' pages stay theirs."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from talaria.services.instance_agent.engine import Sequence
from talaria.services.instance_agent.memory.page_client import pull
from talaria.services.instance_agent.memory.page_server import PageServer
from talaria.shared.tokenizer import block_hashes, encode

M = "qwen3-tiny"
PROMPT = encode("<|system|>You are a careful coding agent. Read before you edit, run the tests after every "
                "change.<|end|><|user|>parse('a,b') returns ['a,b']. Fix it.<|end|><|assistant|>")


def generate(engine, call_id, session, prompt, n=8, **kw):
    return engine.generate(Sequence(call_id, session, M, list(prompt), n, **kw))


@pytest.fixture
def pair(make_engine):
    """The holder (s1's first call ran there, its pages checkpointed to host), its owner thread
    and a fresh engine for the moved return; `follow` is that return's prompt, `expected` its
    greedy tokens computed from scratch."""
    holder, mover = make_engine([M]), make_engine([M])
    owner = ThreadPoolExecutor(1, thread_name_prefix="holder-engine")
    first = owner.submit(generate, holder, "c1", "s1", PROMPT).result()
    follow = PROMPT + first.token_ids + encode("<|tool|>3 passed<|end|><|assistant|>", bos=False)
    expected = generate(make_engine([M], hkvr=False, staging=False), "ref", "ref", follow).token_ids
    yield holder, owner, mover, follow, expected
    owner.shutdown()


def serve(holder, owner, export=None):
    async def on_owner_thread(model, session, hashes, limit):
        return await asyncio.get_running_loop().run_in_executor(owner, holder.export_pages, model, session, hashes,
                                                                limit)
    return PageServer(export or on_owner_thread)


def hashes_of(engine, prompt, scope=""):
    return block_hashes(prompt[: len(prompt) - 1], engine.page_size, scope=scope)


async def migrate(mover, address, follow, session="s1", scope="", transport=None, **bounds):
    bounds = {"timeout_s": 10.0, "max_bytes": 1 << 30, **bounds}
    got = await pull(address, session, M, hashes_of(mover, follow, scope), transport=transport, **bounds)
    layout = got.layout
    tokens = mover.import_pages(M, "s1", got.hashes, got.slabs, layout.dtype, tuple(layout.shape), layout.ranks) \
        if got.hashes else 0
    return got, tokens


def test_a_moved_return_gets_the_same_greedy_tokens_from_migrated_pages(pair):
    holder, owner, mover, follow, expected = pair

    async def go():
        server = serve(holder, owner)
        address = await server.start()
        try:
            return await migrate(mover, address, follow)
        finally:
            await server.close()

    got, tokens = asyncio.run(go())
    # the holder has the first call's full pages; the return's new tail is computed
    assert got.why == f"the holder had {len(got.hashes)} of {len(hashes_of(mover, follow))} pages"
    assert tokens == len(got.hashes) * mover.page_size > 0
    assert got.bytes == len(got.hashes) * holder.page_bytes(M)
    # its repr (asyncio.run formats it on exit before 3.13) leaves the page bytes out
    assert len(repr(got)) < got.bytes // 100
    out = generate(mover, "c2", "s1", follow, migrated_tokens=tokens)
    assert out.kv_source == "migrated" and out.cached_tokens >= tokens
    assert out.token_ids == expected


async def through_link(address, mangle):
    """A real TCP hop in front of the holder: the request goes through as is, the reply as
    `mangle(chunk, offset)` makes it (None: the link dies there)."""
    async def hop(r, w):
        ur, uw = await asyncio.open_connection(*address.split(":"))
        uw.write(await r.read(1 << 16))
        sent = 0
        while chunk := await ur.read(1 << 16):
            out = mangle(chunk, sent)
            if out is None:
                break
            w.write(out)
            sent += len(chunk)
        await w.drain()
        w.close()
        uw.close()

    proxy = await asyncio.start_server(hop, "127.0.0.1", 0)
    return proxy, "127.0.0.1:%d" % proxy.sockets[0].getsockname()[1]


def moved_through(pair, mangle):
    holder, owner, mover, follow, _ = pair

    async def go():
        server = serve(holder, owner)
        proxy, address = await through_link(await server.start(), mangle)
        try:
            return await migrate(mover, address, follow)
        finally:
            proxy.close()
            await server.close()

    return asyncio.run(go())


def test_a_page_torn_in_transit_ends_the_prefix_and_the_rest_is_recomputed_with_the_same_tokens(pair):
    holder, _, mover, follow, expected = pair
    at = int(2.5 * holder.page_bytes(M))  # a byte inside the third page's slabs

    def flip(chunk, offset):
        if offset <= at < offset + len(chunk):
            chunk = bytearray(chunk)
            chunk[at - offset] ^= 1
        return bytes(chunk)

    got, tokens = moved_through(pair, flip)
    assert len(got.hashes) == 2 and "hash check" in got.why
    out = generate(mover, "c2", "s1", follow, migrated_tokens=tokens)
    assert out.token_ids == expected


def test_a_holder_dying_mid_transfer_leaves_a_verified_prefix_and_the_same_tokens(pair):
    holder, _, mover, follow, expected = pair
    cut = 3 * holder.page_bytes(M)  # the holder's link dies a little before three pages

    got, tokens = moved_through(pair, lambda chunk, offset: chunk[: cut - offset] if offset < cut else None)
    assert 0 < len(got.hashes) < 3 and "broke" in got.why
    out = generate(mover, "c2", "s1", follow, migrated_tokens=tokens)
    assert out.kv_source == "migrated" and out.token_ids == expected


def test_pages_go_only_to_the_same_tenant_and_session_and_within_the_byte_bound(pair):
    holder, owner, mover, follow, _ = pair

    async def go():
        server = serve(holder, owner)
        address = await server.start()
        try:
            other_tenant = await pull(address, "s1", M, hashes_of(mover, follow, scope="tenant-b"), timeout_s=10,
                                      max_bytes=1 << 30)
            other_session = await pull(address, "s2", M, hashes_of(mover, follow), timeout_s=10, max_bytes=1 << 30)
            bounded = await pull(address, "s1", M, hashes_of(mover, follow), timeout_s=10,
                                 max_bytes=2 * holder.page_bytes(M))
            return other_tenant, other_session, bounded
        finally:
            await server.close()

    other_tenant, other_session, bounded = asyncio.run(go())
    assert other_tenant.hashes == [] and other_session.hashes == []
    assert len(bounded.hashes) == 2


def test_a_silent_holder_is_given_up_at_the_time_bound_and_a_cancelled_pull_closes_its_connection():
    async def go():
        connected, seen_eof = asyncio.Event(), asyncio.Event()

        async def silent(r, w):
            connected.set()
            await r.read()  # returns at EOF: the puller closed the connection
            seen_eof.set()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        address = "127.0.0.1:%d" % server.sockets[0].getsockname()[1]
        timed = await pull(address, "s1", M, [1, 2], timeout_s=0.2, max_bytes=1 << 20)
        connected.clear()
        seen_eof.clear()
        task = asyncio.create_task(pull(address, "s1", M, [1, 2], timeout_s=60, max_bytes=1 << 20))
        await asyncio.wait_for(connected.wait(), 5)
        task.cancel()  # the call was cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(seen_eof.wait(), 5)  # the holder sees the connection go
        server.close()
        return timed

    timed = asyncio.run(go())
    assert timed.hashes == [] and "timed out" in timed.why


# -- Mooncake's transfer engine as the bulk path (memory/mooncake_transport.py) ----------------

def mooncake(slot_bytes=None):
    """A started transport on loopback (`tcp` protocol), or the test skips saying why not."""
    from talaria.services.instance_agent.memory.mooncake_transport import open_transport

    kw = {"slot_bytes": slot_bytes} if slot_bytes else {}
    transport, why = open_transport("127.0.0.1", "tcp", **kw)
    if transport is None:
        pytest.skip(f"no Mooncake transfer engine here: {why}")
    return transport


async def counting_link(address, streamed):
    """A TCP hop both ways (the puller's acks go up) that counts the bytes coming back."""
    async def pipe(r, w, count):
        while chunk := await r.read(1 << 16):
            streamed[0] += len(chunk) if count else 0
            w.write(chunk)
            await w.drain()
        w.close()

    async def hop(r, w):
        ur, uw = await asyncio.open_connection(*address.split(":"))
        await asyncio.gather(pipe(r, uw, False), pipe(ur, w, True), return_exceptions=True)

    proxy = await asyncio.start_server(hop, "127.0.0.1", 0)
    return proxy, "127.0.0.1:%d" % proxy.sockets[0].getsockname()[1]


def moved_by_mooncake(pair, holder_side, mover_side, stage=None):
    """Pull s1's pages from a holder with transport `holder_side` into the mover with
    `mover_side` (None: TCP only) through a counting TCP hop; the pull, the tokens imported
    and the bytes the TCP stream carried back. `stage` replaces the holder's staging copy."""
    holder, owner, mover, follow, _ = pair
    streamed = [0]
    if stage is not None:
        holder_side.stage = stage

    async def go():
        server = serve(holder, owner)
        server.transport = holder_side
        proxy, address = await counting_link(await server.start(), streamed)
        try:
            return await migrate(mover, address, follow, transport=mover_side)
        finally:
            proxy.close()
            await server.close()

    got, tokens = asyncio.run(go())
    return got, tokens, streamed[0]


def test_over_mooncake_the_page_bytes_bypass_the_tcp_stream_and_the_tokens_are_the_same(pair):
    holder, _, mover, follow, expected = pair
    slot = 3 * holder.page_bytes(M)  # three pages a chunk: several chunks, each acked before the next
    got, tokens, streamed = moved_by_mooncake(pair, mooncake(slot), mooncake(slot))
    assert got.transport == "mooncake"
    assert got.why == f"the holder had {len(got.hashes)} of {len(hashes_of(mover, follow))} pages"
    assert len(got.hashes) > 3 and tokens == len(got.hashes) * mover.page_size
    assert streamed < got.bytes / 10  # only the frames went over TCP
    out = generate(mover, "c2", "s1", follow, migrated_tokens=tokens)
    assert out.kv_source == "migrated" and out.token_ids == expected


def test_a_page_torn_in_the_mooncake_slot_ends_the_prefix_and_the_rest_is_recomputed(pair):
    holder, _, mover, follow, expected = pair
    side = mooncake(3 * holder.page_bytes(M))
    real, staged = side.stage, []

    def torn(slot, offset, slabs):  # the fourth page's bytes change after its digest was taken
        staged.append(offset)
        return real(slot, offset, [bytes([slabs[0][0] ^ 1]) + slabs[0][1:], *slabs[1:]] if len(staged) == 4 else slabs)

    got, tokens, _ = moved_by_mooncake(pair, side, mooncake(), stage=torn)
    assert len(got.hashes) == 3 and "hash check" in got.why
    out = generate(mover, "c2", "s1", follow, migrated_tokens=tokens)
    assert out.token_ids == expected


def test_a_mooncake_side_and_a_tcp_only_side_still_migrate_over_tcp(pair):
    holder, _, mover, follow, expected = pair
    pulled_by_tcp_only, _, streamed = moved_by_mooncake(pair, mooncake(), None)
    assert pulled_by_tcp_only.transport == "tcp" and streamed > pulled_by_tcp_only.bytes > 0
    from_tcp_only, tokens, _ = moved_by_mooncake(pair, None, mooncake())
    assert from_tcp_only.transport == "tcp" and from_tcp_only.hashes == pulled_by_tcp_only.hashes
    assert generate(mover, "c2", "s1", follow, migrated_tokens=tokens).token_ids == expected


def test_without_the_mooncake_package_the_transport_falls_back_with_a_reason(monkeypatch):
    from talaria.services.instance_agent.memory.mooncake_transport import open_transport

    monkeypatch.setitem(__import__("sys").modules, "mooncake.engine", None)
    transport, why = open_transport("127.0.0.1")
    assert transport is None and why.startswith("mooncake does not import")


class Owner:
    """The engine's owner thread, as KvMigration calls it (EngineThread.call)."""

    def __init__(self, pool):
        self.pool = pool

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


class Log:
    def __init__(self):
        self.lines = []

    def info(self, event, **kw):
        self.lines.append((event, kw))

    warning = info


def routed_return(follow, address):
    from talaria.shared.events import CallRouted, CallSubmitted

    call = CallSubmitted("c2", "s1", M, follow, [], 8, 0.0)
    return CallRouted(call, 1, "mover", "talaria", 0.0, kv_from="holder", kv_from_address=address)


def agents_migrate(pair, mode="auto", segment=None):
    """Two agents' KvMigration (the holder's and the mover's, each on its engine's owner
    thread); the mover pulls the routed return's pages. Their logs and the pull's record.
    `segment` renames the holder's Mooncake segment after start (a peer cannot reach it)."""
    from talaria.services.instance_agent.kv_migration import KvMigration

    holder, owner, mover, follow, _ = pair
    logs = Log(), Log()

    async def go():
        near = KvMigration(holder, Owner(owner), logs[0], transport=mode)
        far = KvMigration(mover, Owner(owner), logs[1], transport=mode)
        await near.start()
        await far.start()
        if segment and near.mooncake is not None:
            near.mooncake.segment = segment
        try:
            return await far.pull_into(routed_return(follow, near.address))
        finally:
            await near.close()
            await far.close()

    return asyncio.run(go()), logs


def test_an_agent_logs_its_transport_at_start_and_its_pulls_record_it(pair):
    mooncake()  # skips where Mooncake does not start
    holder, _, mover, follow, expected = pair
    got, (near, far) = agents_migrate(pair)
    assert [kw["transport"] for e, kw in near.lines if e == "kv page transport"] == ["mooncake"]
    assert got.transport == "mooncake" and got.tokens > 0
    assert [kw["transport"] for e, kw in far.lines if e == "kv pulled"] == ["mooncake"]
    out = generate(mover, "c2", "s1", follow, migrated_tokens=got.tokens)
    assert out.token_ids == expected


def test_tcp_by_setting_and_an_unreachable_segment_fall_back_to_the_bytes_inline(pair):
    mooncake()
    tcp, (near, _) = agents_migrate(pair, mode="tcp")
    assert [kw for e, kw in near.lines if e == "kv page transport"][0]["why"] == "TALARIA_PAGE_TRANSPORT=tcp"
    assert tcp.transport == "tcp" and tcp.tokens > 0
    fallback, (_, far) = agents_migrate(pair, segment="127.0.0.1:1")
    assert fallback.transport == "tcp" and fallback.tokens == tcp.tokens
    assert any(e == "kv pull over mooncake failed, again over tcp" for e, _ in far.lines)


# -- The holder's stall fault (TALARIA_FAULT_PAGE_STALL; the live kill test's hook) ----------

@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_the_stall_fault_holds_a_pull_after_k_pages_and_says_so(pair, transport):
    """With the fault set a pull gets exactly K verified pages, then nothing until its time
    bound; the hook says how many left (the live test kills the holder on that word)."""
    holder, owner, mover, follow, expected = pair
    sides = (mooncake(), mooncake()) if transport == "mooncake" else (None, None)
    stalled = []

    async def go():
        server = serve(holder, owner)
        server.transport, server.stall_after, server.on_stall = sides[0], 2, stalled.append
        address = await server.start()
        try:
            return await migrate(mover, address, follow, transport=sides[1], timeout_s=2.0)
        finally:
            await server.close()

    got, tokens = asyncio.run(go())
    assert stalled == [2] and got.transport == transport
    assert len(got.hashes) == 2 and tokens == 2 * mover.page_size and got.why == "timed out after 2 s"
    assert generate(mover, "c2", "s1", follow, migrated_tokens=tokens).token_ids == expected


def test_the_stall_fault_is_off_unless_named_and_a_bad_value_is_refused_clearly():
    from talaria.services.instance_agent.memory.page_server import stall_fault
    from talaria.shared.settings import SettingsError

    assert stall_fault({}) is None and stall_fault({"TALARIA_FAULT_PAGE_STALL": ""}) is None
    assert stall_fault({"TALARIA_FAULT_PAGE_STALL": "3"}) == 3
    with pytest.raises(SettingsError, match=r"TALARIA_FAULT_PAGE_STALL='three': expected a number of pages"):
        stall_fault({"TALARIA_FAULT_PAGE_STALL": "three"})
