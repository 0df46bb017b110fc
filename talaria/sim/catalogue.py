"""`--catalogue N|FILE`: the models a simulated cluster serves, and a trace's models on them.

`N`: N models calibrated like the matrix's catalogue (profiles.catalogue: copies of the
profile's models, cycled, named m00.., m01..). `FILE`: the user's own models, JSON or TOML
(format in docs/capacity.md); every bad field is a `CatalogueError` naming it. Where a
trace's model names are not the catalogue's, its models are mapped onto the catalogue's in
popularity order (the trace's most-called model onto the catalogue's first, and so on,
cycling when the trace has more models), as a Zipf catalogue's first model is its most popular.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections import Counter
from dataclasses import replace
from pathlib import Path

from talaria.sim.profiles import QWEN235_ALPHA, QWEN235_K, ServerProfile, SimModelProfile, catalogue, power_curve
from talaria.sim.workloads import on_model
from talaria.traces.format import Session


class CatalogueError(ValueError):
    """A bad `--catalogue` value or file; the message names the field and what it must be."""


def resolve(spec: str, base: ServerProfile) -> ServerProfile:
    """The server of `--catalogue spec` on top of profile `base` (its GPUs and links)."""
    if spec.isdigit():
        n = int(spec)
        if n < 1:
            raise CatalogueError(f"--catalogue {spec}: expected a positive model count or a file")
        return catalogue(base, n)
    path = Path(spec)
    if not path.is_file():
        raise CatalogueError(f"--catalogue {spec}: neither a model count nor a readable file")
    try:
        text = path.read_text(encoding="utf-8")
        doc = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, TOMLDecodeError
        raise CatalogueError(f"--catalogue {spec}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: "
                             f"{str(exc).splitlines()[0]}") from None
    return from_document(doc, base, spec)


def _number(where: str, value, *, integer: bool = False, positive: bool = True):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or (value <= 0 if positive else value < 0):
        kind = "integer" if integer else "number"
        raise CatalogueError(f"{where}: expected a {'positive' if positive else 'non-negative'} {kind}, got {value!r}")
    return value


def _model(where: str, m) -> tuple[SimModelProfile, int]:
    if not isinstance(m, dict):
        raise CatalogueError(f"{where}: expected a table of fields, got {type(m).__name__}")
    allowed = {"name", "weight_bytes", "tp", "kv_bytes_per_token", "max_context", "prefill", "decode"}
    extra = sorted(set(m) - allowed)
    if extra:
        raise CatalogueError(f"{where}: unknown field(s) {extra}; known: {sorted(allowed)}")
    for key in ("name", "weight_bytes", "tp", "kv_bytes_per_token"):
        if key not in m:
            raise CatalogueError(f"{where}.{key}: missing")
    name = m["name"]
    if not isinstance(name, str) or not name.strip():
        raise CatalogueError(f"{where}.name: expected a non-empty string, got {name!r}")
    tp = _number(f"{where}.tp", m["tp"], integer=True)
    kw: dict = {
        "weight_bytes": _number(f"{where}.weight_bytes", m["weight_bytes"], integer=True),
        "kv_bytes_per_token": _number(f"{where}.kv_bytes_per_token", m["kv_bytes_per_token"], integer=True),
        "max_context": _number(f"{where}.max_context", m.get("max_context", 131_072), integer=True),
    }
    prefill = m.get("prefill", {"speed": 1.0})
    if not isinstance(prefill, dict) or len(prefill) != 1 or next(iter(prefill)) not in ("speed", "points"):
        raise CatalogueError(f"{where}.prefill: expected {{\"speed\": X}} (derived) or "
                             f"{{\"points\": [[tokens, seconds], [tokens, seconds]]}} (measured), got {prefill!r}")
    if "speed" in prefill:  # derived: the reference curve (Qwen3-235B on TP=8) X times faster
        kw.update(prefill_k=QWEN235_K, prefill_alpha=QWEN235_ALPHA,
                  prefill_speed=_number(f"{where}.prefill.speed", prefill["speed"]))
    else:
        pts = prefill["points"]
        if (not isinstance(pts, list) or len(pts) != 2
                or not all(isinstance(p, list) and len(p) == 2 for p in pts)):
            raise CatalogueError(f"{where}.prefill.points: expected two [tokens, seconds] pairs, got {pts!r}")
        (n1, t1), (n2, t2) = pts
        for k, (n, t) in enumerate(pts):
            _number(f"{where}.prefill.points[{k}][0]", n)
            _number(f"{where}.prefill.points[{k}][1]", t)
        if not (n1 < n2 and t1 < t2):
            raise CatalogueError(f"{where}.prefill.points: tokens and seconds must both increase, got {pts!r}")
        k, alpha = power_curve(n1, t1, n2, t2)  # the points include the launch cost (c0 = 0)
        kw.update(prefill_k=k, prefill_alpha=alpha, prefill_c0_s=0.0)
    decode = m.get("decode", {})
    if not isinstance(decode, dict) or set(decode) - {"d0_s", "d1_s", "d2_s"}:
        raise CatalogueError(f"{where}.decode: expected a table of d0_s, d1_s, d2_s (each optional), got {decode!r}")
    for key, value in decode.items():
        kw[f"decode_{key}"] = _number(f"{where}.decode.{key}", value, positive=key == "d0_s")
    source = "measured prefill" if "points" in prefill else "derived prefill"
    return SimModelProfile(name.strip(), source=f"catalogue file ({source})", **kw), tp


def from_document(doc, base: ServerProfile, where: str = "catalogue") -> ServerProfile:
    """The server of a parsed catalogue document (docs/capacity.md). One instance is one
    TP group, so every model must share one TP; the GPUs and links are `base`'s, the links
    scaled by TP / base GPUs (as profiles.ROUTER_TP4 is the TP=8 server's halved)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise CatalogueError(f"{where}: expected a top-level 'models' list with at least one model")
    extra = sorted(set(doc) - {"models"})
    if extra:
        raise CatalogueError(f"{where}: unknown top-level field(s) {extra}; known: ['models']")
    models, tps = {}, set()
    for k, m in enumerate(doc["models"]):
        model, tp = _model(f"{where}: models[{k}]", m)
        if model.name in models:
            raise CatalogueError(f"{where}: models[{k}].name: {model.name!r} is named twice")
        models[model.name], tps = model, tps | {tp}
    if len(tps) > 1:
        raise CatalogueError(f"{where}: models have TP {sorted(tps)}; one instance is one TP group, so all "
                             "models must share one TP (run one catalogue per TP)")
    tp = tps.pop()
    scale = tp / base.gpus
    server = replace(base, name=f"{base.name}:{Path(where).name}", gpus=tp, host_bytes=int(base.host_bytes * scale),
                     h2d_bytes_s=base.h2d_bytes_s * scale, d2d_bytes_s=base.d2d_bytes_s * scale,
                     kv_restore_bytes_s=base.kv_restore_bytes_s * scale, models=models)
    for m in models.values():
        if m.weight_bytes >= server.bump_bytes:
            raise CatalogueError(f"{where}: {m.name}.weight_bytes: {m.weight_bytes} does not fit TP={tp} x "
                                 f"{base.hbm_per_gpu_bytes} B less the {1 - base.bump_fraction:.0%} reserve")
    return server


def by_popularity(sessions: list[Session], served: list[str]) -> list[Session]:
    """`sessions` with their models mapped onto `served` (in its order) by popularity, the
    trace's most-called model first, when any trace model is not served; else unchanged."""
    if all(s.model in served for s in sessions):
        return sessions
    calls = Counter(s.model for s in sessions for _ in s.calls)
    order = sorted(calls, key=lambda m: (-calls[m], m))
    mapping = {m: served[k % len(served)] for k, m in enumerate(order)}
    return [on_model(s, mapping[s.model], s.calls[0].gap_before_s, suffix=False) for s in sessions]
