"""Peers deployed as they are deployed (talaria/sim/deployment.py) and the workload cells that
contain what they are good at: a shared system prompt, human turns, mixed depths."""

from __future__ import annotations

from collections import Counter

import pytest

from talaria.services.router.policy.base import PolicyConfig
from talaria.sim.agents import PromptHashes
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.deployment import deploy, pool_split
from talaria.sim.executor import instance_config
from talaria.sim.profiles import PAPER_TP8
from talaria.sim.workloads import HUMAN_GAP_P50_S, agent_sessions, at_rate
from talaria.traces.gaps import GapModel

MODELS = list(PAPER_TP8.models)


def test_pool_split_gives_every_model_one_instance_then_follows_demand():
    assert Counter(pool_split({"a": 1, "b": 1, "c": 1}, 4)) == {"a": 2, "b": 1, "c": 1}
    assert Counter(pool_split({"a": 10, "b": 1, "c": 1}, 4)) == {"a": 2, "b": 1, "c": 1}
    assert Counter(pool_split({"a": 6, "b": 3, "c": 1}, 10)) == {"a": 6, "b": 3, "c": 1}
    assert Counter(pool_split({"a": 100, "b": 0, "c": 0}, 3)) == {"a": 1, "b": 1, "c": 1}
    with pytest.raises(ValueError, match="do not fit"):
        pool_split({"a": 1, "b": 1}, 1)


def test_deploy_pools_where_models_fit_and_serverless_where_they_do_not():
    pc, pinned = deploy(PolicyConfig(), {"a": 1, "b": 1}, 2, 2)
    assert pinned == ("a", "b") and not pc.serverless
    pc, pinned = deploy(PolicyConfig(), {"a": 1, "b": 1, "c": 1}, 2, 3)
    assert pinned == () and pc.serverless


def run(policy, pinned=(), shared=0, serverless=False, sessions=None):
    sessions = sessions or at_rate(agent_sessions(12, MODELS, 6, 8_000, 100, seed=3, shared=shared), 0.05)
    pc = PolicyConfig(serverless=serverless)
    return simulate(sessions, RunConfig(PAPER_TP8, len(pinned) or 3, policy, pc, instance_config("talaria"),
                                        GapModel("recorded", None), pinned=tuple(pinned),
                                        shared_prefix={m: shared for m in MODELS} if shared else {}))


def test_a_pinned_pool_serves_only_its_model_and_never_switches():
    r = run("round-robin", pinned=(MODELS[0], MODELS[0], MODELS[1], MODELS[2]))
    for inst in r.instances:
        assert not inst.switches
        assert {j.model for j in r.jobs if j.instance == inst.id} <= {inst.config.pinned_model}
    assert len(r.jobs) == sum(len(s.calls) for s in r.sessions)


def test_serverless_instances_each_serve_few_models():
    r = run("dynamo-kv", serverless=True)
    assert len(r.jobs) == sum(len(s.calls) for s in r.sessions)
    per_instance = Counter((j.instance, j.model) for j in r.jobs)
    assert all(n > 0 for n in per_instance.values())


def test_shared_prefix_is_hashed_alike_across_sessions_and_cached_across_them():
    h = PromptHashes()
    a = h.for_call("s1", 0, 6_000, 0, shared=4_000, model="m")
    b = h.for_call("s2", 0, 6_000, 0, shared=4_000, model="m")
    c = h.for_call("s3", 0, 6_000, 0, shared=4_000, model="other")
    assert a[:250] == b[:250] and a[250:] != b[250:]  # 4,000 tokens = 250 blocks of 16
    assert a[0] != c[0]
    # the second session of a model on a pinned instance finds the prompt's shared part cached
    shared = run("round-robin", pinned=MODELS, shared=4_000)
    plain = run("round-robin", pinned=MODELS)
    firsts = [j for j in shared.jobs if j.call_index == 0]
    assert sum(j.cached >= 4_000 for j in firsts) >= len(firsts) - len(MODELS)
    assert all(j.cached == 0 for j in plain.jobs if j.call_index == 0)


def test_human_gaps_are_minutes_for_a_fifth_of_the_returns():
    s = agent_sessions(60, ["a"], 30, 25_000, 250, gaps="human", seed=4)
    returns = [c for x in s for c in x.calls if c.call_index]
    human = [c for c in returns if c.kind == "user"]
    assert 0.15 < len(human) / len(returns) < 0.25
    gaps = sorted(c.gap_before_s for c in human)
    assert HUMAN_GAP_P50_S / 2 < gaps[len(gaps) // 2] < HUMAN_GAP_P50_S * 2
    assert max(c.gap_before_s for c in returns if c.kind == "tool") <= 10.0


def test_mixed_depths_mix_short_and_long_sessions():
    depths = [len(x.calls) for x in agent_sessions(200, ["a"], 30, 8_000, 50, seed=5, mixed_depth=True)]
    assert sum(d <= 8 for d in depths) > 60 and sum(d >= 60 for d in depths) > 10


def test_sim_run_deploys_a_peer_as_deployed(tmp_path, capsys):
    import json

    from talaria.sim.cli import main
    from talaria.traces.format import save_sessions

    trace = tmp_path / "t.jsonl"
    save_sessions(at_rate(agent_sessions(6, MODELS[:2], 4, 4_000, 50, seed=7), 0.2), trace)
    out = tmp_path / "r.json"
    for deploy, opens in (("as-deployed", 0), ("shared", None)):
        assert main(["run", "--trace", str(trace), "--policy", "sglang-cache-aware", "--instances", "3",
                     "--deploy", deploy, "--gaps", "recorded", "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["complete"]
        if opens is not None:  # pinned pools: loaded at start, never opened or switched
            assert got["router"]["model_opens"] == opens
        else:
            assert got["router"]["model_opens"] > 0


def test_talaria_sizes_its_own_pools_unless_told_the_forecast():
    from talaria.sim.deployment import talaria_pools

    demand = {"a": 1.0, "b": 5.0}
    assert talaria_pools(demand, 3, 2) == (("a", "a", "b"), True)  # even start, resized online
    assert talaria_pools(demand, 3, 2, "forecast") == (("a", "b", "b"), False)  # the peers' split
    assert talaria_pools(demand, 1, 2) == ((), False)  # models > instances: its cold pool
    with pytest.raises(ValueError, match="pools must be one of"):
        talaria_pools(demand, 3, 2, "guess")


def test_sim_run_deploys_talaria_with_its_online_pools(tmp_path):
    """`talaria sim run --deploy as-deployed --policy talaria` is the matrix's talaria: hot pools
    from an even split that its router moves towards the demand it measures."""
    import json

    from talaria.sim.cli import main
    from talaria.sim.workloads import on_model
    from talaria.traces.format import save_sessions

    # the later name carries nearly all the work; the even start gives the spare instance to the other
    light, heavy = sorted(MODELS[:2])
    sessions = agent_sessions(16, [heavy], 10, 8_000, 100, seed=3)
    sessions[0] = on_model(sessions[0], light, sessions[0].calls[0].gap_before_s, suffix=False)
    trace = tmp_path / "t.jsonl"
    save_sessions(at_rate(sessions, 0.5), trace)
    out = tmp_path / "r.json"
    repins = {}
    for pools in ("online", "forecast"):
        assert main(["run", "--trace", str(trace), "--policy", "talaria", "--instances", "3", "--deploy",
                     "as-deployed", "--pools", pools, "--gaps", "recorded", "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["complete"] and got["router"]["model_opens"] <= got["router"]["repins"]
        repins[pools] = got["router"]["repins"]
    assert repins["online"] >= 1 and repins["forecast"] == 0
