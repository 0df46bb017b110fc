"""Router replicas in the simulator: with an instant view, N partitioned routers place every
call where one router would (the policy is the same, the state the same); with a lag, each
places on a stale view of the others' placements, and the run still completes."""

from talaria.services.router.policy.base import PolicyConfig
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.executor import instance_config
from talaria.sim.profiles import PAPER_TP8, catalogue
from talaria.sim.workloads import synthetic_catalogue
from talaria.traces.gaps import GapModel


def _run(routers: int, lag_s: float):
    server = catalogue(PAPER_TP8, 4)
    work = synthetic_catalogue(40, list(server.models), 1.0, 1.0, seed=3)
    cfg = RunConfig(server, 4, "talaria", PolicyConfig(overload="queue"), instance_config(),
                    GapModel("paper", 10.0, seed=0), routers=routers, propagation_s=lag_s)
    result = simulate(work, cfg)
    return {j.call_id: j.instance for j in result.jobs}, result


def test_partitioned_routers_with_an_instant_view_place_as_one_router():
    one, _ = _run(1, 0.0)
    three, result = _run(3, 0.0)
    assert one == three
    assert result.router.leases_issued > 0  # the owners issued (and peers folded) leases


def test_a_lagging_view_still_serves_every_call():
    placed, result = _run(3, 0.5)
    one, _ = _run(1, 0.0)
    assert set(placed) == set(one)  # every call of every session served
    assert result.router.gave_up == 0
