"""The paper's validation protocol (App. B) on the real engine: forced switches, host
restores, rank disagreement, switch barrier and dirty staged chunks. Greedy continuations
must equal a from-scratch run; the hit must be recorded as device or host."""

import torch

from talaria.services.instance_agent.engine import Sequence
from talaria.services.instance_agent.memory.host_pages import RankReport
from talaria.shared.tokenizer import encode

TASK = encode("Issue 1234: astropy units round-trip fails for composite units. " * 2)
TOOL = encode(" [tool] pytest: 1 failed, 41 passed. ", bos=False)


def fresh(make_engine, model, prompt, n):
    eng = make_engine([model], hkvr=False, staging=False)
    return eng.generate(Sequence("ref", "ref", model, prompt, n)).token_ids


def test_forced_switch_then_host_restore_matches_scratch(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
    first = eng.generate(Sequence("a1", "s1", "qwen3-tiny", TASK, 12))
    rec = eng.switch_to("gpt2-tiny")  # forced: qwen3's device KV is released
    assert rec.drained_d2h_jobs == 1 and eng.hkvr.core.pending_jobs("qwen3-tiny") == []
    assert eng.kv_state("s1", "qwen3-tiny") == "host"
    eng.generate(Sequence("b1", "s2", "gpt2-tiny", TASK, 4))
    prompt = TASK + first.token_ids + TOOL
    back = eng.generate(Sequence("a2", "s1", "qwen3-tiny", prompt, 12))
    committed = len(TASK) + len(first.token_ids) - 1
    assert back.kv_source == "host"
    assert back.cached_tokens == back.host_restored_tokens == committed // 16 * 16
    assert back.token_ids == fresh(make_engine, "qwen3-tiny", prompt, 12)
    assert eng.stats().host_hits == 1 and eng.stats().restore_tok_s > 0
    # no switch in between: the same return is a device hit
    again = eng.generate(Sequence("a3", "s1", "qwen3-tiny", prompt + back.token_ids, 6))
    assert again.kv_source == "device"


def test_without_hkvr_a_switched_session_recomputes(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"], hkvr=False)
    first = eng.generate(Sequence("a1", "s1", "qwen3-tiny", TASK, 6))
    eng.switch_to("gpt2-tiny")
    assert eng.kv_state("s1", "qwen3-tiny") == "none"
    back = eng.generate(Sequence("a2", "s1", "qwen3-tiny", TASK + first.token_ids, 6))
    assert back.kv_source == "recompute" and back.cached_tokens == 0


def test_rank_disagreement_truncates_and_never_corrupts(make_engine):
    eng = make_engine(["gpt2-tiny", "qwen3-tiny"])

    def lagging(rep: RankReport) -> RankReport:  # rank 1 diverges after two pages
        if rep.rank == 0:
            return rep
        return RankReport(1, rep.committed_tokens, rep.hashes[:2] + tuple(h ^ 1 for h in rep.hashes[2:]))

    eng.rank_fault = lagging
    first = eng.generate(Sequence("a1", "s1", "gpt2-tiny", TASK, 10))
    eng.rank_fault = None
    eng.switch_to("qwen3-tiny")
    assert eng.hkvr.core.counters.truncated_saves == 1
    prompt = TASK + first.token_ids + TOOL
    back = eng.generate(Sequence("a2", "s1", "gpt2-tiny", prompt, 10))
    assert back.kv_source == "host" and back.cached_tokens == 2 * 16
    assert back.token_ids == fresh(make_engine, "gpt2-tiny", prompt, 10)


def test_transfer_pins_hold_device_pages_until_copy_retired(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
    eng.generate(Sequence("a1", "s1", "qwen3-tiny", TASK, 4))
    entry = eng.sessions.get("s1")
    full = len(entry.tokens) // 16
    assert all(eng.pool.use_refs[p] == 1 for p in entry.pages[:full])  # pinned by the D2H job
    assert eng.hkvr.core.match("qwen3-tiny", []) == 0
    eng.sessions.clear()
    eng.index.clear()  # the cache forgets them; the pins still keep them
    assert all(p not in eng.pool._free for p in entry.pages[:full])
    eng.hkvr.drain("qwen3-tiny")
    assert all(eng.pool.use_refs[p] == 0 for p in entry.pages[:full])
    assert eng.pool.num_free == eng.pool.num_pages


def test_staged_switch_full_partial_and_dirty(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"], kv_pages=160, stage_chunk_bytes=512 * 1024)
    eng.switch_to("qwen3-tiny")
    staged = eng.stage("gpt2-tiny", wait=True)
    assert staged == eng.layouts["gpt2-tiny"].nbytes
    rec = eng.switch_to("gpt2-tiny")
    assert rec.path == "d2d_full" and rec.bytes_d2d == staged and rec.bytes_h2d == 0
    assert torch.equal(eng.bump.weight_region(), eng.host_images["gpt2-tiny"])
    # back on qwen3 (gpt2 auto-staged), then a long call allocates pages over the staged tail
    eng.switch_to("qwen3-tiny")
    eng.stage("gpt2-tiny", wait=True)
    tail_pages = (eng.bump.runtime_base - eng.bump.kv_base) // eng.page_bytes("qwen3-tiny")
    long_prompt = (TASK * 200)[: tail_pages * 16 - 40]
    eng.generate(Sequence("big", "big", "qwen3-tiny", long_prompt, 2))
    assert eng.staging.planner.dirty_events > 0
    rec = eng.switch_to("gpt2-tiny")
    assert rec.dirty_chunks > 0 and rec.path in ("d2d_partial", "host_only")
    assert rec.bytes_uncovered >= rec.dirty_chunks * 512 * 1024 - 512 * 1024
    assert rec.bytes_d2d + rec.bytes_h2d == eng.layouts["gpt2-tiny"].nbytes
    assert torch.equal(eng.bump.weight_region(), eng.host_images["gpt2-tiny"])  # no dirty chunk used
    out = eng.generate(Sequence("g", "g", "gpt2-tiny", TASK, 8)).token_ids
    assert out == fresh(make_engine, "gpt2-tiny", TASK, 8)


def test_staging_off_is_host_only(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"], staging=False)
    eng.switch_to("qwen3-tiny")
    assert eng.stage("gpt2-tiny", wait=True) == 0
    assert eng.switch_to("gpt2-tiny").path == "host_only"
    assert eng.stats().staging_free_bytes == 0


def test_session_states_report_device_and_host(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
    eng.generate(Sequence("a", "s1", "qwen3-tiny", TASK, 4))
    eng.generate(Sequence("b", "s2", "gpt2-tiny", TASK, 4))
    states = {(s, m): (st, n) for s, m, st, n in eng.session_states()}
    assert states[("s2", "gpt2-tiny")][0] == "device"
    assert states[("s1", "qwen3-tiny")] == ("host", (len(TASK) + 3) // 16 * 16)
    assert eng.kv_state("s3", "qwen3-tiny") == "none"
