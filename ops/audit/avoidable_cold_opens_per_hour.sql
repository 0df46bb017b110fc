-- Avoidable cold opens per hour: the chosen instance had to open the model although another
-- healthy instance already had it resident.
SELECT date_trunc('hour', decided_at) AS hour,
       policy,
       count(*) FILTER (WHERE avoidable_cold_open) AS avoidable_cold_opens,
       count(*) FILTER (WHERE model_opened) AS model_opens,
       count(*) AS decisions
FROM lease_decisions
GROUP BY 1, 2
ORDER BY 1, 2;
