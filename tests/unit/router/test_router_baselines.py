"""The registry and the baselines: least-pressure, session-sticky, round-robin, prefix-aware, kv-cost."""

from __future__ import annotations

import pytest
from router_support import call, core, done, one, snap

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.registry import (
    REGISTRY,
    UnknownPolicyError,
    create_policy,
    policy_names,
    register,
)
from talaria.shared.events import CallRouted, LeaseIssued, RoutingDecision

BASELINES = ["least-pressure", "least-loaded", "session-sticky", "round-robin", "prefix-aware", "kv-cost"]


def routed_to(c, the_call, now=0.0):
    return one(c.handle(the_call, now), CallRouted).instance_id


def test_registry_has_every_policy_and_both_least_pressure_names():
    assert set(BASELINES) | {"talaria"} <= set(policy_names())
    for name in policy_names():
        assert create_policy(name).name == name


def test_registry_refuses_unknown_names_and_lists_known_ones():
    with pytest.raises(UnknownPolicyError) as err:
        create_policy("nope")
    assert "nope" in str(err.value) and "talaria" in str(err.value)


def test_registry_refuses_duplicate_names():
    policy_names()  # load built-ins

    class Dup(PlacementPolicy):
        name = "talaria"

        def decide(self, state, call, now) -> RoutingDecision:
            raise AssertionError

    with pytest.raises(ValueError, match="already registered"):
        register(Dup)
    assert REGISTRY["talaria"] is not Dup


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_issue_no_leases_and_reject_when_nothing_serves(name):
    c = core(name)
    c.observe(snap("a"), 0.0)
    routed_to(c, call("c0"))
    assert not [e for e in c.handle(done("c0", "a"), 1.0) if isinstance(e, LeaseIssued)]
    audit = one(c.handle(call("c1", model="zz"), 1.0), RoutingDecision)
    assert audit.action == "reject"


def test_least_pressure_counts_queue_running_and_overlay():
    c = core("least-pressure")
    c.observe(snap("a", queued={"m1": 1}), 0.0)
    c.observe(snap("b", running=1), 0.0)
    c.observe(snap("c"), 0.0)
    assert routed_to(c, call("c0", session="s1")) == "c"
    assert routed_to(c, call("c1", session="s2")) == "a"  # ties at 1 call: id order
    assert routed_to(c, call("c2", session="s3")) == "b"  # a has 2 now (overlay)


def test_least_pressure_is_blind_to_model_residency():
    c = core("least-pressure")
    c.observe(snap("a", active="m1", models={"m1": "active", "m2": "absent"}, queued={"m1": 3}), 0.0)
    c.observe(snap("b", active="m2", models={"m1": "absent", "m2": "active"}), 0.0)
    audit = one(c.handle(call("c0", model="m1"), 0.0), RoutingDecision)
    assert audit.chosen == "b"  # would have to open m1 although a has it active


def test_session_sticky_pins_to_first_instance_and_falls_back_when_stale():
    c = core("session-sticky", stale_after_s=2.0)
    c.observe(snap("a"), 0.0)
    c.observe(snap("b", queued={"m1": 5}), 0.0)
    assert routed_to(c, call("c0")) == "a"
    c.observe(snap("a", version=2, queued={"m1": 50}), 0.5)
    assert routed_to(c, call("c1"), 1.0) == "a"  # pinned, however loaded
    c.observe(snap("b", version=2, at=4.0, queued={"m1": 5}), 4.0)
    assert routed_to(c, call("c2"), 4.0) == "b"  # a is stale: least pressure this time
    assert c.state.sessions["s1"].first_instance == "a"  # the pin does not move


def test_round_robin_cycles_in_id_order():
    c = core("round-robin")
    for iid in ("c", "a", "b"):
        c.observe(snap(iid), 0.0)
    got = [routed_to(c, call(f"x{i}", session=f"s{i}")) for i in range(6)]
    assert got == ["a", "b", "c", "a", "b", "c"]


def _prefix_world(policy="prefix-aware", **config):
    c = core(policy, **config)
    c.observe(snap("a"), 0.0)
    c.observe(snap("b"), 0.0)
    c.observe(snap("c"), 0.0)
    return c


def test_prefix_aware_routes_to_best_match_above_threshold():
    c = _prefix_world()
    shared = list(range(100, 164))  # 64 blocks = 1024 tokens
    assert routed_to(c, call("c0", session="s0", tokens=1024, hashes=shared)) == "a"  # empty trees
    # a 1100-token prompt sharing those 1024 tokens: 1024/1100 > 0.5 -> a, despite a's load
    assert routed_to(c, call("c1", session="s1", tokens=1100, hashes=shared + [9, 9, 9, 9])) == "a"


def test_prefix_aware_low_match_goes_to_smallest_tree():
    c = _prefix_world()
    routed_to(c, call("c0", session="s0", tokens=1024, hashes=list(range(100, 164))))  # a's tree grows
    routed_to(c, call("c1", session="s1", tokens=1024, hashes=list(range(300, 364))))  # b (smallest)
    got = routed_to(c, call("c2", session="s2", tokens=4000, hashes=list(range(100, 110)) + [1]))
    assert got == "c"  # 160/4000 below threshold: the smallest tree (c is empty)


def test_prefix_aware_imbalance_uses_shortest_queue():
    c = _prefix_world(balance_abs_threshold=2, balance_rel_threshold=1.5)
    shared = list(range(100, 164))
    routed_to(c, call("c0", session="s0", tokens=1024, hashes=shared))
    c.observe(snap("a", version=2, queued={"m1": 9}), 0.0)
    c.observe(snap("b", version=2, queued={"m1": 2}), 0.0)
    c.observe(snap("c", version=2, queued={"m1": 4}), 0.0)
    audit = one(c.handle(call("c1", session="s1", tokens=1024, hashes=shared), 0.0), RoutingDecision)
    assert audit.chosen == "b"  # imbalanced: 9 - 2 > 2 and 9 > 1.5 * 2


def test_kv_cost_prefers_cached_blocks_and_weights_host_hits():
    c = core("kv-cost", affinity_ttl_s=0.0)
    c.observe(snap("dev", kv_used_tokens=1600, sessions=[("s1", "m1", "device", 800)]), 0.0)
    c.observe(snap("host", kv_used_tokens=0, sessions=[("s1", "m1", "host", 800)]), 0.0)
    c.observe(snap("none", kv_used_tokens=0), 0.0)
    audit = one(c.handle(call("c1", tokens=1600), 0.0), RoutingDecision)
    cost = {x.instance_id: x.total_s for x in audit.candidates}
    # 100 blocks requested; dev: 50 to prefill + 100 active; host: 100 - 0.5*50; none: 100
    assert cost == {"dev": 150.0, "host": 75.0, "none": 100.0}
    assert audit.chosen == "host"


def test_kv_cost_session_affinity_within_idle_ttl():
    c = core("kv-cost", affinity_ttl_s=5.0)
    c.observe(snap("a"), 0.0)
    c.observe(snap("b"), 0.0)
    routed_to(c, call("c0"))
    c.handle(done("c0", "b", at=1.0), 1.0)  # served on b (as far as the router knows)
    c.observe(snap("b", version=2, at=2.0, kv_used_tokens=50_000), 2.0)
    assert routed_to(c, call("c1", at=3.0), 3.0) == "b"  # idle 2 s < 5 s: affinity
    c.handle(done("c1", "b", index=1, at=3.5), 3.5)
    c.observe(snap("a", version=2, at=9.0), 9.0)
    c.observe(snap("b", version=3, at=9.0, kv_used_tokens=50_000), 9.0)
    assert routed_to(c, call("c2", at=9.0), 9.0) == "a"  # idle 5.5 s: cost decides


@pytest.mark.parametrize("name", ["talaria", *BASELINES])
def test_the_audit_on_the_stream_is_the_record_the_policy_returned(name):
    """One decision shape: `decide` returns the RoutingDecision itself and the core publishes
    it unchanged (nothing is copied field by field), for a lease return and a new session."""
    c = core(name)
    c.observe(snap("a"), 0.0)
    c.observe(snap("b"), 0.0)
    first = routed_to(c, call("c0"))
    c.handle(done("c0", first, at=1.0), 1.0)
    for the_call in (call("c1", at=1.2), call("n0", session="s2", at=1.2)):
        record = c.policy.decide(c.state, the_call, 1.2)
        out = c.handle(the_call, 1.2)
        assert one(out, RoutingDecision) == record
        assert record.policy == name and record.call_index == (1 if the_call.call_id == "c1" else 0)
        assert one(out, CallRouted).instance_id == record.chosen
