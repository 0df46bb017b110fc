"""`talaria trace export`: calls rows -> a normalised trace the simulator replays (pure part)."""

from datetime import datetime, timezone

import pytest

from talaria.trace_export import parse_since, rows_to_sessions


def _row(sid, idx, model, prompt, output, sub, done, cached=0):
    return {"call_id": f"{sid}-{idx}", "session_id": sid, "call_index": idx, "model": model,
            "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": cached, "sub": sub, "done": done}


def test_rows_become_model_sessions_with_measured_gaps_and_reuse():
    rows = [
        _row("a", 0, "m1", 100, 10, 1000.0, 1001.0),
        _row("a", 1, "m1", 150, 10, 1001.5, 1002.0),  # appends: reuses 100 + 10
        _row("a", 2, "m1", 50, 5, 1003.0, 1004.0, cached=32),  # compacted: only what was cached
        _row("b", 0, "m1", 80, 0, 1000.5, 1001.0),  # output 0 -> 1 (the format needs >= 1)
        _row("b", 1, "m2", 90, 3, 1002.0, 1003.0),  # model change: its own model-session
        _row("c", 0, "m1", 0, 3, 1000.0, None),  # unusable: skipped
    ]
    sessions = {s.id: s for s in rows_to_sessions(rows)}
    assert set(sessions) == {"a", "b@m1", "b@m2"}
    a = sessions["a"].calls
    assert [c.reusable_prefix_tokens for c in a] == [0, 110, 32]
    assert [c.gap_before_s for c in a] == pytest.approx([0.0, 0.5, 1.0])
    assert sessions["b@m1"].calls[0].output_tokens == 1
    assert sessions["b@m1"].calls[0].gap_before_s == pytest.approx(0.5)  # start offset
    assert sessions["b@m2"].calls[0].call_index == 0 and sessions["b@m2"].calls[0].gap_before_s == pytest.approx(2.0)
    assert rows_to_sessions([]) == []


def test_since_accepts_durations_and_iso_times_and_explains_bad_input():
    now = datetime(2026, 1, 2, 12, 0, tzinfo=timezone.utc)
    assert parse_since("2h", now) == datetime(2026, 1, 2, 10, 0, tzinfo=timezone.utc)
    assert parse_since("30m", now).minute == 30
    assert parse_since("2026-01-01T00:00:00", now).tzinfo is not None
    with pytest.raises(ValueError, match="duration"):
        parse_since("yesterday", now)


def test_the_cli_explains_bad_input_instead_of_crashing(tmp_path, capsys, monkeypatch):
    from talaria.cli import main

    monkeypatch.delenv("TALARIA_DATABASE_URL", raising=False)
    assert main(["trace", "export", str(tmp_path / "o.jsonl"), "--since", "last tuesday"]) == 2
    assert "--since" in capsys.readouterr().err
    assert main(["trace", "export", str(tmp_path / "o.jsonl"), "--data-dir", str(tmp_path)]) == 2
    assert "TALARIA_DATABASE_URL" in capsys.readouterr().err  # no running stack there, no URL set
    assert not (tmp_path / "o.jsonl").exists()
