"""Eq. 1 cost terms and the admission checks, one rule per test (services/router/costs.py).

Each test prices one call on hand-built instances with CostModel directly and breaks when its
rule alone is broken: the fallback order of each term, whose rate prices what, and each
boundary of the KV-pool and weight checks. Snapshots are fresh and healthy unless a test says
otherwise, so no test passes because an instance was ruled out for another reason.
"""

from __future__ import annotations

import msgspec
import pytest
from router_support import PAPER_EQ1, call, snap

from talaria.services.router.costs import CostModel
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.state import RouterState, SessionEntry, SnapshotReceived
from talaria.shared.events import CallRouted, LeaseIssued, RoundSummary
from talaria.shared.snapshots import ModelResidency

CFG = PolicyConfig(**PAPER_EQ1)


def state_of(*snapshots, now: float = 0.0) -> RouterState:
    state = RouterState()
    for s in snapshots:
        state.apply(SnapshotReceived(s, now))
    return state


def price(state: RouterState, iid: str, the_call=None, entry=None, cfg: PolicyConfig = CFG, now: float = 0.0):
    return CostModel(cfg).price(state, state.instances[iid], the_call or call("c"), entry, now).cost


def with_(s, **fields):
    return msgspec.structs.replace(s, **fields)


def models(*rows):
    return [ModelResidency(*row) for row in rows]


# ---- C_act: the fallback order --------------------------------------------------------------


def test_a_resident_model_activates_at_its_switch_cost_else_the_snapshot_s_else_the_default():
    base = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, switch_cost_s=1.5)
    assert price(state_of(base), "i").activation_s == 1.5
    no_switch = with_(base, models=models(("m2", "active"), ("m1", "resident", 0.0, 7.0)), switch_s=0.7)
    assert price(state_of(no_switch), "i").activation_s == 0.7  # never the open cost
    nothing = with_(no_switch, switch_s=0.0)
    assert price(state_of(nothing), "i").activation_s == CFG.default_open_s


def test_an_absent_model_opens_at_its_open_cost_then_switch_then_snapshot_then_measured_then_default():
    rows = lambda sw, op: models(("m2", "active"), ("m1", "absent", sw, op))  # noqa: E731
    base = snap("i", active="m2")
    assert price(state_of(with_(base, models=rows(1.0, 3.0), switch_s=0.5)), "i").activation_s == 3.0
    assert price(state_of(with_(base, models=rows(1.0, 0.0), switch_s=0.5)), "i").activation_s == 1.0
    assert price(state_of(with_(base, models=rows(0.0, 0.0), switch_s=0.5)), "i").activation_s == 0.5
    measured = state_of(with_(base, models=rows(0.0, 0.0), switch_s=0.0))
    assert price(measured, "i").activation_s == CFG.default_open_s
    measured.apply(RoundSummary("i", 1, 4.0, 3.0, 0.9, 0.0))  # a measured switch on i
    assert price(measured, "i").activation_s == pytest.approx(0.9)


def test_an_active_model_costs_no_activation_and_opens_nothing():
    p = CostModel(CFG).price(state_of(snap("i")), state_of(snap("i")).instances["i"], call("c"), None, 0.0)
    assert (p.cost.activation_s, p.cost.model_state, p.fresh) == (0.0, "active", False)


# ---- whose rate prices what ------------------------------------------------------------------


def test_a_snapshot_s_rates_price_only_its_active_model():
    # i runs m2 with slow engine rates; m1 is resident there. m1's host restore, prefill and
    # decode are priced at m1's own rates (here the fallbacks), never at m2's.
    slow = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, prefill_tok_s=10.0,
                decode_tok_s=1.0, restore_tok_s=10.0, sessions=[("s1", "m1", "host", 500)])
    c = price(state_of(slow), "i", call("c", tokens=1000, max_tokens=10))
    assert c.kv_recovery_s == pytest.approx(500 * CFG.default_restore_s_per_tok)
    assert c.prefill_s == pytest.approx(500 * CFG.default_prefill_s_per_tok)
    assert c.decode_s == pytest.approx(10 * CFG.default_decode_s_per_tok)


def test_where_the_model_is_active_its_engine_rates_price_it():
    here = snap("i", prefill_tok_s=1000.0, decode_tok_s=50.0, restore_tok_s=2000.0,
                sessions=[("s1", "m1", "host", 500)])
    other = snap("j", prefill_tok_s=1e6, decode_tok_s=1e4, restore_tok_s=1e7)  # the model's profile differs
    c = price(state_of(other, here), "i", call("c", tokens=1000, max_tokens=10))
    assert (c.kv_recovery_s, c.prefill_s, c.decode_s) == pytest.approx((500 / 2000, 500 / 1000, 10 / 50))


def test_an_engine_rate_of_zero_means_not_reported_not_free():
    blank = snap("i", prefill_tok_s=0.0, decode_tok_s=0.0, restore_tok_s=0.0, sessions=[("s1", "m1", "host", 500)])
    c = price(state_of(blank), "i", call("c", tokens=1000, max_tokens=10))
    assert c.kv_recovery_s == pytest.approx(500 * CFG.default_restore_s_per_tok)
    assert c.prefill_s == pytest.approx(500 * CFG.default_prefill_s_per_tok)
    assert c.decode_s == pytest.approx(10 * CFG.default_decode_s_per_tok)


def test_completions_measured_decode_comes_before_the_engine_rate():
    state = state_of(snap("i", decode_tok_s=50.0))
    state.model("m1").decode_s_per_tok = 0.5
    assert price(state, "i", call("c", max_tokens=10)).decode_s == pytest.approx(5.0)


def test_other_engines_rates_price_a_model_where_it_is_not_active():
    fast = snap("j", prefill_tok_s=1000.0, restore_tok_s=4000.0)  # m1 active on j: m1's rates
    there = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, prefill_tok_s=10.0,
                 restore_tok_s=10.0, sessions=[("s1", "m1", "host", 400)])
    c = price(state_of(fast, there), "i", call("c", tokens=1000))
    assert c.kv_recovery_s == pytest.approx(400 / 4000) and c.prefill_s == pytest.approx(600 / 1000)


# ---- the queue ahead -------------------------------------------------------------------------


def test_the_agent_s_prefill_prediction_is_the_queue_even_when_zero():
    zero = snap("i", queued_tokens=50_000, queued_prefill_s=0.0)
    assert price(state_of(zero), "i").queue_s == 0.0  # 0 reported: nothing to compute ahead
    unreported = snap("i", queued_tokens=50_000, queued_prefill_s=-1.0)
    assert price(state_of(unreported), "i").queue_s == pytest.approx(50_000 / 10_000)


def test_queued_tokens_are_priced_at_the_instance_s_own_rate_where_the_model_is_active():
    slow = snap("i", queued_tokens=1000, prefill_tok_s=100.0)
    fast = snap("j", prefill_tok_s=100_000.0)  # the model's profile mixes both engines' rates
    assert price(state_of(fast, slow), "i").queue_s == pytest.approx(1000 / 100.0)
    elsewhere = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, queued_tokens=1000,
                     prefill_tok_s=100.0)
    st = state_of(fast, elsewhere)  # m1 not active on i: its profile's rate (j's), never m2's
    assert price(st, "i").queue_s == pytest.approx(1000 * st.models["m1"].prefill_rate())


def test_the_wait_for_the_active_slot_is_paid_only_by_a_model_that_is_not_active():
    other = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, round_remaining_s=0.4)
    assert price(state_of(other), "i").queue_s == pytest.approx(0.4)
    own = snap("i", round_remaining_s=0.4)
    assert price(state_of(own), "i").queue_s == 0.0
    idle = snap("i", active=None, models={"m1": "resident"}, round_remaining_s=0.4)
    assert price(state_of(idle), "i").queue_s == 0.0  # nothing active: no slot to wait for


# ---- the KV-pool and weight checks: each boundary --------------------------------------------


def test_a_prompt_past_the_kv_pool_is_refused_and_a_cap_past_it_only_deprioritised():
    # No completion of m1 yet: the output estimate is the cap itself (output_estimate.py).
    pool = snap("i", kv_capacity_tokens=2000, kv_pinned_tokens=0)
    fits = price(state_of(pool), "i", call("c", tokens=1000, max_tokens=1000))
    assert fits.feasible  # exactly the pool
    over = price(state_of(pool), "i", call("c", tokens=1000, max_tokens=1001))
    assert (over.feasible, over.reason) == (False, "kv_full")  # soft: it may stop short of its cap
    never = price(state_of(pool), "i", call("c", tokens=2000, max_tokens=1))
    assert (never.feasible, never.reason) == (False, "hbm")  # its prompt alone fills the pool


def test_kv_held_by_running_calls_counts_and_a_reported_zero_is_zero():
    """Beside running calls' KV a call that fits the pool alone is "kv_full": it waits (soft)."""
    held = snap("i", kv_capacity_tokens=2000, kv_used_tokens=1500, kv_pinned_tokens=1000)
    assert price(state_of(held), "i", call("c", tokens=990, max_tokens=10)).feasible
    assert price(state_of(held), "i", call("c", tokens=991, max_tokens=10)).reason == "kv_full"
    unreported = with_(held, kv_pinned_tokens=-1)  # an older agent: all used KV counts
    assert price(state_of(unreported), "i", call("c", tokens=490, max_tokens=10)).feasible
    assert price(state_of(unreported), "i", call("c", tokens=491, max_tokens=10)).reason == "kv_full"
    none_held = with_(held, kv_pinned_tokens=0)
    assert price(state_of(none_held), "i", call("c", tokens=1990, max_tokens=10)).feasible


def test_another_model_s_held_kv_does_not_count_where_switching_frees_the_pool():
    busy = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, kv_capacity_tokens=2000,
                kv_pinned_tokens=1900)
    assert price(state_of(busy), "i", call("c", tokens=1990, max_tokens=10)).feasible


def test_calls_routed_since_the_snapshot_count_against_the_pool():
    state = state_of(snap("i", kv_capacity_tokens=2000, kv_pinned_tokens=0))
    state.instances["i"].add_overlay("x", 1000, "m1")
    assert price(state, "i", call("c", tokens=990, max_tokens=10)).feasible
    assert price(state, "i", call("c", tokens=991, max_tokens=10)).reason == "kv_full"


def test_an_unknown_pool_size_refuses_nothing():
    assert price(state_of(snap("i", kv_capacity_tokens=0, kv_pinned_tokens=10**9)), "i").feasible


def test_weights_must_fit_hbm_only_for_a_model_not_on_device():
    big = snap("i", active="m2", models={"m2": "active", "m1": "absent"}, weight_gib=100.0, hbm_gib=80.0)
    assert price(state_of(big), "i").reason == "hbm"
    exact = snap("i", active="m2", models={"m2": "active", "m1": "absent"}, weight_gib=80.0, hbm_gib=80.0)
    assert price(state_of(exact), "i").feasible
    resident = snap("i", active="m2", models={"m2": "active", "m1": "resident"}, weight_gib=100.0, hbm_gib=80.0)
    assert price(state_of(resident), "i").feasible  # already there
    unknown = snap("i", active="m2", models={"m2": "active", "m1": "absent"}, weight_gib=100.0, hbm_gib=0.0)
    assert price(state_of(unknown), "i").feasible  # HBM size not reported: no check


# ---- opening a replica (Eq. 2 applies) -------------------------------------------------------


def test_fresh_means_opening_a_new_replica_and_nothing_else():
    def fresh(s):
        st = state_of(s)
        return CostModel(CFG).price(st, st.instances["i"], call("c"), None, 0.0).fresh

    absent = snap("i", active="m2", models={"m2": "active", "m1": "absent"})
    assert fresh(absent)
    assert not fresh(snap("i", active="m2", models={"m2": "active", "m1": "staged"}))
    assert not fresh(snap("i", active="m2", models={"m2": "active", "m1": "resident"}))
    assert not fresh(with_(absent, queued={"m1": 1}))  # already being opened for a queued call
    st = state_of(absent)
    st.instances["i"].add_overlay("x", 10, "m1")  # routed there since the snapshot
    assert not CostModel(CFG).price(st, st.instances["i"], call("c"), None, 0.0).fresh


# ---- staleness and health rule an instance out, with the reason -----------------------------


def test_a_stale_or_unhealthy_instance_is_priced_infeasible_with_its_reason():
    st = state_of(snap("i"), now=0.0)
    assert price(st, "i", now=CFG.stale_after_s).feasible  # exactly the bound: still fresh
    assert price(st, "i", now=CFG.stale_after_s + 0.01).reason == "stale"
    sick = state_of(with_(snap("i"), healthy=False))
    assert price(sick, "i").reason == "unhealthy"
    assert price(state_of(snap("i", active="m2", models={"m2": "active"})), "i").reason == "model_not_served"
    pinned = snap("i", pool="hot", active="m2", models={"m2": "active", "m1": "resident"})
    assert price(state_of(pinned), "i").reason == "hot_pool_pinned"


# ---- KV recovery: own KV, a completion newer than the snapshot, recompute ---------------------


def test_a_completion_newer_than_the_snapshot_is_trusted_for_the_session_s_kv():
    st = state_of(snap("i", at=5.0), now=6.4)  # received just now: fresh
    entry = SessionEntry("s1", model="m1", last_instance="i", kv_tokens=800, last_used=6.0, calls=1)
    c = price(st, "i", call("c", tokens=1000), entry, now=6.5)
    assert c.feasible and (c.kv_state, c.kv_recovery_s) == ("device", 0.0)
    older = SessionEntry("s1", model="m1", last_instance="i", kv_tokens=800, last_used=5.0, calls=1)
    c = price(st, "i", call("c", tokens=1000), older, now=6.5)  # the snapshot is as new: it says none
    assert c.kv_state == "recompute" and c.kv_recovery_s == pytest.approx(800 * 1e-4)
    other_model = SessionEntry("s1", model="m2", last_instance="i", kv_tokens=800, last_used=6.0, calls=1)
    assert price(st, "i", call("c", tokens=1000), other_model, now=6.5).kv_state == "recompute"  # not on device


def test_only_the_prompt_s_share_of_known_kv_is_reusable():
    st = state_of(snap("i", sessions=[("s1", "m1", "device", 5000)]))
    c = price(st, "i", call("c", tokens=1000))
    assert (c.kv_state, c.prefill_s, c.kv_recovery_s) == ("device", 0.0, 0.0)


def test_device_kv_shorter_than_what_the_session_knows_recomputes_the_rest():
    st = state_of(snap("i", sessions=[("s1", "m1", "device", 300)]))
    entry = SessionEntry("s1", model="m1", last_instance="j", kv_tokens=800, last_used=0.0, calls=1)
    c = price(st, "i", call("c", tokens=1000), entry)
    assert c.kv_recovery_s == pytest.approx(500 * 1e-4) and c.prefill_s == pytest.approx(200 * 1e-4)
    st = state_of(snap("i", sessions=[("s1", "m1", "host", 300)]))
    c = price(st, "i", call("c", tokens=1000), entry)
    assert c.kv_recovery_s == pytest.approx(300 * 1e-5 + 500 * 1e-4)



def test_a_move_pays_its_recompute_once_for_every_other_session_living_where_it_goes():
    # s1's context (1,000 tokens) lives on j; on i it recomputes 0.1 s of prefill that each
    # session living on i waits behind: two of them, plus s1's own old home there, not counted
    entry = SessionEntry("s1", model="m1", last_instance="j", kv_tokens=1000, last_used=0.0, calls=1)
    st = state_of(snap("i"))
    assert price(st, "i", call("c", tokens=1000), entry).placement_s == 0.0  # nobody lives on i
    for sid in ("a", "b"):
        st.apply(routed_to(call(sid, session=sid, model="m2"), "i"))
    c = price(st, "i", call("c", tokens=1000), entry)
    assert c.kv_state == "recompute" and c.placement_s == pytest.approx(2 * 1000 * 1e-4)
    st.apply(routed_to(call("old", session="s1", model="m1"), "i"))  # s1 itself lived on i
    assert price(st, "i", call("c", tokens=1000), entry).placement_s == pytest.approx(2 * 1000 * 1e-4)
    # a first call has no context to move: it pays nothing for the sessions there
    assert price(st, "i", call("c", tokens=1000)).placement_s == 0.0


# ---- round sharing: each other model counted once, wherever it is seen ----------------------

SHARING = PolicyConfig(new_session_running_s=0.0, price_round_sharing=True)
PER_OTHER = 10 * 0.01 + SHARING.default_open_s  # r's decode (10 tokens at 10 ms) + one switch


def stretch(state: RouterState, now: float = 0.0) -> float:
    c = price(state, "i", call("c", max_tokens=10), cfg=SHARING, now=now)
    return c.decode_s - 10 * 0.01


def test_a_model_routed_since_the_snapshot_takes_a_slot_once():
    busy = snap("i", running=1, queued={"m2": 1})  # m1 active with work; m2 queued
    st = state_of(busy)
    assert stretch(st) == pytest.approx(PER_OTHER)
    st.instances["i"].add_overlay("x", 10, "m2")  # m2 again: already rotating
    assert stretch(st) == pytest.approx(PER_OTHER)
    st.instances["i"].add_overlay("y", 10, "m3")  # a third model routed there since
    assert stretch(st) == pytest.approx(2 * PER_OTHER)
    st.instances["i"].add_overlay("z", 10, "m1")  # r's own model never stretches r
    assert stretch(st) == pytest.approx(2 * PER_OTHER)


def test_a_model_whose_session_lives_there_takes_a_slot_once():
    st = state_of(snap("i", running=1))
    st.apply(routed_to(call("w", session="w", model="m3"), "i"))  # a call of m3 runs on i ...
    st.apply(SnapshotReceived(snap("i", version=2, running=1), 0.0))  # ... the overlay is reset
    assert st.live_models("i", 0.0) == ("m3",)
    assert stretch(st) == pytest.approx(PER_OTHER)
    st.instances["i"].add_overlay("y", 10, "m3")  # also routed since: still once
    assert stretch(st) == pytest.approx(PER_OTHER)
    queued = state_of(snap("i", running=1))
    queued.apply(routed_to(call("w", session="w", model="m3"), "i"))
    queued.apply(SnapshotReceived(snap("i", version=2, running=1, queued={"m3": 1}), 0.0))
    assert stretch(queued) == pytest.approx(PER_OTHER)  # queued and living there: once


def routed_to(the_call, iid: str) -> CallRouted:
    return CallRouted(call=the_call, call_index=0, instance_id=iid, policy="talaria", routed_at=0.0)


def test_an_active_model_with_queued_calls_is_not_idle_even_with_nothing_running():
    # m2 is active on i with a call of it queued (none running), and a session of m2 that ran
    # there is idle now. m2 rotates with r because of its queued call: one slot. Taking the
    # instance for idle would also charge m2's comeback share on top.
    st = RouterState()
    st.apply(SnapshotReceived(snap("i", active="m2", models={"m2": "active", "m1": "resident"}), 0.0))
    st.apply(routed_to(call("w", session="w", model="m2"), "i"))
    st.apply(done_("w", "i", "w", "m2"))  # its session ran on i and is idle now
    st.apply(SnapshotReceived(snap("i", version=2, active="m2", models={"m2": "active", "m1": "resident"},
                                   queued={"m2": 1}), 0.0))
    assert st.live_models("i", 0.5) == ()
    decode = 10 * SHARING.default_decode_s_per_tok  # m1 is not active on i: the fallback rate
    c = price(st, "i", call("c", max_tokens=10), cfg=SHARING, now=0.5)
    assert c.decode_s == pytest.approx(2 * decode + SHARING.default_open_s)  # one other model


def done_(call_id: str, iid: str, session: str, model: str):
    from router_support import done

    return done(call_id, iid, session=session, model=model, at=0.2)


# ---- round admission: every term counts, the budget itself passes ---------------------------

BUDGET = CFG.gamma * CFG.ttft_target_s  # 9 s


def admission(queue_s: float, prompt: int = 0, host_kv: int = 0, models=None, active="m1", **extra):
    """One instance with `queue_s` of predicted prefill ahead; a call whose new prompt costs 1e-4
    s/token, whose own KV (another session's, so kv_home_admits does not apply) is absent."""
    s = snap("i", queued_prefill_s=queue_s, models=models, active=active, **extra)
    return price(state_of(s), "i", call("c", tokens=prompt, max_tokens=1))


def test_round_admission_counts_the_prefill():
    assert admission(1.0, prompt=80_000).feasible  # 1 + 8 = 9: exactly the budget
    assert admission(1.0, prompt=80_001).reason == "round_admission"


def test_round_admission_counts_the_activation():
    rows = {"m2": "active", "m1": "resident"}
    assert admission(1.0, models=rows, active="m2", switch_cost_s=8.0).feasible
    assert admission(1.0, models=rows, active="m2", switch_cost_s=8.01).reason == "round_admission"


def test_round_admission_counts_the_kv_recovery():
    entry = SessionEntry("s1", model="m1", last_instance="j", kv_tokens=80_001, last_used=0.0, calls=1)
    st = state_of(snap("i", queued_prefill_s=1.0))  # s1's KV is not here: recompute 80,001 tokens
    c = price(st, "i", call("c", tokens=80_001, max_tokens=1), entry)
    assert (c.kv_state, c.prefill_s) == ("recompute", 0.0) and c.reason == "round_admission"


def test_nothing_ahead_always_passes_whatever_the_call_costs():
    assert admission(0.0, prompt=200_000).feasible


def test_the_snapshot_s_switch_time_prices_each_rotation_switch():
    st = state_of(with_(snap("i", running=1, queued={"m2": 1}), switch_s=0.5))
    assert stretch(st) == pytest.approx(10 * 0.01 + 0.5)


def test_only_a_session_s_own_kv_with_tokens_in_it_passes_admission_at_home():
    home = snap("i", queued_prefill_s=1.0, restore_tok_s=10_000.0, sessions=[("s1", "m1", "host", 85_000)])
    assert price(state_of(home), "i", call("c", tokens=90_000, max_tokens=1)).feasible  # restorable here
    empty = snap("i", queued_prefill_s=1.0, sessions=[("s1", "m1", "device", 0)])
    c = price(state_of(empty), "i", call("c", tokens=90_000, max_tokens=1))
    assert c.reason == "round_admission"  # listed, but nothing in it
    off = PolicyConfig(**PAPER_EQ1, kv_home_admits=False)
    assert price(state_of(home), "i", call("c", tokens=90_000, max_tokens=1), cfg=off).reason == "round_admission"


# ---- Eq. 2: the replica-opening threshold and gain ------------------------------------------


def opening(staging_gib: float = 0.0, hbm_used_gib: float = 40.0, hbm_gib: float = 80.0, weight_gib: float = 10.0,
            penalty: float = 0.5, running: int = 0, running_s: float = 0.0):
    cfg = PolicyConfig(**{**PAPER_EQ1, "new_session_running_s": running_s}, replica_penalty_s=penalty)
    s = snap("i", active="m2", models={"m2": "active", "m1": "absent"}, weight_gib=weight_gib, hbm_gib=hbm_gib,
             hbm_used_gib=hbm_used_gib, open_cost_s=2.0, running=running)
    s = with_(s, staging_free_bytes=int(staging_gib * (1 << 30)))
    st = state_of(s)
    model = CostModel(cfg)
    return st, model, model.price(st, st.instances["i"], call("c"), None, 0.0)


def test_the_threshold_is_activation_plus_hbm_pressure_times_weights_plus_the_penalty():
    st, model, cand = opening()
    _, threshold = model.replica_gain(st, "m1", cand, None, 0.0)
    assert threshold == pytest.approx(2.0 + 0.05 * 0.5 * 10 + 0.5)
    st, model, cand = opening(hbm_gib=0.0)  # HBM not reported: no pressure
    assert model.replica_gain(st, "m1", cand, None, 0.0)[1] == pytest.approx(2.0 + 0.5)


def test_staging_room_for_the_weights_halves_the_hbm_price():
    st, model, cand = opening(staging_gib=10.0)  # exactly the weights
    assert model.replica_gain(st, "m1", cand, None, 0.0)[1] == pytest.approx(2.0 + 0.05 * 0.5 * 10 / 2 + 0.5)
    st, model, cand = opening(staging_gib=9.99)
    assert model.replica_gain(st, "m1", cand, None, 0.0)[1] == pytest.approx(2.0 + 0.05 * 0.5 * 10 + 0.5)


def test_the_gain_is_the_saving_per_call_times_the_expected_calls():
    st, model, cand = opening()
    gain, _ = model.replica_gain(st, "m1", cand, None, 0.0)
    assert gain == float("inf")  # no replica anywhere: all of its demand spills over
    eq1_without_act = cand.cost.total_s - cand.cost.placement_s - cand.cost.activation_s
    gain, _ = model.replica_gain(st, "m1", cand, eq1_without_act + 3.0, 0.0)
    assert gain == pytest.approx(3.0)  # one call expected: this one
    st.apply(LeaseIssued("s9", "m1", "j", "c9", 0.0, 5.0))  # a live lease: a reserved return
    assert model.replica_gain(st, "m1", cand, eq1_without_act + 3.0, 0.0)[0] == pytest.approx(6.0)
    assert model.replica_gain(st, "m1", cand, eq1_without_act - 1.0, 0.0)[0] == 0.0  # no saving


def test_the_gain_compares_eq1_costs_without_the_placement_term():
    st, model, cand = opening(running=2, running_s=1.5)  # a first call: 2 running x 1.5 s placement
    assert cand.cost.placement_s == pytest.approx(3.0)
    eq1_without_act = cand.cost.total_s - cand.cost.placement_s - cand.cost.activation_s
    gain, _ = model.replica_gain(st, "m1", cand, eq1_without_act + 1.0, 0.0)
    assert gain == pytest.approx(1.0)


def test_observed_arrivals_over_the_control_window_add_to_the_demand():
    st, model, cand = opening()
    eq1_without_act = cand.cost.total_s - cand.cost.placement_s - cand.cost.activation_s
    prof = st.model("m1")
    for t in (0.0, 0.5, 1.0):
        prof.observe_arrival(t)
    rate = prof.arrival_rate(1.0)
    assert rate > 0
    gain, _ = model.replica_gain(st, "m1", cand, eq1_without_act + 3.0, 1.0)
    assert gain == pytest.approx(3.0 * (1.0 + rate * CFG.control_window_s))


# ---- placement_s: what a first call and a session's later calls pay --------------------------


def test_a_first_call_pays_the_calls_running_there_at_the_configured_or_its_own_decode_price():
    st = state_of(snap("i", running=3))
    cfg = PolicyConfig(**{**PAPER_EQ1, "new_session_running_s": 0.7})
    assert price(st, "i", call("c", max_tokens=10), cfg=cfg).placement_s == pytest.approx(3 * 0.7)
    derived = PolicyConfig(**{**PAPER_EQ1, "new_session_running_s": None})
    c = price(st, "i", call("c", max_tokens=10), cfg=derived)
    assert c.placement_s == pytest.approx(3 * c.decode_s)
    returning = SessionEntry("s1", model="m1", last_instance="j", kv_tokens=0, calls=1)
    assert price(st, "i", call("c", max_tokens=10), returning, cfg=cfg).placement_s == 0.0
    known_but_unrouted = SessionEntry("s1", calls=0)  # e.g. made by a completion before its routing
    assert price(st, "i", call("c", max_tokens=10), known_but_unrouted, cfg=cfg).placement_s == pytest.approx(2.1)
    assert c.total_s == pytest.approx(c.queue_s + c.prefill_s + c.decode_s + c.kv_recovery_s + c.activation_s
                                      + c.placement_s)


def test_later_calls_pay_the_rotation_again_as_many_as_measured():
    st = state_of(snap("i", running=1, queued={"m2": 1}))  # one other model rotates here
    cfg = SHARING
    entry = SessionEntry("s1", model="m1", last_instance="j", kv_tokens=0, calls=4)
    c = price(st, "i", call("c", max_tokens=10), entry, cfg=cfg)
    assert c.placement_s == pytest.approx(4 * PER_OTHER)  # a return expects as many more as it made
    prof = st.model("m1")
    prof.calls_seen, prof.sessions_seen = 9, 3  # 3 calls per session so far
    first = price(st, "i", call("c", max_tokens=10), None, cfg=cfg)
    assert first.placement_s == pytest.approx(2 * PER_OTHER)  # a first call: the 2 after it


def test_a_prefix_hit_counts_only_on_the_instance_that_holds_it():
    st = state_of(snap("i", sessions=[("owner", "m1", "device", 800)]), snap("j"))
    model = CostModel(CFG)
    hit = {"i": (800, "owner")}
    on_i = model.price(st, st.instances["i"], call("c", tokens=1000), None, 0.0, None, hit).cost
    on_j = model.price(st, st.instances["j"], call("c", tokens=1000), None, 0.0, None, hit).cost
    assert (on_i.kv_state, on_i.prefill_s) == ("device", pytest.approx(200 * 1e-4))
    assert (on_j.kv_state, on_j.prefill_s) == ("none", pytest.approx(1000 * 1e-4))
    gone = state_of(snap("i"))  # the owner's KV is no longer reported: the hit is worth nothing
    c = model.price(gone, gone.instances["i"], call("c", tokens=1000), None, 0.0, None, hit).cost
    assert c.kv_state == "none"
    dropped = state_of(snap("i", sessions=[("owner", "m1", "none", 800)]))  # reported, but dropped
    c = model.price(dropped, dropped.instances["i"], call("c", tokens=1000), None, 0.0, None, hit).cost
    assert (c.kv_state, c.kv_recovery_s, c.prefill_s) == ("none", 0.0, pytest.approx(1000 * 1e-4))


def test_an_idle_instance_s_last_model_claims_its_comeback_share_of_a_slot():
    st = RouterState()
    st.apply(SnapshotReceived(snap("i", active="m2", models={"m2": "active", "m1": "resident"}), 0.0))
    st.apply(routed_to(call("w", session="w", model="m2"), "i"))
    st.apply(done_("w", "i", "w", "m2"))  # m2's session ran here, idle now past every gap (none measured)
    st.apply(SnapshotReceived(snap("i", version=2, active="m2", models={"m2": "active", "m1": "resident"}), 0.0))
    decode = 10 * SHARING.default_decode_s_per_tok
    c = price(st, "i", call("c", max_tokens=10), cfg=SHARING, now=0.5)
    assert c.decode_s == pytest.approx(2 * decode + SHARING.default_open_s)  # 1 / (0 gaps + 1) = a whole slot
    st.model("m2").gaps.extend([1.0, 1.0, 1.0])
    c = price(st, "i", call("c", max_tokens=10), cfg=SHARING, now=0.5)
    assert c.decode_s == pytest.approx(decode + 0.25 * (decode + SHARING.default_open_s))


def test_a_kv_entry_saying_none_is_no_evidence_against_a_newer_completion():
    st = state_of(snap("i", at=5.0, sessions=[("s1", "m1", "none", 0)]), now=6.4)
    entry = SessionEntry("s1", model="m1", last_instance="i", kv_tokens=800, last_used=6.0, calls=1)
    c = price(st, "i", call("c", tokens=1000), entry, now=6.5)
    assert c.feasible and (c.kv_state, c.kv_recovery_s) == ("device", 0.0)
