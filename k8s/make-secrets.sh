#!/bin/sh
# Prints one Secret per part of Ebb (master, controller, worker, client) holding its NATS
# user and a fresh random password; NATS reads all four. Create them once, before the first
# `kubectl apply -k k8s/base` (or k8s/overlays/prod):
#   kubectl create namespace ebb
#   sh k8s/make-secrets.sh | kubectl create -f -
# `create`, not `apply`: running it again must not change passwords under running pods.
# Clients (`ebb submit`) use ebb-nats-client's user and password.
set -eu
namespace=${NAMESPACE:-ebb}
prefix=${EBB_PREFIX:-ebb}
for role in master controller worker client; do
    password=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
    cat <<SECRET
---
apiVersion: v1
kind: Secret
metadata:
  name: ebb-nats-$role
  namespace: $namespace
  labels:
    app.kubernetes.io/part-of: ebb
type: Opaque
stringData:
  user: $prefix-$role
  password: "$password"
SECRET
done
