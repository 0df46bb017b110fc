"""The scale workload builder and a tiny scale run (the 64-instance experiment, shrunk)."""

from talaria.sim.experiments import scale_exp
from talaria.sim.profiles import PAPER_TP8, catalogue
from talaria.sim.workloads import synthetic_catalogue


def _shape(sessions):
    return [(s.id, [(c.model, c.prompt_tokens, c.reusable_prefix_tokens, c.output_tokens, c.gap_before_s)
                    for c in s.calls]) for s in sessions]


def test_scale_workload_is_deterministic_and_zipf_skewed():
    models = list(catalogue(PAPER_TP8, 20).models)
    a = synthetic_catalogue(300, models, 4.0, 1.0, seed=7)
    b = synthetic_catalogue(300, models, 4.0, 1.0, seed=7)
    assert _shape(a) == _shape(b)
    assert _shape(a) != _shape(synthetic_catalogue(300, models, 4.0, 1.0, seed=8))
    firsts = [s.calls[0].model for s in a]
    assert firsts.count(models[0]) > firsts.count(models[-1])  # Zipf: model 0 is the most popular
    assert all(c.model == s.calls[0].model for s in a for c in s.calls)  # a session keeps its model
    # sessions per second: 300 sessions at 4/s start within ~75 s
    assert 40 < a[-1].calls[0].gap_before_s < 120


def test_tiny_scale_run_completes_and_is_deterministic():
    kw = dict(sessions=30, instances=4, models=4, arrival_rate_s=0.5, progress=False)
    one = scale_exp(**kw)
    two = scale_exp(**kw)
    assert one["policies"], "no policy ran"
    for name, s in one["policies"].items():
        assert s["complete"] and not s["capped"], name
        assert s["calls"] == s["calls_total"] > 30
        assert s["sct_p50"] == two["policies"][name]["sct_p50"]
        assert s["events"] == two["policies"][name]["events"]


def test_wall_cap_stops_a_scale_run_and_says_so():
    out = scale_exp(sessions=30, instances=4, models=4, arrival_rate_s=0.5, progress=False, max_wall_s=0.0)
    for name, s in out["policies"].items():
        assert not s["complete"] and s["capped"], name
        assert s["events"] == 0
