"""Every submitted call finishes, whatever the arrivals, flags and budgets (no starvation)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sched_driver import Driver, make, work
from talaria.services.instance_agent.scheduler import CallAdmitted, CallFinished

MODELS = ("a", "b", "c")

arrival = st.tuples(
    st.floats(0.0, 8.0),  # arrival time
    st.sampled_from(MODELS),
    st.integers(1, 30_000),  # prompt tokens
    st.floats(0.0, 1.0),  # reusable fraction
    st.sampled_from(["device", "host", "none"]),
    st.booleans(),  # continuation
    st.integers(1, 60),  # max tokens
    st.one_of(st.none(), st.integers(1, 60)),  # engine EOS after this many tokens
)

config = st.fixed_dictionaries(
    {
        "sp": st.booleans(),
        "hkvr": st.booleans(),
        "staging": st.booleans(),
        "drain_on_switch": st.booleans(),
        "max_batch": st.integers(1, 8),
        "sp_max_batch": st.integers(1, 4),
        "ttft_target_s": st.sampled_from([0.5, 3.0, 10.0]),
        "tpot_target_s": st.sampled_from([0.005, 0.05, 0.2]),
        "kv_budget_bytes": st.sampled_from([None, 200_000]),
    }
)


def build(arrivals, pool, cfg, slowdown):
    extra = {"pool": "hot", "pinned_model": "a"} if pool == "hot" else {}
    d = Driver(make(models=MODELS, **cfg, **extra), slowdown=slowdown)
    expected = {}
    for i, (t, model, prompt, frac, kv, cont, max_tokens, eos) in enumerate(arrivals):
        if pool == "hot":
            model = "a"
        reuse = 0 if kv == "none" else int(prompt * frac)
        w = work(f"c{i}", model, session=f"s{i % 5}", prompt=prompt, reuse=reuse, kv=kv, max_tokens=max_tokens,
                 at=t, cont=cont)
        d.at(t, w)
        limit = max_tokens if eos is None else min(eos, max_tokens)
        if eos is not None:
            d.eos[w.call_id] = eos
        expected[w.call_id] = limit
    return d, expected


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=25),
    pool=st.sampled_from(["cold", "cold", "hot"]),
    cfg=config,
    slowdown=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_every_submitted_call_finishes_exactly_once(arrivals, pool, cfg, slowdown):
    d, expected = build(arrivals, pool, cfg, slowdown)
    d.run(max_steps=50_000)
    finished = d.of(CallFinished)
    assert sorted(e.call_id for e in finished) == sorted(expected)
    assert {e.call_id: e.tokens for e in finished} == expected
    assert not d.sched.calls.any_active()
    admitted = d.of(CallAdmitted)
    assert sorted(e.call_id for e in admitted) == sorted(expected)
    view = d.sched.snapshot(d.now)
    assert sum(view.queued.values()) == sum(view.running.values()) == 0
    if pool == "hot":
        assert not any(t.startswith("S:") for t in d.trace)
    if not cfg["sp"]:
        assert all(e.via != "SP" for e in admitted)


def test_steady_stream_of_returns_does_not_starve_a_new_session():
    d = Driver(make(models=("a",), initial_model="a", sp_max_batch=1))
    d.submit(work("long", "a", max_tokens=400))
    for k in range(200):
        d.at(0.01 * k, work(f"r{k}", "a", prompt=1000, reuse=900, kv="device", cont=True, max_tokens=3))
    d.at(0.05, work("new", "a", max_tokens=2))
    d.run()
    assert "new" in {e.call_id for e in d.of(CallFinished)}
    new = next(e for e in d.of(CallAdmitted) if e.call_id == "new")
    assert new.via == "P" and new.slot_wait_s < 1.0
