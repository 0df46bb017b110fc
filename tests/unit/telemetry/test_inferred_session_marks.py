"""A session the gateway inferred is marked so: on its session span, on each call span, and
in `talaria trace`."""

from __future__ import annotations

from talaria.services.telemetry.session_spans import SessionSpans
from talaria.shared.events import CallSubmitted
from talaria.shared.tracing import JsonLinesExporter, read_spans
from talaria.timeline import print_timeline


def submitted(call_id: str, session: str, origin: str) -> CallSubmitted:
    return CallSubmitted(call_id=call_id, session_id=session, model="qwen3-tiny", prompt_ids=[1, 2],
                         block_hashes=[], max_tokens=4, submitted_at=100.0, session_origin=origin)


def test_session_span_and_trace_mark_an_inferred_session(tmp_path, capsys):
    spans = SessionSpans(JsonLinesExporter(tmp_path / "telemetry.jsonl"), idle_s=1.0)
    spans.observe(submitted("c1", "anon-1", "new"))
    spans.observe(submitted("c2", "anon-1", "continued"))
    spans.observe(submitted("c3", "named-1", "named"))
    assert spans.flush(200.0) == 2
    marks = {s["attributes"]["gen_ai.conversation.id"]: s["attributes"]["talaria.session.inferred"]
             for s in read_spans(tmp_path)}
    assert marks == {"anon-1": True, "named-1": False}
    assert print_timeline(tmp_path, "anon-1") == 0
    assert "(inferred" in capsys.readouterr().out
    assert print_timeline(tmp_path, "named-1") == 0
    assert "inferred" not in capsys.readouterr().out
