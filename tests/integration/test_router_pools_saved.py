"""The router's checkpoint in Postgres holds its hot pools: what a restarted router loads
(ProjectionStore.load) is the controller it saved, table order included (JSONB keeps none)."""

from __future__ import annotations

import pytest

from talaria.services.router.hot_pools import HotPools
from talaria.services.router.projection import ProjectionStore
from talaria.services.router.state import RouterState
from talaria.shared.db.connection import create_engine

pytestmark = pytest.mark.integration


async def test_the_saved_router_state_brings_its_hot_pools_back(database_url):
    state = RouterState(pools=HotPools.spare_cold(["zeta", "alpha", "mid"], ["b-model", "a-model"]))
    pools = state.pools
    for k, (model, inst) in enumerate([("b-model", "zeta"), ("a-model", "alpha"), ("b-model", "mid")] * 3):
        pools.routed(f"s{k}", model, inst, 1000 + k, float(k), f"c{k}")
        pools.completed(f"s{k}", model, 1000 + k, 10, 50, 0.1, 0.7, k + 0.5, f"c{k}")
    pools.pinned("mid", "b-model", 4.0)
    pools.expire(100.0, lambda m: 1.0)
    store = ProjectionStore(create_engine(database_url))
    try:
        await store.save_dict(42, state.to_dict())
        loaded, seq = await store.load()
    finally:
        await store.db.dispose()
    assert seq == 42 and loaded.pools.to_dict() == pools.to_dict()
    assert loaded.pools.decide(200.0, {}, {}) == pools.decide(200.0, {}, {})
