"""Process entry point shared by every service: settings, logging, signals, exit codes."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from talaria.shared import logs
from talaria.shared.settings import Settings, SettingsError

Runner = Callable[[Settings, asyncio.Event | None, asyncio.Event | None], Awaitable[None]]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Run in a child process (e.g. a pool's initializer): the kernel sends it SIGKILL when
    its parent dies, however the parent died (a SIGKILLed service would otherwise leave it
    to PID 1, and the resource tracker it holds open with it). A parent already gone before
    the request took effect is caught by the pid check. Linux only (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def main(service: str, run: Runner) -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"talaria {service}: configuration error: {exc}", file=sys.stderr)
        return 2
    common = settings.common
    log = logs.configure(service, common.log_level, common.log_json)
    if not common.nats_url or (service != "gateway" and service != "instance_agent" and not common.database_url):
        print(f"talaria {service}: TALARIA_NATS_URL and TALARIA_DATABASE_URL must be set "
              "(`talaria up` sets them)", file=sys.stderr)
        return 2

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, None, stop)

    try:
        asyncio.run(_main())
    except SettingsError as exc:
        print(f"talaria {service}: configuration error: {exc}", file=sys.stderr)
        return 2
    except Exception:
        log.exception(f"{service} crashed")
        return 1
    return 0


async def serve_until_stopped(service: str, stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    """Wait for `stop`; a core task that ends first raises (its error, or that it ended), so
    the process exits non-zero and is restarted rather than heartbeating with no one working.
    Tasks that end with `stop` (in the same loop turn) are not counted as dead."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    for task in (done - {stopped}) if not stop.is_set() else ():
        task.result()
        raise RuntimeError(f"{service} task {task.get_name()} ended unexpectedly")
