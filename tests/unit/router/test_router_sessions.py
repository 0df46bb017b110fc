"""Sessions as the unit of placement: where live sessions live (homes.py) and what the
rotation they join costs over the calls they will still make (costs.py placement_s).

Rates (router_support.snap defaults): prefill 1e-4 s/token, decode 1e-2 s/token; the
snapshots report no switch time, so a switch is priced at PolicyConfig().default_open_s.
"""

from __future__ import annotations

import pytest
from router_support import call, core, done, one, snap

from talaria.services.router import state as router_state
from talaria.services.router.policy.base import PolicyConfig
from talaria.shared.events import RoutingDecision

NO_LEASE = dict(lease_timeout_s=0.0)
SW = PolicyConfig().default_open_s
THREE = {"m1": "active", "m2": "absent", "m3": "absent"}


def by_instance(audit):
    return {x.instance_id: x for x in audit.candidates}


def run_session(c, session: str, model: str, instance: str, calls: int, start: float, gap: float = 0.5,
                prompt: int = 1000, output: int = 10) -> float:
    """Route and complete `calls` calls of one session on `instance` (the only fresh view)."""
    t = start
    for k in range(calls):
        c.observe(snap(instance, version=int(t * 100) + 1, at=t, active=model, models={model: "active"}), t)
        out = c.handle(call(f"{session}-{k}", session=session, model=model, tokens=prompt + 100 * k, at=t), t)
        assert one(out, RoutingDecision).chosen == instance
        t += 0.5
        c.handle(done(f"{session}-{k}", instance, session=session, model=model, index=k, at=t,
                      prompt=prompt + 100 * k, output=output), t)
        t += gap
    return t


def test_a_session_lives_on_its_instance_through_its_tool_gaps():
    c = core(**NO_LEASE)
    t = run_session(c, "s1", "m2", "a", calls=3, start=0.0, gap=0.8)  # gaps of 0.8 s measured
    done_at = t - 0.8
    assert c.state.idle_horizon_s("m2") == pytest.approx(0.8)
    assert c.state.live_models("a", done_at + 0.7) == ("m2",)  # within its longest gap
    assert c.state.live_models("a", done_at + 0.9) == ()  # idle longer than any gap: ended
    c.observe(snap("b", at=done_at + 0.1, active="m2", models={"m2": "active"}), done_at + 0.1)
    c.handle(call("s1-3", session="s1", model="m2", at=done_at + 0.2), done_at + 0.2)  # it moves
    home = c.state.homes.home_of["s1"][0]
    other = "a" if home == "b" else "b"
    assert c.state.live_models(home, done_at + 0.3) == ("m2",) and c.state.live_models(other, done_at + 0.3) == ()


def test_a_model_whose_sessions_are_between_calls_still_counts_in_the_rotation():
    # m2's session on `a` is in a tool gap (nothing of m2 queued or running): its next call
    # brings m2 back into a's rounds, so an m1 call there shares them with m2.
    def stretch(sharing: bool):
        c = core(price_round_sharing=sharing, **NO_LEASE)
        t = run_session(c, "s2", "m2", "a", calls=2, start=0.0, gap=1.0)
        now = t - 0.5  # half-way through its tool gap
        c.observe(snap("a", version=999, at=now, active="m1", models={"m1": "active", "m2": "resident"}), now)
        audit = one(c.handle(call("c1", session="new", max_tokens=100, at=now), now), RoutingDecision)
        return by_instance(audit)["a"].decode_s

    assert stretch(False) == pytest.approx(1.0)  # 100 tokens x 1e-2
    assert stretch(True) == pytest.approx(2 * 1.0 + SW)  # one other slot per round, one switch


def test_an_idle_instance_s_last_model_claims_a_slot_only_while_its_sessions_may_return():
    # s2 (m2) made 3 calls on `a` (2 tool gaps of 1 s measured) and went idle; `a` has
    # nothing running or queued, m2 still active. Within the longest gap s2 lives there (a
    # full slot per round); idle past every measured gap it returns with chance 1 / (2 + 1).
    def stretch(idle_s: float):
        c = core(price_round_sharing=True, **NO_LEASE)
        t = run_session(c, "s2", "m2", "a", calls=3, start=0.0, gap=1.0)
        now = t - 1.0 + idle_s  # the last call completed at t - 1.0
        c.observe(snap("a", version=999, at=now, active="m2", models={"m1": "resident", "m2": "active"}), now)
        audit = one(c.handle(call("c1", session="new", max_tokens=100, at=now), now), RoutingDecision)
        return audit.candidates[0].decode_s

    alone = 100 * PolicyConfig().default_decode_s_per_tok  # m1's decode: no rate measured yet
    assert stretch(0.5) == pytest.approx(2 * alone + SW)  # s2 is between calls: m2 rotates
    assert stretch(5.0) == pytest.approx(alone + (alone + SW) / 3)


def _return_after(calls_made: int):
    """s1 (150K-token context) has made `calls_made` calls on `a`, which now rotates three
    models; `b` runs m1 alone and would recompute s1's context (15 s). Where does its next
    call go?"""
    c = core(price_round_sharing=True, **NO_LEASE)
    t = run_session(c, "s1", "m1", "a", calls=calls_made, start=0.0, prompt=150_000, output=50)
    prompt = 150_000 + 100 * calls_made
    kv = [("s1", "m1", "device", prompt - 100 + 10)]
    c.observe(snap("a", version=10_000, at=t, models=THREE, queued={"m2": 1, "m3": 1}, sessions=kv), t)
    c.observe(snap("b", version=10_000, at=t), t)
    return one(c.handle(call("next", session="s1", tokens=prompt, max_tokens=50, at=t), t), RoutingDecision)


def test_a_long_session_leaves_a_crowded_rotation_once_the_recompute_pays_for_itself():
    stretch = 2 * 0.5 + 2 * SW  # two more slots per round and a switch before each
    short, long = _return_after(1), _return_after(4)
    for audit in (short, long):
        x = by_instance(audit)
        assert x["a"].kv_state == "device" and x["b"].kv_state == "recompute"
        assert x["b"].kv_recovery_s == pytest.approx(15.0, rel=0.01)
        assert x["a"].decode_s - x["b"].decode_s == pytest.approx(stretch)
    # This call and 1 later one: 2 stretches < 15 s of recompute; this call and 4 more: 5 > 15 s.
    assert by_instance(short)["a"].placement_s == pytest.approx(1 * stretch) and short.chosen == "a"
    assert by_instance(long)["a"].placement_s == pytest.approx(4 * stretch) and long.chosen == "b"


def test_a_first_call_prices_the_rotation_for_the_calls_its_model_shows_per_session():
    c = core(price_round_sharing=True, **NO_LEASE)
    t = run_session(c, "old1", "m1", "b", calls=4, start=0.0, output=100)  # m1 calls: 100 tokens
    t = run_session(c, "old2", "m1", "b", calls=2, start=t, output=100)  # m1 sessions: 6 calls / 2 sessions
    assert c.state.models["m1"].calls_per_session() == pytest.approx(3.0)
    c.observe(snap("a", version=10_000, at=t, models=THREE, queued={"m2": 1}), t)
    c.observe(snap("b", version=10_000, at=t, active="m2", models={"m1": "absent", "m2": "active"}), t)
    audit = one(c.handle(call("n0", session="new", max_tokens=100, at=t), t), RoutingDecision)
    x = by_instance(audit)
    stretch = x["a"].decode_s - 1.0  # 100 tokens at 1e-2 s, plus one other slot and switch
    assert stretch == pytest.approx(1.0 + SW)
    assert x["a"].placement_s == pytest.approx(2.0 * stretch)  # the 2 calls it will still make


def test_the_idle_horizon_is_the_longest_gap_still_in_the_window():
    import random

    from talaria.services.router.profiles import GAP_KEEP, ModelProfile

    rng = random.Random(3)
    prof = ModelProfile()
    for k in range(3 * GAP_KEEP):
        gap = rng.expovariate(1.0) * (20.0 if k == GAP_KEEP // 2 else 1.0)  # one long gap, then it ages out
        prof.observe_gap(gap)
        assert prof.idle_horizon_s() == max(prof.gaps)
    assert ModelProfile(gaps=[0.5, 3.0]).idle_horizon_s() == 3.0  # a profile stored without gap_max


def test_past_its_bound_the_session_table_forgets_the_least_recently_routed_idle_sessions():
    # A router runs for weeks: past `sessions_kept` rows it forgets the sessions routed longest
    # ago, so its table and its checkpoint stay bounded, but never one with a call in flight
    # or a lease (the session is coming back to it now).
    def serve(c, sessions):
        c.state.sessions_kept = 3
        c.observe(snap("a", at=0.0, models={"m1": "active"}), 0.0)
        c.handle(call("s0-0", session="s0"), 0.1)  # in flight throughout
        for k, sid in enumerate(sessions):
            c.observe(snap("a", version=k + 2, at=0.2 + k, models={"m1": "active"}), 0.2 + k)
            assert one(c.handle(call(f"{sid}-{k}", session=sid), 0.2 + k), RoutingDecision).chosen == "a"
            c.handle(done(f"{sid}-{k}", "a", session=sid, at=0.5 + k), 0.5 + k)
        return list(c.state.sessions)

    # s1 comes back before s3 starts: s2 is the one routed longest ago
    assert serve(core(**NO_LEASE), ("s1", "s2", "s1", "s3")) == ["s0", "s1", "s3"]
    # every completed session holds its lease: nothing is idle enough to forget
    assert serve(core(lease_timeout_s=100.0), ("s1", "s2", "s3")) == ["s0", "s1", "s2", "s3"]


def test_a_lost_instance_leaves_nothing_in_the_home_book_and_starts_afresh_if_it_returns():
    from talaria.services.router.homes import HomeBook

    book = HomeBook()
    book.routed("s1", "a", "m1", 0.0)
    assert book.live_models("a", 0.5, lambda m: 1.0) == ("m1",)  # cached for "a"
    book.forget_instance("a")  # lost: agents restart under new ids, so nothing of it may stay
    assert (book.by_instance, book.home_of, book._live, book._versions) == ({}, {}, {}, {})
    assert book.live_models("a", 0.5, lambda m: 1.0) == ()  # not the cached answer
    book.routed("s2", "a", "m2", 1.0)  # the same id back (a restart): its own sessions only
    assert book.live_models("a", 1.5, lambda m: 1.0) == ("m2",)


def test_the_session_table_is_capped_in_bytes():
    from talaria.shared.settings import RouterSettings, SettingsError

    assert router_state.rows_for(128 << 20) == (128 << 20) // router_state.SESSION_ROW_BYTES == 52_428
    assert router_state.rows_for(1 << 20) == 409
    with pytest.raises(SettingsError, match="TALARIA_ROUTER_SESSION_TABLE_BYTES"):
        RouterSettings(router_session_table_bytes=1000).validate()
