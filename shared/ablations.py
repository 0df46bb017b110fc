"""The paper's ablations (§5), one table: each row says which of Talaria's mechanisms are on;
turning one off changes timing only, never output. The named configurations
(services/configs.py) take their mechanisms from it (`talaria-no-sp`, ...), and
`--ablation NAME` / `TALARIA_ABLATION=NAME` turn a configuration's mechanisms to a row's.

    sp        mid-slot session-prefill (off: returns wait for the next slot's P)
    hkvr      host-restorable session KV (off: host KV counts as missing, recompute)
    staging   D2D-staged model switches (off: host-only H2D switches)
    park_kv   a switched-out model's running calls keep their KV on device while HBM has room
              (off: offloaded and restored on reopen); only an engine that switches with
              calls running has any to park
"""

from __future__ import annotations

ABLATIONS: dict[str, dict[str, bool]] = {
    "talaria": {"sp": True, "hkvr": True, "staging": True, "park_kv": True, "migrate": True},
    "no-sp": {"sp": False, "hkvr": True, "staging": True, "park_kv": True, "migrate": True},
    "no-hkvr": {"sp": True, "hkvr": False, "staging": True, "park_kv": True, "migrate": True},
    "h2d-only": {"sp": True, "hkvr": True, "staging": False, "park_kv": True, "migrate": True},
    "no-migrate": {"sp": True, "hkvr": True, "staging": True, "park_kv": True, "migrate": False},
    # the paper's baseline: none of Talaria's mechanisms, running calls' KV parked off-device
    "round-only": {"sp": False, "hkvr": False, "staging": False, "park_kv": False, "migrate": False},
}


def mechanisms(name: str) -> dict[str, bool]:
    """The mechanisms of ablation `name`; a KeyError naming the known ones otherwise."""
    try:
        return dict(ABLATIONS[name])
    except KeyError:
        raise KeyError(f"unknown ablation {name!r}; known: {', '.join(ABLATIONS)}") from None
