"""KV admission by the expected output, not max_tokens: a large cap is admitted for what the
router expects the call to use, grows past it into unreserved pages, waits while none is
left, and only when no call can go on finishes on the instance (finish reason "length"),
never touching other calls' pages."""

import pytest

from talaria.services.instance_agent.engine import OutOfKvPages, Sequence

M = "qwen3-tiny"  # 131,072-token context


def test_a_32k_cap_is_admitted_for_its_expected_output_and_grows_past_it(make_engine):
    eng = make_engine([M], kv_pages=16, staging=False)  # 256 tokens of KV: far below 40 + 32,000
    prompt = [65] * 40
    with pytest.raises(OutOfKvPages):  # reserving the cap: refused
        eng.prefill([Sequence("cap", "s0", M, prompt, 32_000)])
    assert not eng.running
    est = Sequence("est", "s1", M, prompt, 32_000, kv_output_tokens=8)
    first = eng.prefill([est])
    assert est.total_pages == 3  # ceil((40 + 8 - 1) / 16), not 32,000 tokens
    for _ in range(29):  # 30 tokens in all: past its 8, into free pages
        eng.decode([est])
    got = eng.finish(est)
    assert len(got.token_ids) == 30 and got.token_ids[0] == first[0].token_id
    ref = make_engine([M], kv_pages=64, staging=False, hkvr=False)
    assert got.token_ids == ref.generate(Sequence("r", "r", M, prompt, 30)).token_ids  # same tokens


def _run_like_the_agent(eng, seqs, limit=10_000):
    """Decode until every call finished, releasing each as soon as it finishes (as the
    runner does); (results, steps in which each call got no token), by call id."""
    results, waited, live = {}, {s.call_id: 0 for s in seqs}, list(seqs)
    for _ in range(limit):
        if not live:
            break
        got = {st.call_id: st for st in eng.decode(live)}
        for s in live:
            if s.call_id not in got:
                waited[s.call_id] += 1
            elif got[s.call_id].finished:
                results[s.call_id] = eng.finish(s)
        live = [s for s in live if s.call_id not in results]
    return results, waited


def test_a_call_that_outgrows_a_full_pool_waits_for_room_and_others_keep_their_pages(make_engine):
    eng = make_engine([M], kv_pages=16, staging=False, hkvr=False)  # 256 tokens
    small = Sequence("a", "sa", M, [66] * 60, 1_000, kv_output_tokens=4)  # 4 pages reserved
    big = Sequence("b", "sb", M, [67] * 60, 120, kv_output_tokens=120)  # 12 pages: the rest
    eng.prefill([small, big])
    out, waited = _run_like_the_agent(eng, [small, big])
    assert len(out["b"].token_ids) == 120  # everything it reserved, never taken from it
    assert waited["a"] > 0 and waited["b"] == 0  # `a` waited while `b` held the pool ...
    assert len(out["a"].token_ids) > 120  # ... then grew into what `b` left
    # the pool is full of `a` alone: it ends with what it has, as at the context limit
    assert out["a"].finish_reason == "length" and len(out["a"].token_ids) < 1_000
    ref = make_engine([M], kv_pages=64, staging=False, hkvr=False)
    n = len(out["a"].token_ids)
    assert out["a"].token_ids == ref.generate(Sequence("r", "r", M, [66] * 60, n)).token_ids  # waiting changes no token
    assert not eng.running and eng.pool.num_unused() == eng.pool.num_pages  # nothing leaked
