"""A session's slot: the stable hash that spreads call intake over router partitions.

The gateway publishes a call's submission on `<deployment>.evt.call.submitted.<slot>`; a
router deployment groups the SLOTS slots into partitions (services/router/ownership.py), one
durable consumer each. SLOTS is part of the wire contract and never changes, so the gateway
needs no router setting: only the routers agree on how slots are grouped.
"""

from __future__ import annotations

import zlib

SLOTS = 64  # the most router partitions a deployment can have


def slot_of(session_id: str) -> int:
    """Stable across processes and hosts (Python's hash() is salted per process)."""
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % SLOTS
