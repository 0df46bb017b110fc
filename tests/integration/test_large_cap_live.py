"""A 32,000-token `max_tokens` on a 131K-context model, live: neither refused nor queued for
its cap. The router estimates each call's output from completed calls and the engine reserves
KV for prompt + that estimate, so eight concurrent 2,000-token calls with Claude Code's cap
(which by the cap would need 8 x 34,000 tokens of a 131,072-token KV pool) all complete."""

from __future__ import annotations

import asyncio

import nats
import pytest

from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.health import wait_for_router
from talaria.shared.messages import REPLY_DECODER, CallRequest, CallResult
from talaria.shared.model_text import text_for
from talaria.shared.settings import Settings
from talaria.shared.wire import encode
from talaria.embedded import free_port
from tests.integration.harness import Services, wait_rows
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"  # 131,072-token context; the engine's pool holds one such context
CAP = 32_000  # what Claude Code sends


async def test_a_32k_cap_is_neither_refused_nor_queued_for_its_cap(nats_url, database_url, tmp_path, db):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=120, models=(MODEL,))
    services = Services()
    await services.start_control_plane(settings)
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(settings.common.nats_url)
    assert BUILTIN_MODELS[MODEL].context_length == 131_072
    eos = text_for(BUILTIN_MODELS[MODEL]).eos_ids[0]
    filler = "the quick brown fox jumps over the lazy dog; " * 230  # ~2,000 tokens

    async def call(session: str, call_id: str):
        # the bias makes the random-weight model answer at once, as a tool call often does
        req = CallRequest(model=MODEL, prompt=f"{session} {filler}", session_id=session, call_id=call_id,
                          max_tokens=CAP, temperature=0, logit_bias={eos: 100.0})
        return REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=120)).data)

    try:
        await wait_for_router(nc, instances=1)
        first = await call("warm", "warm-0")  # no history yet: reserved for its cap, alone it fits
        assert isinstance(first, CallResult), first
        replies = await asyncio.gather(*(call(f"s{k}", f"big-{k}") for k in range(8)))
        assert all(isinstance(r, CallResult) for r in replies), replies
        assert all(r.usage.completion_tokens == 1 for r in replies)
        rows = await wait_rows(db, "SELECT * FROM calls WHERE call_id LIKE 'big-%' AND outcome='completed'", 8)
        assert len(rows) == 8 and not [r for r in rows if r["error"]]
        # none waited for room: every call's queue time is its turn behind the others' prefill,
        # never a KV wait or a retry
        refused = await db.fetch("SELECT call_id FROM calls WHERE outcome='failed'")
        assert not refused
    finally:
        await nc.close()
        await services.close()
