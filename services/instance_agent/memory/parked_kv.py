"""Device KV of switched-out models' running calls, kept as a cache. Pure: no tensors, no clock.

With resumable switches (`SchedulerConfig.drain_on_switch=False`, paper §3.4) a model is
switched away from with calls still running; their KV must survive until the model's next
slot. Offloading it (the paper's parked pool) puts a D2H copy behind the switch and an H2D
restore, at the KV restore rate, on the critical path of the switch that reopens the model.
Keeping it on device costs two D2D copies instead (out of the incoming weights' way; back
into the model's pool when it reopens). This planner keeps it on device while HBM has room
(how much, and what is offloaded first: `ParkedKv`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

Key = tuple[str, str]  # (model, session)


@dataclass(frozen=True)
class Unparked:
    """What reopening a model finds of its running calls' KV."""

    device: dict[str, int] = field(default_factory=dict)  # session -> bytes kept on device
    host: dict[str, int] = field(default_factory=dict)  # session -> bytes offloaded under pressure

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


def parking_room(pool_bytes: int, active_kv_bytes: int, staging_reserve_bytes: int) -> int:
    """HBM the parked region may use while a model with `pool_bytes` of KV pool is active."""
    return max(0, pool_bytes - active_kv_bytes - staging_reserve_bytes)


def staging_reserve(weight_bytes: Mapping[str, int], active: str, staging: bool) -> int:
    """The staging slots' share of the pool while `active` serves: the weights of the largest
    other model (any of them may be the rotation's next), none without staging."""
    return max((w for m, w in weight_bytes.items() if m != active), default=0) if staging else 0


class ParkedKv:
    """Parked running-call KV of models that are not active, oldest parked first.

        bump:  | weights(active) | active KV ->   ...free...   | parked KV | staging slots | runtime |

        room = KV pool of the active model - its own KV - the staging reserve (the weights the
               rotation may stage next, the largest other model's when staging is on)

    so the parked region uses only HBM that neither the active model's KV nor the staged next
    model needs: when the active KV grows into it, parked entries are offloaded oldest-parked
    first (`fit`), before any staged chunk is dirtied. An offloaded entry is restored from host
    when its model reopens (`unpark` returns it under `host`). Sizes are bytes.
    """

    def __init__(self) -> None:
        self._device: OrderedDict[Key, int] = OrderedDict()
        self._host: dict[Key, int] = {}
        self.bytes = 0  # on device now
        self.offloads = 0  # entries moved to host under pressure

    def park(self, model: str, sessions: Mapping[str, int], room: int) -> list[Key]:
        """The running calls of `model` (switched away from) keep their KV on device; then
        offload oldest-first until the parked region fits `room`. Returns what was offloaded."""
        for session, nbytes in sessions.items():
            key = (model, session)
            self.bytes -= self._device.pop(key, 0)
            self._host.pop(key, None)
            if nbytes > 0:
                self._device[key] = nbytes
                self.bytes += nbytes
        return self.fit(room)

    def fit(self, room: int) -> list[Key]:
        """Offload oldest-parked entries until the parked bytes are within `room`."""
        out: list[Key] = []
        while self.bytes > max(0, room) and self._device:
            key, nbytes = self._device.popitem(last=False)
            self.bytes -= nbytes
            self._host[key] = nbytes
            self.offloads += 1
            out.append(key)
        return out

    def unpark(self, model: str) -> Unparked:
        """`model` reopens: hand back its entries (device ones move back into its pool)."""
        device = {s: self._device.pop((m, s)) for (m, s) in list(self._device) if m == model}
        self.bytes -= sum(device.values())
        host = {s: self._host.pop((m, s)) for (m, s) in list(self._host) if m == model}
        return Unparked(device, host)

    def on_device(self, model: str, session: str) -> int:
        return self._device.get((model, session), 0)

    def __len__(self) -> int:
        return len(self._device)
