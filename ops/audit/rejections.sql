-- Calls the router refused, and why: the policy's reason (the bound it hit) per model.
SELECT model, policy, reason, count(*) AS rejected, max(decided_at) AS last_at
FROM lease_decisions
WHERE action = 'reject'
GROUP BY model, policy, reason
ORDER BY rejected DESC;
