-- Poison events the telemetry projection recorded and skipped (each also logged as an ALERT).
-- `data` holds the raw message for a replay once the cause is fixed.
SELECT seq, subject, at, left(error, 200) AS error, length(data) AS bytes
FROM quarantined_events
ORDER BY seq DESC
LIMIT 100;
