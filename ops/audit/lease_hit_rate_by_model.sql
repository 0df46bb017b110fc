-- Lease hit rate and unused leases by model. A lease is unused when it expired or was
-- discarded instead of being consumed by the session's next call.
SELECT model,
       count(*) FILTER (WHERE kind = 'issued') AS issued,
       count(*) FILTER (WHERE kind = 'consumed') AS consumed,
       count(*) FILTER (WHERE kind = 'discarded') AS discarded,
       count(*) FILTER (WHERE kind = 'expired') AS expired,
       round(count(*) FILTER (WHERE kind = 'consumed')::numeric
             / nullif(count(*) FILTER (WHERE kind = 'issued'), 0), 3) AS hit_rate
FROM lease_events
GROUP BY model
ORDER BY model;
