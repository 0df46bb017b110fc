"""Today's simulator names keep working as aliases of the configuration registry: each older
policy name and flag is called once, on a small generated trace, and must run (issue 35)."""

from __future__ import annotations

import json

import pytest

from talaria.services import configs
from talaria.sim.cli import main
from talaria.sim.experiments import main as experiments_main
from talaria.sim.workloads import agent_sessions, at_rate
from talaria.traces.format import save_sessions

OLD_POLICIES = ("round-robin", "sglang-cache-aware", "dynamo-kv", "llm-d", "vllm-stack-session")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("alias") / "t.jsonl"
    save_sessions(at_rate(agent_sessions(6, ["qwen3-235b", "glm5-nvfp4"], 4, 4_000, 40, seed=5), 0.5), path)
    return path


def _run(trace, tmp_path, *flags) -> dict:
    out = tmp_path / "r.json"
    assert main(["run", "--trace", str(trace), "--instances", "2", "--json", str(out),
                 *flags]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("policy", OLD_POLICIES)
def test_each_old_policy_name_runs_as_deployed(trace, tmp_path, policy):
    got = _run(trace, tmp_path, "--policy", policy, "--deploy", "as-deployed", "--gaps", "recorded")
    assert got["complete"] and got["policy"] == policy


def test_old_talaria_flags_run(trace, tmp_path):
    for flags in (("--pools", "forecast"), ("--pools", "online"), ("--ablation", "round-only"), ("--gaps", "paper")):
        got = _run(trace, tmp_path, "--policy", "talaria", "--deploy", "as-deployed", *flags)
        assert got["complete"], flags


def test_peer_split_and_seeds_run_the_matrix(tmp_path):
    assert experiments_main(["matrix", "--cells", "depth=5@60%", "--peer-split", "history", "--workers", "1",
                             "--seeds", "1000,2000", "--no-report", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "matrix.json").read_text())
    assert got["peer_split"] == "history" and got["matrix"]["seeds"] == [1000, 2000]
    assert set(configs.PEERS) <= set(got["cells"][0]["results"])


def test_a_bad_seed_list_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="^error: --seeds 'a,b'"):
        experiments_main(["matrix", "--seeds", "a,b", "--no-report", "--out", str(tmp_path)])
