"""NATS subject names: the only coupling between Talaria services.

    talaria.api.call                 request/reply API for agent runtimes (gateway answers)
    talaria.tokens.<call_id>         streamed TokenChunk messages for one call
    talaria.telemetry.<instance_id>  InstanceSnapshot heartbeats (last value, not history)
    talaria.evt.>                    the event log, captured by the JetStream stream EVENTS_STREAM
        call.submitted               gateway  -> router
        call.routed.<instance_id>    router   -> that instance agent (the dispatch itself)
        call.started / completed / failed
        lease.issued / consumed / discarded / expired
        decision                     router's audit record of one placement
        switch.done / round.summary  instance agents
"""

from __future__ import annotations

EVENTS_STREAM = "TALARIA_EVENTS"
EVENTS_WILDCARD = "talaria.evt.>"

API_CALL = "talaria.api.call"
API_QUEUE_GROUP = "gateway"
# Cancel a call in flight: a `CancelCall` (core NATS, every agent listens). The gateway sends
# one when an HTTP client disconnects; a NATS API client may send one for its own call_id.
API_CANCEL = "talaria.api.cancel"

CALL_SUBMITTED = "talaria.evt.call.submitted"
CALL_ROUTED_PREFIX = "talaria.evt.call.routed"
CALL_STARTED = "talaria.evt.call.started"
CALL_COMPLETED = "talaria.evt.call.completed"
CALL_FAILED = "talaria.evt.call.failed"
LEASE_ISSUED = "talaria.evt.lease.issued"
LEASE_CONSUMED = "talaria.evt.lease.consumed"
LEASE_DISCARDED = "talaria.evt.lease.discarded"
LEASE_EXPIRED = "talaria.evt.lease.expired"
ROUTING_DECISION = "talaria.evt.decision"
SWITCH_DONE = "talaria.evt.switch.done"
ROUND_SUMMARY = "talaria.evt.round.summary"

TELEMETRY_PREFIX = "talaria.telemetry"
TELEMETRY_WILDCARD = "talaria.telemetry.*"
TOKENS_PREFIX = "talaria.tokens"
# A copy of each CallRouted on core NATS, sent before the durable one: the agent starts the
# call from it at once; the JetStream copy (what the agent acks) keeps it durable.
DISPATCH_PREFIX = "talaria.dispatch"


def call_routed(instance_id: str) -> str:
    return f"{CALL_ROUTED_PREFIX}.{instance_id}"


def dispatch(instance_id: str) -> str:
    return f"{DISPATCH_PREFIX}.{instance_id}"


def telemetry(instance_id: str) -> str:
    return f"{TELEMETRY_PREFIX}.{instance_id}"


def tokens(call_id: str) -> str:
    return f"{TOKENS_PREFIX}.{call_id}"


def valid_token(value: str) -> bool:
    """A subject token must not contain separators or wildcards."""
    return bool(value) and not any(c in value for c in ".*> \t\r\n")

HEALTH_PREFIX = "talaria.health"
HEALTH_WILDCARD = "talaria.health.*"


def health(service: str) -> str:
    return f"{HEALTH_PREFIX}.{service}"
