"""Issue 34 part 5: under overload (a round of many models cannot hold its cap) no session
starves. 20 models, one session each, on one instance: the paper's least decode gives each
model one token per round of 20 switches (the device ~99 % switching); the overload rule
(scheduler/budget.py) decodes at least as long as it switches."""

from talaria.services import configs
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PAPER_TP8, catalogue
from talaria.traces.format import Session, TraceCall
from talaria.traces.gaps import GapModel


def _run(**knobs):
    server = catalogue(PAPER_TP8, 20)
    models = list(server.models)
    work = [Session(f"s{i}", (TraceCall(f"s{i}", 0, models[i], 4_000, 0, 100, 0.1 * i, "start"),
                              TraceCall(f"s{i}", 1, models[i], 4_300, 4_100, 100, 0.5, "tool")))
            for i in range(20)]
    cfg = configs.get("talaria", **knobs)
    return summarise(simulate(work, RunConfig(server, 1, cfg.policy, cfg.router, cfg.sim_scheduler(),
                                              GapModel("recorded", None))))


def test_an_overloaded_instance_decodes_at_least_as_long_as_it_switches():
    paper, ours = _run(switch_amortisation=0.0), _run()
    assert paper["rounds"]["switch_share"] > 0.95  # the starvation: one token per 20-switch round
    assert ours["complete"] and ours["rounds"]["switch_share"] < 2 / 3
    assert ours["sct_p95"] < 0.1 * paper["sct_p95"]
