"""What one host runs: `talaria up --role control|gateway|agent` (comma-separated to combine).

`all` (the default) is one machine with everything. A host with fewer roles joins servers that
run elsewhere: it needs the NATS URL (every cluster member) and, with `--nats-credentials`, the
directory `talaria nats-config` wrote, so each service connects as its own user.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROLES = ("control", "gateway", "agent")


class RoleError(ValueError):
    pass


def parse_roles(text: str) -> frozenset[str]:
    """`all`, or a comma-separated subset of ROLES."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return frozenset(ROLES)
    unknown = [n for n in names if n not in ROLES]
    if unknown or not names:
        raise RoleError(f"--role {text!r}: expected all, or a comma-separated subset of {', '.join(ROLES)}")
    return frozenset(names)


@dataclass(frozen=True)
class HostPlan:
    """The parts of the stack one host starts."""

    roles: frozenset[str]

    @property
    def everything(self) -> bool:
        return self.roles == frozenset(ROLES)

    @property
    def database(self) -> bool:  # Postgres and its migrations: only the router and telemetry use it
        return "control" in self.roles

    @property
    def api_keys(self) -> bool:
        return "gateway" in self.roles

    def agents(self, requested: int) -> int:
        return requested if "agent" in self.roles else 0

    def check(self, nats_url: str, agents: int, credentials: Path | None) -> None:
        """A host that is not the whole stack joins an existing NATS: it cannot embed one that
        nobody else could reach (the embedded servers listen on 127.0.0.1)."""
        if not self.everything and not nats_url:
            raise RoleError(f"--role {','.join(sorted(self.roles))}: give the cluster's NATS URL "
                            "(--nats-url or TALARIA_NATS_URL); only --role all embeds one")
        if credentials is not None and not credentials.is_dir():
            raise RoleError(f"--nats-credentials {credentials}: not a directory (write one with "
                            "`talaria nats-config DIR`)")


def credentials_env(directory: Path, key: str) -> dict[str, str]:
    """The NATS user of service `key` (gateway, router, telemetry, agent-<id>) from the
    `<key>.env` file `talaria nats-config` wrote; a clear error when it is missing."""
    from talaria.container import read_env

    path = directory / f"{key}.env"
    try:
        return read_env(path)
    except OSError as exc:
        raise RoleError(f"no NATS credentials for {key} in {directory}: {exc.strerror} "
                        f"(`talaria nats-config {directory} --agents ...` must name every agent id)") from None
    except ValueError as exc:
        raise RoleError(str(exc)) from None
