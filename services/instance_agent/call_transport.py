"""What the live executor owns of a call, beside the core's and the scheduler's record
(`AgentCall.transport`): how it came and how it is answered (the JetStream message to ack, the
reply and token subjects, the trace span), its handle to the engine (the call's `Sequence`,
handed to every engine step), and the watchdog's view of its progress (watchdog.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from opentelemetry import trace

from talaria.services.instance_agent.engine.engine_errors import EngineError
from talaria.services.instance_agent.engine.sequence import Sequence
from talaria.shared.events import CallRouted


@dataclass
class CallTransport:
    routed: CallRouted  # the call as routed: its reply subject, stream flag, tenant, deadline
    # The JetStream message, acked once the outcome is published; None while the call runs
    # from its core-NATS fast copy and the durable copy has not arrived (it is acked on arrival).
    msg: Msg | None
    span: trace.Span
    streamed: int = 0  # token chunks sent (the last one's index)
    seq: Sequence | None = None  # the call on the engine, from its prefill hand-off on
    in_engine: bool = False  # the engine holds it (its prefill was handed over, not yet released)
    started_pub: asyncio.Future | None = None  # the CallStarted publish, off the prefill path
    logprobs: list = field(default_factory=list)  # a streamed call's logprobs not yet in a chunk
    # The engine step that finished it released it: True, or the EngineError releasing it raised
    released: bool | EngineError = False
    migrated: object | None = None  # kv_migration.Migrated: its prefix pages pulled from another instance
    pull: asyncio.Future | None = None  # the pull of those pages while it runs (cancelled with the call)
    # -- the watchdog's ---------------------------------------------------------------------
    progress_at: float | None = None  # its last engine step ended (or its first began); None: not started
    stuck: str = ""  # why the watchdog failed it; "" until then (a call is failed once)
