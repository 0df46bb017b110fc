"""Clients that send no session id in the simulator (talaria/sim/anonymous_sessions.py):
talaria's gateway infers the sessions with the live SessionIndex, a peer's router sees each
call as its own session, and SCT stays per true session."""

from collections import Counter
from dataclasses import replace

import pytest

from talaria.services import configs
from talaria.shared.events import CallSubmitted, RoutingDecision
from talaria.sim.cluster import Cluster, RunConfig
from talaria.sim.metrics import session_scts, summarise
from talaria.sim.profiles import PAPER_TP8
from talaria.sim.workloads import agent_sessions, at_rate
from talaria.traces.gaps import GapModel

MODELS = sorted(PAPER_TP8.models)


def _workload():
    # 8 sessions of 3 models that are never compacted (every continuation repeats its
    # predecessor's prompt and answer), and every session of a model opens with the same
    # 2,000-token system prompt: sessions that share only it must not merge.
    drawn = agent_sessions(40, MODELS, depth=5, prompt=3_000, output=120, seed=3, shared=2_000)
    kept = [s for s in drawn if len(s.calls) > 1 and all(c.reusable_prefix_tokens for c in s.calls[1:])][:8]
    assert len(kept) == 8
    return at_rate(kept, 0.2)


def _config(name: str, session_ids: str) -> RunConfig:
    cfg = configs.get(name, pools="shared")
    return RunConfig(PAPER_TP8, 2, cfg.policy, cfg.router, cfg.sim_scheduler(), GapModel("recorded", None),
                     shared_prefix={m: 2_000 for m in MODELS}, session_ids=session_ids)


class _Seen:
    """What the routers are told: each submitted call's session, each snapshot's sessions."""

    def __init__(self, cluster: Cluster) -> None:
        self.submitted: list[CallSubmitted] = []
        self.snapshot_sessions: set[str] = set()
        self.decisions: list[RoutingDecision] = []
        for router in cluster.routers:
            handle, observe = router.handle, router.observe

            def seen_handle(event, now, handle=handle):
                if isinstance(event, CallSubmitted):
                    self.submitted.append(event)
                out = handle(event, now)
                self.decisions += [e for e in out if isinstance(e, RoutingDecision)]
                return out

            def seen_observe(snap, now, observe=observe):
                self.snapshot_sessions |= {kv.session_id for kv in snap.sessions}
                return observe(snap, now)

            router.handle, router.observe = seen_handle, seen_observe


def _run(name: str, session_ids: str):
    cluster = Cluster(_workload(), _config(name, session_ids))
    seen = _Seen(cluster)
    return cluster, cluster.run(), seen


def test_talaria_without_ids_attributes_every_session_and_serves_it_as_with_ids():
    named_cluster, named, _ = _run("talaria", "named")
    cluster, anon, seen = _run("talaria", "inferred")
    sessions, calls = len(anon.sessions), sum(len(s.calls) for s in anon.sessions)
    # each session started once and every later call continued it; none merged or forked
    assert cluster.anonymous.kinds == {"new": sessions, "continued": calls - sessions, "forked": 0}
    assert cluster.anonymous.merged == 0
    by_true = {}
    for ev in seen.submitted:
        by_true.setdefault(ev.call_id.split("#")[0], set()).add(ev.session_id)
    assert all(len(ids) == 1 for ids in by_true.values())  # one inferred id per true session ...
    assert len(set().union(*by_true.values())) == sessions  # ... and a different one for each
    assert not {s.id for s in anon.sessions} & ({e.session_id for e in seen.submitted} | seen.snapshot_sessions)
    # the same leases and KV hits as with the ids, and the same SCT per true session
    for counter in ("leases_issued", "leases_consumed", "returns", "same_instance_returns"):
        assert getattr(anon.router, counter) == getattr(named.router, counter), counter
    assert anon.router.leases_consumed > 0
    kv = lambda r: Counter(j.kv_source for j in r.jobs)  # noqa: E731
    assert kv(anon) == kv(named) and kv(anon)["device"] > 0
    assert session_scts(anon) == pytest.approx(session_scts(named))


def test_a_continuation_that_does_not_repeat_its_answer_starts_a_session():
    # the answers are what tells a continuation from a prompt that only shares a prefix: if the
    # next prompt did not repeat them, every call would start a session of its own
    cluster = Cluster(_workload(), _config("talaria", "inferred"))
    cluster.anonymous.tokens.answered = lambda session, index, output: b"\x00" * output
    result = cluster.run()
    assert cluster.anonymous.kinds["continued"] == 0
    assert cluster.anonymous.kinds["new"] == sum(len(s.calls) for s in result.sessions)


@pytest.mark.parametrize("peer", ["vllm-stack-session", "sglang-cache-aware"])
def test_peers_without_ids_see_every_call_as_its_own_session(peer):
    _, result, seen = _run(peer, "per-call")
    calls = sum(len(s.calls) for s in result.sessions)
    ids = [e.session_id for e in seen.submitted]
    assert len(set(ids)) == calls  # one fresh id per call (no retries here)
    assert {e.session_origin for e in seen.submitted} == {"new"}
    assert not {s.id for s in result.sessions} & (set(ids) | seen.snapshot_sessions)
    assert {d.call_index for d in seen.decisions} == {0}  # the router never saw a continuation
    if peer == "vllm-stack-session":  # production-stack's keyless path: lowest QPS, never the ring
        assert {d.reason for d in seen.decisions} == {"no session key: lowest qps"}
    summary = summarise(result)  # SCT is still per true session
    assert summary["sessions"] == len(result.sessions) and summary["complete"]


def test_vllm_stack_session_hashes_a_named_session():
    _, _, seen = _run("vllm-stack-session", "named")
    assert {d.reason for d in seen.decisions} == {"session hash"}


def test_an_unknown_session_ids_mode_is_one_clear_error():
    with pytest.raises(ValueError, match="session_ids must be one of"):
        Cluster(_workload(), replace(_config("talaria", "named"), session_ids="nobody"))


def test_sim_run_no_session_ids_flag(tmp_path, capsys, monkeypatch):
    from talaria.sim import cluster
    from talaria.sim.cli import main as cli_main
    from talaria.traces.format import save_sessions

    modes = []
    real = cluster.AnonymousSessions
    monkeypatch.setattr(cluster, "AnonymousSessions", lambda mode: modes.append(mode) or real(mode))
    trace = tmp_path / "t.jsonl"
    save_sessions(_workload(), trace)
    for flags in ([], ["--no-session-ids"]):
        out = tmp_path / f"run{len(flags)}.json"
        assert cli_main(["run", "--trace", str(trace), "--config", "talaria", "--instances", "2",
                         "--gaps", "recorded", "--json", str(out), *flags]) == 0
    import json
    named, anon = (json.loads((tmp_path / f"run{k}.json").read_text()) for k in (0, 1))
    assert modes == ["inferred"]  # only the run without ids, and talaria infers
    assert anon["sct_p95"] == pytest.approx(named["sct_p95"]) and "SCT p50" in capsys.readouterr().out


def test_the_matrix_deploys_each_configuration_as_it_does_without_ids():
    from talaria.sim import matrix

    cell = next(c for c in matrix.cells() if c.name == "depth=5@60%")
    assert matrix.run_config(cell, "talaria")[0].session_ids == "named"
    assert matrix.run_config(cell, "talaria-paper", session_ids="none")[0].session_ids == "inferred"
    assert matrix.run_config(cell, "sglang-cache-aware", session_ids="none")[0].session_ids == "per-call"
    with pytest.raises(ValueError, match="session_ids must be one of"):
        matrix.run_config(cell, "talaria", session_ids="some")
