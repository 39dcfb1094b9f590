"""The controller: worker capacity reconciled against the cluster, locally or on Kubernetes.

The folders are its layers, each importing only those below it (import-linter keeps the order,
pyproject.toml):

- here, on the event loop: `service` (its loop: lead, reconcile, stand by), `reconcile` (one
  pass, level-triggered: desired workers per job and tier against those that run), `election`
  (the Kubernetes Lease), `backend` (the protocol every backend speaks), `groups` (the workers
  of one tier of one job, sized on its backlog);
- `local/` and `kube/`, the two backends, independent of each other: child processes on this
  machine; pods on a cluster (its informers, pod specs, placement, the tide's harvest);
- `policy/`, pure decisions of plain values, tested by tables: capacity, failures and their
  classes, a pipeline that cannot start, nodes to avoid, pools, the tide;
- `metrics`, which every layer uses.
"""
