"""The runner's handling of scheduler notes that are only logged (issue 15: logging
CallParked/DeadlineRisk raised a TypeError, so the events with them were dropped: a
finished call's completion was never published and the agent hung)."""

from talaria.services.instance_agent.agent_core import StepReport
from talaria.services.instance_agent.scheduler import CallParked, DeadlineRisk, Idle
from tests.unit.agent.test_agent_reply_order import runner as bare_runner


async def test_parked_and_risk_notes_are_logged_and_completions_still_published(tmp_path):
    runner = bare_runner(tmp_path)
    completed = []

    async def record_completion(call_id):  # stands in for publishing over NATS
        completed.append(call_id)

    runner.closer.complete = record_completion
    await runner.closer.events(StepReport(finished=["c2"], notes=[
        CallParked("c1", "qwen3-tiny", "sp_budget", 1.0),
        DeadlineRisk("qwen3-tiny", "capacity", 2.0, 1.0, calls=1, at=1.0)]))
    assert completed == ["c2"]


async def test_a_completion_that_fails_does_not_strand_the_calls_finished_with_it(tmp_path):
    # Issue 15: one call's completion raising left the other calls finished in the same step
    # uncompleted and held by the engine ("cannot switch model: 1 call(s) still running").
    runner = bare_runner(tmp_path)
    completed = []

    async def complete(call_id):
        if call_id == "bad":
            raise KeyError(call_id)
        completed.append(call_id)

    runner.closer.complete = complete
    await runner.closer.events(StepReport(finished=["bad", "c2", "c3"]))
    assert completed == ["c2", "c3"]


async def test_a_failure_outside_an_action_in_flight_is_survived(tmp_path):
    # The work loop hands every failure to the steps' `failed`; one while idle (e.g. publishing a
    # drained event with NATS down) has no action in flight to end, and must not raise.
    runner = bare_runner(tmp_path)
    outcome = await runner.steps.failed(Idle(None), TimeoutError("nats: timeout"))
    assert outcome.finished == []
