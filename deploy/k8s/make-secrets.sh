#!/usr/bin/env bash
# Make the files deploy/k8s's kustomizations turn into Secrets (kept out of git, never
# overwritten): a random PS auth token and Redis password, and for overlays/standalone-tls a CA
# and a PS certificate for the dynemb-ps Service (and localhost, for the probes).
#   deploy/k8s/make-secrets.sh [NAMESPACE]      (default: dynemb)
set -euo pipefail
cd "$(dirname "$0")"
ns=${1:-dynemb}
mkdir -p base/secrets components/ps-tls/secrets
umask 077
for f in base/secrets/ps-token base/secrets/redis-password; do
  [ -s "$f" ] || { openssl rand -hex 32 | tr -d '\n' > "$f"; echo "made $f"; }
done
tls=components/ps-tls/secrets
if [ ! -s $tls/tls.crt ]; then
  openssl req -x509 -newkey rsa:3072 -nodes -days 3650 -subj "/CN=dynemb PS CA" \
    -keyout $tls/ca.key -out $tls/ca.crt 2>/dev/null
  openssl req -newkey rsa:3072 -nodes -subj "/CN=dynemb-ps" -keyout $tls/tls.key -out $tls/tls.csr 2>/dev/null
  printf 'subjectAltName=DNS:dynemb-ps,DNS:dynemb-ps.%s,DNS:dynemb-ps.%s.svc,DNS:dynemb-ps.%s.svc.cluster.local,DNS:localhost,IP:127.0.0.1\n' \
    "$ns" "$ns" "$ns" > $tls/san.ext
  openssl x509 -req -in $tls/tls.csr -CA $tls/ca.crt -CAkey $tls/ca.key -CAcreateserial -days 825 \
    -extfile $tls/san.ext -out $tls/tls.crt 2>/dev/null
  rm -f $tls/tls.csr $tls/san.ext $tls/ca.srl
  echo "made $tls/{ca.crt,ca.key,tls.crt,tls.key} (keep ca.key safe: it signs the PS's certificates)"
fi
