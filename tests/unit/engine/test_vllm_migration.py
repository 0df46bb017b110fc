"""KV migration between two vLLM engines (issue 40, ask 3; docs/migration.md "vLLM"): the holder's
page server asks its engine thread for a session's pages (`VllmEngine.export_pages`: leased in
the engine core's connector, copied out of the shared pool), the puller checks each on arrival,
and `import_pages` reserves slots in the mover's connector, writes them and publishes. A moved
return then loads them as any host hit and gets the greedy tokens of a return that stayed, with
`kv_source = migrated`; a transfer cut mid-way leaves a verified prefix and the rest is
recomputed with the same tokens. Pages stay their tenant's and their session's.

Skipped where vLLM is not installed (`.ci/vllm_stage.sh` runs it in its own venv). Two engines
serve the module (vLLM starts two processes for each, ~20 s apiece); every test uses its own
tenant scope, so the pages one test moved never serve another's return.
"""

from __future__ import annotations

import asyncio
import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (the vllm engine's tests run in .ci/vllm_stage.sh's venv)",
                allow_module_level=True)

from talaria.services.instance_agent.engine import Sequence  # noqa: E402
from talaria.services.instance_agent.engine.contract import PageStore  # noqa: E402
from talaria.services.instance_agent.engine.vllm_engine import VllmEngine  # noqa: E402
from talaria.services.instance_agent.memory.page_client import list_pages, pull  # noqa: E402
from talaria.services.instance_agent.memory.page_server import PageServer  # noqa: E402
from talaria.shared.tokenizer import encode  # noqa: E402
from tests.unit.memory.test_page_migration import through_link  # noqa: E402

A = "qwen3-tiny"
BLOCK = 32  # tokens per vLLM block (= per migrated page): PROMPT spans ~25 of them
PROMPT = encode("<|system|>You are a careful coding agent. Read before you edit, run the tests after every "
                "change.<|end|><|user|>" + "parse('a,b') returns ['a,b'] instead of ['a', 'b']. " * 12
                + "Fix it.<|end|><|assistant|>")
TAIL = encode("<|tool|>3 passed, 1 failed<|end|><|assistant|>", bos=False)


def engine(data_dir) -> VllmEngine:
    return VllmEngine(data_dir, [A], hkvr=True, max_model_len=2048, block_size=BLOCK)


@pytest.fixture(scope="module")
def engines(data_dir):
    """(holder, its engine thread, mover): the holder is driven from its own thread, as the
    agent's EngineThread drives it while its page server exports."""
    holder = engine(data_dir)
    mover = engine(data_dir)
    owner = ThreadPoolExecutor(1, thread_name_prefix="holder-engine")
    yield holder, owner, mover
    owner.shutdown()
    holder.close()
    mover.close()


def run(eng, call_id, session, prompt, n=12, scope="", migrated=0) -> Sequence:
    seq = Sequence(call_id, session, A, list(prompt), n, kv_scope=scope, migrated_tokens=migrated)
    step = eng.prefill([seq])[0]
    while not step.finished:
        step = eng.decode([seq])[0]
    return eng.finish(seq)


def first_call(engines, session, scope):
    """The session's first call on the holder (its blocks saved to the connector's pool) and
    the return that follows it."""
    holder, owner, _ = engines
    first = owner.submit(run, holder, "c1-" + scope, session, PROMPT, 12, scope).result()
    return PROMPT + first.token_ids + TAIL


def moved(engines, session, follow, scope, *, ask_scope=None, ask_session=None, link=None, **bounds):
    """Pull the session's pages of `follow` from the holder's page server (through `link`'s TCP
    hop when given) into the mover; (the pull, the tokens the mover can now restore)."""
    holder, owner, mover = engines

    async def export(model, sid, hashes, limit):
        return await asyncio.get_running_loop().run_in_executor(owner, holder.export_pages, model, sid, hashes, limit)

    async def go():
        server = PageServer(export)
        address = await server.start()
        proxy = None
        if link is not None:
            proxy, address = await through_link(address, link)
        try:
            hashes = mover.page_hashes(A, follow[:-1], scope if ask_scope is None else ask_scope)
            return await pull(address, ask_session or session, A, hashes, **{"timeout_s": 30.0,
                                                                               "max_bytes": 1 << 30, **bounds})
        finally:
            if proxy is not None:
                proxy.close()
            await server.close()

    got = asyncio.run(go())
    tokens = 0
    if got.hashes:
        lay = got.layout
        tokens = mover.import_pages(A, session, got.hashes, got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
    return got, tokens


def test_a_moved_return_gets_the_same_greedy_tokens_as_one_that_stayed(engines):
    holder, owner, mover = engines
    assert isinstance(holder, PageStore) and holder.capabilities.kv_migration
    assert holder.page_size == BLOCK and holder.kv_bytes_per_token(A) > 0
    follow = first_call(engines, "s1", "tenant-a")
    got, tokens = moved(engines, "s1", follow, "tenant-a")
    asked = mover.page_hashes(A, follow[:-1], "tenant-a")
    # the holder had the first call's full blocks (prompt and decoded tokens); the return's tail is new
    assert 0 < len(got.hashes) < len(asked) and got.why.startswith("the holder had")
    assert got.hashes == asked[:len(got.hashes)] and tokens == len(got.hashes) * BLOCK
    assert got.bytes == tokens * mover.kv_bytes_per_token(A)
    assert mover.kv_state("s1", A) == "host"
    back = run(mover, "c2", "s1", follow, scope="tenant-a", migrated=tokens)
    stayed = owner.submit(run, holder, "c2-stayed", "s1", follow, 12, "tenant-a").result()
    fresh = run(mover, "c2-fresh", "s-fresh", follow, scope="tenant-fresh")
    assert back.kv_source == "migrated" and back.host_restored_tokens == tokens
    assert stayed.kv_source == "device" and fresh.kv_source == "recompute"
    assert back.token_ids == stayed.token_ids == fresh.token_ids


def test_a_drains_listing_names_the_sessions_host_prefix_and_pushes_it(engines):
    holder, owner, mover = engines
    follow = first_call(engines, "s-push", "tenant-p")

    async def listing():
        async def export(model, sid, hashes, limit):
            return await asyncio.get_running_loop().run_in_executor(owner, holder.export_pages, model, sid, hashes,
                                                                    limit)

        async def listed(model, sid):
            return await asyncio.get_running_loop().run_in_executor(owner, holder.session_hashes, model, sid)

        server = PageServer(export, listing=listed)
        address = await server.start()
        try:
            hashes, why = await list_pages(address, "s-push", A, timeout_s=30)
            return hashes, why, await pull(address, "s-push", A, hashes, timeout_s=30, max_bytes=1 << 30)
        finally:
            await server.close()

    hashes, why, got = asyncio.run(listing())
    assert why == "" and hashes == mover.page_hashes(A, follow, "tenant-p")[:len(hashes)] and hashes
    assert got.hashes == hashes
    lay = got.layout
    tokens = mover.import_pages(A, "s-push", got.hashes, got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
    back = run(mover, "c2-push", "s-push", follow, scope="tenant-p", migrated=tokens)
    fresh = run(mover, "c2-push-fresh", "s-push-fresh", follow, scope="tenant-p-fresh")
    assert back.kv_source == "migrated" and back.host_restored_tokens == tokens == len(hashes) * BLOCK
    assert back.token_ids == fresh.token_ids


def test_a_holder_dying_mid_transfer_leaves_a_verified_prefix_and_the_same_tokens(engines):
    _, _, mover = engines
    follow = first_call(engines, "s-cut", "tenant-c")
    cut = int(2.5 * BLOCK * mover.kv_bytes_per_token(A))  # the link dies inside the third page
    got, tokens = moved(engines, "s-cut", follow, "tenant-c",
                        link=lambda chunk, offset: chunk[: cut - offset] if offset < cut else None)
    assert len(got.hashes) == 2 and "broke" in got.why and tokens == 2 * BLOCK
    back = run(mover, "c2-cut", "s-cut", follow, scope="tenant-c", migrated=tokens)
    fresh = run(mover, "c2-cut-fresh", "s-cut-fresh", follow, scope="tenant-c-fresh")
    assert back.kv_source == "migrated" and back.host_restored_tokens == 2 * BLOCK
    assert back.token_ids == fresh.token_ids


def test_a_page_torn_in_transit_ends_the_prefix_and_the_rest_is_recomputed(engines):
    _, _, mover = engines
    follow = first_call(engines, "s-torn", "tenant-t")
    at = int(1.5 * BLOCK * mover.kv_bytes_per_token(A))  # a byte inside the second page

    def flip(chunk, offset):
        if offset <= at < offset + len(chunk):
            chunk = bytearray(chunk)
            chunk[at - offset] ^= 1
        return bytes(chunk)

    got, tokens = moved(engines, "s-torn", follow, "tenant-t", link=flip)
    assert len(got.hashes) == 1 and "hash check" in got.why
    back = run(mover, "c2-torn", "s-torn", follow, scope="tenant-t", migrated=tokens)
    fresh = run(mover, "c2-torn-fresh", "s-torn-fresh", follow, scope="tenant-t-fresh")
    assert back.host_restored_tokens == BLOCK and back.token_ids == fresh.token_ids


def test_pages_go_only_to_the_same_tenant_and_session_and_a_foreign_layout_is_refused(engines):
    _, _, mover = engines
    follow = first_call(engines, "s-own", "tenant-o")
    other_tenant, _ = moved(engines, "s-own", follow, "tenant-o", ask_scope="tenant-x")
    other_session, _ = moved(engines, "s-own", follow, "tenant-o", ask_session="s-other")
    bounded, _ = moved(engines, "s-bounded", follow, "tenant-o", ask_session="s-own",
                       max_bytes=3 * BLOCK * mover.kv_bytes_per_token(A))
    assert other_tenant.hashes == [] and other_session.hashes == []
    assert len(bounded.hashes) == 3
    lay = bounded.layout
    assert mover.import_pages(A, "s-odd", bounded.hashes, bounded.slabs, "float32", tuple(lay.shape), 1) == 0
    assert mover.import_pages(A, "s-odd", bounded.hashes, bounded.slabs, lay.dtype, (1, 2), 1) == 0
    assert mover.kv_state("s-odd", A) == "none"


def test_over_mooncake_the_tokens_are_the_same(engines):
    from talaria.services.instance_agent.memory.mooncake_transport import open_transport

    holder, owner, mover = engines
    holder_side, why = open_transport("127.0.0.1", "tcp")
    if holder_side is None:
        pytest.skip(f"no Mooncake transfer engine here: {why}")
    mover_side, _ = open_transport("127.0.0.1", "tcp")
    follow = first_call(engines, "s-mc", "tenant-m")

    async def export(model, sid, hashes, limit):
        return await asyncio.get_running_loop().run_in_executor(owner, holder.export_pages, model, sid, hashes, limit)

    async def go():
        server = PageServer(export, transport=holder_side)
        address = await server.start()
        try:
            return await pull(address, "s-mc", A, mover.page_hashes(A, follow[:-1], "tenant-m"), timeout_s=30,
                              max_bytes=1 << 30, transport=mover_side)
        finally:
            await server.close()

    try:
        got = asyncio.run(go())
    finally:
        holder_side.close()
        mover_side.close()
    assert got.transport == "mooncake" and got.hashes
    lay = got.layout
    tokens = mover.import_pages(A, "s-mc", got.hashes, got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
    back = run(mover, "c2-mc", "s-mc", follow, scope="tenant-m", migrated=tokens)
    fresh = run(mover, "c2-mc-fresh", "s-mc-fresh", follow, scope="tenant-m-fresh")
    assert back.kv_source == "migrated" and back.host_restored_tokens == tokens > 0
    assert back.token_ids == fresh.token_ids


def test_an_agents_migration_pulls_a_routed_return_into_the_vllm_engine(engines):
    """The agent's glue (kv_migration.KvMigration) on vLLM: the requester asks for its engine's
    own page keys (`page_hashes`: one per vLLM block), the holder exports on its engine thread,
    and the return restores them as migrated."""
    from talaria.services.instance_agent.kv_migration import KvMigration
    from talaria.shared.events import CallRouted, CallSubmitted
    from tests.unit.memory.test_page_migration import Log, Owner

    holder, owner, mover = engines
    follow = first_call(engines, "s-agent", "tenant-g")
    here = ThreadPoolExecutor(1, thread_name_prefix="mover-engine")

    async def go():
        near = KvMigration(holder, Owner(owner), Log(), transport="tcp")
        far = KvMigration(mover, Owner(here), Log(), transport="tcp")
        address = await near.start()
        await far.start()
        try:
            call = CallSubmitted("c2-agent", "s-agent", A, follow, [], 12, 0.0, kv_scope="tenant-g")
            return await far.pull_into(CallRouted(call, 1, "mover", "talaria", 0.0, kv_from="holder",
                                                  kv_from_address=address))
        finally:
            await near.close()
            await far.close()

    got = asyncio.run(go())
    here.shutdown()
    assert got.tokens > 0 and got.tokens % BLOCK == 0 and got.bytes == got.tokens * mover.kv_bytes_per_token(A)
    back = run(mover, "c2-agent", "s-agent", follow, scope="tenant-g", migrated=got.tokens)
    fresh = run(mover, "c2-agent-fresh", "s-agent-fresh", follow, scope="tenant-g-fresh")
    assert back.kv_source == "migrated" and back.host_restored_tokens == got.tokens
    assert back.token_ids == fresh.token_ids
