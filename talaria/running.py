"""The operator commands' view of a running stack, so they need no copied URL.

`talaria up` writes `<data_dir>/stack.json` (mode 0600, docs/operating.md). `audit`, `trace`,
`trace export` and `replay --running` find it as `up` does: `--data-dir`, else
`TALARIA_DATA_DIR`, else `./.talaria`. Session ids are stored scoped by tenant
(`<tenant>:<id>`); `match_sessions` maps the id a client sent to the stored form.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit

from talaria.services.gateway.auth import SCOPE_SEPARATOR
from talaria.shared.bus import servers
from talaria.shared.settings import Settings

STACK_FILE = "stack.json"


class StackNotFound(RuntimeError):
    """No usable stack.json where the CLI looked; the message says where and what to do."""


class AmbiguousSession(ValueError):
    """Several tenants sent the typed session id; the message names them."""


@dataclass(frozen=True)
class RunningStack:
    """What `talaria up` recorded about the stack it runs (the keys of docs/operating.md)."""

    data_dir: Path
    description: dict

    @property
    def database_url(self) -> str:
        return self.description["database"]

    @property
    def nats_client_url(self) -> str:
        return self.description["nats_client"]

    @property
    def nats_admin_url(self) -> str:
        """The admin user's NATS URL (`talaria drain`); the client URL on an external NATS."""
        return self.description.get("nats_admin") or self.nats_client_url

    @property
    def api_key(self) -> str | None:
        return self.description.get("api_key")

    @property
    def traces_dir(self) -> Path:
        return Path(self.description.get("traces") or self.data_dir / "traces")

    def check_running(self, timeout_s: float = 3.0) -> "RunningStack":
        """Its NATS answers (a stopped stack's stack.json stays behind): else one clear error,
        before a client would retry a dead address and log each attempt."""
        url = urlsplit(servers(self.nats_client_url)[0])
        try:
            socket.create_connection((url.hostname or "127.0.0.1", url.port or 4222), timeout=timeout_s).close()
        except OSError as exc:
            raise StackNotFound(f"the stack of {self.data_dir} is not running (NATS at {url.hostname}:{url.port}: "
                                f"{exc.strerror or exc}); start it with `talaria up`") from None
        return self


def data_dir(settings: Settings, flag: str | None) -> Path:
    """`--data-dir`, else TALARIA_DATA_DIR, else ./.talaria (the settings' default)."""
    return Path(flag) if flag else settings.common.data_dir


def find_stack(directory: Path) -> RunningStack:
    path = directory / STACK_FILE
    try:
        description = json.loads(path.read_text())
    except FileNotFoundError:
        raise StackNotFound(f"no {path}: start the stack with `talaria up` here, or pass --data-dir "
                            "(or TALARIA_DATA_DIR) of the one running") from None
    except PermissionError:
        raise StackNotFound(f"cannot read {path} (mode 0600: run as the user who ran `talaria up`)") from None
    except (OSError, ValueError) as exc:
        raise StackNotFound(f"{path}: not a stack description ({exc})") from None
    if not isinstance(description, dict) or not description.get("database"):
        raise StackNotFound(f"{path}: names no database")
    return RunningStack(directory, description)


def database_url(settings: Settings, flag: str | None) -> str:
    """TALARIA_DATABASE_URL when set (an operator's own Postgres), else the running stack's."""
    if settings.common.database_url:
        return settings.common.database_url
    try:
        return find_stack(data_dir(settings, flag)).database_url
    except StackNotFound as exc:
        raise StackNotFound(f"{exc}; or set TALARIA_DATABASE_URL") from None


def match_sessions(typed: str, stored: Iterable[str], tenant: str | None = None) -> list[str]:
    """The stored session ids a client's `typed` id can mean: `<tenant>:<typed>` for each tenant
    that sent it (only `tenant`'s when given), or `typed` itself when stored so (an open
    gateway's ids, or the scoped form typed whole). Tenant names hold no separator, so the
    first one splits a stored id unambiguously."""
    if tenant is not None:
        wanted = f"{tenant}{SCOPE_SEPARATOR}{typed}"
        return [s for s in stored if s == wanted]
    out = []
    for s in stored:
        _, sep, rest = s.partition(SCOPE_SEPARATOR)
        if s == typed or (sep and rest == typed):
            out.append(s)
    return sorted(set(out))


def pick_session(typed: str, matches: list[str]) -> str:
    """The one stored id for `typed`; several tenants' sessions under it: an error naming them."""
    if len(matches) > 1:
        tenants = ", ".join(m.partition(SCOPE_SEPARATOR)[0] for m in matches)
        raise AmbiguousSession(f"session {typed!r} was sent by several tenants ({tenants}): pass --tenant NAME")
    return matches[0] if matches else typed


def executions(logs: Iterable[Path], session_prefix: str = "") -> dict[str, int]:
    """call_id -> how many times an agent ran it to completion, read from the agents' logs: one
    JSON `call completed` line per execution (docs/operating.md); only sessions starting with
    `session_prefix` (scoped, `<tenant>:...`)."""
    runs: dict[str, int] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if '"call completed"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            call_id = entry.get("call_id")
            if entry.get("event") == "call completed" and call_id \
                    and str(entry.get("session_id", "")).startswith(session_prefix):
                runs[call_id] = runs.get(call_id, 0) + 1
    return runs
