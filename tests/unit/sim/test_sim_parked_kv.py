"""Paper-mode switches: a switched-out model's running calls keep their KV on device while
HBM has room, so reopening the model restores nothing; without park_kv (round-only) or
under HBM pressure it is restored from host. The schedule bound bounds every session."""

from dataclasses import replace

from talaria.services.instance_agent.memory.parked_kv import parking_room

from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.executor import SimExecutor, instance_config
from talaria.sim.metrics import session_scts
from talaria.sim.profiles import PAPER_TP8, GiB
from talaria.sim.schedule_bound import schedule_bound_scts
from talaria.sim.workloads import fixed_replay
from talaria.traces.gaps import GapModel

GAPS = GapModel("paper", 10.0, seed=0)


def _run(server=PAPER_TP8, **cfg):
    sessions = fixed_replay()[:12]
    config = RunConfig(server, 1, "least-loaded", scheduler=instance_config("talaria", **cfg), gaps=GAPS,
                       log_actions=True)
    return simulate(sessions, config)


def _kv_seconds(result, phase):
    return sum(s.phases.get(phase, 0.0) for s in result.instances[0].switches)


def test_parked_kv_stays_on_device_and_reopening_restores_nothing():
    on, off = _run(), _run(park_kv=False)
    assert _kv_seconds(off, "kv_resume") > 0  # the offloaded baseline restores on reopen
    assert _kv_seconds(on, "kv_resume") == 0
    assert _kv_seconds(on, "kv_unpark") > 0 and on.instances[0].parked.offloads == 0
    # a D2D move back costs far less than the host restore it replaces
    assert _kv_seconds(on, "kv_park") + _kv_seconds(on, "kv_unpark") < 0.2 * _kv_seconds(off, "kv_resume")


def test_hbm_pressure_offloads_parked_kv_and_the_reopen_restores_it(monkeypatch):
    # bump buffer just over the two largest models' weights: little room is left to park
    w = sorted(m.weight_bytes for m in PAPER_TP8.models.values())
    tight = replace(PAPER_TP8, hbm_per_gpu_bytes=int((w[-1] + w[-2] + 8 * GiB) / PAPER_TP8.bump_fraction / 8))
    seen = []
    done = SimExecutor._done

    def checked(self, now, token, steps):
        out = done(self, now, token, steps)
        if self.active is not None:  # after every action: parked KV within the room left
            used = self.kv.device_tokens * self.server.model(self.active).kv_bytes_per_token
            room = parking_room(self.server.kv_pool_bytes(self.active), used, self._reserve(self.active))
            seen.append((self.parked.bytes, room))
        return out

    monkeypatch.setattr(SimExecutor, "_done", checked)
    r = _run(tight)
    assert r.instances[0].parked.offloads > 0
    assert _kv_seconds(r, "kv_resume") > 0
    assert any(b > 0 for b, _ in seen) and all(b <= room for b, room in seen)


def test_round_only_keeps_the_offloaded_meaning():
    assert instance_config("round-only").park_kv is False
    assert all(instance_config(n).park_kv for n in ("talaria", "no-sp", "no-hkvr", "h2d-only"))


def test_schedule_bound_is_below_every_session():
    r = _run()
    run, bound = session_scts(r), schedule_bound_scts(r)
    assert run and set(run) == set(bound)
    assert all(bound[s] <= run[s] + 1e-9 for s in run)
    assert sum(bound.values()) < sum(run.values())  # the transfers it removes are real
