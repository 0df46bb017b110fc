"""The runner's handling of scheduler events that are only logged (issue 15: logging
CallParked/DeadlineRisk raised a TypeError that dropped the events after them, so a
finished call's completion was never published and the agent hung)."""

import structlog

from talaria.services.instance_agent.runner import CallRunner
from talaria.services.instance_agent.scheduler import CallFinished, CallParked, DeadlineRisk
from talaria.shared.settings import Settings


async def test_parked_and_risk_events_are_logged_and_the_events_after_them_still_handled(tmp_path):
    settings = Settings(data_dir=tmp_path, instance_id="agent-t", models=("qwen3-tiny",))
    # No engine, NATS or tracer: these events touch none of them.
    runner = CallRunner(settings, None, None, None, None, None, structlog.get_logger())
    completed = []

    async def record_completion(call_id):  # stands in for publishing over NATS
        completed.append(call_id)

    runner._complete = record_completion
    await runner._events([CallParked("c1", "qwen3-tiny", "sp_budget", 1.0),
                          DeadlineRisk("qwen3-tiny", "capacity", 2.0, 1.0, calls=1, at=1.0),
                          CallFinished("c2", "qwen3-tiny", 3, "length", 1.0)])
    assert completed == ["c2"]
