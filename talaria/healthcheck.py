"""`python -m talaria.healthcheck SERVICE`: exit 0 when SERVICE is alive, 1 otherwise.

For container healthchecks (docker-compose.yml): `gateway` asks its /healthz; `router` and
`telemetry` wait for a heartbeat on talaria.health.<service>; `agent` waits for the
snapshot of TALARIA_INSTANCE_ID on talaria.telemetry.<id>. One line on failure.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.request

import nats

from talaria.shared.bus import servers
from talaria.shared.settings import CommonSettings, Settings
from talaria.shared.snapshots import HEARTBEAT_DECODER

TIMEOUT_S = 3.0  # heartbeats come every 0.5 s: several must be missed to fail


async def _heard(settings: CommonSettings, subject: str, timeout: float, router_id: str = "") -> bool:
    """`settings`: the service's own (its NATS URL and credentials). `router_id`: a router
    replica's own beat, not any router's."""
    nc = await nats.connect(servers(settings.nats_url or "nats://127.0.0.1:4222"), connect_timeout=timeout,
                            allow_reconnect=False, **settings.nats_options())
    try:
        sub = await nc.subscribe(subject)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            msg = await sub.next_msg(timeout=max(0.01, deadline - asyncio.get_running_loop().time()))
            if not router_id or HEARTBEAT_DECODER.decode(msg.data).detail.get("router_id") == router_id:
                return True
    except TimeoutError:
        return False
    finally:
        await nc.close()


def check(service: str, timeout: float = TIMEOUT_S) -> str | None:
    """None when healthy, else why not."""
    try:
        settings = Settings.from_env()
        deployment = settings.common.deployment
        if service == "gateway":
            with urllib.request.urlopen(f"http://127.0.0.1:{settings.gateway.http_port}/healthz", timeout=timeout) as r:
                return None if r.status == 200 else f"gateway /healthz answered {r.status}"
        if service == "agent":
            subject = deployment.telemetry(settings.agent.instance_id)
        elif service in ("router", "telemetry"):
            subject = deployment.health(service)
        else:
            return f"unknown service {service!r} (gateway, router, telemetry, agent)"
        mine = settings.router.router_id if service == "router" else ""
        heard = asyncio.run(asyncio.wait_for(_heard(settings.common, subject, timeout, mine), 2 * timeout))
        return None if heard else f"no heartbeat on {subject} within {timeout:.0f}s"
    except Exception as exc:  # unreachable NATS or gateway: unhealthy, said in one line
        return f"{service}: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m talaria.healthcheck gateway|router|telemetry|agent", file=sys.stderr)
        return 2
    why = check(argv[0])
    if why:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
