-- Is tau (the lease timeout) right? For each session return: the gap between the previous
-- call's completion and this call's decision, whether a lease was live, and the outcome.
-- Returns that arrive just after expiry suggest a longer tau; many unused leases a shorter one.
WITH returns AS (
  SELECT d.session_id, d.call_index, d.model, d.lease_outcome, d.discard_reason, d.kv_source, d.ttft_s,
         extract(epoch FROM d.decided_at - prev.completed_at) AS gap_s
  FROM lease_decisions d
  JOIN calls prev ON prev.session_id = d.session_id AND prev.call_index = d.call_index - 1
  WHERE d.call_index > 0 AND prev.completed_at IS NOT NULL
)
SELECT width_bucket(gap_s, 0, 5, 10) AS gap_bucket,
       round(min(gap_s)::numeric, 2) AS gap_from_s,
       round(max(gap_s)::numeric, 2) AS gap_to_s,
       count(*) AS returns,
       count(*) FILTER (WHERE lease_outcome = 'consumed') AS lease_consumed,
       count(*) FILTER (WHERE discard_reason = 'expired' OR lease_outcome = 'none') AS no_live_lease,
       count(*) FILTER (WHERE kv_source IN ('device', 'host')) AS kv_reused,
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_s)::numeric, 3) AS ttft_p50_s
FROM returns
GROUP BY 1
ORDER BY 1;
