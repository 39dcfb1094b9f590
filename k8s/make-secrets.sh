#!/bin/sh
# Makes the NATS keys of a new installation and prints them as Secrets
# (ebb.common.messaging.installation):
#   ebb-nats-auth           auth.conf: nats-server's operator and accounts (operator mode)
#   ebb-nats-master         creds: the shard master's credentials
#   ebb-nats-controller     creds: the controller's credentials
#   ebb-nats-client         creds: the operator's client (`ebb submit`, the SDK: EBB_NATS_CREDS),
#                           which sees every job
#   ebb-nats-gateway        creds: the Batch API gateway's credentials
#   ebb-nats-worker-signer  signing_key, account: with these the controller mints each worker
#                           pod a credential of its own (only the controller reads this one)
#   ebb-nats-tenant-signer  signing_key, account: with these the operator mints each team a
#                           credential of its own jobs (no pod reads this one):
#     kubectl -n ebb get secret ebb-nats-tenant-signer -o yaml \
#       | python -m ebb.common.messaging.installation team team-a --signer - > team-a.creds
# Create them once, before the first `kubectl apply -k k8s/base` (or k8s/overlays/prod):
#   kubectl create namespace ebb
#   sh k8s/make-secrets.sh | kubectl create -f -
# `create`, not `apply`: running it again makes a new operator and new keys; applied, they
# would lock out every running pod. Needs Ebb installed (PYTHON: the interpreter that has it).
set -eu
exec "${PYTHON:-python3}" -m ebb.common.messaging.installation k8s \
    --namespace "${NAMESPACE:-ebb}" --prefix "${EBB_PREFIX:-ebb}"
