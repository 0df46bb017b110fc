"""The wire contract of every event, one row each: the table subjects, NATS permissions, sender
checks and JetStream message ids are all derived from (the fields: `EventSpec`).

Adding an event: its Struct (with a tag) in events.py, a member of `Event`, and one
`EventSpec` here. tests/unit/contract/test_event_specs.py fails when an event has no row or a
row no event.

Every event is durable (it is on the deployment's JetStream stream); `dedupe` says whether a
retried publish is dropped by the stream as a duplicate (published at most once), and
`core_readers` who also hears it without a stream consumer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import msgspec

from talaria.shared import events as e
from talaria.shared.session_slots import slot_of

# The services (NATS roles) that publish events; "agent" is any instance agent, and an agent's
# event that names an instance must name that agent.
SERVICES = ("gateway", "router", "telemetry", "agent")


@dataclass(frozen=True)
class EventSpec:
    """One event's row of the wire contract:

        field         what it says                               derived from it
        event         the Struct (its tag names the subject)     <deployment>.evt.<tag>
        owners        the services that publish it               publish permissions, `trusted`
        dedupe        fields of its natural key, () for none    the Nats-Msg-Id `<Type>:<k1>:<k2>`
        per_instance  the subject ends in the target instance    <deployment>.evt.<tag>.<instance_id>
        core_readers  services that read it on core NATS as it   their subscribe permissions
                      is published (besides the stream)
        by_session    the subject ends in its session's slot     <deployment>.evt.<tag>.<slot> (a
                      (shared/session_slots.py)                  router partition's consumer reads its slots)
    """

    event: type[msgspec.Struct]
    owners: frozenset[str]
    dedupe: tuple[str, ...] = ()  # dotted field paths: ("call.call_id",) reads event.call.call_id
    per_instance: bool = False
    core_readers: frozenset[str] = frozenset()
    by_session: bool = False

    @property
    def tag(self) -> str:
        return self.event.__struct_config__.tag  # type: ignore[return-value]

    @property
    def name(self) -> str:
        return self.event.__name__

    def subject(self, deployment: str) -> str:
        """Its subject; with `per_instance` / `by_session`, the prefix of every instance's (slot's)
        own subject."""
        return f"{deployment}.evt.{self.tag}"

    def subject_of(self, deployment: str, event: msgspec.Struct) -> str:
        base = self.subject(deployment)
        if self.by_session:
            return f"{base}.{slot_of(event.session_id)}"
        return f"{base}.{event.instance_id}" if self.per_instance else base

    def publish_pattern(self, deployment: str) -> str:
        """What its owners may publish (every instance's subject for a per-instance event)."""
        return f"{self.subject(deployment)}.*" if self.per_instance or self.by_session else self.subject(deployment)

    def msg_id(self, event: msgspec.Struct) -> str | None:
        if not self.dedupe:
            return None
        return ":".join([self.name, *(str(_field(event, path)) for path in self.dedupe)])


def _field(event: object, path: str) -> object:
    for part in path.split("."):
        event = getattr(event, part)
    return event


_GATEWAY, _ROUTER, _AGENT = frozenset({"gateway"}), frozenset({"router"}), frozenset({"agent"})

SPECS: tuple[EventSpec, ...] = (
    # Partitioned by session: each router partition consumes its own slots (router/ownership.py).
    EventSpec(e.CallSubmitted, _GATEWAY, dedupe=("call_id",), by_session=True),
    EventSpec(e.CallRouted, _ROUTER, dedupe=("call.call_id",), per_instance=True),
    EventSpec(e.CallStarted, _AGENT, dedupe=("call_id",)),
    EventSpec(e.CallCompleted, _AGENT, dedupe=("call_id",)),
    EventSpec(e.CallFailed, frozenset({"gateway", "router", "agent"}), dedupe=("call_id",)),
    EventSpec(e.LeaseIssued, _ROUTER, dedupe=("session_id", "call_id")),
    EventSpec(e.LeaseConsumed, _ROUTER, dedupe=("session_id", "call_id")),
    EventSpec(e.LeaseDiscarded, _ROUTER, dedupe=("session_id", "call_id")),
    # Its id lets the router send it again after a lost ack (a stream leader cut off), as a
    # router tick waits for it (RouterService._tick_once).
    EventSpec(e.LeaseExpired, _ROUTER, dedupe=("session_id", "model", "instance_id", "at")),
    EventSpec(e.RoutingDecision, _ROUTER, dedupe=("call_id",)),
    EventSpec(e.SwitchDone, _AGENT),
    EventSpec(e.RoundSummary, _AGENT),
    # The router declares an agent process gone; that agent stops the listed calls at once.
    EventSpec(e.InstanceLost, _ROUTER, dedupe=("instance_id", "incarnation"), core_readers=_AGENT),
    # The router's hot-pool decision; the agent it names repins (hot_pools.py).
    EventSpec(e.PoolPinned, _ROUTER, core_readers=_AGENT, dedupe=("instance_id", "model", "at")),  # as LeaseExpired
    # A stale router's dispatch an agent did not run (the audit's refused_dispatches).
    EventSpec(e.DispatchRefused, _AGENT, dedupe=("call_id", "instance_id")),
    # A drain's push of a session's KV (router_core.RouterCore.drain): the agent it names pulls
    # the pages from the drained holder and reports what arrived.
    EventSpec(e.KvPushRequested, _ROUTER, dedupe=("session_id", "holder", "attempt"), core_readers=_AGENT),
    EventSpec(e.KvPushed, _AGENT, dedupe=("session_id", "holder", "at")),
)

EVENT_TYPES: tuple[type[msgspec.Struct], ...] = get_args(e.Event)
_BY_TYPE: dict[type, EventSpec] = {spec.event: spec for spec in SPECS}


def spec_of(event: msgspec.Struct | type) -> EventSpec | None:
    """The row of an event (or event type); None for anything that is not an event."""
    return _BY_TYPE.get(event if isinstance(event, type) else type(event))


def published_by(role: str) -> tuple[EventSpec, ...]:
    return tuple(spec for spec in SPECS if role in spec.owners)


def read_on_core_by(role: str) -> tuple[EventSpec, ...]:
    return tuple(spec for spec in SPECS if role in spec.core_readers)
