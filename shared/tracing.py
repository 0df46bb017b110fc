"""OpenTelemetry wiring: one trace per session, context carried in NATS headers.

A session's trace id and its root span id are derived from the session id, so every
service can attach call spans to the same trace without coordination; telemetry emits
the session span itself with exactly those ids once the session goes idle.

Names follow the OpenTelemetry GenAI semantic conventions (gen-ai-spans.md): the gateway's
span of a call is `{gen_ai.operation.name} {gen_ai.request.model}` (e.g. `chat qwen3-tiny`)
with the `gen_ai.*` request, response and usage attributes, `gen_ai.conversation.id` = the
session; what is Talaria's own (scheduling, KV placement, timings) is under `talaria.`. The
router's `route`, the agent's `execute` and telemetry's `session` span use the same keys.

Export: OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else JSON lines under the
traces directory (one file per process) that `talaria trace` and the tests read.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from talaria.shared.settings import CommonSettings


GEN_AI_PROVIDER = "talaria"  # gen_ai.provider.name: the serving system that answers


def operation(api: str) -> str:
    """gen_ai.operation.name of a call that came in through `api` (its CallSubmitted.api)."""
    return "text_completion" if api == "completion" else "chat"


def call_span_name(api: str, model: str) -> str:
    return f"{operation(api)} {model}"


def request_attributes(call) -> dict:
    """A CallSubmitted's attributes: the GenAI request, the session as the conversation."""
    attrs = {
        "gen_ai.operation.name": operation(call.api), "gen_ai.provider.name": GEN_AI_PROVIDER,
        "gen_ai.request.model": call.model, "gen_ai.conversation.id": call.session_id,
        "gen_ai.request.max_tokens": call.max_tokens, "gen_ai.request.temperature": call.temperature,
        "gen_ai.request.top_p": call.top_p,
        "talaria.call.id": call.call_id, "talaria.api": call.api, "talaria.prompt_tokens": call.prompt_tokens,
    }
    if call.seed is not None:
        attrs["gen_ai.request.seed"] = call.seed
    if call.session_origin != "named":  # the gateway inferred the session: new, continued or forked
        attrs["talaria.session.origin"] = call.session_origin
    return attrs


def result_attributes(reply) -> dict:
    """A CallResult's attributes: the GenAI response and usage, Talaria's placement and timings."""
    t, u = reply.timings, reply.usage
    return {
        "gen_ai.response.id": reply.call_id, "gen_ai.response.model": reply.model,
        "gen_ai.response.finish_reasons": [reply.finish_reason],
        "gen_ai.usage.input_tokens": u.prompt_tokens, "gen_ai.usage.output_tokens": u.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": u.cached_tokens,
        "talaria.call.index": reply.call_index, "talaria.instance.id": reply.instance_id,
        "talaria.kv_source": reply.kv_source, "talaria.queue_s": t.queue_s, "talaria.ttft_s": t.ttft_s,
        "talaria.prefill_s": t.prefill_s, "talaria.decode_s": t.decode_s, "talaria.slot_wait_s": t.slot_wait_s,
    }


def decision_attributes(decision) -> dict:
    """The router's RoutingDecision on its `route` span."""
    attrs = {"talaria.route.action": decision.action, "talaria.route.policy": decision.policy,
             "talaria.route.lease_outcome": decision.lease_outcome, "talaria.route.expected_kv": decision.expected_kv,
             "talaria.route.model_opened": decision.model_opened, "talaria.route.candidates": len(decision.candidates)}
    if decision.chosen:
        attrs["talaria.instance.id"] = decision.chosen
    return attrs


def execute_attributes(call, instance_id: str) -> dict:
    """An agent's `execute` span of a call."""
    return {"gen_ai.request.model": call.model, "gen_ai.conversation.id": call.session_id,
            "talaria.call.id": call.call_id, "talaria.instance.id": instance_id}


def error_attributes(reply) -> dict:
    """An ErrorReply's: `error.type` (the OTel general attribute) is its code."""
    return {"error.type": reply.code, "talaria.http.status": reply.status}


def session_trace_id(session_id: str) -> int:
    return int.from_bytes(hashlib.sha256(b"trace:" + session_id.encode()).digest()[:16], "big") or 1


def session_span_id(session_id: str) -> int:
    return int.from_bytes(hashlib.sha256(b"span:" + session_id.encode()).digest()[:8], "big") or 1


def session_context(session_id: str) -> Context:
    """A context whose current span is the (remote) session span: parent of every call span."""
    ctx = SpanContext(
        trace_id=session_trace_id(session_id),
        span_id=session_span_id(session_id),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    headers = dict(headers or {})
    inject(headers)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> Context:
    return extract(dict(headers or {}))


def trace_id_hex(trace_id: int) -> str:
    return f"{trace_id:032x}"


TRACE_FILE_MAX_BYTES = 64 * 1024 * 1024  # ~45,000 calls' spans at the ~1.4 KB each measured (issue 25)


class JsonLinesExporter(SpanExporter):
    """Writes finished spans as JSON lines; good enough to inspect timelines without a collector."""

    def __init__(self, path: Path, max_bytes: int = TRACE_FILE_MAX_BYTES) -> None:
        # Spans name every tenant's sessions and calls: owner-only (issue 25).
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        self._path, self._max_bytes = path, max_bytes
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(s)) for s in spans]
        with self._lock:
            self._rotate()
            with open(self._path, "a", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
                f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def _rotate(self) -> None:
        """Past `max_bytes` the file becomes `<name>.1` (the one before is dropped): at most
        twice that per process on disk."""
        try:
            if self._path.stat().st_size >= self._max_bytes:
                os.replace(self._path, self._path.with_name(self._path.name + ".1"))
        except FileNotFoundError:
            pass

    def shutdown(self) -> None:
        return None


def span_to_dict(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start": span.start_time / 1e9 if span.start_time else None,
        "end": span.end_time / 1e9 if span.end_time else None,
        "service": span.resource.attributes.get("service.name"),
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "at": e.timestamp / 1e9, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


def setup(service: str, settings: CommonSettings) -> TracerProvider:
    """A tracer provider for one service (not installed globally, so tests can run several)."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"talaria-{service}"}))
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        path = settings.traces_path / f"{service}-{os.getpid()}.jsonl"
        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(path), schedule_delay_millis=500))
    return provider


def read_spans(directory: Path) -> list[dict]:
    """All spans written by JsonLinesExporter under `directory`."""
    spans: list[dict] = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans
