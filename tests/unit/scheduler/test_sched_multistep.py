"""Multi-step decode: one `Decode(steps=k)` equals k single-step Decodes.

The simulator asks for `next_action(now, max_decode_steps=k)` to advance many tokens per
event; the live agent keeps the default (1). The scheduler cuts a multi-step Decode at
every boundary it would act on, and a driver that learns of a submission mid-action
stops at the next step boundary (`on_decode_done(..., steps=j)`), so the schedule — which
calls run when, and when each finishes — is the same as stepping one token at a time.
"""

from __future__ import annotations

import pytest

from sched_driver import Driver, make, ret, work
from talaria.services.instance_agent.scheduler import (
    CallAdmitted,
    CallFinished,
    Decode,
    LinearCosts,
    SchedulerConfig,
)

CTX_COSTS = LinearCosts(
    prefill_tok_s=100_000.0,
    restore_tok_s=1_000_000.0,
    decode_base_s=0.01,
    decode_ctx_s_per_tok=1e-7,  # context growth within a multi-step decode matters
    switch_staged_s=0.5,
    switch_host_s=1.0,
    kv_bytes_per_token=1,
)


def scenario(max_steps: int, **config) -> Driver:
    d = Driver(make(models=("a", "b", "c"), costs=CTX_COSTS, **config), max_steps=max_steps)
    d.submit(work("a1", "a", max_tokens=300, prompt=2000))
    d.submit(work("a2", "a", max_tokens=40))
    d.submit(work("b1", "b", max_tokens=250))
    d.submit(work("c1", "c", max_tokens=90))
    # returns (SP candidates) and new work arriving while decodes run
    d.at(0.7, ret("a-r1", "a", session="s-a2", max_tokens=60))
    d.at(1.3, work("b2", "b", max_tokens=30))
    d.at(2.05, ret("b-r1", "b", session="s-b1", kv="host", max_tokens=80))
    d.at(3.3, ret("a-r2", "a", session="s-a1", max_tokens=120))
    d.at(6.0, work("c2", "c", max_tokens=500))
    d.run()
    return d


def outcome(d: Driver):
    fin = {e.call_id: (e.at, e.tokens) for e in d.of(CallFinished)}
    adm = {e.call_id: (e.via, e.at) for e in d.of(CallAdmitted)}
    return fin, adm


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"drain_on_switch": False},
        {"drain_on_switch": False, "fill_slot": False},
        {"sp_max_batch": 1, "drain_on_switch": False},
        {"pool": "hot", "pinned_model": "a"},
    ],
)
def test_k_single_steps_equal_one_k_step(config):
    if config.get("pool") == "hot":
        def run(k):
            d = Driver(make(models=("a",), costs=CTX_COSTS, **config), max_steps=k)
            d.submit(work("a1", "a", max_tokens=300))
            d.at(0.5, work("a2", "a", max_tokens=50))
            d.at(1.01, ret("a3", "a", max_tokens=70))
            d.run()
            return d
    else:
        run = lambda k: scenario(k, **config)
    single, multi = run(1), run(64)
    (f1, a1), (fk, ak) = outcome(single), outcome(multi)
    assert f1.keys() == fk.keys()
    for cid in f1:
        assert fk[cid][1] == f1[cid][1], cid  # same token counts
        assert fk[cid][0] == pytest.approx(f1[cid][0], abs=1e-6), cid  # same finish times
    assert {c: v[0] for c, v in a1.items()} == {c: v[0] for c, v in ak.items()}  # same P/SP
    assert single.sched.sp_admitted == multi.sched.sp_admitted
    assert single.sched.sp_parked == multi.sched.sp_parked
    # and it is actually fewer actions
    assert len(multi.trace) < len(single.trace) / 2


def test_decode_steps_stop_at_the_first_call_to_finish():
    d = Driver(make(models=("a",), initial_model="a"), max_steps=1000)
    d.submit(work("a1", "a", max_tokens=10))
    d.submit(work("a2", "a", max_tokens=25))
    d.run()
    decodes = [a for a in d.actions if isinstance(a, Decode)]
    assert [a.steps for a in decodes] == [9, 15]  # a1: 1 token from P + 9; a2: 24 - 9


def test_default_is_one_step_and_short_reports_are_checked():
    s = make(models=("a",), initial_model="a")
    s.submit(work("a1", "a", max_tokens=10), 0.0)
    p = s.next_action(0.0)
    s.on_prefill_done(p, 0.01)
    assert s.next_action(0.01) == Decode(("a1",), "a", 1)
    s.on_decode_done(Decode(("a1",), "a", 1), 0.02)
    a = s.next_action(0.02, max_decode_steps=5)
    assert a.steps == 5
    with pytest.raises(ValueError):
        s.on_decode_done(a, 0.03, steps=6)
    s.on_decode_done(a, 0.03, steps=2)  # stopped early: two tokens counted
    assert s.generated("a1") == 4
    with pytest.raises(ValueError):
        s.next_action(0.03, max_decode_steps=0)
