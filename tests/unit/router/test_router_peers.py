"""The faithful peers, one rule each: sglang-cache-aware, dynamo-kv, llm-d, vllm-stack-session,
and the serverless deployment scope they run under where models outnumber instances."""

from __future__ import annotations

from collections import Counter

import pytest
from router_support import call, core, done, one, snap

from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.policy.llm_d import model_affinity
from talaria.services.router.policy.peer_signals import HashRing
from talaria.services.router.policy import serverless
from talaria.shared.events import CallRouted, LeaseIssued, RoutingDecision

PEERS = ["sglang-cache-aware", "dynamo-kv", "llm-d", "vllm-stack-session"]
PREFIX = list(range(1000, 1100))  # 100 blocks = 1,600 tokens of shared prompt


def routed_to(c, the_call, now=0.0):
    return one(c.handle(the_call, now), CallRouted).instance_id


def place(c, the_call, instance: str, now: float = 0.0) -> None:
    """Fold a routing of `the_call` to `instance` (as if the router had made it)."""
    c.state.apply(CallRouted(the_call, 0, instance, "test", now))


def busy(c, instance: str, n: int) -> None:
    """n calls in flight on `instance`, as the router's own record has them."""
    view = c.state.instances[instance]
    view.inflight.update(f"busy-{instance}-{k}" for k in range(n))


def audit(c, the_call, now=0.0) -> RoutingDecision:
    return one(c.handle(the_call, now), RoutingDecision)


@pytest.mark.parametrize("name", PEERS)
def test_peers_issue_no_leases_and_reject_when_nothing_serves(name):
    c = core(name)
    c.observe(snap("a"), 0.0)
    routed_to(c, call("c0"))
    assert not [e for e in c.handle(done("c0", "a"), 1.0) if isinstance(e, LeaseIssued)]
    assert audit(c, call("c1", model="zz"), 1.0).action == "reject"


# ---- sglang-cache-aware ----------------------------------------------------------------

def sglang_with_prefix_on(holder: str):
    c = core("sglang-cache-aware")
    for iid in ("a", "b", "c"):
        c.observe(snap(iid), 0.0)
    place(c, call("seed", session="s0", tokens=1600, hashes=PREFIX), holder)
    return c


def test_sglang_routes_a_match_above_0_3_to_its_holder():
    c = sglang_with_prefix_on("b")
    busy(c, "b", 5)  # balanced: 5 - 0 <= 64
    # 1,600 of 4,000 tokens match: 0.4 > 0.3
    assert routed_to(c, call("x", session="s1", tokens=4000, hashes=PREFIX + [7, 8])) == "b"


def test_sglang_sends_a_miss_to_the_least_loaded_not_the_smallest_tree():
    c = sglang_with_prefix_on("b")
    busy(c, "a", 2)
    busy(c, "c", 1)
    # 1,600 of 8,000 tokens: 0.2 <= 0.3 -> least loaded, b (0 in flight; it holds the biggest tree)
    assert routed_to(c, call("x", session="s1", tokens=8000, hashes=PREFIX + [7])) == "b"
    busy(c, "b", 3)
    assert routed_to(c, call("y", session="s2", tokens=8000, hashes=[9] * 5)) == "c"


def test_sglang_balances_only_when_both_thresholds_are_crossed():
    c = sglang_with_prefix_on("b")
    busy(c, "a", 10)
    busy(c, "c", 10)
    busy(c, "b", 73)  # with the seed call, 74 - 10 = 64: not > 64, balanced -> the prefix holder
    assert routed_to(c, call("x", session="s1", tokens=4000, hashes=PREFIX + [7])) == "b"
    busy(c, "b", 76)  # 76 - 10 > 64 and 76 > 1.5 * 10 -> least loaded
    assert routed_to(c, call("y", session="s2", tokens=4000, hashes=PREFIX + [8])) == "a"


# ---- dynamo-kv ---------------------------------------------------------------------------

def test_dynamo_cost_weighs_host_blocks_0_75_and_counts_in_flight_blocks():
    c = core("dynamo-kv")
    c.observe(snap("a", sessions=[("s1", "m1", "host", 1600)]), 0.0)
    c.observe(snap("b"), 0.0)
    rec = audit(c, call("x", session="s1", tokens=1600))
    cost = {k.instance_id: k.total_s for k in rec.candidates}
    # a: prefill 1600 - 0.75 * 100 blocks * 16 = 400 tokens = 25 blocks, + 100 request blocks
    assert cost["a"] == pytest.approx(125.0)
    assert cost["b"] == pytest.approx(200.0)
    assert rec.chosen == "a"


def test_dynamo_does_not_count_idle_sessions_kv_as_load():
    c = core("dynamo-kv")
    c.observe(snap("a", kv_used_tokens=500_000, kv_capacity_tokens=1_000_000), 0.0)  # idle sessions' KV
    c.observe(snap("b"), 0.0)
    place(c, call("r", session="other", tokens=3200), "b")  # in flight on b
    assert routed_to(c, call("x", session="s1", tokens=1600)) == "a"


def test_dynamo_counts_the_engines_queued_prefill():
    c = core("dynamo-kv")
    c.observe(snap("a", queued_prefill_s=1.0, prefill_tok_s=3200.0), 0.0)  # 3,200 tokens to prefill
    c.observe(snap("b"), 0.0)
    rec = audit(c, call("x", session="s1", tokens=1600))
    cost = {k.instance_id: k.total_s for k in rec.candidates}
    assert cost["a"] - cost["b"] == pytest.approx(200.0)


def test_dynamo_breaks_ties_at_random_and_has_no_session_affinity():
    c = core("dynamo-kv")
    for iid in ("a", "b", "c"):
        c.observe(snap(iid), 0.0)
    chosen = Counter(audit(c, call(f"x{k}", session=f"s{k}", tokens=1600)).chosen for k in range(60))
    assert set(chosen) == {"a", "b", "c"}  # not always the lowest id
    # a session's second call follows the cost, not the session: its first instance is busier
    first = routed_to(c, call("p0", session="sx", tokens=1600))
    c.handle(done("p0", first, session="sx"), 1.0)
    busy(c, first, 5)
    assert routed_to(c, call("p1", session="sx", tokens=1600), 1.0) != first


def test_dynamo_counts_a_shared_prefix_of_in_flight_calls_once():
    # ActiveSequences dedups by block hash: two in-flight calls sharing a 100-block system
    # prompt hold 100 + 2 x 10 distinct blocks on a, not 220; the new call's shared blocks
    # are not new there either.
    c = core("dynamo-kv")
    c.observe(snap("a"), 0.0)
    for k in range(2):  # routed by the policy (it records what it routes), to a: the only one
        assert routed_to(c, call(f"r{k}", session=f"o{k}", tokens=1760,
                                 hashes=PREFIX + list(range(7000 + 100 * k, 7010 + 100 * k)))) == "a"
    c.observe(snap("b"), 0.0)
    x = call("x", session="s1", tokens=1760, hashes=PREFIX + list(range(9000, 9010)))
    cost = {k.instance_id: k.decode_s for k in audit(c, x).candidates}
    assert cost["a"] == pytest.approx(100 + 2 * 10 + 10)
    assert cost["b"] == pytest.approx(110)


# ---- llm-d -------------------------------------------------------------------------------

def llmd_with_prefix_on(holder: str):
    c = core("llm-d")
    c.observe(snap("a", queued={"m1": 3}), 0.0)
    c.observe(snap("b"), 0.0)
    place(c, call("seed", session="s0", tokens=1600, hashes=PREFIX), holder)
    c.handle(done("seed", holder, session="s0"), 0.5)
    return c


def test_llm_d_prefix_weight_3_beats_queue_weight_2():
    c = llmd_with_prefix_on("a")
    # a: 3 * 1.0 (full prefix) + 2 * 0 (longest queue) = 3; b: 0 + 2 * 1 = 2
    assert routed_to(c, call("x", session="s1", tokens=1600, hashes=PREFIX)) == "a"
    # half the prompt matched: 3 * 0.5 = 1.5 < 2 -> the empty queue
    assert routed_to(c, call("y", session="s2", tokens=3200, hashes=PREFIX + list(range(5000, 5100)))) == "b"


def test_llm_d_kv_utilisation_scorer_weight_2():
    c = core("llm-d")
    c.observe(snap("a", kv_capacity_tokens=1000, kv_used_tokens=900, kv_pinned_tokens=900), 0.0)
    c.observe(snap("b", kv_capacity_tokens=1000, kv_used_tokens=900, kv_pinned_tokens=100), 0.0)
    rec = audit(c, call("x", tokens=1600))
    score = {k.instance_id: -k.total_s for k in rec.candidates}
    assert score["b"] - score["a"] == pytest.approx(2 * 0.8)  # only held KV counts as used
    assert rec.chosen == "b"


def test_llm_d_prefix_scorer_sees_only_256_blocks():
    # past 256 blocks (4,096 tokens) the scorer cannot tell the session's own instance from
    # one holding only the prompt's head: both score 1, and the queue decides
    head = list(range(20_000, 20_256))
    c = core("llm-d")
    c.observe(snap("a", queued={"m1": 3}), 0.0)
    c.observe(snap("b"), 0.0)
    place(c, call("own", session="s1", tokens=8000, hashes=head + list(range(30_000, 30_244))), "a")
    c.handle(done("own", "a", session="s1"), 0.5)
    place(c, call("other", session="s2", tokens=4096, hashes=head), "b")
    c.handle(done("other", "b", session="s2"), 0.5)
    rec = audit(c, call("x", session="s1", tokens=8000, hashes=head + list(range(30_000, 30_244))), 1.0)
    score = {k.instance_id: -k.total_s for k in rec.candidates}
    assert score["b"] - score["a"] == pytest.approx(2.0)  # equal prefix, b's empty queue
    assert rec.chosen == "b"


def test_llm_d_shipped_profile_has_no_model_affinity_the_variant_does():
    def scores(name):
        c = core(name)
        c.observe(snap("on", models={"m1": "active", "m2": "absent"}, active="m1"), 0.0)
        c.observe(snap("off", models={"m1": "absent", "m2": "active"}, active="m2", running=2), 0.0)
        return {k.instance_id: -k.total_s for k in audit(c, call("x", tokens=1600)).candidates}
    shipped, variant = scores("llm-d"), scores("llm-d-affinity")
    assert shipped["on"] == pytest.approx(shipped["off"])
    assert variant["on"] - variant["off"] == pytest.approx(1.0)


def test_llm_d_model_affinity_levels():
    c = core("llm-d")
    c.observe(snap("on", models={"m1": "active", "m2": "absent"}, active="m1"), 0.0)
    c.observe(snap("idle", models={"m1": "absent", "m2": "absent"}, active=None), 0.0)
    c.observe(snap("loading", models={"m1": "absent", "m2": "active"}, active="m2", queued={"m1": 1}), 0.0)
    c.observe(snap("busy", models={"m1": "absent", "m2": "active"}, active="m2", running=2), 0.0)
    got = {iid: model_affinity(v, "m1") for iid, v in c.state.instances.items()}
    assert got == {"on": 1.0, "idle": 0.8, "loading": 0.6, "busy": 0.0}


# ---- vllm-stack-session ------------------------------------------------------------------

def test_vllm_stack_hashes_sessions_to_instances_whatever_the_load():
    c = core("vllm-stack-session")
    for iid in ("a", "b", "c", "d"):
        c.observe(snap(iid), 0.0)
    first = {f"s{k}": routed_to(c, call(f"x{k}", session=f"s{k}")) for k in range(40)}
    assert len(set(first.values())) == 4  # sessions spread over the ring
    busy(c, first["s0"], 50)
    assert routed_to(c, call("again", session="s0")) == first["s0"]


def test_hash_ring_moves_few_keys_when_a_node_joins():
    keys = [f"session-{k}" for k in range(2000)]
    before = HashRing(["a", "b", "c", "d"])
    after = HashRing(["a", "b", "c", "d", "e"])
    moved = sum(before.get_node(k) != after.get_node(k) for k in keys)
    assert all(after.get_node(k) == "e" for k in keys if before.get_node(k) != after.get_node(k))
    assert 0.1 < moved / len(keys) < 0.3  # ~1/5 of the keys, all to the new node


# ---- serverless deployment ---------------------------------------------------------------

def serverless_core(name="round-robin"):
    return core(name, serverless=True)


def test_serverless_keeps_a_model_on_the_instances_that_hold_it():
    c = serverless_core()
    c.observe(snap("a", models={"m1": "active", "m2": "absent"}, active="m1", running=1), 0.0)
    c.observe(snap("b", models={"m1": "absent", "m2": "active"}, active="m2"), 0.0)
    for k in range(4):
        assert routed_to(c, call(f"x{k}", session=f"s{k}")) == "a"


def test_serverless_loads_where_the_model_starts_fastest_then_least_recently_used():
    c = serverless_core()
    c.observe(snap("a", models={"m1": "absent", "m2": "active", "m3": "absent"}, active="m2"), 6.0)
    c.observe(snap("b", models={"m1": "absent", "m2": "absent", "m3": "active"}, active="m3"), 6.0)
    c.observe(snap("c", models={"m1": "staged", "m2": "absent", "m3": "absent"}, active="m2", running=1), 6.0)
    # c has m1 staged but is busy: an idle instance wins; b's model was used longer ago than a's
    c.state.homes.routed("old", "b", "m3", 1.0)
    c.state.homes.ended("old", "b", 2.0)
    c.state.homes.routed("new", "a", "m2", 1.0)
    c.state.homes.ended("new", "a", 5.0)
    assert routed_to(c, call("x", model="m1"), 6.0) == "b"


def test_serverless_scales_out_when_every_holder_has_calls_waiting():
    c = serverless_core()
    c.observe(snap("a", models={"m1": "active", "m2": "absent"}, active="m1", queued={"m1": 2}), 0.0)
    c.observe(snap("b", models={"m1": "absent", "m2": "active"}, active="m2"), 0.0)
    views = list(c.state.instances.values())
    assert {v.instance_id for v in serverless.scope(c.state, views, "m1")} == {"a", "b"}


def test_serverless_is_off_by_default():
    assert PolicyConfig().serverless is False


def test_sglang_needs_the_relative_threshold_too():
    c = sglang_with_prefix_on("b")
    busy(c, "a", 200)
    busy(c, "c", 200)
    busy(c, "b", 269)  # 270 - 200 > 64, but 270 <= 1.5 * 200: balanced -> the prefix holder
    assert routed_to(c, call("x", session="s1", tokens=4000, hashes=PREFIX + [7])) == "b"
