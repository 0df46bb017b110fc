"""AgentCore: the records both executors publish, driven here on a fake clock."""

from types import SimpleNamespace

import pytest

from talaria.services.instance_agent.agent_core import AgentCore
from talaria.services.instance_agent.scheduler import Decode, Idle, Prefill, SchedulerConfig, SwitchModel
from talaria.services.instance_agent.scheduler.costs import decode_steps_s, first_step_reaching
from sched_driver import COSTS

MEMORY = SimpleNamespace(kv_capacity_tokens=1000, kv_used_tokens=0, staging_free_bytes=0, hbm_bytes=1,
                         hbm_used_bytes=0, prefill_tok_s=1.0, decode_tok_s=1.0, restore_tok_s=1.0)


def core(**config) -> AgentCore:
    return AgentCore("inst-0", SchedulerConfig(**config), ["a", "b"], COSTS)


def accept(c: AgentCore, call_id: str, model: str = "a", *, at: float = 0.0, index: int = 0, max_tokens: int = 3):
    return c.accept(call_id, f"s-{call_id}", model, call_index=index, prompt_tokens=100, max_tokens=max_tokens,
                    submitted_at=at, kv_state="none", reusable_tokens=0, now=at)


def snapshot(c: AgentCore, now: float):
    return c.snapshot(1, now, pool="cold", active_model=None, models=[], sessions=[], memory=MEMORY, heartbeat_s=1.0)


def test_a_call_timeline_becomes_one_completion_record():
    c = core()
    accept(c, "c1", at=0.0)
    switch = c.next_action(0.5)
    assert isinstance(switch, SwitchModel) and switch.to_model == "a"
    out = c.switch_done(switch, 1.5, 1.0, path="d2d", phases={"d2d": 1.0})
    assert out.switch.to_model == "a" and out.switch.total_s == 1.0 and out.switch.at == 1.5
    prefill = c.next_action(1.5)
    assert isinstance(prefill, Prefill)
    out = c.prefill_done(prefill, 2.0)
    now, finished = 2.0, []
    while not finished:
        decode = c.next_action(now)
        assert isinstance(decode, Decode)
        now += 0.01
        finished = c.decode_done(decode, now).finished
    assert finished == ["c1"]
    done = c.completed("c1", now, prompt_tokens=100, output_tokens=3, finish_reason="length", prefill_s=0.5,
                       trace_id="t")
    assert done.started_at == 1.5 and done.first_token_at == 2.0 and done.completed_at == now
    assert done.queue_s == 1.5 and done.ttft_s == 2.0  # from the caller's submission
    assert done.slot_wait_s == 1.5 and done.model_opened  # its slot began with the switch to its model
    assert done.kv_tokens == 103 and done.instance_id == "inst-0" and done.trace_id == "t"
    c.end("c1")
    assert "c1" not in c.calls  # a core that keeps no ended calls (the simulator's) forgets it


def test_rounds_become_round_summaries_and_aborted_calls_are_not_completed():
    c = core(initial_model="a")
    accept(c, "c1", max_tokens=1)
    accept(c, "c2", max_tokens=1)
    prefill = c.next_action(0.0)
    out = c.abort("c2", 0.1)
    assert out.finished == [] and c.calls.holding("c2") is None
    out = c.prefill_done(prefill, 0.2)
    assert out.finished == ["c1"]  # the aborted call is not reported as finished
    assert isinstance(c.next_action(0.2), Idle)
    rounds = c.drain(0.2).rounds
    assert len(rounds) == 1 and rounds[0].instance_id == "inst-0" and rounds[0].slots == ["a"]


def test_snapshot_counts_a_call_under_prefill_as_running():
    # The simulator once dropped such calls from both counts (the router saw an idle instance).
    c = core(initial_model="a")
    accept(c, "c1")
    snap = snapshot(c, 0.0)
    assert snap.queued == {"a": 1, "b": 0} and snap.queued_tokens == 100 and snap.running == 0
    prefill = c.next_action(0.0)
    snap = snapshot(c, 0.0)
    assert isinstance(prefill, Prefill) and snap.running == 1 and snap.queued == {"a": 0, "b": 0}
    assert snap.queued_tokens == 0


def test_snapshot_reports_deadline_risk_as_soon_as_the_scheduler_counts_it():
    # A P that cannot fit its prefill budget raises risk when the action is chosen; the
    # simulator used to report it only after the action completed.
    c = AgentCore("i", SchedulerConfig(initial_model="a", ttft_target_s=0.01), ["a", "b"], COSTS)
    for k in range(3):
        c.accept(f"c{k}", f"s{k}", "a", call_index=0, prompt_tokens=90_000, max_tokens=2, submitted_at=0.0,
                 kv_state="none", reusable_tokens=0, now=0.0)
    assert isinstance(c.next_action(0.0), Prefill)
    assert c.sched.deadline_risk > 0 and snapshot(c, 0.0).deadline_risk == c.sched.deadline_risk


@pytest.mark.parametrize("target", [0.0, 0.004, 0.01, 0.0100000001, 0.035, 0.5, 9.0])
def test_first_step_reaching_is_the_fewest_steps_that_reach_the_target(target):
    def step_s(batch, ctx):
        return 0.01 + 1e-6 * ctx
    duration = lambda j: decode_steps_s(step_s, 2, 1000, j)  # noqa: E731
    brute = next((j for j in range(1, 51) if duration(j) >= target - 1e-9), 50)
    assert first_step_reaching(duration, target, 50) == brute


def test_a_failed_action_ends_so_the_core_can_choose_again():
    # Issue 15: an engine step that raised left its action in flight, so every later
    # next_action raised SchedulerBusyError and the agent's work loop died.
    c = core()
    accept(c, "c1", "a")
    switch = c.next_action(0.0)
    assert isinstance(switch, SwitchModel)
    c.action_failed(switch, 0.1)  # e.g. the engine still held a call: the switch is chosen afresh
    assert c.next_action(0.2) == switch
    c.switch_done(switch, 0.3, 0.1, path="d2d")
    prefill = c.next_action(0.3)
    assert isinstance(prefill, Prefill)
    c.abort("c1", 0.4)  # the executor failed the prefill's call
    c.action_failed(prefill, 0.4)
    assert isinstance(c.next_action(0.5), Idle)
    accept(c, "c2", "b", at=0.6)  # and it keeps serving
    assert isinstance(c.next_action(0.6), SwitchModel)


def test_a_failed_switch_whose_calls_were_failed_is_not_tried_again():
    c = core()
    accept(c, "c1", "b")
    switch = c.next_action(0.0)
    c.abort("c1", 0.1)  # the executor failed the calls waiting for model b
    c.action_failed(switch, 0.1)
    assert isinstance(c.next_action(0.2), Idle)


def test_a_call_has_one_record_the_scheduler_state_is_part_of_it():
    """The agent's table is the scheduler's: what the scheduler does to a call (admitted,
    tokens done) is read from the call's record, with no second table or copy to sync."""
    c = core()
    accept(c, "c1")
    record = c.calls["c1"]
    assert c.sched.calls is c.calls and c.calls.holding("c1") is record and record.prompt_tokens == 100
    assert list(c.calls.queued["a"]) == [record]
    c.switch_done(c.next_action(0.5), 1.5, 1.0, path="d2d")
    c.prefill_done(c.next_action(1.5), 2.0)
    assert (record.via, record.generated, record.started_at) == ("P", 1, 1.5)


def test_the_snapshot_reports_the_slopes_prior_until_the_fit_is_established_and_the_prices_overstatement():
    from talaria.shared.prefill_cost import prefill_s
    mem = SimpleNamespace(**{**vars(MEMORY), "prefill_tok_s": 1000.0})  # the engine: 1 ms a token
    c = AgentCore("i", SchedulerConfig(), ["a", "b"], COSTS, attention_ratios={"a": 1e-3})

    def snap():
        return c.snapshot(1, 0.0, pool="cold", active_model="a", models=[], sessions=[], memory=mem, heartbeat_s=1.0)
    # nothing measured: the architecture's ratio on the engine's rate, not measured
    assert (snap().prefill_ctx_s_per_tok2, snap().prefill_ctx_measured) == (pytest.approx(1e-6), False)
    c.prefill_probed("a", [(256, 3072, 0.09), (256, 0, 0.0128), (256, 0, 0.013)])
    assert snap().prefill_ctx_s_per_tok2 == pytest.approx(1e-3 * 0.0128 / 256)  # on the probe's rate
    assert snap().prefill_overstatement == 0.0  # no chunked prefill ran: the router's MARGIN
    for c_ in range(0, 16_384, 1024):  # chunks over 16K of context: the fit is established
        c.sched.curve.observe("a", 1024, c_, prefill_s(5e-5, 5e-8, 1024, c_) * (1.1 if c_ % 2048 else 0.9))
    assert snap().prefill_ctx_measured and snap().prefill_ctx_s_per_tok2 == pytest.approx(5e-8, rel=0.2)
    c.sched.curve.prefilled("a", 16_384, 0, 10.0)
    b = snap().prefill_ctx_s_per_tok2  # priced on the probe's linear rate, not the engine's 1 ms
    assert snap().prefill_overstatement == pytest.approx(prefill_s(0.0128 / 256, b, 16_384, 0) / 10.0)
