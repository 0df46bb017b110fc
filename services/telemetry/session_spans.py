"""Session spans: the root span of each session's trace, emitted once the session idles.

Call spans (gateway, router, agent) name the session span as their parent by its
derived id before it exists; this tracker emits it with exactly that id, covering
first submission to last completion, when no call has arrived for `idle_s` or at
shutdown. Pure bookkeeping plus one exporter call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from talaria.shared.events import CallCompleted, CallFailed, CallSubmitted, Event
from talaria.shared.tracing import session_span_id, session_trace_id


@dataclass
class OpenSession:
    session_id: str
    start: float
    end: float
    last_activity: float
    calls: int = 0
    completed: int = 0
    failed: int = 0
    models: set[str] = field(default_factory=set)
    instances: set[str] = field(default_factory=set)
    inferred: bool = False  # the gateway inferred it: its client named no session


class SessionSpans:
    def __init__(self, exporter: SpanExporter, idle_s: float) -> None:
        self.exporter, self.idle_s = exporter, idle_s
        self.open: dict[str, OpenSession] = {}
        self.resource = Resource.create({"service.name": "talaria-telemetry"})

    def observe(self, event: Event) -> None:
        match event:
            case CallSubmitted():
                s = self._get(event.session_id, event.submitted_at)
                s.calls += 1
                s.models.add(event.model)
                s.inferred = s.inferred or event.session_origin != "named"
                s.last_activity = max(s.last_activity, event.submitted_at)
            case CallCompleted():
                s = self._get(event.session_id, event.submitted_at)
                s.completed += 1
                s.instances.add(event.instance_id)
                s.end = max(s.end, event.completed_at)
                s.last_activity = max(s.last_activity, event.completed_at)
            case CallFailed():
                s = self._get(event.session_id, event.at)
                s.failed += 1
                s.end = max(s.end, event.at)
                s.last_activity = max(s.last_activity, event.at)

    def _get(self, session_id: str, at: float) -> OpenSession:
        s = self.open.get(session_id)
        if s is None:
            s = self.open[session_id] = OpenSession(session_id, at, at, at)
        s.start = min(s.start, at)
        return s

    def flush(self, now: float, *, all_sessions: bool = False) -> int:
        done = [s for s in self.open.values() if all_sessions or now - s.last_activity >= self.idle_s]
        if done:
            self.exporter.export([self._span(s) for s in done])
            for s in done:
                del self.open[s.session_id]
        return len(done)

    def _span(self, s: OpenSession) -> ReadableSpan:
        ctx = SpanContext(session_trace_id(s.session_id), session_span_id(s.session_id), is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
        return ReadableSpan(
            name="session",
            context=ctx,
            parent=None,
            resource=self.resource,
            kind=SpanKind.INTERNAL,
            start_time=int(s.start * 1e9),
            end_time=int(max(s.end, s.start) * 1e9),
            attributes={  # the session is the GenAI conversation; its counts are ours
                "gen_ai.conversation.id": s.session_id, "talaria.session.calls": s.calls,
                "talaria.session.completed": s.completed, "talaria.session.failed": s.failed,
                "talaria.session.models": sorted(s.models), "talaria.session.instances": sorted(s.instances),
                "talaria.session.inferred": s.inferred,
            },
        )
