"""The agent watchdog (pure): stuck steps flag the agent and fail that step's calls; a
started call with no progress is failed; bounds follow the slowest step/round measured.
It keeps no table of calls: it is handed their records, whose fields it reads and writes."""

from talaria.services.instance_agent.call_transport import CallTransport
from talaria.services.instance_agent.scheduler.calls import AgentCall, Phase
from talaria.services.instance_agent.watchdog import STUCK_FACTOR, Watchdog


def calls(*ids):
    """Calls as the live runner holds them: the watchdog's fields are on their transport."""
    return [AgentCall(i, f"s-{i}", "m", 0, 0.0, transport=CallTransport(None, None, None)) for i in ids]


def failed(verdict):
    return {c.call_id for c in verdict.fail_calls}


def test_a_step_far_slower_than_any_before_flags_the_agent_and_fails_its_calls():
    w, table = Watchdog(min_stuck_s=1.0), calls("a", "b")
    w.step_started("decode", table, 0.0)
    w.step_ended(0.5)  # the slowest decode so far: 0.5 s -> stuck after 5 s
    w.step_started("decode", table, 1.0)
    assert w.check(1.0 + 0.5 * STUCK_FACTOR - 0.01, table).unhealthy == ""
    v = w.check(1.0 + 0.5 * STUCK_FACTOR + 0.01, table)
    assert v.unhealthy.startswith("engine decode step") and failed(v) == {"a", "b"}
    assert all(c.transport.stuck.startswith("watchdog: engine decode step stuck") for c in v.fail_calls)
    assert failed(w.check(7.0, table)) == set()  # each call is failed once
    assert w.check(7.0, table).unhealthy  # still flagged while the step has not returned
    w.step_ended(8.0)
    assert w.check(8.0, table).unhealthy == ""  # healthy again once it returns


def test_the_floor_protects_the_first_slow_step():
    w = Watchdog(min_stuck_s=3.0)
    w.step_started("switch_to", [], 0.0)
    assert w.check(2.9, []).unhealthy == ""
    assert w.check(3.1, []).unhealthy


def test_a_step_planned_long_is_judged_against_its_plan():
    # The first chunk of a long prompt is planned up to the round cap (9 s): past the floor,
    # but not stuck until far longer than planned.
    w = Watchdog(min_stuck_s=3.0)
    w.step_started("prefill", calls("long"), 0.0, predicted_s=9.0)
    assert w.check(12.0, []).unhealthy == ""
    assert w.check(9.0 * STUCK_FACTOR + 0.1, []).unhealthy
    w.step_ended(100.0)
    w.step_started("prefill", calls("short"), 100.0, predicted_s=0.01)  # the next plan is its own
    assert w.step_limit_s("prefill") == STUCK_FACTOR * 100.0  # the slowest step measured so far


def test_a_started_call_without_progress_is_failed_alone():
    w = Watchdog(min_stuck_s=1.0)
    lost, ok, waiting = table = calls("lost", "ok", "waiting")
    w.round_ended(0.2)  # limit: max(1.0, 10 * 0.2) = 2 s
    w.step_started("prefill", [lost, ok], 0.0)
    w.step_ended(0.1)
    for t in (1.0, 2.0, 3.0):  # "ok" keeps decoding; "lost" never comes back
        w.step_started("decode", [ok], t)
        w.step_ended(t + 0.1)
    v = w.check(3.2, table)  # "waiting" never started: not watched
    assert v.unhealthy == "" and failed(v) == {"lost"} and lost.transport.stuck.startswith("watchdog: no progress")
    ok.phase = Phase.FINISHED
    assert failed(w.check(100.0, table)) == set()  # done calls are not watched
