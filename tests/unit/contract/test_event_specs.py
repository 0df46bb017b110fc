"""The wire table (shared/event_specs.py): every event has one row and every row an event, and
the subjects, permissions, sender checks and message ids all agree with it."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import get_type_hints

import pytest

from talaria.shared.bus import event_msg_id, event_subject
from talaria.shared.event_specs import EVENT_TYPES, SERVICES, SPECS, spec_of
from talaria.shared.nats_auth import owner_sender, permissions, sender_name, trusted
from tests.unit.contract.test_codecs import EVENTS
from talaria.shared import events
from talaria.shared.events import DispatchFence, DispatchRefused, InstanceLost, KvPushed, KvPushRequested, PoolPinned
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

SAMPLES = [*EVENTS, InstanceLost("agent-0", "inc1", "heartbeats stopped", 3.0, calls=["c1"]),
           PoolPinned("agent-0", "m1", None, 4.0, "demand"),
           DispatchRefused("c1", "s1", "agent-0", DispatchFence("router-0", 3, 17), "router-1", 42, 5.0),
           KvPushRequested("agent-1", "s1", "m1", "agent-0", "127.0.0.1:7000", 6.0),
           KvPushed("agent-0", "s1", "m1", "agent-1", 7.0, listed=2, pages=2, tokens=32, bytes=4096, seconds=0.1)]


def test_every_event_type_has_one_row_and_every_row_an_event():
    rows = [spec.event for spec in SPECS]
    assert len(rows) == len(set(rows)), "an event with two rows"
    assert set(rows) == set(EVENT_TYPES)
    assert {type(e) for e in SAMPLES} == set(EVENT_TYPES)  # the samples below cover the table


def test_tags_are_unique_and_owners_are_services():
    tags = [spec.tag for spec in SPECS]
    assert len(tags) == len(set(tags)) and all(isinstance(t, str) and t for t in tags)
    for spec in SPECS:
        assert spec.owners and spec.owners <= set(SERVICES), spec.name
        assert spec.core_readers <= set(SERVICES), spec.name


def test_dedupe_keys_name_fields_of_the_event():
    for spec in SPECS:
        for path in spec.dedupe:
            owner = spec.event
            for part in path.split("."):
                hints = get_type_hints(owner)
                assert part in hints, f"{spec.name}.dedupe: {path}"
                owner = hints[part]


def test_message_ids_keep_their_format():
    """The ids already on a deployment's stream: a retry after an upgrade is still a duplicate."""
    ids = {type(e).__name__: event_msg_id(e) for e in SAMPLES}
    assert ids == {
        "CallSubmitted": "CallSubmitted:c1", "CallRouted": "CallRouted:c1", "CallStarted": "CallStarted:c1",
        "CallCompleted": "CallCompleted:c1", "CallFailed": "CallFailed:c1",
        "LeaseIssued": "LeaseIssued:s1:c1", "LeaseConsumed": "LeaseConsumed:s1:c2",
        "LeaseDiscarded": "LeaseDiscarded:s1:c2", "LeaseExpired": "LeaseExpired:s1:qwen3-tiny:agent-0:4.0",
        "RoutingDecision": "RoutingDecision:c1", "SwitchDone": None, "RoundSummary": None,
        "InstanceLost": "InstanceLost:agent-0:inc1", "PoolPinned": "PoolPinned:agent-0:m1:4.0",
        "DispatchRefused": "DispatchRefused:c1:agent-0",
        "KvPushRequested": "KvPushRequested:s1:agent-0:1", "KvPushed": "KvPushed:s1:agent-1:7.0",
    }


def test_a_deployments_event_subjects_are_the_rows_subjects():
    for name in ("talaria", "blue"):
        for spec in SPECS:
            assert Deployment(name).event(spec.tag) == spec.subject(name)
    with pytest.raises(KeyError):
        DEP.event("call.finished")  # no such row


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more trailing tokens."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


def _allowed(role: str, kind: str, subject: str) -> bool:
    perms = permissions(role, instance_id="agent-0" if role == "agent" else None)
    return any(_matches(p, subject) for p in perms[kind]["allow"])


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_only_an_events_owners_may_publish_it_and_its_sender_is_trusted(event):
    spec = spec_of(event)
    subject = event_subject(DEP, event)
    for role in SERVICES:
        assert _allowed(role, "publish", subject) == (role in spec.owners), (role, subject)
        sender = sender_name(role, "agent-0")
        msg = SimpleNamespace(headers={"Talaria-Sender": sender})
        assert trusted(msg, event) == (role in spec.owners), (role, spec.name)
    assert not _allowed("client", "publish", subject)
    assert trusted(SimpleNamespace(headers={"Talaria-Sender": owner_sender(event)}), event)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_core_readers_may_subscribe_and_nobody_else_on_core_nats(spec):
    for role in SERVICES:
        assert _allowed(role, "subscribe", spec.subject(DEP.name)) == (role in spec.core_readers)


ROOT = Path(__file__).resolve().parents[3]
SERVICE_DIRS = {"gateway": "gateway", "router": "router", "instance_agent": "agent", "telemetry": "telemetry"}


def _constructed_events(folder: Path) -> set[str]:
    """Event types a service's code builds (a call with arguments; match patterns are not calls)."""
    names = {t.__name__ for t in EVENT_TYPES}
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (node.args or node.keywords):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in names:
                    found.add(name)
    return found


# Events a service builds only to price them, never to publish (so no permission is at stake):
# each with where and why. Anything else a service builds, it must own.
PRICED_NOT_SENT = {
    ("router", "CallSubmitted"): "drain_push.next_call: a drained session's next call, priced on each "
                                 "push target before the call exists",
}


@pytest.mark.parametrize("folder, role", SERVICE_DIRS.items())
def test_every_event_a_service_builds_is_one_it_owns(folder, role):
    """The table against the code: a row naming the wrong owner would be a permission denial
    (and a sender-check drop) at run time."""
    built = _constructed_events(ROOT / "services" / folder) - {n for (r, n) in PRICED_NOT_SENT if r == role}
    assert all(role in spec_of(getattr(events, name)).owners for name in built), built


def test_what_a_service_only_prices_is_still_built_there():
    """An entry of PRICED_NOT_SENT whose event the service no longer builds is stale."""
    for (role, name), why in PRICED_NOT_SENT.items():
        folder = next(f for f, r in SERVICE_DIRS.items() if r == role)
        assert name in _constructed_events(ROOT / "services" / folder), why
