"""Paper §5 ablations: each flag changes ordering and timing, never what a call computes."""

from __future__ import annotations

import random

import pytest

from talaria.services import configs

from sched_driver import Driver, make, ret, work
from talaria.services.instance_agent.scheduler import (
    ABLATIONS,
    CallAdmitted,
    CallFinished,
    RoundEnded,
    SchedulerConfig,
    SwitchModel,
)

MID_SLOT = 1.05


def scenario(**config):
    d = Driver(make(models=("a", "b"), **config))
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("b1", "b", max_tokens=200))
    return d


def admitted(d, call_id):
    return next(e for e in d.of(CallAdmitted) if e.call_id == call_id)


def test_sp_off_sends_returns_to_the_next_slot_p():
    on, off = scenario(), scenario(sp=False)
    for d in (on, off):
        d.at(MID_SLOT, ret("r1", "a"))
        d.run()
    assert admitted(on, "r1").via == "SP"
    assert admitted(off, "r1").via == "P"
    assert not [t for t in off.trace if t.startswith("SP:")]
    assert off.trace.index("P:a:r1") > off.trace.index("S:b")
    assert admitted(off, "r1").slot_wait_s > admitted(on, "r1").slot_wait_s
    assert off.sched.sp_parked == 0 and off.sched.sp_admitted == 0


def test_hkvr_off_treats_host_kv_as_missing():
    on, off = scenario(), scenario(hkvr=False)
    for d in (on, off):
        d.at(MID_SLOT, ret("r1", "a", kv="host"))
        d.run()
    assert admitted(on, "r1").via == "SP" and admitted(on, "r1").kv_state == "host"
    assert admitted(off, "r1").via == "P" and admitted(off, "r1").kv_state == "none"
    # ... and charges a full recompute for it
    def returning():  # a record each: a record keeps its price once computed
        return ret("x", "a", kv="host", prompt=10_000, reuse=9_000)

    assert make(hkvr=False).pricing.cost(returning()) > make().pricing.cost(returning())


def test_hkvr_off_still_uses_device_kv():
    d = scenario(hkvr=False)
    d.at(MID_SLOT, ret("r1", "a", kv="device"))
    d.run()
    assert admitted(d, "r1").via == "SP"


def test_staging_off_asks_for_host_only_switches_and_prices_them():
    staged, host = scenario(), scenario(staging=False)
    for d in (staged, host):
        d.run()
    assert all(a.staged for a in _switches(staged)) and not any(a.staged for a in _switches(host))
    assert host.of(RoundEnded)[0].switch_s == 2 * staged.of(RoundEnded)[0].switch_s


def test_round_only_turns_all_three_off():
    config = configs.get("talaria-round-only").scheduler
    assert (config.sp, config.hkvr, config.staging) == (False, False, False)
    assert configs.get(configs.ablation_name("no-sp"), gamma=0.5).scheduler.gamma == 0.5
    with pytest.raises(configs.ConfigurationError):
        configs.ablation_name("nope")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_output_does_not_depend_on_the_ablation(seed):
    outcomes = {}
    for name in ABLATIONS:
        d = Driver(make(models=("a", "b", "c"), sp_max_batch=2, **ABLATIONS[name]))
        rng = random.Random(seed)
        for i in range(30):
            kind = rng.choice(["new", "device", "host", "none"])
            model = rng.choice("abc")
            max_tokens = rng.randint(1, 40)
            if kind == "new":
                w = work(f"c{i}", model, max_tokens=max_tokens, at=0.0)
            else:
                w = ret(f"c{i}", model, kv=kind, reuse=0 if kind == "none" else 900, max_tokens=max_tokens)
            d.at(rng.uniform(0, 6), w)
            if rng.random() < 0.3:
                d.eos[f"c{i}"] = rng.randint(1, max_tokens)
        d.run()
        outcomes[name] = sorted((e.call_id, e.tokens) for e in d.of(CallFinished))
    reference = outcomes["talaria"]
    assert len(reference) == 30
    assert all(v == reference for v in outcomes.values())


def _switches(d):
    return [a for a in d.actions if isinstance(a, SwitchModel)]
