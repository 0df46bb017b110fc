"""KV migration in the simulator (issue 40): a return routed away from its pages pulls them
from their holder at the profile's link price, the same pricing the router uses; pages the
holder no longer has, or the `no-migrate` ablation, mean recompute, as before."""

from dataclasses import replace

import pytest

from talaria.sim.cluster import simulate
from talaria.sim.executor import Job, SimExecutor, instance_config
from talaria.sim.matrix import cells, run_config
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PAPER_TP8

MODEL = "qwen3-235b"


class _Sink:
    def completed(self, job, done, now):
        return []


def _pair(**sched):
    cfg = instance_config("talaria", **sched)
    a, b = (SimExecutor(i, PAPER_TP8, replace(cfg, initial_model=MODEL), _Sink()) for i in ("a", "b"))
    a.peers = b.peers = {"a": a, "b": b}
    a.kv.put_host(MODEL, "s1", 20_480)  # a holds s1's context (page-aligned) in its host registry
    return a, b


def _return(kv_from="a"):
    return Job("s1#1", "s1", MODEL, 1, prompt=21_000, reusable=20_480, output=10, release_t=0.0, kv_from=kv_from)


def test_a_return_away_from_its_pages_pulls_them_at_setup_plus_bytes_over_the_link_plus_restore():
    _, b = _pair()
    seconds, source, avail = b._prefill_cost(_return())
    assert (source, avail) == ("migrated", 20_480)
    bpt = PAPER_TP8.model(MODEL).kv_bytes_per_token
    pull = PAPER_TP8.link_setup_s + 20_480 * bpt / PAPER_TP8.link_bytes_s + PAPER_TP8.restore_s(MODEL, 20_480)
    assert seconds == pytest.approx(PAPER_TP8.model(MODEL).prefill_s(520, 20_480) + pull)
    assert seconds < PAPER_TP8.model(MODEL).prefill_s(21_000, 0)  # far below recompute


def test_pages_gone_from_the_holder_or_the_ablation_mean_recompute():
    a, b = _pair()
    a.kv = type(a.kv)(PAPER_TP8)  # the holder lost them (evicted, restarted)
    assert b._prefill_cost(_return())[1] == "recompute"
    _, b = _pair(migrate=False)
    assert b._prefill_cost(_return())[1] == "recompute"
    _, b = _pair()
    assert b._prefill_cost(_return(kv_from=""))[1] == "recompute"  # the router priced no pull


def test_moved_returns_migrate_instead_of_recomputing_in_a_matrix_cell():
    cell = next(c for c in cells(0) if c.name == "instances=16@60%")
    kv = {}
    for policy in ("talaria", "talaria-no-migrate"):
        run, _, sessions, _ = run_config(cell, policy)
        kv[policy] = summarise(simulate(sessions, run))["kv_sources"]
    assert kv["talaria-no-migrate"].get("recompute", 0) > 0 and "migrated" not in kv["talaria-no-migrate"]
    assert kv["talaria"].get("migrated", 0) > 0 and kv["talaria"].get("recompute", 0) == 0
