"""The driving loop from the package docstring, run as written against a fake engine."""

from __future__ import annotations

from talaria.services.instance_agent.scheduler import (
    AgentCall,
    CallFinished,
    Decode,
    Idle,
    LinearCosts,
    Prefill,
    RoundScheduler,
    SchedulerConfig,
    SwitchModel,
)


def test_docstring_loop_serves_two_models():
    t = [0.0]
    clock = lambda: t[0]
    costs = LinearCosts()
    published = []

    def run_switch(a):
        t[0] += 1.0
        return 1.0

    def run_prefill(a):
        t[0] += 0.01
        return set()

    def run_decode(a):
        t[0] += 0.02
        return {c for c in a.call_ids if c == "c2"}  # the engine hit EOS for c2

    sched = RoundScheduler(SchedulerConfig(), ["qwen", "glm"], costs)
    sched.submit(AgentCall("c1", "s1", "qwen", prompt_tokens=900, max_tokens=64), now=clock())
    sched.submit(AgentCall("c2", "s2", "glm", prompt_tokens=300, max_tokens=64), now=clock())
    for _ in range(1000):
        match sched.next_action(clock()):
            case SwitchModel() as a:
                took = run_switch(a)
                events = sched.on_switch_done(a, clock(), took)
            case Prefill() as a:
                eos = run_prefill(a)
                events = sched.on_prefill_done(a, clock(), eos)
            case Decode() as a:
                eos = run_decode(a)
                events = sched.on_decode_done(a, clock(), eos)
            case Idle():
                events = sched.drain_events()
                published += events
                break
        published += events
    done = {e.call_id: e for e in published if isinstance(e, CallFinished)}
    assert (done["c1"].tokens, done["c1"].reason) == (64, "length")
    assert (done["c2"].tokens, done["c2"].reason) == (2, "engine")
