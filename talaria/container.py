"""A container's entry point: `python -m talaria.container [--env FILE] MODULE [ARGS]` loads the
service's own secrets (KEY=VALUE lines in FILE, default /run/secrets/talaria/env, which
`talaria compose-secrets` wrote) into the environment, then runs `python -m MODULE ARGS`
(whose settings read them). Secrets never appear in the compose file, an image, or a command
line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_ENV = "/run/secrets/talaria/env"


def read_env(path: Path) -> dict[str, str]:
    values = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{path}:{n}: not KEY=VALUE")
        values[key.strip()] = value
    return values


def main(argv: list[str]) -> int:
    path = Path(DEFAULT_ENV)
    if argv[:1] == ["--env"] and len(argv) > 1:
        path, argv = Path(argv[1]), argv[2:]
    if not argv:
        print("usage: python -m talaria.container [--env FILE] MODULE [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(read_env(path))
    except FileNotFoundError:
        print(f"talaria: {path}: no secrets (the compose `secrets` service writes them)", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"talaria: {exc}", file=sys.stderr)
        return 2
    os.execv(sys.executable, [sys.executable, "-m", *argv])
    return 1  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
