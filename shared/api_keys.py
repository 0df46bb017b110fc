"""API key entries as configured (`TALARIA_API_KEYS`, `TALARIA_API_KEYS_FILE`): `tenant:sha256:<hex>`
or `tenant:<plaintext key>`, only ever kept as the key's SHA-256 hash. Read by the settings (to
name a malformed entry at start), the gateway's key store and `talaria up` (which writes one).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HASH_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")


class InvalidKeyEntry(ValueError):
    """A configured key entry is malformed (settings name the variable)."""


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "tk-" + secrets.token_urlsafe(32)


def parse_key_entry(entry: str) -> tuple[str, str]:
    """`tenant:sha256:<hex>` or `tenant:<plaintext key>` -> (tenant, hash)."""
    tenant, sep, rest = entry.strip().partition(":")
    if not sep or not rest:
        raise InvalidKeyEntry("entries `tenant:sha256:<hex>` or `tenant:<key>`")
    if not TENANT_PATTERN.fullmatch(tenant):
        raise InvalidKeyEntry("a tenant name of 1-64 letters, digits, '_' or '-'")
    if rest.startswith("sha256:"):
        if not _HASH_PATTERN.fullmatch(rest):
            raise InvalidKeyEntry("sha256: followed by 64 lowercase hex digits")
        return tenant, rest
    if len(rest) < 16:
        raise InvalidKeyEntry("a key of at least 16 characters")
    return tenant, hash_key(rest)


def read_key_file(path: Path) -> list[tuple[str, str]]:
    """One `tenant sha256:<hex>` per line; '#' comments and blank lines are skipped."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        tenant, _, digest = line.partition(" ")
        try:
            out.append(parse_key_entry(f"{tenant}:{digest.strip()}"))
        except InvalidKeyEntry as exc:
            raise InvalidKeyEntry(f"{path}:{n}: {exc}") from None
    return out


def write_key_file(path: Path, entries: list[tuple[str, str]]) -> None:
    """Write hashes only, readable by the owner only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as fd:
        fd.writelines(f"{tenant} {digest}\n" for tenant, digest in entries)
    path.chmod(0o600)
