-- Dispatches agents refused: decided by a router whose partition claim another router had
-- taken since (it stalled past its TTL); the new owner ran the call. One row per refusal.
SELECT at, call_id, instance_id, router_id, partition, epoch, holder, holder_epoch
FROM refused_dispatches
ORDER BY at DESC
LIMIT 100;
