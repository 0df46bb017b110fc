"""Parked running-call KV: kept on device within the room, offloaded oldest-parked first."""

from talaria.services.instance_agent.memory.parked_kv import ParkedKv, parking_room, staging_reserve


def test_room_is_what_neither_active_kv_nor_staging_needs():
    assert parking_room(1000, 300, 500) == 200
    assert parking_room(1000, 600, 500) == 0  # never negative
    weights = {"a": 400, "b": 300, "c": 200}
    assert staging_reserve(weights, "a", staging=True) == 300  # the largest other model
    assert staging_reserve(weights, "b", staging=True) == 400
    assert staging_reserve(weights, "a", staging=False) == 0


def test_kept_on_device_while_it_fits_and_handed_back_on_reopen():
    p = ParkedKv()
    assert p.park("a", {"s1": 40, "s2": 60}, room=100) == []
    assert p.bytes == 100 and p.on_device("a", "s1") == 40
    back = p.unpark("a")
    assert back.device == {"s1": 40, "s2": 60} and back.host == {}
    assert p.bytes == 0 and len(p) == 0 and p.unpark("a").device == {}


def test_pressure_offloads_oldest_parked_first_and_reopen_restores_them_from_host():
    p = ParkedKv()
    p.park("a", {"s1": 40}, room=1000)
    p.park("b", {"s2": 50}, room=1000)
    p.park("c", {"s3": 30}, room=1000)
    assert p.fit(50) == [("a", "s1"), ("b", "s2")]  # 120 -> 30: the two oldest go
    assert p.bytes == 30 and p.offloads == 2
    assert p.unpark("a").host == {"s1": 40}
    b = p.unpark("b")
    assert b.device == {} and b.host == {"s2": 50}
    assert p.unpark("c").device == {"s3": 30}


def test_park_over_room_offloads_at_once_and_reparking_replaces_an_entry():
    p = ParkedKv()
    assert p.park("a", {"s1": 80, "s2": 80}, room=100) == [("a", "s1")]
    assert p.park("a", {"s1": 10}, room=100) == []  # back on device (parked anew), host copy gone
    assert p.bytes == 90
    back = p.unpark("a")
    assert back.device == {"s2": 80, "s1": 10} and back.host == {}
