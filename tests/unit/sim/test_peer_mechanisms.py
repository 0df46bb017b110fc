"""Each peer deployment's mechanisms act as its row in services/configs.py declares: vLLM
sleep mode wakes by a host-to-device copy and has dropped the KV it slept with; the
Aegaeon-like scheduler frees a call's KV when it ends; a drained engine never switches with
a call running. Real simulator, real router policies and scheduler; nothing stubbed."""

from __future__ import annotations

import pytest

from talaria.services import configs
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.deployment import place
from talaria.sim.executor import RELOAD_OVER_WAKE
from talaria.sim.profiles import PAPER_TP8, catalogue
from talaria.traces.format import Session, TraceCall
from talaria.traces.gaps import GapModel


def _run(name: str, sessions: list[Session], server, instances: int = 1):
    cfg = configs.get(name)
    models = sorted({s.model for s in sessions})
    placed = place(cfg, {m: 1.0 for m in models}, instances, len(server.models))
    run = RunConfig(server, instances, cfg.policy, placed.policy_config, cfg.sim_scheduler(),
                    GapModel("recorded", None), pinned=placed.pinned, hot_pools=placed.online)
    return simulate(sessions, run)


def _session(sid: str, model: str, start: float, calls: list[tuple[int, int, int, float]]) -> Session:
    """calls: (prompt, reusable prefix, output, gap before) per call."""
    return Session(sid, tuple(TraceCall(sid, k, model, p, r, o, start if k == 0 else g, "start" if k == 0 else "tool")
                              for k, (p, r, o, g) in enumerate(calls)))


def _kv_sources(result, session: str) -> list[str]:
    return [j.kv_source for j in sorted((j for j in result.jobs if j.session == session), key=lambda j: j.call_index)]


def test_the_aegaeon_like_scheduler_frees_a_calls_kv_when_it_ends():
    server = catalogue(PAPER_TP8, 1)
    (model,) = server.models
    work = [_session("a", model, 0.0, [(8_000, 0, 100, 0.0), (8_300, 8_100, 100, 1.0), (8_600, 8_400, 50, 1.0)])]
    assert _kv_sources(_run("aegaeon-like", work, server), "a") == ["none", "recompute", "recompute"]
    # the same scheduler with the engine's prefix cache (keep_kv) reuses it on device
    assert _kv_sources(_run("talaria-round-only", work, server), "a") == ["none", "device", "device"]


def _two_models():
    server = catalogue(PAPER_TP8, 3)  # 3 models on 1 instance: serverless, switching on demand
    m0, m1, _ = server.models
    work = [_session("a", m0, 0.0, [(8_000, 0, 200, 0.0), (8_400, 8_200, 50, 60.0)]),
            _session("b", m1, 1.0, [(4_000, 0, 100, 0.0)])]
    return server, m0, work


def test_vllm_sleep_wakes_by_a_host_copy_and_has_dropped_the_kv_it_slept_with():
    server, m0, work = _two_models()
    result = _run("vllm-sleep", work, server)
    switches = result.instances[0].switches
    assert [s.to_model for s in switches][-1] == m0 and len(switches) == 3  # m0, m1, m0 again
    for s in switches:  # wake = bytes / H2D + the fixed phases, nothing staged, no KV moved
        assert s.path == "host_only" and s.total_s == pytest.approx(server.switch(s.to_model, 0)[1])
    assert _kv_sources(result, "a") == ["none", "recompute"]  # level 1 discards the KV
    # talaria keeps the session's KV in host memory across the switch (HKVR)
    assert _kv_sources(_run("talaria", work, server), "a") == ["none", "host"]


def test_a_dedicated_pool_with_too_few_instances_reloads_its_engine_to_switch():
    server, _, work = _two_models()
    wake = _run("vllm-sleep", work, server).instances[0].switches
    reload = _run("vllm-stack-session", work, server).instances[0].switches
    assert [s.to_model for s in reload] == [s.to_model for s in wake]
    for r, w in zip(reload, wake):
        assert r.path == "cold" and r.total_s == pytest.approx(RELOAD_OVER_WAKE * w.total_s)


@pytest.mark.parametrize("name", ["vllm-sleep", "serverlessllm", *configs.PEERS])
def test_a_drained_engine_never_switches_with_a_call_running(name):
    server, _, work = _two_models()
    result = _run(name, work, server)
    assert not configs.get(name).mechanisms()["token-level time-sharing"]
    for s in result.instances[0].switches:
        started = s.at - s.total_s
        running = [j for j in result.jobs if j.release_t < started < j.done_t - 1e-9 and j.first_token_t < started]
        assert not running, (s, running)


def test_the_aegaeon_like_scheduler_switches_with_calls_running():
    server, _, work = _two_models()
    result = _run("aegaeon-like", work, server)
    across = [s for s in result.instances[0].switches for j in result.jobs
              if j.first_token_t < s.at - s.total_s < j.done_t - 1e-9]
    assert across  # b's call is served while a's first call is still decoding


def test_the_table_declares_each_peers_mechanisms_and_source():
    for name in configs.peer_deployments():
        cfg = configs.get(name)
        m = cfg.mechanisms()
        assert set(m) == set(configs.MECHANISMS) and cfg.source and cfg.describe_models()
        assert not (m["host KV across switches"] or m["staging"]), f"{name} got a talaria mechanism"
    assert configs.get("talaria").mechanisms()["host KV across switches"]
    assert configs.get("sglang-cache-aware+hicache").mechanisms()["host KV across switches"]
    assert "sglang-cache-aware+hicache" not in configs.peer_deployments()
    assert configs.get("vllm-sleep").mechanisms()["sleep/wake"]
    assert configs.get("serverlessllm").mechanisms()["tiered checkpoint loading"]
    assert not configs.get("aegaeon-like").mechanisms()["KV kept after a call"]


def test_a_row_that_contradicts_its_weights_is_a_one_line_error():
    with pytest.raises(configs.ConfigurationError, match="weights='pinned' needs weights_in_host=False") as err:
        configs.get("sglang-cache-aware", weights_in_host=True)
    assert "\n" not in str(err.value)
    with pytest.raises(configs.ConfigurationError, match="weights='lukewarm'"):
        configs.get("vllm-sleep", weights="lukewarm")
