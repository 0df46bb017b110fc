"""The fourth KV tier (issue 40, services/router/costs.py): a return whose pages another
instance holds is priced setup + bytes / link rate + restore, and migrated only where that is
cheaper than recompute; the router's CallRouted names the holder to pull from."""

from __future__ import annotations

import msgspec
import pytest
from router_support import PAPER_EQ1, call, core, done, one, snap

from talaria.services.router.costs import CostModel
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.state import RouterState, SessionEntry, SnapshotReceived
from talaria.shared.events import CallRouted
from talaria.shared.snapshots import ModelResidency

BPT = 1000  # KV bytes per token of m1 in these tests
CFG = PolicyConfig(**PAPER_EQ1)


def with_bpt(s, bpt: int = BPT, **fields):
    models = [msgspec.structs.replace(m, kv_bytes_per_token=bpt) for m in s.models]
    return msgspec.structs.replace(s, models=models, **fields)


def two(holder_tokens: int = 10_000, bpt: int = BPT, **dest):
    """h holds s1's pages on host; d does not; both run m1 at 10K tokens/s prefill."""
    h = with_bpt(snap("h", sessions=[("s1", "m1", "host", holder_tokens)]), bpt)
    d = with_bpt(snap("d"), bpt, **dest)
    state = RouterState()
    for s in (h, d):
        state.apply(SnapshotReceived(s, 0.0))
    return state


def price_d(state, cfg=CFG, tokens=10_500):
    entry = SessionEntry("s1", model="m1", last_instance="h", kv_tokens=10_000, calls=1, last_used=-1.0)
    return CostModel(cfg).price(state, state.instances["d"], call("c", tokens=tokens), entry, 0.0).cost


def test_a_return_away_from_its_pages_migrates_at_setup_plus_bytes_over_the_link_plus_restore():
    c = price_d(two(migrate_bytes_s=1e9, migrate_setup_s=0.01))
    # 10K tokens x 1000 B / 1 GB/s = 10 ms, + 10 ms setup, + restore 10K / 100K tok/s = 100 ms
    assert (c.kv_state, c.kv_from) == ("migrated", "h")
    assert c.kv_recovery_s == pytest.approx(0.01 + 0.01 + 0.1)
    assert c.prefill_s == pytest.approx(500 / 10_000)  # the suffix only, never the prefix again


def test_without_a_measured_link_the_defaults_price_it():
    c = price_d(two())
    want = CFG.default_migrate_setup_s + 10_000 * BPT / CFG.default_migrate_bytes_s + 0.1
    assert (c.kv_state, c.kv_recovery_s) == ("migrated", pytest.approx(want))


def test_migration_is_chosen_only_where_cheaper_than_recompute():
    # a slow link: 10 MB over 1 MB/s = 10 s, recompute 10K tokens at 10K tok/s = 1 s
    c = price_d(two(migrate_bytes_s=1e6, migrate_setup_s=0.0))
    assert (c.kv_state, c.kv_from, c.kv_recovery_s) == ("recompute", "", pytest.approx(1.0))


def test_a_holder_with_fewer_pages_migrates_what_it_has_and_recomputes_the_tail():
    c = price_d(two(holder_tokens=6_000, migrate_bytes_s=1e9, migrate_setup_s=0.0))
    assert c.kv_state == "migrated"
    assert c.kv_recovery_s == pytest.approx(6_000 * BPT / 1e9 + 6_000 / 100_000 + 4_000 / 10_000)


def test_off_unknown_bytes_or_a_stale_holder_mean_recompute():
    assert price_d(two(), cfg=PolicyConfig(**PAPER_EQ1, migrate=False)).kv_state == "recompute"
    assert price_d(two(bpt=0)).kv_state == "recompute"  # bytes cannot be priced
    stale = two()
    stale.instances["h"].received_at = -CFG.stale_after_s - 1.0
    assert price_d(stale).kv_state == "recompute"


def test_the_holder_itself_is_priced_as_its_own_tier_not_a_migration():
    state = two()
    entry = SessionEntry("s1", model="m1", last_instance="h", kv_tokens=10_000, calls=1, last_used=-1.0)
    c = CostModel(CFG).price(state, state.instances["h"], call("c", tokens=10_500), entry, 0.0).cost
    assert (c.kv_state, c.kv_from) == ("host", "")


def test_the_routed_call_names_the_holder_when_the_return_lands_elsewhere():
    # h is pinned to another model (the return must move), d is free: the CallRouted pulls from h
    r = core()
    h = with_bpt(snap("h", pool="hot", active="m2", models={"m2": "active", "m1": "absent"},
                      sessions=[("s1", "m1", "host", 10_000)]))
    r.handle(SnapshotReceived(with_bpt(snap("d")), 0.0), 0.0)
    r.handle(SnapshotReceived(h, 0.0), 0.0)
    r.state.sessions["s1"] = SessionEntry("s1", model="m1", last_instance="h", kv_tokens=10_000, calls=1, last_used=-1.0)
    routed = one(r.handle(call("c", tokens=10_500), 0.1), CallRouted)
    assert (routed.instance_id, routed.kv_from) == ("d", "h")
