"""What an event means for a metric (shared/metrics.py): pure, no server."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from talaria.shared.events import CallCompleted, CallFailed, CandidateCost, LeaseExpired, RoutingDecision
from talaria.shared.messages import Timings, Usage
from talaria.shared.metrics import AgentMetrics, FrontendMetrics, RouterMetrics, decision_path


def sample(metrics, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def decision(**kw) -> RoutingDecision:
    base = dict(call_id="c1", session_id="s1", call_index=0, model="m", policy="talaria", action="route",
                decided_at=0.0, chosen="i1")
    return RoutingDecision(**{**base, **kw})


def completed(call_id: str = "c1", queue_s: float = 0.5, kv_source: str = "host") -> CallCompleted:
    return CallCompleted(call_id, "s1", 0, "m", "i1", 100, 10, "stop", 0.0, 0.5, 0.6, 1.0, kv_source=kv_source,
                         queue_s=queue_s, ttft_s=0.6)


def test_decision_path_names_how_the_call_was_placed():
    assert decision_path(decision(lease_outcome="consumed", expected_kv="device")) == "lease"
    assert decision_path(decision(expected_kv="host")) == "kv_host"
    assert decision_path(decision(model_opened=True)) == "cold_open"
    assert decision_path(decision()) == "cost"
    assert decision_path(decision(action="reject", chosen=None)) == "none"


def test_queue_estimate_error_compares_the_chosen_candidate_with_the_measured_wait():
    m = RouterMetrics()
    m.observe(decision(candidates=[CandidateCost("i0", 9.0, queue_s=9.0), CandidateCost("i1", 2.0, queue_s=2.0)]))
    m.observe(completed(queue_s=0.5))
    assert sample(m, "talaria_router_queue_estimate_error_seconds_sum", direction="over") == 1.5
    assert sample(m, "talaria_router_queue_estimate_error_seconds_count", direction="under") == 0
    m.observe(completed(queue_s=0.1))  # a second completion of the same call: nothing to compare
    assert sample(m, "talaria_router_queue_estimate_error_seconds_count", direction="over") == 1
    m.observe(LeaseExpired("s1", "m", "i1", 1.0))
    assert sample(m, "talaria_router_lease_events_total", outcome="expired") == 1


def test_an_agent_counts_a_record_stored_twice_once():
    m = AgentMetrics("i1")
    m.observe(completed())
    m.observe(completed())  # republished after a lost ack
    m.observe(CallFailed("c2", "s1", "m", "cancelled: x", "agent", 1.0, status=499))
    assert sample(m, "talaria_agent_calls_total", outcome="completed") == 1
    assert sample(m, "talaria_agent_call_kv_source_total", source="host") == 1
    assert sample(m, "talaria_agent_calls_total", outcome="cancelled") == 1
    assert sample(m, "talaria_agent_prompt_tokens_total", instance_id="i1") == 100


def test_frontend_ttft_is_the_first_streamed_token_and_itl_the_gaps():
    m = FrontendMetrics()
    call = m.call("m", "chat", started=10.0)
    assert sample(m, "talaria_frontend_inflight_requests", model="m") == 1
    for t in (10.25, 10.5, 11.0):
        call.token(now=t)
    call.answered(200, Usage(3, 3, 6, cached_tokens=1), Timings(ttft_s=99.0), now=11.5)
    call.answered(200, now=12.0)  # a second answer is not counted again
    assert sample(m, "talaria_frontend_time_to_first_token_seconds_sum") == 0.25  # not the agent's 99 s
    assert sample(m, "talaria_frontend_inter_token_latency_seconds_sum") == 0.75
    assert sample(m, "talaria_frontend_inter_token_latency_seconds_count") == 2
    assert sample(m, "talaria_frontend_requests_total", status="200") == 1
    assert sample(m, "talaria_frontend_inflight_requests", model="m") == 0
    assert sample(m, "talaria_frontend_cached_input_tokens_total") == 1
    plain = m.call("m", "chat", started=0.0)
    plain.answered(200, Usage(3, 5, 8), Timings(ttft_s=0.3, decode_s=0.4), now=1.0)
    assert sample(m, "talaria_frontend_time_to_first_token_seconds_count") == 2
    assert sample(m, "talaria_frontend_inter_token_latency_seconds_sum") == 0.75 + 0.1


def defined_series() -> set[str]:
    """Every sample name the four services can expose (counters with _total, histograms'
    _bucket/_sum/_count), from the definitions themselves."""
    from talaria.shared.metrics import TelemetryMetrics

    agent = AgentMetrics("i")
    agent.snapshot_gauges(lambda: None)
    registries = [FrontendMetrics(), RouterMetrics(), agent, TelemetryMetrics()]
    names = set()
    for m in registries:
        for collector in list(m.registry._collector_to_names):
            for fam in collector.describe():
                suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
                names |= {fam.name + s for s in suffixes}
    names |= {"talaria_router_leases_active", "talaria_router_instances", "talaria_router_sessions",
              "talaria_router_partitions_owned"}  # scrape gauges of the router service
    return names


def test_the_dashboard_queries_only_series_that_exist():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    dashboard = json.loads((root / "ops" / "grafana" / "talaria.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    used = {n for e in exprs for n in re.findall(r"talaria_[a-z_]+", e)}
    assert used and used <= defined_series(), used - defined_series()
    provisioned = (root / "ops" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {"talaria-prometheus"} and "uid: talaria-prometheus" in provisioned


def test_compose_prometheus_scrapes_every_talaria_service_of_compose():
    yaml = __import__("pytest").importorskip("yaml")
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    services = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    talaria = {n for n, s in services.items() if str(s.get("command", [""])[0]).startswith("talaria.services.")}
    config = yaml.safe_load((root / "ops" / "prometheus" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for sc in config["scrape_configs"] for c in sc["static_configs"] for t in c["targets"]}
    assert talaria and talaria == targets


def test_a_stream_subject_is_counted_by_its_event_type_never_its_instance():
    from talaria.shared.metrics import event_type

    assert event_type("talaria.evt.call.routed.agent-0") == "call.routed"
    assert event_type("blue.evt.instance.lost") == "instance.lost"
    assert event_type("talaria.evt.decision") == "decision"
    assert event_type("talaria.evt.something.new") == "other"
