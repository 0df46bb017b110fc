"""A simulated instance snapshots when a call finishes there, as the live agent does, so the
router sees the freed capacity at once rather than a heartbeat later."""

from talaria.sim.cluster import Cluster, RunConfig
from talaria.sim.profiles import PAPER_TP8
from talaria.traces.format import Session, TraceCall
from talaria.traces.gaps import GapModel


def _one_call():
    return [Session("a", (TraceCall("a", 0, "qwen3-235b", 2000, 0, 20, 0.0),))]


def _view_after_the_call(**cfg):
    config = RunConfig(PAPER_TP8, 1, "least-pressure", gaps=GapModel("recorded", 10.0), heartbeat_s=60.0, **cfg)
    cluster = Cluster(_one_call(), config)
    result = cluster.run()
    [job] = result.jobs
    return cluster.router.state.instances["inst-00"].snapshot, job


def test_the_router_hears_of_a_finished_call_at_once():
    snap, job = _view_after_the_call()
    assert snap.at == job.done_t and snap.running == 0 and not snap.queued.get("qwen3-235b")


def test_without_it_the_router_sees_the_call_running_until_the_next_heartbeat():
    snap, job = _view_after_the_call(snapshot_on_change_s=float("inf"))
    assert snap.at < job.done_t  # the last snapshot predates the completion (heartbeat 60 s)
