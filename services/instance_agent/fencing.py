"""Fencing at the agent: a dispatch is run only if its router's claim on the session's
partition has not been superseded (services/router/ownership.py: `superseded_by`). A router
stalled past its claim's TTL (SIGSTOP, a long GC pause) may still publish dispatches when it
resumes; their partition's new owner has already placed those calls, so running them would
run them twice. The current claim is read from the ownership bucket per new fenced call;
a refusal is a `DispatchRefused` event (the audit's refused_dispatches)."""

from __future__ import annotations

import time

from talaria.services.router.claims import ClaimStore
from talaria.services.router.ownership import superseded_by
from talaria.shared.bus import BUS_ERRORS, emit
from talaria.shared.events import CallRouted, DispatchRefused


class DispatchFencing:
    def __init__(self, js, bucket: str, instance_id: str, log) -> None:
        self.js, self.bucket, self.instance_id, self.log = js, bucket, instance_id, log
        self.claims: ClaimStore | None = None

    async def refused(self, routed: CallRouted) -> bool:
        """Whether `routed` must not run here (its refusal is then published)."""
        fence = routed.fence
        if fence is None:
            return False
        try:
            if self.claims is None:
                self.claims = ClaimStore(await self.js.key_value(self.bucket), ttl_s=0.0)
            claim = await self.claims.claim(fence.partition)
        except BUS_ERRORS as exc:  # the bucket unreachable: refusing would lose the call, running risks a rerun
            self.log.warning("partition claim unreadable; dispatch run unfenced", call_id=routed.call.call_id,
                             partition=fence.partition, error=str(exc))
            return False
        holder = superseded_by(fence, claim)
        if holder is None:
            return False
        call = routed.call
        self.log.warning("dispatch refused: its router's partition claim was superseded", call_id=call.call_id,
                         router_id=fence.router_id, partition=fence.partition, epoch=fence.epoch,
                         holder=holder.owner, holder_epoch=holder.revision)
        await emit(self.js, DispatchRefused(call.call_id, call.session_id, self.instance_id, fence, holder.owner,
                                            holder.revision, time.time()))
        return True
