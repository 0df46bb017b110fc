"""Cost profiles: what each model costs on each server class. Every number says its source.

Tags: [cal] quoted in /work/shared/calibration.md (the paper's numbers); [card] a public model
card or architecture config; [der] derived from those by the arithmetic shown; [asm] an
assumption with no published number behind it (change it freely). Prefill is a cumulative
power curve through the paper's two recompute anchors, decode a linear step, a switch the
paper's five phases (App. D); the derivations are `ServerProfile`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GiB = 1024**3
GB = 10**9

# Switch phases other than P2, seconds [cal: App. D Table 2 p50s: P1 22-27 ms, P3 <1 ms,
# P4 ~8 ms, P5 <1 ms].
P1_S, P3_S, P4_S, P5_S = 0.025, 0.0006, 0.0083, 0.0002
SWITCH_OVERHEAD_S = P1_S + P3_S + P4_S + P5_S
D2D_SYNC_S = 0.0183  # [cal] D2D gather-sync p50


def power_curve(n1: float, t1: float, n2: float, t2: float) -> tuple[float, float]:
    """(k, alpha) of k * n**alpha through (n1, t1) and (n2, t2)."""
    alpha = math.log(t2 / t1) / math.log(n2 / n1)
    return t1 / n1**alpha, alpha


PREFILL_C0_S = 0.05  # [asm] fixed cost of one prefill launch (scheduling, sampling)
# [cal] recompute anchors, less c0 so that c0 + F(n) hits them exactly.
QWEN235_K, QWEN235_ALPHA = power_curve(25_000, 4.3 - PREFILL_C0_S, 100_000, 10.9 - PREFILL_C0_S)


@dataclass(frozen=True)
class SimModelProfile:
    """One model on one server class. Times in seconds, sizes in bytes."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    prefill_speed: float = 1.0  # divides F: 2.0 = twice as fast as Qwen3-235B/TP=8
    prefill_k: float = QWEN235_K
    prefill_alpha: float = QWEN235_ALPHA
    prefill_c0_s: float = PREFILL_C0_S
    decode_d0_s: float = 0.013  # [asm] ~75 tok/s single stream, SGLang-class MoE on TP=8
    decode_d1_s: float = 0.0004  # [asm] per sequence in the batch
    decode_d2_s: float = 5e-9  # [asm] per context token summed over the batch
    max_context: int = 131_072
    source: str = ""

    def curve(self, n: float) -> float:
        return self.prefill_k * n**self.prefill_alpha / self.prefill_speed if n > 0 else 0.0

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        if new_tokens <= 0:
            return self.prefill_c0_s
        ctx = max(0, context_tokens)
        return self.prefill_c0_s + self.curve(ctx + new_tokens) - self.curve(ctx)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_d0_s + self.decode_d1_s * batch + self.decode_d2_s * context_tokens


@dataclass(frozen=True)
class ServerProfile:
    """One GPU group (an instance) and the models it can serve.

    Prefill is modelled by a cumulative curve F(n) = k * n**alpha: computing tokens
    [ctx, ctx+new) costs c0 + F(ctx+new) - F(ctx). F passes exactly through the paper's two
    recompute anchors for Qwen3-235B on TP=8 (25K tokens -> 4.3 s, 100K -> 10.9 s [cal]), which
    are sub-linear (alpha ~ 0.68), so no linear+quadratic fit with non-negative terms exists.
    The marginal cost of a short suffix on a long context is therefore small, which is the
    regime SP exploits. Other models scale F by a speed factor [asm].

    Decode step: d0 + d1 * batch + d2 * (context tokens summed over the batch) [asm: the paper
    publishes no TPOT].

    Switch (paper App. D, five phases): P1 save/teardown + P2 open weights + P3 + P4 + P5.
    P2 = D2D gather (sync + staged bytes / D2D bandwidth) + uncovered bytes / H2D bandwidth.
    H2D bandwidth is chosen so the median model's host-only switch is 1.50 s [cal]; D2D
    bandwidth so its full-D2D switch is 106 ms [cal]. The path is `d2d_full` when every byte
    was staged, `d2d_partial` when some were, `host_only` when none were.
    """

    name: str
    gpus: int
    hbm_per_gpu_bytes: int
    host_bytes: int
    h2d_bytes_s: float  # aggregate over the group, weights
    d2d_bytes_s: float
    kv_restore_bytes_s: float
    models: dict[str, SimModelProfile] = field(default_factory=dict)
    bump_fraction: float = 0.8  # [cal] App. E mem-fraction-bump
    runtime_reserve_bytes: int = 0  # CUDA graphs, workspaces (outside the bump buffer)
    kv_page_tokens: int = 512  # host KV page ([asm] coarse for speed, memory.SIM_PAGE_TOKENS)
    source: str = ""
    # The network between instances, for KV page migration (issue 40). [asm] one 200 Gbit/s
    # NIC per instance (25 GB/s; a TP=8 node usually has 8, and Mooncake's transfer engine
    # reports 87 GB/s over 4 x 200 Gbit/s RoCE); setup, a pull's request and first page
    # (results/migration.md sweeps both: the matrix is flat over 10x either way).
    link_bytes_s: float = 25e9
    link_setup_s: float = 1e-3

    @property
    def hbm_bytes(self) -> int:
        return self.gpus * self.hbm_per_gpu_bytes

    @property
    def bump_bytes(self) -> int:
        return int(self.hbm_bytes * self.bump_fraction)

    def model(self, name: str) -> SimModelProfile:
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(f"profile {self.name!r} has no model {name!r}") from None

    def kv_pool_bytes(self, model: str) -> int:
        """Device KV pool while `model` is active: the bump buffer less its weights."""
        return max(0, self.bump_bytes - self.model(model).weight_bytes)

    def restore_s(self, model: str, tokens: int) -> float:
        return tokens * self.model(model).kv_bytes_per_token / self.kv_restore_bytes_s

    def migrate_s(self, model: str, tokens: int) -> float:
        """Pull `tokens` of a session's pages from another instance: setup + bytes over the
        link, then their restore into the device pool (they land in the host registry)."""
        return self.link_setup_s + tokens * self.model(model).kv_bytes_per_token / self.link_bytes_s \
            + self.restore_s(model, tokens)

    def switch(self, to_model: str, staged_bytes: int) -> tuple[str, float, dict[str, float]]:
        """(path, seconds, phases) of a switch to `to_model` with `staged_bytes` staged."""
        w = self.model(to_model).weight_bytes
        staged = max(0, min(staged_bytes, w))
        d2d = (D2D_SYNC_S + staged / self.d2d_bytes_s) if staged else 0.0
        h2d = (w - staged) / self.h2d_bytes_s
        path = "d2d_full" if staged >= w else ("d2d_partial" if staged else "host_only")
        phases = {"P1": P1_S, "P2": d2d + h2d, "P3": P3_S, "P4": P4_S, "P5": P5_S}
        return path, SWITCH_OVERHEAD_S + d2d + h2d, phases

    def with_models(self, models: dict[str, SimModelProfile]) -> ServerProfile:
        return replace(self, models=dict(models))


# ---- (1) the paper's TP=8 server ---------------------------------------------------------

_QWEN235 = SimModelProfile(
    "qwen3-235b",
    weight_bytes=470 * GB,  # [card] 235B params x 2 B (BF16)
    kv_bytes_per_token=94 * 4 * 128 * 2 * 2,  # [card] 94 layers, 4 KV heads, dim 128, K+V, BF16
    prefill_speed=1.0,  # [cal] the anchors are this model's
    source="recompute anchors 4.3 s / 10.9 s [cal]; decode [asm]",
)
_GLM5 = SimModelProfile(
    "glm5-nvfp4",
    weight_bytes=440 * GB,  # [asm] ~744B params at ~0.59 B/param (NVFP4 experts, BF16 rest)
    kv_bytes_per_token=78 * 576 * 2,  # [card-ish] MLA latent 512+64 per layer, 78 layers, BF16
    prefill_speed=1.0,  # [asm] ~40B active at FP4 ~ Qwen3-235B's 22B active at BF16
    decode_d0_s=0.016,  # [asm]
    source="[asm] scaled from Qwen3-235B",
)
_QWEN35 = SimModelProfile(
    "qwen3.5-122b-a10b",
    weight_bytes=244 * GB,  # [card] 122B params x 2 B
    kv_bytes_per_token=12 * 2 * 256 * 2 * 2,  # [asm] hybrid: 12 of 48 layers full attention
    prefill_speed=2.0,  # [asm] 10B active, mostly linear attention
    decode_d0_s=0.010,  # [asm]
    source="[asm] scaled from Qwen3-235B",
)
PAPER_MODELS = (_QWEN235, _GLM5, _QWEN35)
_MEDIAN_WEIGHTS = sorted(m.weight_bytes for m in PAPER_MODELS)[1]

PAPER_TP8 = ServerProfile(
    "paper-tp8",
    gpus=8,
    hbm_per_gpu_bytes=183 * GiB,  # [cal]
    host_bytes=2 * 10**12,  # [cal] 2 TB host memory
    # [der] median model's host-only switch = 1.50 s [cal]: 440 GB / (1.50 - overhead)
    h2d_bytes_s=_MEDIAN_WEIGHTS / (1.497 - SWITCH_OVERHEAD_S),
    # [der] median model's full-D2D switch = 106 ms [cal]
    d2d_bytes_s=_MEDIAN_WEIGHTS / (0.106 - SWITCH_OVERHEAD_S - D2D_SYNC_S),
    # [asm] KV pages restore at half the weight H2D rate (scattered pages, smaller DMAs)
    kv_restore_bytes_s=0.5 * _MEDIAN_WEIGHTS / (1.497 - SWITCH_OVERHEAD_S),
    models={m.name: m for m in PAPER_MODELS},
    source="paper TP=8 server, calibration.md",
)

# ---- (2) the two-worker TP=4 router testbed ----------------------------------------------

_TB_MODELS = (
    SimModelProfile(
        "qwen3-32b",
        weight_bytes=65 * GB,  # [card] 32.8B x 2 B
        kv_bytes_per_token=64 * 8 * 128 * 2 * 2,  # [card] 64 layers, 8 KV heads, dim 128
        prefill_speed=1.4,  # [asm] dense 32B on 4 GPUs
        decode_d0_s=0.018,
        source="[asm]",
    ),
    SimModelProfile(
        "qwen2.5-32b-instruct",
        weight_bytes=65 * GB,  # [card]
        kv_bytes_per_token=64 * 8 * 128 * 2 * 2,  # [card]
        prefill_speed=1.4,  # [asm]
        decode_d0_s=0.018,
        source="[asm]",
    ),
    SimModelProfile(
        "qwen3.5-35b-a3b",
        weight_bytes=70 * GB,  # [card] ~35B x 2 B
        kv_bytes_per_token=10 * 2 * 256 * 2 * 2,  # [asm] hybrid attention
        prefill_speed=3.0,  # [asm] 3B active
        decode_d0_s=0.012,
        source="[asm]",
    ),
)
ROUTER_TP4 = ServerProfile(
    "router-tp4",
    gpus=4,
    hbm_per_gpu_bytes=183 * GiB,  # [asm] same GPU class as the TP=8 server
    host_bytes=1 * 10**12,  # [asm]
    h2d_bytes_s=PAPER_TP8.h2d_bytes_s / 2,  # [der] half the links of the TP=8 server
    d2d_bytes_s=PAPER_TP8.d2d_bytes_s / 2,
    kv_restore_bytes_s=PAPER_TP8.kv_restore_bytes_s / 2,
    # [asm] like the TP=8 server, a worker keeps one active model's weights on device
    # (cold-pool time-sharing, paper §3.4); others are opened from host or staged.
    models={m.name: m for m in _TB_MODELS},
    source="two TP=4 workers, paper §5.3 (model ids mapped); costs [asm]",
)

# ---- (3) the torch engine on this machine (CPU) --------------------------------------------

# [bench] = results/agent_bench.md (the instance-agent bench of the torch engine, CPU, 1 thread,
# qwen3-tiny): host restore adds ~98 ms at 16,384 tokens (154.49 - 56.11 ms); switch p50s:
# host-only 0.73 ms for 3,418,624 B of weights.
# [meas] = `python bench/sim_fidelity.py --measure` on this machine (torch engine, 1 torch thread
# as the agent runs it, medians): each model's prefill at 512 and 2,048 prompt tokens and its
# decode step at (batch 1, 512 context), (batch 1, 2,048) and (batch 4, 4 x 512). The prefill
# curve goes through the two prefill points; the decode line d0 + d1 * batch + d2 * context
# through the three decode points (results/sim_fidelity_peers.md uses this profile).
_TINY_MEASURED = {  # [meas] seconds
    "qwen3-tiny": dict(p512=0.03166, p2048=0.18942, b1c512=0.001497, b1c2048=0.002347, b4c512=0.003235),
    "qwen3-moe-tiny": dict(p512=0.05248, p2048=0.25693, b1c512=0.004378, b1c2048=0.006711, b4c512=0.008831),
    "gpt2-tiny": dict(p512=0.03223, p2048=0.14255, b1c512=0.001176, b1c2048=0.002616, b4c512=0.003119),
}
_TINY_WEIGHTS = {"qwen3-tiny": 3_418_624, "qwen3-moe-tiny": 10_512_896, "gpt2-tiny": 7_633_920}  # [bench]


def _tiny(name: str, weights: int, m: dict) -> SimModelProfile:
    """A demo model's profile from its [meas] points (see above)."""
    k, alpha = power_curve(512, m["p512"], 2048, m["p2048"])
    d2 = (m["b1c2048"] - m["b1c512"]) / (2048 - 512)  # per context token
    d1 = (m["b4c512"] - m["b1c512"] - d2 * (4 * 512 - 512)) / 3  # per sequence in the batch
    d0 = m["b1c512"] - d1 - d2 * 512
    return SimModelProfile(
        name, weight_bytes=weights,
        kv_bytes_per_token=4 * 2 * 32 * 2 * 4,  # [card] shared/catalog.py: 4 layers, 2 KV heads, dim 32, fp32
        prefill_k=k, prefill_alpha=alpha, prefill_c0_s=0.0,  # [meas] (c0 inside the two points)
        decode_d0_s=d0, decode_d1_s=d1, decode_d2_s=d2,  # [meas]
        max_context=32_768,
        source="[meas] bench/sim_fidelity.py --measure; switch/restore [bench]",
    )


_TINY = tuple(_tiny(name, w, _TINY_MEASURED[name]) for name, w in _TINY_WEIGHTS.items())
LOCAL_TORCH = ServerProfile(
    "local-torch",
    gpus=1,
    hbm_per_gpu_bytes=2 * GiB,  # PLACEHOLDER (CPU "device" memory budget)
    host_bytes=8 * GiB,  # PLACEHOLDER
    h2d_bytes_s=3_418_624 / (0.00073 - SWITCH_OVERHEAD_S) if 0.00073 > SWITCH_OVERHEAD_S else 5 * GB,  # [bench] ~5 GB/s
    d2d_bytes_s=10 * GB,  # PLACEHOLDER
    kv_restore_bytes_s=16384 * (4 * 2 * 32 * 2 * 4) / 0.098,  # [bench] 16,384 tokens in ~98 ms
    models={m.name: m for m in _TINY},
    kv_page_tokens=16,  # [card] the torch engine's page (torch_engine.py page_size): host KV restores whole pages
    source="torch engine on this machine's CPU: bench/sim_fidelity.py --measure, results/agent_bench.md",
)

PROFILES: dict[str, ServerProfile] = {p.name: p for p in (PAPER_TP8, ROUTER_TP4, LOCAL_TORCH)}


def get_profile(name: str) -> ServerProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None


def catalogue(base: ServerProfile, n_models: int) -> ServerProfile:
    """A server serving `n_models` models: copies of `base`'s models, cycled, renamed m00..

    Used by the scale experiment: each synthetic model costs what the base model it copies
    costs, so the catalogue stays calibrated.
    """
    bases = list(base.models.values())
    models = {}
    for i in range(n_models):
        src = bases[i % len(bases)]
        name = f"m{i:02d}-{src.name}"
        models[name] = replace(src, name=name, source=f"copy of {src.name}")
    return base.with_models(models)


@dataclass(frozen=True)
class ProfileCosts:
    """Adapter: `ServerProfile` as the instance scheduler's `StepCostModel` protocol."""

    server: ServerProfile

    def prefill_s(self, model: str, new_tokens: int, context_tokens: int) -> float:
        return self.server.model(model).prefill_s(new_tokens, context_tokens)

    def restore_s(self, model: str, tokens: int) -> float:
        return self.server.restore_s(model, tokens)

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float:
        return self.server.model(model).decode_step_s(batch, context_tokens)

    def switch_s(self, from_model: str | None, to_model: str, staged: bool = True) -> float:
        w = self.server.model(to_model).weight_bytes
        return self.server.switch(to_model, w if staged else 0)[1]

    def kv_bytes(self, model: str, tokens: int) -> int:
        return tokens * self.server.model(model).kv_bytes_per_token
