"""What one client may hold of the gateway's HTTP server (issue 25): connections per client
address and overall, and how long it may take to send a request's header and body.

Without these, ~20,000 half-open connections (slowloris) exhausted the gateway's file
descriptors and locked every client out for ~40 s. Now:
- a connection over the limit of its address (`TALARIA_HTTP_MAX_CONNECTIONS_PER_ADDRESS`) or
  over the overall limit is answered `503` with `Retry-After` and closed before anything of it
  is parsed; the overall limit defaults to the process's file-descriptor limit less what the
  gateway itself needs (`default_max_connections`), so accept() never fails with EMFILE;
- a request's header must be complete within `TALARIA_HTTP_HEADER_TIMEOUT_S` of its first
  byte (of the connection, for the first request), else `408` and the connection is closed;
- a request's body must be read within `TALARIA_HTTP_BODY_TIMEOUT_S`, else `408`.

`ConnectionCounts` is the rule (pure); `GuardedRunner` fits it to aiohttp's server.
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

# Descriptors the gateway needs beside client sockets: NATS, the parser worker's pipes, log
# and trace files, the interpreter's own (counted on a running gateway: ~40), with room to spare.
RESERVED_FDS = 128


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft - RESERVED_FDS)


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = field(default_factory=default_max_connections)
    max_connections_per_address: int = 256

    @classmethod
    def from_settings(cls, settings) -> "HttpLimits":
        return cls(settings.http_header_timeout_s, settings.http_body_timeout_s,
                   settings.http_max_connections or default_max_connections(),
                   settings.http_max_connections_per_address)


@dataclass
class ConnectionCounts:
    """Open connections, per client address and in all. Pure: no sockets, no clock."""

    limits: HttpLimits
    per_address: Counter = field(default_factory=Counter)
    total: int = 0

    def admit(self, address: str) -> str | None:
        """Count a new connection from `address`; the reason it is refused (then not counted)."""
        if self.total >= self.limits.max_connections:
            return "the gateway has as many connections open as it can serve"
        if self.per_address[address] >= self.limits.max_connections_per_address:
            return "too many connections open from this address"
        self.per_address[address] += 1
        self.total += 1
        return None

    def release(self, address: str) -> None:
        self.total -= 1
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]


def _raw_response(status: str, code: str, reason: str, retry_after: int | None = None) -> bytes:
    """A whole response written straight to the socket (no request was parsed to answer)."""
    body = ('{"error": {"message": "%s", "type": "server_error", "code": "%s"}}' % (reason, code)).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if retry_after is not None:
        head += f"Retry-After: {retry_after}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


class GuardedHandler(RequestHandler):
    """aiohttp's connection protocol, counted and with a header deadline."""

    __slots__ = ("_counts", "_limits", "_address", "_counted", "_header_timer", "_seen", "_log")

    def __init__(self, manager, *, counts: ConnectionCounts, log, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._counts, self._limits, self._log = counts, counts.limits, log
        self._address, self._counted, self._header_timer, self._seen = "", False, None, 0

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self._address = peer[0] if peer else "unknown"
        refused = self._counts.admit(self._address)
        if refused is not None:
            transport.write(_raw_response("503 Service Unavailable", "too_many_connections", refused,
                                          retry_after=1))
            transport.close()
            return  # never registered with the server: nothing of it is parsed or handled
        self._counted = True
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_count > self._seen:  # a whole header arrived
            self._seen = self._request_count
            self._disarm()
        elif data and self._header_timer is None and self._between_requests():
            self._arm()  # the first bytes of the next request on a kept-alive connection

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self._counts.release(self._address)
            super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self._loop.call_later(self._limits.header_timeout_s, self._header_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _between_requests(self) -> bool:
        """No request is queued or being handled. (A body's bytes can arrive after its message
        left the queue and before its handler starts: they are not a next request's header.)"""
        return self._current_request is None and not self._messages and not self._request_in_progress

    def _header_late(self) -> None:
        self._header_timer = None
        if not self._between_requests():
            return  # armed by a body's bytes as its handler started: that request is under way
        if self.transport is not None and self._request_count == self._seen:
            self.transport.write(_raw_response(
                "408 Request Timeout", "request_timeout",
                f"no complete request header within {self._limits.header_timeout_s:g}s"))
            self.force_close()
            self.transport.close()


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections are counted and held to the header deadline."""

    def __init__(self, app: web.Application, limits: HttpLimits, log, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self.counts = ConnectionCounts(limits)
        self._log = log

    @property
    def server(self):
        inner = self._server
        if inner is None:
            return None

        def protocol() -> GuardedHandler:
            return GuardedHandler(inner, loop=inner._loop, counts=self.counts, log=self._log, **inner._kwargs)

        return protocol


def body_deadline(timeout_s: float):
    """Middleware: a request's body is read whole within `timeout_s` (handlers then read it
    from aiohttp's cache), else 408."""

    @web.middleware
    async def read_in_time(request: web.Request, handler):
        if request.can_read_body:
            try:
                await asyncio.wait_for(request.read(), timeout_s)
            except TimeoutError:
                return web.json_response(
                    {"error": {"message": f"the request body was not received within {timeout_s:g}s",
                               "type": "invalid_request_error", "code": "request_timeout"}}, status=408)
        return await handler(request)

    return read_in_time
