"""Event sourcing: the router state is the fold of its recorded inputs (events, heartbeats,
instance losses) through `RouterState.apply` alone; to_dict round-trips."""

from __future__ import annotations

import json
import random

import pytest
from router_support import call, core, done, of_type, one, snap

from talaria.services.router.router_core import RouterCore
from talaria.services.router.policy.registry import create_policy
from talaria.services.router.state import RouterState, SnapshotReceived
from talaria.shared.events import (
    CallFailed,
    CallRouted,
    CallSubmitted,
    EVENT_DECODER,
    InstanceLost,
    RoundSummary,
    RoutingDecision,
)
from talaria.shared.wire import encode

INSTANCES = ("i0", "i1", "i2")


def scripted_run(policy: str, seed: int = 7, steps: int = 160):
    """Drive a core with a seeded mix of calls, completions, snapshots, rounds and ticks.

    Returns (core, inputs) where inputs replays the run: ("observe", snap, now) with the
    events it produced (a restart loses the old process), ("handle", event, now) likewise,
    ("tick", now) likewise, ("liveness", now) likewise (heartbeat loss).
    """
    rng = random.Random(seed)
    c = core(policy, lease_timeout_s=1.0, overload="reject")
    inputs: list = []
    version = {i: 0 for i in INSTANCES}
    incarnation = {i: "p0" for i in INSTANCES}
    open_calls: list[tuple[CallSubmitted, str, int]] = []
    calls_of: dict[str, int] = {}
    now = 0.0

    def observe(iid: str) -> None:
        version[iid] += 1
        kv = [(s, "m1", rng.choice(["device", "host"]), 500) for s in calls_of if rng.random() < 0.3]
        models = {"m1": "active", "m2": rng.choice(["absent", "resident"])}
        s = snap(iid, version=version[iid], at=now, sessions=kv, models=models,
                 queued_tokens=rng.choice([0, 5_000, 95_000]), incarnation=incarnation[iid])
        inputs.append(("observe", s, now, c.observe(s, now)))

    def forget_open(out) -> None:
        lost = {e.call_id for e in out if isinstance(e, CallFailed)}
        open_calls[:] = [o for o in open_calls if o[0].call_id not in lost]

    def handle(event) -> None:
        out = c.handle(event, now)
        inputs.append(("handle", event, now, out))
        for e in out:
            if isinstance(e, CallRouted):
                open_calls.append((e.call, e.instance_id, e.call_index))

    def submit(sid: str) -> None:
        n = calls_of.get(sid, 0)
        calls_of[sid] = n + 1
        model = "m1" if rng.random() < 0.85 else "m2"
        hashes = [hash((sid[:2], b)) for b in range(rng.randrange(0, 40))]
        handle(call(f"{sid}-{n}", session=sid, model=model, tokens=400 + 50 * n, at=now, hashes=hashes))

    for iid in INSTANCES:
        observe(iid)
    for step in range(steps):
        now += rng.choice([0.05, 0.2, 0.7, 1.3])
        roll = rng.random()
        if roll < 0.12:
            observe(rng.choice(INSTANCES))
        elif roll < 0.14:  # an agent restarts: a new process, versions from 1 again
            iid = rng.choice(INSTANCES)
            incarnation[iid] = f"p{step}"
            version[iid] = 0
            observe(iid)
            forget_open(inputs[-1][-1])
        elif roll < 0.15:  # heartbeats stop for long enough: the router declares instances lost
            now += 4.0
            out = c.check_liveness(now, since=0.0)
            inputs.append(("liveness", now, out))
            forget_open(out)
            for iid in INSTANCES:
                observe(iid)
        elif roll < 0.45 or not open_calls:
            submit(f"s{rng.randrange(12)}")
        elif roll < 0.85:
            the_call, iid, index = open_calls.pop(rng.randrange(len(open_calls)))
            handle(done(the_call.call_id, iid, session=the_call.session_id, model=the_call.model,
                        index=index, at=now, prompt=the_call.prompt_tokens, prefill_s=0.01 * rng.random()))
            if rng.random() < 0.6:  # a quick return after a short tool call
                now += 0.1
                submit(the_call.session_id)
        elif roll < 0.9:
            handle(RoundSummary(rng.choice(INSTANCES), step, 1.0 + rng.random(), 0.8, 0.2, now))
        else:
            out = c.tick(now)
            inputs.append(("tick", now, out))
    return c, inputs


def recorded_stream(inputs) -> list:
    """What the router's shell sees and publishes, in order: its inputs (a submission is a
    decision, not state) and the events each one caused, events through the wire format."""
    stream: list = []
    for item in inputs:
        produced = [EVENT_DECODER.decode(encode(e)) for e in item[-1]]
        if item[0] == "observe":
            stream += produced  # a new incarnation loses the old process first
            stream.append(SnapshotReceived(item[1], item[2]))
            continue
        if item[0] == "handle" and not isinstance(item[1], CallSubmitted):
            stream.append(item[1])
        stream += produced
    return stream


def fold(inputs) -> RouterState:
    """Rebuild from the recorded stream through `apply` alone: no other method touches state."""
    state = RouterState()
    for record in recorded_stream(inputs):
        state.apply(record)
    return state


def assert_same_state(rebuilt: RouterState, live: RouterState) -> None:
    """Field for field: every dataclass field of the state, the views and the sessions."""
    assert rebuilt.to_dict() == live.to_dict()
    assert rebuilt.sessions == live.sessions
    assert rebuilt.routed == live.routed and rebuilt.inflight_calls == live.inflight_calls
    assert rebuilt.leases.to_list() == live.leases.to_list()
    assert rebuilt.prefix.by_model == live.prefix.by_model
    assert rebuilt.models.keys() == live.models.keys()
    assert rebuilt.instance_profiles == live.instance_profiles
    assert rebuilt.instances.keys() == live.instances.keys()
    assert rebuilt.homes == live.homes
    for iid, view in live.instances.items():
        other = rebuilt.instances[iid]
        for name in ("snapshot", "received_at", "overlay", "overlay_tokens", "overlay_models", "inflight",
                     "models", "pinned"):
            assert getattr(other, name) == getattr(view, name), (iid, name)


@pytest.mark.parametrize("policy", ["talaria", "kv-cost", "round-robin"])
def test_fold_of_events_equals_live_state(policy):
    live, inputs = scripted_run(policy)
    kinds = {type(e).__name__ for item in inputs if item[0] != "observe" for e in item[-1]}
    if policy == "talaria":  # the script must exercise what it claims to
        assert {"LeaseIssued", "LeaseConsumed", "LeaseExpired", "CallFailed"} <= kinds
    if policy == "talaria":
        assert {"InstanceLost"} <= kinds
    assert_same_state(fold(inputs), live.state)


def test_to_dict_round_trips_through_json_and_routes_identically():
    live, inputs = scripted_run("talaria", seed=11)
    data = json.loads(json.dumps(live.state.to_dict()))
    restored = RouterCore(create_policy("talaria", live.policy.config), RouterState.from_dict(data))
    assert restored.state.to_dict() == live.state.to_dict()
    now = inputs[-1][2] if inputs[-1][0] in ("observe", "handle") else inputs[-1][1]
    nxt = call("after-restart", session="s3", at=now + 0.1)
    strip = lambda evs: [e if not isinstance(e, RoutingDecision) else  # noqa: E731
                         (e.chosen, e.action, e.lease_outcome, e.candidates) for e in evs]
    for iid in INSTANCES:  # homes are derived on restore: the same live sessions
        for t in (now, now + 2.0, now + 30.0):
            assert restored.state.live_models(iid, t) == live.state.live_models(iid, t)
    assert any(live.state.live_models(iid, now) for iid in INSTANCES)
    a = live.handle(nxt, now + 0.1)
    b = restored.handle(nxt, now + 0.1)
    assert strip(a) == strip(b)
    assert live.tick(now + 50) == restored.tick(now + 50)


def test_from_dict_refuses_unknown_format():
    with pytest.raises(ValueError, match="format"):
        RouterState.from_dict({"format": 99})


def test_a_redelivered_submission_is_never_routed_twice():
    c = core()
    c.observe(snap("a"), 0.0)
    first = c.handle(call("c1"), 0.0)
    assert len(of_type(first, CallRouted)) == 1
    assert c.handle(call("c1"), 0.5) == []  # the router crashed before acking: same input again
    # ...and after a restart from the folded events, too.
    rebuilt = RouterCore(c.policy)
    for event in first:
        rebuilt.state.apply(event)
    assert rebuilt.handle(call("c1"), 1.0) == []


def test_a_call_completed_before_its_routing_was_stored_is_never_placed_again():
    """The router sent the fast copy and stopped before its CallRouted reached the stream;
    the agent ran the call. After a restart the stream holds the completion but no routing:
    the redelivered submission must neither run the call again nor count it in flight."""
    c = core()
    c.observe(snap("a"), 0.0)
    c.handle(call("c1"), 0.0)  # routed, but these outputs are lost with the old process
    rebuilt = RouterCore(c.policy)
    rebuilt.observe(snap("a"), 0.0)
    rebuilt.handle(done("c1", "a"), 1.0)  # replayed from the stream
    assert rebuilt.handle(call("c1"), 1.5) == []
    assert rebuilt.state.inflight_calls == {}
    assert not rebuilt.state.instances["a"].inflight


def test_a_routing_replayed_after_its_completion_counts_nothing_in_flight():
    """On the stream a fast 1-token call's completion can precede its CallRouted."""
    c = core()
    c.observe(snap("a"), 0.0)
    routed = one(c.handle(call("c1"), 0.0), CallRouted)
    state = RouterState()
    state.apply(SnapshotReceived(snap("a"), 0.0))
    state.apply(done("c1", "a"))
    state.apply(routed)
    assert state.inflight_calls == {}
    assert state.sessions["s1"].last_completed_at == 1.0  # the completion still stands


def test_a_reused_call_id_is_told_apart_from_a_redelivered_submission():
    """The same message again (a restart's replay) is dropped as before; another message under a
    decided call's id is a client reusing the id, which the service answers 409. Survives a save."""
    state = RouterState()
    state.routed["c1"] = "agent-0"
    state.decided("c1", 7)
    state.decided("c2", 8)  # never decided: nothing to remember
    assert not state.reused("c1", 7) and state.reused("c1", 9)
    assert not state.reused("c2", 9) and not state.reused("c1", 0)
    restored = RouterState.from_dict(state.to_dict())
    assert restored.reused("c1", 9) and not restored.reused("c1", 7)
