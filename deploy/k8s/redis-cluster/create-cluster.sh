#!/bin/sh
# Join the StatefulSet's nodes into a Redis Cluster with one replica per master; nothing to do
# when they already form one (the Job may run again). redis-cli takes its password from REDISCLI_AUTH.
set -eu
: "${NODES:=6}" "${SERVICE:=dynemb-redis-cluster}" "${STATEFULSET:=dynemb-redis-cluster}"
first="$STATEFULSET-0.$SERVICE"
addresses=""
i=0
while [ "$i" -lt "$NODES" ]; do
  host="$STATEFULSET-$i.$SERVICE"
  until redis-cli -h "$host" ping 2>/dev/null | grep -q PONG; do
    echo "waiting for $host"; sleep 2
  done
  # CLUSTER MEET wants addresses: resolve the pod's name
  addresses="$addresses $(getent hosts "$host" | awk '{print $1; exit}'):6379"
  i=$((i + 1))
done
if redis-cli -h "$first" cluster info | grep -q '^cluster_state:ok'; then
  echo "cluster already formed"; exit 0
fi
# shellcheck disable=SC2086  # one argument per address
redis-cli --cluster create $addresses --cluster-replicas 1 --cluster-yes
