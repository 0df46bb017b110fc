"""The `max_tokens` a traced call carried when the trace does not record it: client defaults.

A call's `max_tokens` is its client's cap, not its length, and a live router sees only the
cap. Traces (WEKA's kv-cache-tester files, generated workloads) record output lengths but
not caps, so the simulator gives each session one client's default, drawn from three kinds
in equal shares by a hash of the session id ([asm]: the shares are not measured). The kinds
and their sources: `client_cap`.
"""

from __future__ import annotations

import zlib

from talaria.traces.format import TraceCall

CLAUDE_CODE_MAX_TOKENS = 32_000
GATEWAY_DEFAULT_MAX_TOKENS = 256
KINDS = ("claude-code", "model-max", "gateway-256")


def client_kind(session_id: str) -> str:
    """The client a session is given (deterministic: the same in every process and run)."""
    return KINDS[zlib.crc32(session_id.encode()) % len(KINDS)]


def client_cap(call: TraceCall, context_tokens: int) -> int:
    """The call's `max_tokens`: the trace's when recorded, else its client's default.

        claude-code   32,000  Claude Code's `max_tokens` on /v1/messages (its default
                              CLAUDE_CODE_MAX_OUTPUT_TOKENS; docs/api.md, "max tokens" of
                              /v1/responses, which uses the same number)
        model-max     context - prompt  an OpenAI SDK client that sends no `max_tokens` to a
                              vLLM or SGLang server: the server allows the rest of the context
                              (vLLM's OpenAI server, `max_tokens` default max_model_len - prompt)
        gateway-256   256     the same client against this gateway: its chat default (docs/api.md,
                              "max tokens": default 256)

    A call whose recorded output exceeds its session's default cannot have run under it: its cap
    is the model's remaining context (model-max), and never below its own output.
    """
    if call.max_tokens:
        return call.max_tokens
    model_max = max(1, context_tokens - call.prompt_tokens)
    kind = client_kind(call.session)
    cap = CLAUDE_CODE_MAX_TOKENS if kind == "claude-code" else (
        GATEWAY_DEFAULT_MAX_TOKENS if kind == "gateway-256" else model_max)
    if call.output_tokens > cap:
        cap = model_max
    return max(cap, call.output_tokens)
