-- Why leases were discarded, by model and reason.
SELECT model, reason, count(*) AS discarded
FROM lease_events
WHERE kind = 'discarded'
GROUP BY model, reason
ORDER BY discarded DESC;
