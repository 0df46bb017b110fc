"""Memory substrate of an instance agent (paper §4.2-4.4).

    bump.py      one device buffer: weights low, runtime high, KV pool in the gap
    hkvr_core.py host KV registry bookkeeping, pure (no tensors, no clock): used by the simulator
    host_pages.py its records: page layout, rank reports and agreement, host pages, copy plans
    hkvr.py      host KV registry on tensors: host page pool, async D2H, H2D restore
    staging.py   D2D weight staging: pure chunk planner + the executor that copies chunks
    parked_kv.py running calls' KV of switched-out models kept on device while HBM has room, pure
"""
