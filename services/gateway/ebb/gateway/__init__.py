"""The OpenAI Batch API gateway: files and batches over HTTP, each batch an Ebb job.

- `__main__`: `python -m ebb.gateway`, the process.
- `service`: the service: the HTTP server and the reconcile loop (`Gateway.run`), side by side.
- `api`: the HTTP edge: routes, keys (aiohttp); `params` reads the API's parameters,
  `apierror` is its error shape.
- `batches`: the reconcile loop: which batch is stepped when, level-triggered over an index
  of the live batches in KV, each step a task of its own, so that any replica, or one
  restarted, carries each batch on and no batch's long step holds another's.
- `steps`: one batch's steps, from `validating` to its end, written compare-and-set.
- `quota`: a key's quotas held across replicas: reserve in a ledger, then commit.
- `records`: the files' and batches' records in NATS KV, written compare-and-set.
- `requests`: the input file's lines checked and turned into the job's rows (pure);
  `bodies`: one request's body, as its row or its refusal.
- `results`: the job's committed rows turned into the output and error files (no NATS).
- `jobspec`: a batch's job, from the operator's model catalogue.
- `store`: the files' bytes in a data root or object store, streamed, never whole in memory.
- `config`: the catalogue, the keys and their quotas, the limits.
- `metrics`: what it exports to Prometheus.
"""
