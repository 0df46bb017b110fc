#!/usr/bin/env bash
# Create Talaria's Secrets in namespace talaria (run once, before `kubectl apply -k ops/k8s`; run
# again with AGENTS=N to scale the agents). Every secret is generated here, never stored in the
# manifests: the services' NATS users (`talaria nats-config`), the NATS route password, the
# Postgres passwords and one API key per tenant (printed once; only its hash is stored).
#   AGENTS=2 TENANTS=default ops/k8s/secrets.sh
set -euo pipefail
AGENTS=${AGENTS:-2}
TENANTS=${TENANTS:-default}
NS=${NAMESPACE:-talaria}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
umask 077
rand() { python3 -c 'import secrets; print(secrets.token_urlsafe(24))'; }

ids=$(seq -s, -f 'agent-%g' 0 $((AGENTS - 1)))
keys=""
: > "$work/api_keys"
for t in ${TENANTS//,/ }; do
  key="tk-$(rand)"
  keys="$keys,$t:$key"
  echo "$t $(python3 -c 'import hashlib,sys; print("sha256:" + hashlib.sha256(sys.argv[1].encode()).hexdigest())' "$key")" >> "$work/api_keys"
  echo "API key for tenant $t (shown once): $key"
done
TALARIA_API_KEYS=${keys#,} talaria nats-config "$work/nats-users" --agents "$ids" \
  --cluster-routes nats-0.nats:6222,nats-1.nats:6222,nats-2.nats:6222 >/dev/null
# nats.conf: the services' users (auth.conf) and the routes' user (cluster.conf), as JSON (valid
# nats-server config); each member's name comes from its pod (--name).
python3 - "$work/nats-users" > "$work/nats.conf" <<'PY'
import json, sys
d = sys.argv[1]
cluster = json.load(open(f"{d}/cluster.conf"))["cluster"]
print(json.dumps({"listen": "0.0.0.0:4222", "http": "0.0.0.0:8222", "jetstream": {"store_dir": "/data/jetstream"},
                  "cluster": {**cluster, "listen": "0.0.0.0:6222"}, **json.load(open(f"{d}/auth.conf"))}, indent=1))
PY
rm "$work/nats-users/cluster.conf" "$work/nats-users/auth.conf"  # the NATS servers' alone, in talaria-nats-conf

app=$(rand) admin=$(rand)
apply() { kubectl -n "$NS" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }
kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS"
apply talaria-nats-conf --from-file="$work/nats.conf"
apply talaria-nats-users --from-file="$work/nats-users"
apply talaria-api-keys --from-file=api_keys="$work/api_keys"
if ! kubectl -n "$NS" get secret talaria-db >/dev/null 2>&1; then  # never rotate a live database's password here
  apply talaria-db --from-literal=POSTGRES_ADMIN_PASSWORD="$admin" \
    --from-literal=TALARIA_DATABASE_URL="postgresql://talaria:$app@postgres:5432/talaria" \
    --from-literal=TALARIA_DATABASE_ADMIN_URL="postgresql://postgres:$admin@postgres:5432/talaria"
fi
echo "secrets written to namespace $NS; now: kubectl apply -k ops/k8s"
