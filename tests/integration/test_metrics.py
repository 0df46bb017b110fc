"""GET /metrics on every service after real calls: names, types and label sets as
shared/metrics.py defines them, and no label value is a session or call id."""

from __future__ import annotations

import json

import aiohttp
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from talaria.embedded import free_port
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from tests.integration.harness import Services, wait_until

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"
SESSION = "metrics-session-1"

# name -> (type, label names) that each service must expose after one call of each kind
EXPECTED = {
    "gateway": {
        "talaria_frontend_requests": ("counter", {"model", "endpoint", "status"}),
        "talaria_frontend_inflight_requests": ("gauge", {"model"}),
        "talaria_frontend_request_duration_seconds": ("histogram", {"model"}),
        "talaria_frontend_time_to_first_token_seconds": ("histogram", {"model"}),
        "talaria_frontend_inter_token_latency_seconds": ("histogram", {"model"}),
        "talaria_frontend_input_sequence_tokens": ("histogram", {"model"}),
        "talaria_frontend_output_sequence_tokens": ("histogram", {"model"}),
        "talaria_frontend_cached_tokens": ("histogram", {"model"}),
        "talaria_frontend_input_tokens": ("counter", {"model"}),
        "talaria_frontend_output_tokens": ("counter", {"model"}),
        "talaria_frontend_cached_input_tokens": ("counter", {"model"}),
        "talaria_frontend_http_responses": ("counter", {"route", "status"}),
    },
    "router": {
        "talaria_router_decisions": ("counter", {"model", "outcome", "path"}),
        "talaria_router_lease_events": ("counter", {"model", "outcome"}),
        "talaria_router_leases_active": ("gauge", {"model"}),
        "talaria_router_instances": ("gauge", set()),
        "talaria_router_sessions": ("gauge", set()),
        "talaria_router_checkpoint_seconds": ("histogram", set()),
        "talaria_router_decision_seconds": ("histogram", {"phase"}),
        "talaria_router_queue_estimate_error_seconds": ("histogram", {"model", "direction"}),
        "talaria_router_partitions_owned": ("gauge", set()),
        "talaria_router_partition_takeovers": ("counter", {"how"}),
        "talaria_router_peer_placement_lag_seconds": ("histogram", set()),
    },
    "agent-agent-0": {
        "talaria_agent_calls": ("counter", {"instance_id", "model", "outcome"}),
        "talaria_agent_call_kv_source": ("counter", {"instance_id", "model", "source"}),
        "talaria_agent_prompt_tokens": ("counter", {"instance_id", "model"}),
        "talaria_agent_generation_tokens": ("counter", {"instance_id", "model"}),
        "talaria_agent_request_queue_time_seconds": ("histogram", {"instance_id", "model"}),
        "talaria_agent_time_to_first_token_seconds": ("histogram", {"instance_id", "model"}),
        "talaria_agent_round_seconds": ("histogram", {"instance_id", "part"}),
        "talaria_agent_switch_seconds": ("histogram", {"instance_id", "path"}),
        "talaria_agent_engine_step_seconds": ("histogram", {"instance_id", "kind"}),
        "talaria_agent_session_kv_tokens": ("gauge", {"instance_id", "tier"}),
        "talaria_agent_num_requests": ("gauge", {"instance_id", "state"}),
    },
    "telemetry": {
        "talaria_telemetry_projection_lag_seconds": ("gauge", set()),
        "talaria_telemetry_projection_delay_seconds": ("histogram", set()),
        "talaria_telemetry_events_pending": ("gauge", set()),
        "talaria_telemetry_events_projected": ("counter", {"type"}),
        "talaria_telemetry_batches": ("counter", set()),
    },
}


async def scrape(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            assert r.status == 200 and r.content_type == "text/plain", (url, r.status, r.content_type)
            text = await r.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_sets(family) -> set[frozenset[str]]:
    return {frozenset(k for k in s.labels if k not in ("le", "quantile")) for s in family.samples}


def value(family, suffix: str = "", **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_every_service_exposes_its_metrics_after_calls(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, models=(MODEL,), metrics_port=0,
                        projection_interval_s=0.0, router_id="router-0")
    services = Services()
    call_ids = []
    try:
        await services.start_control_plane(settings)
        await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
        nc = await nats.connect(settings.common.nats_url)
        await wait_for_router(nc, instances=1)
        await nc.close()
        base = f"http://127.0.0.1:{settings.gateway.http_port}"
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/chat/completions", json={"model": "nope", "messages": []}) as r:
                assert r.status in (400, 404)  # refused before submission: counted all the same
            for stream in (False, True):  # a plain call, then the session's streamed second call
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {stream}"}],
                        "max_tokens": 4, "temperature": 0, "stream": stream}
                async with s.post(f"{base}/v1/chat/completions", json=body,
                                  headers={"X-Session-Id": SESSION}) as r:
                    assert r.status == 200
                    call_ids.append(r.headers["X-Talaria-Call-Id"])
                    await r.read()
        urls = {}
        for name, file in (("gateway", "gateway"), ("router", "router-0"), ("telemetry", "telemetry"), ("agent-agent-0", "agent-0")):
            urls[name] = (tmp_path / "metrics" / f"{file}.url").read_text().strip()

        async def projected():  # telemetry commits on its own schedule
            fams = await scrape(urls["telemetry"])
            done = value(fams["talaria_telemetry_events_projected"], "_total", type="call.completed")
            return fams if done >= 2 else None

        async def leased():  # the router folds the completions (and leases after them) on its own too
            fams = await scrape(urls["router"])
            return fams if fams["talaria_router_lease_events"].samples else None

        scraped = {"telemetry": await wait_until(projected, "telemetry to project both completions"),
                   "router": await wait_until(leased, "the router to lease after a completion")}
        for name in ("gateway", "agent-agent-0"):
            scraped[name] = await scrape(urls[name])
    finally:
        await services.close()

    for service, expected in EXPECTED.items():
        families = scraped[service]
        for name, (kind, labels) in expected.items():
            assert name in families, f"{service}: no {name}"
            fam = families[name]
            assert fam.type == kind, f"{service}: {name} is a {fam.type}, not a {kind}"
            assert fam.samples, f"{service}: {name} has no sample after the calls"
            assert label_sets(fam) == {frozenset(labels)}, f"{service}: {name} labels {label_sets(fam)}"
        forbidden = {SESSION, f":{SESSION}", *call_ids}
        for fam in families.values():
            for sample in fam.samples:
                assert not any(v in forbidden or SESSION in v for v in sample.labels.values()), \
                    f"{service}: {sample.name} has a session or call id in {sample.labels}"

    gw, router, agent = scraped["gateway"], scraped["router"], scraped["agent-agent-0"]
    assert value(gw["talaria_frontend_requests"], "_total", model=MODEL, status="200") == 2
    assert value(gw["talaria_frontend_http_responses"], "_total", route="/v1/chat/completions", status="200") == 2
    assert value(gw["talaria_frontend_http_responses"], "_total", route="/v1/chat/completions") == 3
    assert value(gw["talaria_frontend_inflight_requests"]) == 0
    assert value(gw["talaria_frontend_time_to_first_token_seconds"], "_count") == 2
    assert value(gw["talaria_frontend_output_tokens"], "_total") > 0
    assert value(router["talaria_router_decisions"], "_total", outcome="route") == 2
    assert value(router["talaria_router_instances"]) == 1
    assert value(router["talaria_router_sessions"]) == 1
    assert value(agent["talaria_agent_calls"], "_total", outcome="completed") == 2
    assert value(agent["talaria_agent_engine_step_seconds"], "_count", kind="prefill") >= 2
    # The second call of the session found its prefix kept on the device (no recompute).
    assert value(agent["talaria_agent_call_kv_source"], "_total", source="device") == 1
    assert json.dumps(sorted(scraped))  # every service answered


async def test_router_replicas_each_record_their_own_metrics_address(nats_url, database_url, tmp_path):
    """Replicas share the data directory: each writes <router id>.url, none overwrites another's."""
    from talaria.services.router.router_service import run as run_router

    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, metrics_port=0,
                           models=(MODEL,))
    services = Services()
    try:
        for rid in ("router-0", "router-1"):
            await services.start(rid, run_router, settings.with_(router_id=rid))
        urls = {rid: (tmp_path / "metrics" / f"{rid}.url").read_text().strip() for rid in ("router-0", "router-1")}
        assert len(set(urls.values())) == 2 and not (tmp_path / "metrics" / "router.url").exists()
        for url in urls.values():
            assert "talaria_router_partitions_owned" in await scrape(url)
    finally:
        await services.close()
