"""`talaria sim run --trace T --bound`: the capacity-aware bound printed beside the run."""

import json

from talaria.sim.cli import main as cli_main
from talaria.sim.workloads import agent_sessions
from talaria.traces.format import save_sessions


def test_sim_run_prints_the_capacity_aware_bound_beside_the_run(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    save_sessions(agent_sessions(4, ["qwen3-235b", "glm5-nvfp4", "qwen3.5-122b-a10b"], depth=3,
                                 prompt=8_000, output=100, seed=2), trace)
    out = tmp_path / "run.json"
    assert cli_main(["run", "--trace", str(trace), "--gaps", "recorded", "--instances", "2", "--policy", "talaria",
                     "--bound", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "capacity-aware bound: SCT p50" in text and "the bound" in text
    run = json.loads(out.read_text())
    bound = run["bound"]
    for q in ("sct_p50", "sct_p95"):
        # the lower of the two idealised runs, and never above the run itself: the schedule
        # bound is below the run session by session
        assert bound[q] == min(bound["schedule"][q], bound["free_memory_run"][q])
        assert 0 < bound["schedule"][q] <= run[q] + 1e-9
        assert bound[q] <= run[q] + 1e-9
    # the run has to move weights (three models on two instances): the bound is strictly lower
    assert bound["sct_p95"] < run["sct_p95"]
    # without --bound nothing extra is computed or printed
    assert cli_main(["run", "--trace", str(trace), "--gaps", "recorded", "--json", str(out)]) == 0
    assert "capacity-aware bound" not in capsys.readouterr().out and "bound" not in json.loads(out.read_text())
