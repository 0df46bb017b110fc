"""The runner's handling of scheduler notes that are only logged (issue 15: logging
CallParked/DeadlineRisk raised a TypeError, so the events with them were dropped: a
finished call's completion was never published and the agent hung)."""

from types import SimpleNamespace

import structlog

from talaria.services.instance_agent.engine.contract import Capabilities

from talaria.services.instance_agent.core import Outcome
from talaria.services.instance_agent.runner import CallRunner
from talaria.services.instance_agent.scheduler import CallParked, DeadlineRisk
from talaria.shared.settings import Settings


async def test_parked_and_risk_notes_are_logged_and_completions_still_published(tmp_path):
    settings = Settings(data_dir=tmp_path, instance_id="agent-t", models=("qwen3-tiny",))
    # These outcomes touch no engine, NATS or tracer: the engine stand-in only states capabilities.
    engine = SimpleNamespace(capabilities=Capabilities(switch_with_calls_running=False, host_kv=True,
                                                       d2d_staging=True, chunked_prefill=True))
    runner = CallRunner(settings, engine, None, None, None, None, structlog.get_logger())
    completed = []

    async def record_completion(call_ids):  # stands in for publishing over NATS
        completed.extend(call_ids)

    runner._complete = record_completion
    await runner._events(Outcome(finished=["c2"], notes=[
        CallParked("c1", "qwen3-tiny", "sp_budget", 1.0),
        DeadlineRisk("qwen3-tiny", "capacity", 2.0, 1.0, calls=1, at=1.0)]))
    assert completed == ["c2"]
