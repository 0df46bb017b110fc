"""The operator commands find the running stack and the sessions by themselves, and bad input
gets one clear line (talaria/running.py, talaria/cli.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from talaria.cli import main
from talaria.running import (
    AmbiguousSession, StackNotFound, data_dir, database_url, find_stack, match_sessions, pick_session,
)
from talaria.shared.settings import Settings
from talaria.sim.cli import main as sim_main
from talaria.sim.workloads import fixed_replay
from talaria.stack import Stack
from talaria.traces.format import Session, TraceCall
from talaria.traces.gaps import default_gap_spec

ROOT = Path(__file__).resolve().parents[3]
STORED = ["default:demo", "acme:demo", "acme:other", "open-id", "default:a:b"]


def test_a_typed_session_id_means_each_tenants_scoped_one():
    assert match_sessions("other", STORED) == ["acme:other"]
    assert match_sessions("demo", STORED) == ["acme:demo", "default:demo"]
    assert match_sessions("demo", STORED, tenant="default") == ["default:demo"]
    assert match_sessions("default:demo", STORED) == ["default:demo"]  # the stored form, typed whole
    assert match_sessions("open-id", STORED) == ["open-id"]  # an open gateway stores ids as sent
    assert match_sessions("a:b", STORED) == ["default:a:b"]  # a client's id may hold the separator
    assert match_sessions("missing", STORED) == []


def test_one_match_is_used_several_are_an_error_naming_the_tenants():
    assert pick_session("other", ["acme:other"]) == "acme:other"
    assert pick_session("never-seen", []) == "never-seen"  # the query then finds nothing, as typed
    with pytest.raises(AmbiguousSession, match=r"several tenants \(acme, default\).*--tenant"):
        pick_session("demo", match_sessions("demo", STORED))


def test_the_data_directory_is_the_flag_else_the_setting(tmp_path):
    settings = Settings.of(data_dir=tmp_path / "env")
    assert data_dir(settings, None) == tmp_path / "env"
    assert data_dir(settings, str(tmp_path / "flag")) == tmp_path / "flag"
    assert Settings().common.data_dir == Path(".talaria")  # `talaria up`'s default, and the CLI's


def test_the_database_url_comes_from_stack_json_unless_one_is_set(tmp_path):
    settings = Settings.of(data_dir=tmp_path)
    with pytest.raises(StackNotFound, match=re.escape(str(tmp_path / "stack.json"))):
        database_url(settings, None)
    (tmp_path / "stack.json").write_text(json.dumps({"database": "postgresql://talaria:secret@127.0.0.1:5/talaria",
                                                     "traces": str(tmp_path / "t")}))
    assert database_url(settings, None) == "postgresql://talaria:secret@127.0.0.1:5/talaria"
    assert find_stack(tmp_path).traces_dir == tmp_path / "t"
    mine = settings.with_(database_url="postgresql://me:pw@db.example/x")
    assert database_url(mine, None) == "postgresql://me:pw@db.example/x"
    (tmp_path / "stack.json").write_text("{not json")
    with pytest.raises(StackNotFound, match="not a stack description"):
        find_stack(tmp_path)


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("flags, says", [
    (["--model", "foo=/nonexistent"], "talaria: --model foo=/nonexistent: expected a servable checkpoint"),
    (["--models", "nope"], "talaria: --models nope: expected models from the catalogue"),
    (["--port", "99999"], "talaria: --port 99999: expected a TCP port"),
    (["--agents", "-1"], "talaria: --agents -1: at least one agent"),
    (["--hot", "nope"], "talaria: --hot nope: unknown model"),
])
def test_bad_up_flags_fail_in_one_line_before_anything_starts(tmp_path, capsys, flags, says):
    data = tmp_path / "data"
    assert main(["up", *flags, "--data-dir", str(data)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(says)
    assert not data.exists()  # nothing was started or written


def test_operator_commands_without_a_stack_say_where_they_looked(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TALARIA_DATABASE_URL", raising=False)
    for argv in (["audit", "session_calls", "--param", "session_id=demo", "--data-dir", str(tmp_path)],
                 ["trace", "export", str(tmp_path / "out.jsonl"), "--data-dir", str(tmp_path)]):
        assert main(argv) == 2
        assert str(tmp_path / "stack.json") in _one_line(capsys.readouterr().err)
    assert main(["trace", "demo", "--data-dir", str(tmp_path)]) == 1
    assert "no spans under" in _one_line(capsys.readouterr().err)


def test_missing_trace_files_are_one_line(tmp_path, capsys):
    missing = str(tmp_path / "missing.jsonl")
    assert sim_main(["run", "--trace", missing]) == 2
    assert "No such file" in _one_line(capsys.readouterr().err)
    assert sim_main(["convert", missing, str(tmp_path / "out.jsonl")]) == 2
    assert "No such file" in _one_line(capsys.readouterr().err)
    assert main(["replay", missing]) == 2
    assert "No such file" in _one_line(capsys.readouterr().err)


def test_an_exported_trace_replays_its_recorded_gaps_by_default():
    served = [Session("s", (TraceCall("s", 0, "m", 10, 0, 2, 0.0, "start", "calls:c1"),
                            TraceCall("s", 1, "m", 20, 12, 2, 7.5, "tool", "calls:c2")))]
    assert default_gap_spec(served) == "recorded"
    assert default_gap_spec(fixed_replay()) == "paper"
    mixed = served + [Session("t", (TraceCall("t", 0, "m", 10, 0, 2, 0.0, "start", "weka:1"),))]
    assert default_gap_spec(mixed) == "paper"


def _documented_stack_keys() -> set[str]:
    """The keys docs/operating.md's stack.json table names (first column, in backticks)."""
    text = (ROOT / "docs" / "operating.md").read_text()
    section = text.split("## `stack.json`", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)`", section, re.M))


def test_stack_json_holds_exactly_the_documented_keys(tmp_path):
    described = Stack(Settings.of(data_dir=tmp_path)).describe()
    documented = _documented_stack_keys()
    # `nats_cluster` is documented for a clustered NATS (--nats-cluster > 1) and absent otherwise
    assert set(described) - {"nats_cluster"} == documented - {"nats_cluster"}
    assert os.path.basename(str(tmp_path)) in described["data_dir"]


def test_a_stopped_stacks_description_gets_one_line_not_retries(tmp_path, capsys, monkeypatch):
    """stack.json outlives its stack: the commands say it is not running instead of a traceback."""
    from talaria.embedded import free_port

    monkeypatch.delenv("TALARIA_DATABASE_URL", raising=False)
    (tmp_path / "stack.json").write_text(json.dumps({
        "database": f"postgresql://talaria:secret@127.0.0.1:{free_port()}/talaria",
        "nats_client": f"nats://talaria-client-default:pw@127.0.0.1:{free_port()}", "api_key": "tk-x"}))
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"session": "s", "call_index": 0, "model": "qwen3-tiny", "prompt_tokens": 4,
                                 "reusable_prefix_tokens": 0, "output_tokens": 1, "gap_before_s": 0.0}) + "\n")
    assert main(["replay", str(trace), "--running", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "is not running" in _one_line(err) and "pw" not in err
    assert main(["audit", "session_calls", "--param", "session_id=s", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the database" in _one_line(err) and "secret" not in err


def test_executions_count_each_call_completed_line_of_the_sessions_asked_for(tmp_path):
    from talaria.running import executions

    log = tmp_path / "agent-0.log"
    line = '{{"event": "call completed", "call_id": "{}", "session_id": "{}"}}\n'
    log.write_text(line.format("c1", "default:a") + line.format("c1", "default:a") + "not json \"call completed\"\n"
                   + line.format("c2", "other:b") + '{"event": "call failed", "call_id": "c3"}\n')
    assert executions([log]) == {"c1": 2, "c2": 1}
    assert executions([log], "default:") == {"c1": 2}
