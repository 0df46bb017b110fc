"""The router state's fold, one rule per test (services/router/state.py `RouterState.apply`):
what each input changes, and what it must leave alone (issue 26)."""

from __future__ import annotations

import json

import pytest
from router_support import call, done, snap

from talaria.services.router import state as state_module
from talaria.services.router.state import RouterState, SnapshotReceived
from talaria.shared.events import CallFailed, CallRouted, InstanceLost, RoundSummary
from talaria.shared.wire import replace


def routed(call_id: str, instance: str = "a", *, session: str = "s1", model: str = "m1", index: int = 0,
           at: float = 1.0, tokens: int = 1000, seq: int = 0, hashes=()) -> CallRouted:
    return CallRouted(call=call(call_id, session, model, tokens=tokens, at=at, hashes=hashes), call_index=index,
                      instance_id=instance, policy="talaria", routed_at=at, submitted_seq=seq)


def seen(*snapshots, at: float = 0.0) -> RouterState:
    state = RouterState()
    for s in snapshots:
        state.apply(SnapshotReceived(s, at))
    return state


# ---- snapshots ------------------------------------------------------------------------------


def test_an_older_heartbeat_is_ignored_and_the_same_version_replaces():
    state = seen(snap("a", version=5, queued_tokens=1))
    state.apply(SnapshotReceived(snap("a", version=4, queued_tokens=2), 1.0))
    assert state.instances["a"].snapshot.queued_tokens == 1 and state.instances["a"].received_at == 0.0
    state.apply(SnapshotReceived(snap("a", version=5, queued_tokens=3), 2.0))
    assert state.instances["a"].snapshot.queued_tokens == 3


def test_a_new_incarnation_starts_afresh_whatever_its_version():
    state = seen(snap("a", version=5, incarnation="p1"))
    state.apply(routed("c0"))
    state.apply(SnapshotReceived(snap("a", version=1, incarnation="p2"), 1.0))
    view = state.instances["a"]
    assert view.snapshot.incarnation == "p2" and view.inflight == set()


def test_a_fresh_snapshot_keeps_the_calls_in_flight_and_resets_the_overlay():
    state = seen(snap("a"))
    state.apply(routed("c0"))
    assert state.instances["a"].overlay_tokens == 1000
    state.apply(SnapshotReceived(snap("a", version=2, queued_tokens=7), 1.5))
    view = state.instances["a"]
    assert view.inflight == {"c0"} and view.overlay_tokens == 0
    state.apply(SnapshotReceived(snap("a", version=3, queued_tokens=7), 1.6))  # a re-send
    assert state.instances["a"].inflight == {"c0"}


def test_engine_rates_are_folded_into_the_active_model_s_profile_only():
    state = seen(snap("a", prefill_tok_s=1000.0))
    assert state.models["m1"].engine_prefill_s_per_tok == pytest.approx(1e-3)
    idle = seen(snap("b", active=None, models={"m1": "resident"}, prefill_tok_s=1000.0))
    assert "m1" not in idle.models


def test_instance_lost_drops_the_view_only_for_its_incarnation_and_closes_its_calls():
    state = seen(snap("a", incarnation="p1"))
    state.apply(routed("c0", hashes=[11, 12]))
    state.apply(InstanceLost("a", "p0", "old process", 2.0, ["c0"]))
    assert "a" in state.instances and "c0" not in state.inflight_calls  # the calls close either way
    state.apply(routed("c1", at=2.1, hashes=[11, 12]))
    state.apply(InstanceLost("a", "p1", "gone", 3.0, []))
    assert "a" not in state.instances and "c1" in state.inflight_calls
    assert state.prefix.match("m1", [11, 12]) == {} and state.homes.by_instance.get("a") is None


def test_a_round_summary_updates_the_instance_profile_and_clears_the_pricing_memo():
    state = seen(snap("a"))
    state.instances["a"].memo["m1"] = object()
    state.apply(RoundSummary("a", 1, 4.0, 3.0, 0.5, 1.0))
    assert state.instance_profiles["a"].switch_s == 0.5 and state.instances["a"].memo == {}
    state.apply(RoundSummary("gone", 1, 4.0, 3.0, 0.5, 1.0))  # no view: profile only
    assert state.instance_profiles["gone"].rounds == 1


# ---- routing --------------------------------------------------------------------------------


def test_routing_records_the_call_in_flight_in_the_overlay_and_the_session():
    state = seen(snap("a"))
    state.apply(routed("c0", index=0, at=1.0, seq=7, hashes=[5]))
    entry = state.sessions["s1"]
    assert (entry.calls, entry.model, entry.first_instance) == (1, "m1", "a")
    assert state.inflight_calls["c0"][:3] == ("a", 1000, "m1") and state.routed == {"c0": "a"}
    assert state.submission_seq == {"c0": 7} and state.routed_total == 1
    view = state.instances["a"]
    assert view.inflight == {"c0"} and (view.overlay_tokens, view.overlay_new_tokens) == (1000, 1000)
    prof = state.models["m1"]
    assert (prof.calls_seen, prof.sessions_seen) == (1, 1)
    assert prof.arrival_rate(1.0) > 0
    assert state.prefix.match("m1", [5]) != {}
    assert state.homes.home_of["s1"] == ("a", "m1")


def test_a_later_call_counts_no_new_session_and_keeps_the_first_instance():
    state = seen(snap("a"), snap("b"))
    state.apply(routed("c0", "a", index=0))
    state.apply(routed("c1", "b", index=1, at=2.0))
    entry = state.sessions["s1"]
    assert (entry.calls, entry.first_instance) == (2, "a")
    assert (state.models["m1"].calls_seen, state.models["m1"].sessions_seen) == (2, 1)
    state.apply(routed("c9", "b", index=0, at=3.0))  # an index below what was routed never lowers it
    assert state.sessions["s1"].calls == 2


def test_a_return_where_its_kv_lives_queues_only_its_new_tokens():
    state = seen(snap("a"), snap("b"))
    state.apply(routed("c0", "a"))
    state.apply(done("c0", "a", at=2.0, prompt=1000, output=10))  # 1010 tokens of KV on a
    state.apply(routed("c1", "a", index=1, at=3.0, tokens=1500))
    assert state.instances["a"].overlay_new_tokens == 1500 - 1010
    state.apply(routed("c2", "b", index=2, at=3.1, tokens=1600))  # elsewhere: all of it
    assert state.instances["b"].overlay_new_tokens == 1600
    state.apply(routed("c3", "a", model="m2", index=3, at=3.2, tokens=1700))  # another model: all of it
    assert state.instances["a"].overlay_new_tokens == 490 + 1700


def test_a_tool_gap_is_recorded_only_between_a_completion_and_the_same_model_s_next_call():
    state = seen(snap("a"))
    state.apply(routed("c0", at=1.0))
    state.apply(done("c0", "a", at=2.0))
    state.apply(routed("c1", index=1, at=2.5))
    assert state.sessions["s1"].gaps == [0.5] and state.models["m1"].gaps == [0.5]
    state.apply(routed("c2", index=2, at=3.0))  # no completion in between: no gap
    assert state.sessions["s1"].gaps == [0.5]
    state.apply(done("c2", "a", index=2, at=4.0))
    state.apply(routed("c3", model="m2", index=3, at=5.0))  # another model: no gap
    assert state.sessions["s1"].gaps == [0.5]


def test_a_gap_is_never_negative_and_a_longer_one_moves_the_idle_horizon():
    state = seen(snap("a"))
    state.apply(routed("c0", at=1.0))
    state.apply(done("c0", "a", at=2.0))
    epoch = state.horizon_epoch
    state.apply(routed("c1", index=1, at=1.5))  # submitted before the completion (clock skew)
    assert state.sessions["s1"].gaps == [0.0]
    state.apply(done("c1", "a", index=1, at=3.0))
    state.apply(routed("c2", index=2, at=5.0))
    assert state.sessions["s1"].gaps == [0.0, 2.0] and state.horizon_epoch > epoch


def test_only_the_last_gaps_are_kept_per_session():
    state = seen(snap("a"))
    t = 0.0
    for i in range(state_module.SESSION_GAPS_KEPT + 3):
        state.apply(routed(f"c{i}", index=i, at=t))
        state.apply(done(f"c{i}", "a", index=i, at=t + 1.0))
        t += 1.0 + i * 0.01 + 0.1
    gaps = state.sessions["s1"].gaps
    assert len(gaps) == state_module.SESSION_GAPS_KEPT and gaps[-1] == pytest.approx(0.1 + 0.01 * (len(gaps) + 1))


def test_a_routing_that_arrives_after_its_call_completed_counts_nothing_in_flight():
    state = seen(snap("a"))
    state.apply(done("c0", "a", at=2.0))
    state.apply(routed("c0", at=1.0))
    assert "c0" not in state.inflight_calls and state.instances["a"].overlay_tokens == 0
    assert state.routed_total == 0


def test_call_ids_are_remembered_up_to_the_bound_oldest_forgotten_first(monkeypatch):
    monkeypatch.setattr(state_module, "ROUTED_KEPT", 2)
    state = seen(snap("a"))
    for i in range(3):
        state.apply(routed(f"c{i}", at=float(i), seq=10 + i))
    assert list(state.routed) == ["c1", "c2"] and "c0" not in state.submission_seq
    assert state.submission_seq == {"c1": 11, "c2": 12}


def test_decided_and_reused_need_a_real_stream_sequence():
    state = seen(snap("a"))
    state.decided("cx", 5)  # never routed: nothing to remember
    assert state.submission_seq == {}
    state.apply(routed("c0", seq=0))
    state.decided("c0", 0)
    assert state.submission_seq == {} and not state.reused("c0", 9)
    state.decided("c0", 4)
    assert state.submission_seq == {"c0": 4}
    assert state.reused("c0", 9) and not state.reused("c0", 4) and not state.reused("c0", 0)


# ---- completions and failures ---------------------------------------------------------------


def test_a_completion_moves_the_session_and_closes_the_call():
    state = seen(snap("a"))
    state.apply(routed("c0"))
    state.apply(done("c0", "a", at=2.0, prompt=1000, output=10))
    entry = state.sessions["s1"]
    assert (entry.last_instance, entry.kv_tokens, entry.last_used, entry.last_call_id) == ("a", 1010, 2.0, "c0")
    assert "c0" not in state.inflight_calls and state.instances["a"].inflight == set()
    assert state.instances["a"].overlay_tokens == 0
    state.apply(done("c1", "a", index=1, at=3.0, kv_tokens=900, decode_s=0.5))
    assert state.sessions["s1"].kv_tokens == 900  # the agent's own count wins
    assert state.models["m1"].decode_s_per_tok > 0


def test_a_completion_of_a_call_never_routed_here_is_remembered_as_placed():
    state = seen(snap("a"))
    state.apply(done("c7", "b", at=2.0))
    assert state.routed == {"c7": "b"}


def test_a_failure_before_placement_is_never_placed_later_and_counts_router_spillover():
    state = seen(snap("a"))
    state.apply(CallFailed("c0", "s1", "m1", "timeout", "gateway", 1.0))
    assert state.routed == {"c0": ""}
    state.apply(CallFailed("c1", "s1", "m1", "no instance", "router", 1.0))
    assert "c1" not in state.routed and state.models["m1"].arrival_rate(1.0) > 0
    state.apply(routed("c2"))
    state.apply(CallFailed("c2", "s1", "m1", "boom", "agent", 2.0, instance_id="a"))
    assert state.routed["c2"] == "a" and "c2" not in state.inflight_calls  # placed: stays placed
    assert state.instances["a"].inflight == set()


def test_to_dict_round_trips_a_folded_state():
    state = seen(snap("a"))
    state.apply(routed("c0", seq=3))
    state.apply(done("c0", "a", at=2.0))
    again = RouterState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again.to_dict() == state.to_dict() and again.sessions == state.sessions
    # a checkpoint written before session rows were lists (one dict per row) still restores
    older = {**state.to_dict(), "format": 1}
    older["sessions"] = [dict(zip(older.pop("session_fields"), row)) for row in older["sessions"]]
    assert RouterState.from_dict(json.loads(json.dumps(older))).sessions == state.sessions
    with pytest.raises(ValueError, match="format"):
        RouterState.from_dict({**state.to_dict(), "format": 99})


def test_helpers_create_on_first_use_and_read_indexes():
    state = RouterState()
    assert state.sessions.get("x") is None and state.session("x") is state.session("x")
    assert state.model("m") is state.model("m")
    assert state.idle_horizon_s("none") == 0.0 and state.leases_on("a", 0.0) == 0
    assert state.live_models("a", 0.0) == ()
    state.apply(replace(done("c0", "a"), call_id="c0"))
    assert state.idle_horizon_s("m1") == 0.0


def test_losing_an_instance_the_router_never_saw_only_closes_the_named_calls():
    state = seen(snap("a"))
    state.apply(routed("c0"))
    state.apply(InstanceLost("zz", "p0", "unknown", 2.0, ["c0"]))
    assert "a" in state.instances and "c0" not in state.inflight_calls


def test_routing_to_an_instance_forgets_sessions_idle_there_past_their_horizon():
    state = seen(snap("a"))
    state.apply(routed("c0", session="s1", at=1.0))
    state.apply(done("c0", "a", session="s1", at=2.0))  # s1 idle on a from 2.0; no gap measured: horizon 0
    assert state.homes.home_of["s1"] == ("a", "m1")
    state.apply(routed("c1", session="s2", at=2.0))  # not past the horizon yet (idle 0 s)
    assert "s1" in state.homes.home_of
    state.apply(routed("c2", session="s3", at=2.5))
    assert "s1" not in state.homes.home_of and state.homes.home_of["s2"] == ("a", "m1")


def test_a_routing_folded_twice_counts_once():
    # Replay folds again the router's own outputs stored after the checkpoint's sequence.
    once = seen(snap("a"))
    once.apply(routed("c0", seq=4))
    twice = seen(snap("a"))
    twice.apply(routed("c0", seq=4))
    twice.apply(routed("c0", seq=4))
    assert twice.to_dict() == once.to_dict()
    assert twice.models["m1"].calls_seen == 1 and twice.routed_total == 1
    twice.apply(done("c0", "a", at=2.0))
    assert twice.live_models("a", 2.5) == ()  # its session is no longer running there


def test_a_routing_after_its_completion_still_names_its_submission():
    state = seen(snap("a"))
    state.apply(done("c0", "a", at=2.0))
    state.apply(routed("c0", at=1.0, seq=5))
    assert state.submission_seq == {"c0": 5} and state.reused("c0", 6)


def test_the_idle_horizon_epoch_moves_only_when_the_longest_gap_does():
    state = seen(snap("a"))
    t = 0.0
    epochs = []
    for i, gap in enumerate((2.0, 1.0, 3.0)):
        state.apply(routed(f"c{i}", index=i, at=t))
        state.apply(done(f"c{i}", "a", index=i, at=t + 1.0))
        t += 1.0 + gap
        before = state.horizon_epoch
        state.apply(routed(f"n{i}", index=i + 10, at=t))
        epochs.append(state.horizon_epoch - before)
        state.apply(done(f"n{i}", "a", index=i + 10, at=t))
    assert epochs == [1, 0, 1]


def test_a_completion_names_the_session_s_model_and_instance():
    state = seen(snap("a"), snap("b"))
    state.apply(routed("c0", "a", model="m1"))
    state.apply(done("c9", "b", model="m2", at=3.0))  # a call of another model, placed elsewhere
    entry = state.sessions["s1"]
    assert (entry.model, entry.last_instance) == ("m2", "b")
