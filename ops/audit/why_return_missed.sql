-- Why did this session's returns miss their instance? One row per call: the lease found,
-- what happened to it and why, where the call went and where its KV came from.
-- params: session_id
SELECT d.call_index,
       d.model,
       d.lease_outcome,
       d.lease_instance,
       d.discard_reason,
       d.chosen_instance,
       d.chosen_instance IS DISTINCT FROM d.lease_instance AS moved,
       d.model_opened,
       d.avoidable_cold_open,
       d.kv_source,
       round(d.ttft_s::numeric, 3) AS ttft_s,
       jsonb_array_length(d.candidates) AS candidates
FROM lease_decisions d
WHERE d.session_id = :session_id
ORDER BY d.call_index;
