"""KV admission by the expected output, not max_tokens: a large cap is admitted for what the
router expects the call to use, grows past it into unreserved pages, and when none is left
finishes on the instance (finish reason "length") without touching other calls' pages."""

import pytest

from talaria.services.instance_agent.engine import GenRequest, OutOfKvPages

M = "qwen3-tiny"  # 131,072-token context


def _decode_to_end(eng, call_ids, limit=10_000):
    steps = {c: [] for c in call_ids}
    live = list(call_ids)
    for _ in range(limit):
        if not live:
            break
        for st in eng.decode(live):
            steps[st.call_id].append(st)
        live = [c for c in live if not steps[c][-1].finished]
    return {c: eng.finish(c) for c in call_ids}


def test_a_32k_cap_is_admitted_for_its_expected_output_and_grows_past_it(make_engine):
    eng = make_engine([M], kv_pages=16, staging=False)  # 256 tokens of KV: far below 40 + 32,000
    prompt = [65] * 40
    with pytest.raises(OutOfKvPages):  # reserving the cap: refused
        eng.prefill([GenRequest("cap", "s0", M, prompt, 32_000)])
    assert not eng.running
    first = eng.prefill([GenRequest("est", "s1", M, prompt, 32_000, kv_output_tokens=8)])
    assert eng.running["est"].total_pages == 3  # ceil((40 + 8 - 1) / 16), not 32,000 tokens
    for _ in range(29):  # 30 tokens in all: past its 8, into free pages
        eng.decode(["est"])
    got = eng.finish("est")
    assert len(got.token_ids) == 30 and got.token_ids[0] == first[0].token_id
    ref = make_engine([M], kv_pages=64, staging=False, hkvr=False)
    assert got.token_ids == ref.generate(GenRequest("r", "r", M, prompt, 30)).token_ids  # same tokens


def test_a_call_that_outgrows_a_full_pool_finishes_there_and_others_keep_their_pages(make_engine):
    eng = make_engine([M], kv_pages=16, staging=False, hkvr=False)
    small = GenRequest("a", "sa", M, [66] * 60, 1_000, kv_output_tokens=4)  # 4 pages reserved
    big = GenRequest("b", "sb", M, [67] * 60, 120, kv_output_tokens=120)  # 12 pages: the rest
    eng.prefill([small, big])
    out = _decode_to_end(eng, ["a", "b"])
    assert out["a"].finish_reason == "length" and 4 <= len(out["a"].token_ids) < 1_000
    assert out["b"].finish_reason == "length" and len(out["b"].token_ids) == 120  # all it reserved
    assert not eng.running and eng.pool.num_unused() == eng.pool.num_pages  # nothing leaked
