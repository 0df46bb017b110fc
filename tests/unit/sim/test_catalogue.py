"""`--catalogue N|FILE` (issue 34, part 3): calibrated copies, a user's file, popularity mapping."""

import json

import pytest

from talaria.sim.catalogue import CatalogueError, by_popularity, resolve
from talaria.sim.cli import main as cli_main
from talaria.sim.profiles import PAPER_TP8, ROUTER_TP4
from talaria.sim.workloads import agent_sessions
from talaria.traces.format import save_sessions

GOOD = {"models": [
    {"name": "coder-7b", "weight_bytes": 15_000_000_000, "tp": 4, "kv_bytes_per_token": 57_344,
     "max_context": 32_768, "prefill": {"points": [[2_048, 0.12], [16_384, 0.9]]},
     "decode": {"d0_s": 0.008, "d1_s": 0.0002}},
    {"name": "chat-14b", "weight_bytes": 29_000_000_000, "tp": 4, "kv_bytes_per_token": 196_608,
     "prefill": {"speed": 3.0}},
]}


def _write(tmp_path, doc, name="cat.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_a_count_is_the_matrix_catalogue():
    server = resolve("20", PAPER_TP8)
    assert len(server.models) == 20 and list(server.models)[0].startswith("m00-")
    src = PAPER_TP8.model("qwen3-235b")
    first = server.model(list(server.models)[0])
    assert (first.weight_bytes, first.prefill_k, first.decode_d0_s) == (
        src.weight_bytes, src.prefill_k, src.decode_d0_s)


def test_a_file_gives_the_users_models_on_one_tp_group(tmp_path):
    server = resolve(_write(tmp_path, GOOD), PAPER_TP8)
    assert list(server.models) == ["coder-7b", "chat-14b"] and server.gpus == 4
    assert server.h2d_bytes_s == pytest.approx(PAPER_TP8.h2d_bytes_s / 2)  # half the TP=8 server's links
    coder = server.model("coder-7b")
    assert coder.prefill_s(2_048, 0) == pytest.approx(0.12) and coder.prefill_s(16_384, 0) == pytest.approx(0.9)
    assert (coder.decode_d0_s, coder.decode_d1_s, coder.max_context) == (0.008, 0.0002, 32_768)
    chat = server.model("chat-14b")  # derived: the reference curve, 3x faster
    ref = PAPER_TP8.model("qwen3-235b")
    ref_s = ref.prefill_s(25_000, 0) - ref.prefill_c0_s
    assert chat.prefill_s(25_000, 0) - chat.prefill_c0_s == pytest.approx(ref_s / 3)
    toml = ("[[models]]\nname = \"a\"\nweight_bytes = 1000000000\ntp = 8\nkv_bytes_per_token = 1000\n"
            "[models.prefill]\nspeed = 2.0\n")
    assert list(resolve(_write(tmp_path, toml, "c.toml"), PAPER_TP8).models) == ["a"]


def _model(**changes):
    m = dict(GOOD["models"][1])
    m.update(changes)
    return {k: v for k, v in m.items() if v is not None}


@pytest.mark.parametrize("doc, field", [
    ({"models": [_model(weight_bytes=-5)]}, "models[0].weight_bytes"),
    ({"models": [_model(weight_bytes="15GB")]}, "models[0].weight_bytes"),
    ({"models": [_model(tp=None)]}, "models[0].tp"),
    ({"models": [_model(tp=2.5)]}, "models[0].tp"),
    ({"models": [_model(kv_bytes_per_token=0)]}, "models[0].kv_bytes_per_token"),
    ({"models": [_model(name="")]}, "models[0].name"),
    ({"models": [_model(colour="red")]}, "unknown field"),
    ({"models": [_model(prefill={"points": [[16_384, 0.9], [2_048, 0.12]]})]}, "models[0].prefill.points"),
    ({"models": [_model(prefill={"points": [[2_048, -1], [16_384, 0.9]]})]}, "models[0].prefill.points[0][1]"),
    ({"models": [_model(prefill={"speed": 1, "points": []})]}, "models[0].prefill"),
    ({"models": [_model(decode={"d9_s": 1})]}, "models[0].decode"),
    ({"models": [_model(decode={"d1_s": "fast"})]}, "models[0].decode.d1_s"),
    ({"models": [_model(), _model()]}, "named twice"),
    ({"models": [_model(), _model(name="x", tp=8)]}, "share one TP"),
    ({"models": [_model(weight_bytes=10**15)]}, "weight_bytes"),
    ({"models": []}, "'models' list"),
    ({"model": [_model()]}, "'models' list"),
    ("{not json", "not valid JSON"),
])
def test_each_bad_field_is_a_one_line_error_that_names_it(tmp_path, doc, field):
    with pytest.raises(CatalogueError) as e:
        resolve(_write(tmp_path, doc), PAPER_TP8)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_trace_models_map_onto_the_catalogue_by_popularity():
    sessions = agent_sessions(40, ["rare", "common"], 4, 1_000, 10, zipf_s=0.0, seed=4)
    calls = {m: sum(len(s.calls) for s in sessions if s.model == m) for m in ("rare", "common")}
    top = max(calls, key=calls.get)
    mapped = by_popularity(sessions, ["first", "second", "third"])
    assert {s.model for s in mapped} == {"first", "second"}
    assert all((m.model == "first") == (s.model == top) for s, m in zip(sessions, mapped))
    assert [len(s.calls) for s in mapped] == [len(s.calls) for s in sessions]
    assert by_popularity(sessions, ["rare", "common"]) is sessions  # names the catalogue serves: unchanged


def test_sim_run_takes_a_catalogue_and_fails_bad_files_in_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    save_sessions(agent_sessions(3, ["u", "v"], 2, 2_000, 20, seed=2), trace)
    out = tmp_path / "r.json"
    assert cli_main(["run", "--trace", str(trace), "--catalogue", _write(tmp_path, GOOD), "--profile", "router-tp4",
                     "--config", "talaria", "--instances", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["complete"]
    capsys.readouterr()
    bad = _write(tmp_path, {"models": [_model(tp=0)]}, "bad.json")
    assert cli_main(["run", "--trace", str(trace), "--catalogue", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "models[0].tp" in err and "\n" not in err
    assert ROUTER_TP4.gpus == 4  # the file's TP group replaces the profile's
