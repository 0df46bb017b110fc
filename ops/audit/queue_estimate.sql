-- Did the router price the queue it sent each call into? One row per routed call: the queue
-- the router estimated on the chosen instance (queue_s of that candidate: work queued there,
-- not the leases it reserved, which are reserved_s) against the queue the call met (from
-- routed to its prefill's start), and the error. The newest 500.
SELECT d.call_id,
       d.session_id,
       d.chosen_instance AS instance_id,
       round((c->>'queue_s')::numeric, 3) AS queue_est_s,
       round((c->>'reserved_s')::numeric, 3) AS reserved_s,
       round(extract(epoch FROM (k.started_at - k.routed_at))::numeric, 3) AS queue_measured_s,
       round(((c->>'queue_s')::float8 - extract(epoch FROM (k.started_at - k.routed_at)))::numeric, 3) AS error_s,
       k.outcome
FROM lease_decisions d
JOIN calls k ON k.call_id = d.call_id
CROSS JOIN LATERAL jsonb_array_elements(d.candidates) AS c
WHERE d.action = 'route'
  AND c->>'instance_id' = d.chosen_instance
  AND k.started_at IS NOT NULL AND k.routed_at IS NOT NULL
ORDER BY d.decided_at DESC
LIMIT 500;
