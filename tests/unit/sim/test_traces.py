"""Trace format validation, the WEKA converter, and gap models."""

import json
import lzma
import math
from pathlib import Path

import pytest

from talaria.sim.cli import map_models
from talaria.traces.format import TraceCall, TraceFormatError, save_sessions, sessions_from_calls
from talaria.traces.load import load_trace
from talaria.traces.gaps import GapModel, lognormal_from_quantiles, parse_gap_model
from talaria.traces.weka import convert_file

DATA = Path(__file__).parents[2] / "data"


def _line(**over):
    base = dict(session="s", call_index=0, model="m", prompt_tokens=10, reusable_prefix_tokens=0,
                output_tokens=2, gap_before_s=0.0)
    base.update(over)
    return json.dumps(base)


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "bad, field",
    [
        (_line(prompt_tokens=0), "prompt_tokens"),
        (_line(prompt_tokens="10"), "prompt_tokens"),
        (_line(call_index=1, reusable_prefix_tokens=11), "reusable_prefix_tokens"),
        (_line(gap_before_s=-1), "gap_before_s"),
        (_line(model=""), "model"),
        (_line(kind="weird"), "kind"),
        (_line(extra=1), "extra"),
        (json.dumps({"session": "s"}), "call_index"),
    ],
)
def test_validation_names_line_and_field(tmp_path, bad, field):
    p = _write(tmp_path, ["# comment", _line(session="ok"), bad.replace('"s"', '"s2"', 1)])
    with pytest.raises(TraceFormatError) as err:
        load_trace(p)
    assert err.value.line == 3
    assert err.value.field == field
    assert f"{p}:3" in str(err.value) and field in str(err.value)


def test_invalid_json_and_order_errors(tmp_path):
    with pytest.raises(TraceFormatError) as err:
        load_trace(_write(tmp_path, [_line(), "{nope"]))
    assert err.value.line == 2 and err.value.field is None
    with pytest.raises(TraceFormatError) as err:
        load_trace(_write(tmp_path, [_line(), _line(call_index=2)]))
    assert err.value.line == 2 and err.value.field == "call_index"
    with pytest.raises(TraceFormatError) as err:
        load_trace(_write(tmp_path, [_line(), _line(session="b"), _line(call_index=1)]))
    assert err.value.field == "session"


def test_roundtrip(tmp_path):
    calls = [TraceCall("a", 0, "m", 100, 0, 5, 0.0, "start"), TraceCall("a", 1, "m", 150, 105, 5, 0.3)]
    sessions = sessions_from_calls(calls)
    save_sessions(sessions, tmp_path / "x.jsonl")
    assert load_trace(tmp_path / "x.jsonl") == sessions


def test_weka_converter_on_fixture(tmp_path):
    dst = tmp_path / "out.jsonl"
    summary = convert_file(DATA / "weka_mini.jsonl", dst)
    sessions = {s.id: s for s in load_trace(dst)}
    assert summary.traces == 2 and summary.subagent_sessions == 1 and summary.calls == 7
    parent = sessions["trace_9001"].calls
    assert [c.prompt_tokens for c in parent] == [200, 400, 500]
    # full block-prefix match: previous prompt + output is reusable
    assert parent[1].reusable_prefix_tokens == 270 and parent[1].gap_before_s == 2.0
    # partial match: 2 blocks of 64; no think_time -> t - (t_prev + api_time_prev)
    assert parent[2].reusable_prefix_tokens == 128 and parent[2].gap_before_s == 6.0
    assert parent[2].kind == "user" and parent[1].kind == "tool"
    sub = sessions["trace_9001/agent_001"].calls
    assert sub[1].reusable_prefix_tokens == 64 and sub[0].model.startswith("claude-haiku")
    dropped = convert_file(DATA / "weka_mini.jsonl", dst, subagents="drop")
    assert dropped.subagents_dropped == 1 and dropped.sessions == 2


def test_a_raw_weka_file_loads_as_its_conversion_and_xz_is_read(tmp_path):
    dst = tmp_path / "out.jsonl"
    convert_file(DATA / "weka_mini.jsonl", dst)
    assert load_trace(DATA / "weka_mini.jsonl") == load_trace(dst)
    packed = tmp_path / "out.jsonl.xz"
    with lzma.open(packed, "wt", encoding="utf-8") as out:
        out.write(dst.read_text())
    assert load_trace(packed) == load_trace(dst)


def test_model_map_replays_trace_models_as_served_ones():
    calls = [TraceCall("a", 0, "big", 100, 0, 5, 0.0, "start"), TraceCall("a", 1, "big", 150, 105, 5, 0.3),
             TraceCall("b", 0, "small", 100, 0, 5, 2.0, "start"), TraceCall("c", 0, "x", 100, 0, 5, 0.0, "start")]
    sessions = sessions_from_calls(calls)
    auto = map_models(sessions, "auto", ["x", "y"])  # the most used absent model takes the first
    assert [s.calls[0].model for s in auto] == ["x", "y", "x"]
    assert [s.id for s in auto] == ["a", "b", "c"] and auto[1].calls[0].gap_before_s == 2.0
    explicit = map_models(sessions, "big=y", ["x", "y"])
    assert [s.calls[-1].model for s in explicit] == ["y", "small", "x"]
    assert map_models(sessions, None, ["x"]) is sessions
    for bad in ("big", "big=z", "=y"):
        with pytest.raises(ValueError):
            map_models(sessions, bad, ["x", "y"])


def test_gap_models():
    c0 = TraceCall("s", 0, "m", 10, 0, 1, 5.0)
    c1 = TraceCall("s", 1, "m", 10, 5, 1, 30.0)
    assert GapModel("recorded", 10.0).gap(c1) == 10.0
    assert GapModel("recorded", None).gap(c1) == 30.0
    assert GapModel("rescaled", 10.0, factor=0.05).gap(c1) == pytest.approx(1.5)
    assert GapModel("paper").gap(c0) == 5.0  # the start offset is never modified
    paper = GapModel("paper", None, seed=3)
    assert paper.gap(c1) == paper.gap(c1)  # stable per (seed, session, call)
    draws = sorted(paper.gap(TraceCall(f"s{i}", 1, "m", 10, 5, 1, 0.0)) for i in range(4000))
    assert draws[1999] == pytest.approx(0.39, rel=0.1)
    assert draws[3799] == pytest.approx(1.32, rel=0.15)
    mu, sigma = lognormal_from_quantiles(0.39, 1.32)
    assert math.exp(mu) == pytest.approx(0.39)
    assert parse_gap_model("rescaled:0.1:none").cap_s is None
    with pytest.raises(ValueError):
        parse_gap_model("bogus")
