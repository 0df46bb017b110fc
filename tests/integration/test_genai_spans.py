"""Spans in the OpenTelemetry GenAI conventions, caught by an in-memory exporter: the
gateway's `chat {model}` span with gen_ai.* request, usage and response attributes, the
session as gen_ai.conversation.id, Talaria's scheduling attributes under `talaria.`."""

from __future__ import annotations

import aiohttp
import nats
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from talaria.embedded import free_port
from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.router_service import run as run_router
from talaria.shared import tracing
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from tests.integration.harness import Services

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"
SESSION = "genai-session-1"


async def test_call_spans_follow_the_genai_conventions(nats_url, database_url, tmp_path, monkeypatch):
    memory = InMemorySpanExporter()
    setup = tracing.setup

    def with_memory(service, settings):  # each service's provider also hands its spans here
        provider = setup(service, settings)
        provider.add_span_processor(SimpleSpanProcessor(memory))
        return provider

    monkeypatch.setattr(tracing, "setup", with_memory)
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, models=(MODEL,))
    services = Services()
    try:
        await services.start("router", run_router, settings)
        await services.start("gateway", run_gateway, settings)
        await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
        nc = await nats.connect(settings.common.nats_url)
        await wait_for_router(nc, instances=1)
        await nc.close()
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "temperature": 0}
            async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                              headers={"X-Session-Id": SESSION}) as r:
                assert r.status == 200
                answer = await r.json()
                call_id = r.headers["X-Talaria-Call-Id"]
    finally:
        await services.close()
    spans = {s.name: s for s in memory.get_finished_spans()}
    chat = spans[f"chat {MODEL}"]
    a = chat.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.conversation.id"] == SESSION  # the gateway has no keys: the session as sent
    assert a["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0  # the session's first call
    assert tuple(a["gen_ai.response.finish_reasons"]) == (answer["choices"][0]["finish_reason"],)
    assert a["gen_ai.response.id"] == call_id and a["talaria.instance.id"] == "agent-0"
    assert a["talaria.kv_source"] in ("none", "recompute") and a["talaria.ttft_s"] > 0  # nothing kept yet
    assert not [k for k in a if not k.startswith(("gen_ai.", "talaria."))], "only GenAI and talaria. keys"
    route, execute = spans["route"], spans["execute"]
    assert route.attributes["talaria.route.action"] == "route" and route.attributes["talaria.instance.id"] == "agent-0"
    assert execute.attributes["gen_ai.conversation.id"] == SESSION
    assert execute.attributes["gen_ai.usage.output_tokens"] == a["gen_ai.usage.output_tokens"]
    # one trace: the router's and the agent's spans continue the gateway's
    assert {route.context.trace_id, execute.context.trace_id} == {chat.context.trace_id}
    assert chat.parent.span_id == tracing.session_span_id(SESSION)
