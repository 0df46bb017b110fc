-- Every call of a session in order, with timings and where its KV came from.
-- params: session_id
SELECT call_index, model, instance_id, outcome, prompt_tokens, cached_tokens, output_tokens, kv_source,
       round(queue_s::numeric, 3) AS queue_s, round(ttft_s::numeric, 3) AS ttft_s,
       round(prefill_s::numeric, 3) AS prefill_s, round(decode_s::numeric, 3) AS decode_s, error
FROM calls
WHERE session_id = :session_id
ORDER BY call_index;
