"""`talaria sim capacity` (issue 34): the search, the instance lower bound, the SLO stop, the CLI."""

import json
import math
from dataclasses import replace

import pytest

from talaria.sim.capacity import Point, Runner, least_instances, load_inputs, parse_policies, parse_slo
from talaria.sim.cli import main as cli_main
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.instance_bound import ActiveCover, instances_lower_bound
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PAPER_TP8, SimModelProfile, catalogue
from talaria.sim.workloads import agent_sessions, at_rate
from talaria.traces.format import Session, TraceCall, save_sessions
from talaria.traces.gaps import GapModel

# ---- the search -----------------------------------------------------------------------------


def threshold_runs(need: int, calls: list[int]):
    """A stand-in for the simulator (the search is pure): meets the SLO from `need` instances."""
    def run(n: int) -> Point:
        calls.append(n)
        return Point(n, 1.0, 10.0 if n >= need else 1e9, 0, True)
    return run


@pytest.mark.parametrize("need", [1, 2, 3, 7, 8, 33, 64])
def test_search_finds_the_least_count_and_runs_each_count_once(need):
    calls: list[int] = []
    k, runs = least_instances(threshold_runs(need, calls), 100.0, 1, 64)
    assert k == need
    assert len(calls) == len(set(calls)) and [r.instances for r in runs] == calls
    assert need in calls and (need == 1 or need - 1 in calls)  # the answer is bracketed by real runs
    assert len(calls) <= 2 * 7  # doubling then bisection: logarithmic, not a scan


def test_search_starts_at_the_lower_bound_and_gives_up_past_the_maximum():
    calls: list[int] = []
    assert least_instances(threshold_runs(5, calls), 100.0, 4, 64)[0] == 5
    assert min(calls) == 4  # counts under the bound are never run
    calls.clear()
    k, runs = least_instances(threshold_runs(50, calls), 100.0, 1, 20)
    assert k is None and max(calls) == 20 and len(runs) == len(calls)
    assert least_instances(threshold_runs(1, []), 100.0, 30, 20) == (None, [])


def test_an_incomplete_run_never_meets_the_slo():
    assert not Point(4, 1.0, 5.0, 0, complete=False).meets(100.0)
    assert Point(4, 1.0, 100.0, 3, complete=True).meets(100.0)


def test_slo_and_policies_parse_or_fail_in_one_line():
    assert parse_slo("900", 50.0) == 900.0 and parse_slo("900s", 50.0) == 900.0
    assert parse_slo("2x", 50.0) == 100.0 and parse_slo("1.5X", 10.0) == 15.0
    for bad in ("fast", "-2x", "0", "nanx"):
        with pytest.raises(ValueError) as e:
            parse_slo(bad, 50.0)
        assert "\n" not in str(e.value)
    assert parse_policies("all")[0] == "talaria" and len(parse_policies("all")) > 1
    assert parse_policies("talaria, llm-d,talaria") == ["talaria", "llm-d"]
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_policies("talaria,nope")


# ---- the instance lower bound, on traces computed by hand ------------------------------------

# 1 ms per prompt token, 10 ms per output token at any batch: a call of 1,000 new tokens and
# 101 output tokens (100 decode steps) costs 1.0 + 1.0 = 2.0 s of an instance, alone or not.
_FLAT = SimModelProfile("flat", weight_bytes=int(0.6 * PAPER_TP8.hbm_bytes), kv_bytes_per_token=1_000,
                        prefill_k=1e-3, prefill_alpha=1.0, prefill_c0_s=0.0, decode_d0_s=0.0, decode_d1_s=0.01,
                        decode_d2_s=0.0)


def _server(models=("a",)):
    return PAPER_TP8.with_models({m: replace(_FLAT, name=m) for m in models})


def _one_call(sid: str, model: str, start: float) -> Session:
    return Session(sid, (TraceCall(sid, 0, model, 1_000, 0, 101, start, "start", "test"),))


def test_lower_bound_is_the_work_over_the_slo_window_less_the_misses():
    server = _server()
    sessions = [_one_call(f"s{i}", "a", 0.0) for i in range(20)]  # 20 x 2 s of work at t = 0
    # p95 of 20 lets one session miss: 19 x 2 s = 38 s of work inside [0, S]
    assert instances_lower_bound(sessions, server, 4.0, 64, GapModel()) == 10  # ceil(38 / 4)
    assert instances_lower_bound(sessions, server, 2.001, 64, GapModel()) == 19  # ceil(38 / 2.001)
    assert instances_lower_bound(sessions, server, 1e6, 64, GapModel()) == 1
    # below the zero-wait SCT (2 s) no instance count meets the SLO
    assert instances_lower_bound(sessions, server, 1.9, 64, GapModel()) is None


def test_lower_bound_charges_an_activation_for_a_model_no_instance_holds():
    # two models, each too large to share an instance with the other; one session each,
    # started at 0 and 2 s, SLO ~2 s: the window [0, ~4] holds 4 s of work. One instance could
    # do the work, but it holds one model at t = 0 and must load the other inside the window.
    server = _server(("a", "b"))
    sessions = [_one_call("s0", "a", 0.0), _one_call("s1", "b", 2.0)]
    assert server.switch("b", server.model("b").weight_bytes)[1] > 0
    assert instances_lower_bound(sessions, server, 2.001, 64, GapModel()) == 2
    # the same trace on one model: no load is forced, one instance is the bound
    same = [_one_call("s0", "a", 0.0), _one_call("s1", "a", 2.0)]
    assert instances_lower_bound(same, _server(("a", "b")), 2.001, 64, GapModel()) == 1


def test_lower_bound_lets_only_one_models_sessions_share_a_decode_step():
    # 10 ms per step whatever the batch (d0), 1 ms per prompt token: a call of 1,000 new
    # tokens and 100 decode steps costs 1.0 + 1.0 / B s of an instance at batch B.
    batchy = replace(_FLAT, weight_bytes=int(0.1 * PAPER_TP8.hbm_bytes), decode_d0_s=0.01, decode_d1_s=0.0)
    server = PAPER_TP8.with_models({m: replace(batchy, name=m) for m in ("a", "b")})
    together = [_one_call("s0", "a", 0.0), _one_call("s1", "a", 0.0)]  # batch 2: 2 x 1.5 s in [0, 3]
    apart = [_one_call("s0", "a", 0.0), _one_call("s1", "b", 0.0)]  # batch 1 each: 2 x 2.0 s in [0, 3]
    assert instances_lower_bound(together, server, 3.0, 64, GapModel()) == 1
    assert instances_lower_bound(apart, server, 3.0, 64, GapModel()) == 2
    assert instances_lower_bound(together, server, 3.0, 1, GapModel()) == 2  # max_batch 1: no sharing


def test_lower_bound_never_exceeds_what_the_simulator_needs(tmp_path):
    server = catalogue(PAPER_TP8, 3)
    sessions = at_rate(agent_sessions(8, list(server.models), 5, 8_000, 100, seed=3), 0.2)
    gaps = GapModel("recorded", None)
    from talaria.sim.capacity import Runner, zero_wait_p95
    slo = 2 * zero_wait_p95(sessions, server, gaps)
    lb = instances_lower_bound(sessions, server, slo, 64, gaps)
    run = Runner(sessions, server, gaps, slo)
    k, _ = least_instances(lambda n: run("talaria", n), slo, 1, 8)
    assert lb is not None and k is not None and lb <= k


# ---- the SLO stop: the same verdict without simulating the rest ------------------------------


def test_a_run_stopped_at_a_missed_slo_gives_the_full_runs_verdict():
    server = catalogue(PAPER_TP8, 3)
    # > 4,096 events: stop() is polled that often
    sessions = at_rate(agent_sessions(40, list(server.models), 20, 20_000, 200, seed=5), 1.0)
    base = RunConfig(server, 1, "talaria", gaps=GapModel("recorded", None))
    full = summarise(simulate(sessions, base))
    tight = full["sct_p95"] / 3
    stopped = simulate(sessions, replace(base, stop_above_p95_s=tight))
    assert full["complete"] and full["sct_p95"] > tight
    assert not summarise(stopped)["complete"] and stopped.events < full["events"]  # stopped, a miss
    loose = summarise(simulate(sessions, replace(base, stop_above_p95_s=full["sct_p95"])))
    assert loose["complete"] and loose["sct_p95"] == full["sct_p95"]  # met: never stopped, same run


# ---- the CLI ---------------------------------------------------------------------------------


def test_sim_capacity_writes_the_issue_json_shape(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    save_sessions(at_rate(agent_sessions(6, ["x", "y", "z"], 4, 8_000, 100, zipf_s=1.0, seed=1), 0.2), trace)
    out = tmp_path / "cap.json"
    assert cli_main(["capacity", "--trace", str(trace), "--catalogue", "3", "--slo-p95", "2x",
                     "--policies", "talaria,sglang-cache-aware", "--max-instances", "8", "--json", str(out)]) == 0
    text = capsys.readouterr()
    assert "instance lower bound" in text.out and text.err.count("capacity [") == sum(
        len(e["runs"]) for e in json.loads(out.read_text())["policies"].values())  # a progress line per run
    r = json.loads(out.read_text())
    assert r["slo_p95_s"] == pytest.approx(2 * r["bound_p95_s"])
    assert set(r["policies"]) == {"talaria", "sglang-cache-aware"}
    lb = r["instances_lower_bound"]
    for e in r["policies"].values():
        assert {"instances", "sct_p50", "sct_p95", "runs"} <= set(e) and e["monotone"] in (True, False)
        assert e["instances"] is not None and e["instances"] >= lb
        for run in e["runs"]:
            assert {"instances", "sct_p50", "sct_p95", "rejected", "recomputes", "migrations"} <= set(run)
            assert run["recomputes"] >= 0 and run["migrations"] >= 0
        at_k = [x for x in e["runs"] if x["instances"] == e["instances"]]
        assert at_k[0]["sct_p95"] == e["sct_p95"] <= r["slo_p95_s"]
        below = [x for x in e["runs"] if x["instances"] == e["instances"] - 1]
        assert e["instances"] == lb or (below and (below[0]["sct_p95"] is None or below[0]["sct_p95"] > r["slo_p95_s"]))


def test_a_capacity_run_counts_recomputes_and_migrations_and_the_ablation_never_migrates(tmp_path):
    # Two instances for four models at a rate that makes the router move a return.
    trace = tmp_path / "t.jsonl"
    save_sessions(at_rate(agent_sessions(20, ["w", "x", "y", "z"], 10, 25_000, 250, "paper", zipf_s=1.0, seed=0),
                          0.5), trace)
    sessions, server, gaps = load_inputs(str(trace), "paper-tp8", "4", None, 0)
    on = Runner(sessions, server, gaps, math.inf)("talaria", 2)
    off = Runner(sessions, server, gaps, math.inf)("talaria-no-migrate", 2)
    assert off.migrations == 0 and off.recomputes > 0  # every move recomputes there
    assert on.migrations > 0 and on.recomputes < off.recomputes


def test_sim_capacity_bad_input_is_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    save_sessions(agent_sessions(2, ["x"], 2, 1_000, 10, seed=1), trace)
    for flags in (["--slo-p95", "soon"], ["--slo-p95", "2x", "--policies", "nope"],
                  ["--slo-p95", "2x", "--catalogue", str(tmp_path / "missing.json")],
                  ["--slo-p95", "2x", "--max-instances", "0"]):
        assert cli_main(["capacity", "--trace", str(trace), "--catalogue", "1", *flags,
                         "--json", str(tmp_path / "o.json")] if "--catalogue" not in flags else
                        ["capacity", "--trace", str(trace), *flags, "--json", str(tmp_path / "o.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err


@pytest.mark.parametrize("need", [1, 3, 4, 5, 6, 9, 20])
@pytest.mark.parametrize("guess", [1, 5, 6, 12, 64])
def test_search_from_a_guess_gallops_either_way_to_the_same_answer(need, guess):
    calls: list[int] = []
    k, _ = least_instances(threshold_runs(need, calls), 100.0, 1, 64, guess)
    assert k == need and len(calls) == len(set(calls)) and min(calls) >= 1
    assert need in calls and (need == 1 or need - 1 in calls)
    if guess == need > 1:
        assert calls == [need, need - 1]  # the right guess costs two runs, not a search


def test_active_cover_adds_each_shortfall_as_late_as_its_window_allows():
    cover = ActiveCover()
    cover.add(0.0, 1.5, 1.0)  # [0.5, 1.5]
    cover.add(0.5, 2.0, 1.0)  # already holds 1.0 of [0.5, 2.0]: nothing added
    assert cover.total == pytest.approx(1.0)
    cover.add(1.0, 2.5, 1.0)  # holds [1.0, 1.5]: 0.5 more, at [2.0, 2.5]
    assert cover.total == pytest.approx(1.5)
    assert cover.intervals == [[0.5, 1.5], [2.0, 2.5]]
    cover.add(1.2, 2.7, 1.5)  # holds 0.3 + 0.5: 0.7 more, latest first: [2.5, 2.7] then [1.5, 2.0]
    assert cover.total == pytest.approx(2.2)
    assert cover.intervals == [[0.5, 2.7]]


def test_lower_bound_charges_each_model_the_time_it_must_be_active():
    # 10 ms per decode step whatever the batch, prefill ~free: a call of 101 output tokens needs
    # its model active ~1.01 s. Four sessions of one model start 0.5 s apart (S = 1.5 s): all
    # within S of each other, so step 2 credits them a batch of 4 (~0.26 s of work each), but
    # their windows barely overlap and sharing steps saves little: the model must be active
    # ~2.02 s of [0, 3]. Two such models cannot both be on one instance that long.
    quick = replace(_FLAT, weight_bytes=int(0.1 * PAPER_TP8.hbm_bytes), prefill_k=1e-5, decode_d0_s=0.01,
                    decode_d1_s=0.0)
    server = PAPER_TP8.with_models({m: replace(quick, name=m) for m in ("a", "b")})
    one = [_one_call(f"a{i}", "a", 0.5 * i) for i in range(4)]
    two = one + [_one_call(f"b{i}", "b", 0.5 * i) for i in range(4)]
    assert instances_lower_bound(one, server, 1.5, 64, GapModel()) == 1
    assert instances_lower_bound(two, server, 1.5, 64, GapModel()) == 2
