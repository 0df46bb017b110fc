"""The simulator stages weights through the agent's own StagingPlanner."""

from talaria.services.instance_agent.memory.staging_plan import StagingPlanner
from talaria.sim.memory import STAGE_CHUNK_BYTES, StagingState
from talaria.sim.profiles import PAPER_TP8


def test_staged_bytes_grow_with_time_and_kv_growth_dirties_them():
    staging = StagingState(PAPER_TP8)
    assert isinstance(staging.planner, StagingPlanner)
    staging.retarget("glm5-nvfp4", 0.0)
    early = staging.staged_bytes(0.2, "glm5-nvfp4", "qwen3-235b", 0)
    later = staging.staged_bytes(5.0, "glm5-nvfp4", "qwen3-235b", 0)
    assert 0 < early < later <= PAPER_TP8.model("glm5-nvfp4").weight_bytes
    assert early % STAGE_CHUNK_BYTES == 0  # whole chunks only
    full = PAPER_TP8.kv_pool_bytes("qwen3-235b")  # KV grows over every slot
    assert staging.staged_bytes(5.0, "glm5-nvfp4", "qwen3-235b", full) == 0
    assert staging.planner.dirty_events > 0
    assert staging.staged_bytes(5.0, "qwen3-235b", "glm5-nvfp4", 0) == 0  # not the staging target
