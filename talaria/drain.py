"""`talaria drain INSTANCE`: take an instance out of service and wait until it is drained.

The admin NATS user (stack.json's `nats_admin`) asks the routers (`<deployment>.admin.drain`,
router_service.py); every router stops placing calls there at once, and the command asks
again every `every_s` until a router says nothing runs, is queued or was placed there and
no session's KV is left to move: each ask pushes the sessions living there to the instance
their next call would land on (services/router/drain_push.py, docs/migration.md). Stop the
agent after this returns 0 (3: drained, but some sessions' context was lost; it says why).
"""

from __future__ import annotations

import asyncio
import time

import nats
import nats.errors

from talaria.shared.bus import servers
from talaria.shared.messages import DRAIN_STATUS_DECODER, DrainRequest
from talaria.shared.nats_auth import ADMIN_INBOX, SENDER_HEADER, sender_name
from talaria.shared.subjects import Deployment
from talaria.shared.wire import encode


async def drain(nats_url: str, instance_id: str, *, timeout_s: float, every_s: float = 0.5,
                deployment: Deployment = Deployment()) -> tuple[int, str]:
    """(exit status, one line): 0 drained, 1 not drained in `timeout_s`, 2 refused or unreachable,
    3 drained but some session's KV could not be moved (the line says how many and why)."""
    try:
        nc = await nats.connect(servers(nats_url), name=sender_name("admin"), inbox_prefix=ADMIN_INBOX,
                                connect_timeout=5, max_reconnect_attempts=2)
    except Exception as exc:  # noqa: BLE001 - any connect failure is one line for the operator
        return 2, f"cannot reach NATS: {exc}"
    deadline = time.monotonic() + timeout_s
    request = encode(DrainRequest(instance_id))
    headers = {SENDER_HEADER: sender_name("admin")}
    last = "no router answered"
    try:
        while True:
            try:
                reply = await nc.request(deployment.admin_drain, request, timeout=max(0.5, every_s * 4),
                                         headers=headers)
                status = DRAIN_STATUS_DECODER.decode(reply.data)
                if status.error:
                    return 2, status.error
                if status.drained and status.lost:
                    return 3, (f"{instance_id} drained, but {status.lost} session(s) lost their KV context "
                               f"(their next call recomputes what did not arrive; {status.moved} moved): {status.why_lost}")
                if status.drained:
                    return 0, (f"{instance_id} drained: no call runs or waits there, {status.moved} session(s)' KV "
                               "moved off it, none will be placed there")
                last = (f"{status.calls} call(s) running or queued and {status.sessions} session(s)' KV still to "
                        f"move off {instance_id} ({status.moved} moved, {status.lost} lost)")
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                last = "no router answered"
            if time.monotonic() >= deadline:
                return 1, f"{instance_id} not drained after {timeout_s:g} s: {last}"
            await asyncio.sleep(every_s)  # polling another process's state (deadline-bounded)
    finally:
        await nc.close()
