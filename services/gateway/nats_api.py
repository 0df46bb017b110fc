"""The agent-runtime API on NATS: request `talaria.api.call` with a CallRequest (JSON).

The reply is a CallResult or an ErrorReply (tagged by `"type"`). To stream, set
`call_id` and subscribe to `talaria.tokens.<call_id>` before sending the request.
"""

from __future__ import annotations

import asyncio
import uuid

from talaria.services.gateway.prepare import RequestError, prepare
from talaria.services.gateway.sessions import InvalidSessionId, check
from talaria.services.gateway.submitter import Submitter
from talaria.services.gateway.validation import decode
from talaria.shared import subjects
from talaria.shared.messages import CALL_REQUEST_DECODER, ErrorReply, encode


class NatsApi:
    def __init__(self, nc, submitter: Submitter, log) -> None:
        self.nc, self.submitter, self.log = nc, submitter, log
        self._tasks: set[asyncio.Task] = set()
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subjects.API_CALL, queue=subjects.API_QUEUE_GROUP, cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        for task in list(self._tasks):
            await task

    async def _on_msg(self, msg) -> None:
        # Each call runs as its own task: a slow call must not block the subscription.
        task = asyncio.create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, msg) -> None:
        if not msg.reply:
            self.log.warning("api call without reply subject dropped", subject=msg.subject)
            return
        try:
            req = decode(CALL_REQUEST_DECODER, msg.data)
            session_id = check(req.session_id) if req.session_id else f"anon-{uuid.uuid4().hex}"
            call = prepare(req, session_id, "nats")
        except InvalidSessionId as exc:
            reply = ErrorReply(400, "invalid_session_id", str(exc), param="session_id")
        except RequestError as exc:
            reply = exc.reply
        except Exception as exc:  # a bug, not the input's fault: still answer, never leave it waiting
            self.log.exception("api call could not be prepared")
            reply = ErrorReply(500, "internal_error", f"the gateway could not prepare this call: {exc}")
        else:
            reply = await self.submitter.submit(call)
        await self.nc.publish(msg.reply, encode(reply))
