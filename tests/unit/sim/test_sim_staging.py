"""The simulator stages weights through the agent's own StagingPlanner."""

from talaria.services.instance_agent.memory.staging_plan import StagingPlanner
from talaria.sim.instance import STAGE_CHUNK_BYTES, InstanceFlags, SimInstance
from talaria.sim.profiles import PAPER_TP8


class _Sink:
    def first_token(self, job, t):
        return []

    def completed(self, job, t):
        return []


def test_staged_bytes_grow_with_time_and_kv_growth_dirties_them():
    inst = SimInstance("i0", PAPER_TP8, InstanceFlags(), _Sink())
    assert isinstance(inst.planner, StagingPlanner)
    inst.active, inst.stage_target, inst.stage_start = "qwen3-235b", "glm5-nvfp4", 0.0
    inst._last_peak_kv = 0
    early = inst._staged_bytes(0.2, "glm5-nvfp4")
    later = inst._staged_bytes(5.0, "glm5-nvfp4")
    assert 0 < early < later <= PAPER_TP8.model("glm5-nvfp4").weight_bytes
    assert early % STAGE_CHUNK_BYTES == 0  # whole chunks only
    inst._last_peak_kv = PAPER_TP8.kv_pool_bytes("qwen3-235b")  # KV grows over every slot
    assert inst._staged_bytes(5.0, "glm5-nvfp4") == 0
    assert inst.planner.dirty_events > 0
