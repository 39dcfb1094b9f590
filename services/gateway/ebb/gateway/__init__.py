"""The OpenAI Batch API gateway: files and batches over HTTP, each batch an Ebb job.

- `__main__`: `python -m ebb.gateway`, the process.
- `service`: the service: the HTTP server and the reconcile loop (`Gateway.run`), side by side.
- `api`: the HTTP edge: routes, keys, the API's error shapes (aiohttp).
- `batches`: the reconcile loop: a batch's way from `validating` to an end, level-triggered
  over the records in KV, so that any replica, or one restarted, carries each batch on.
- `records`: the files' and batches' records in NATS KV, written compare-and-set.
- `requests`: the input file's lines checked and turned into the job's rows (pure).
- `results`: the job's committed rows turned into the output and error files (no NATS).
- `jobspec`: a batch's job, from the operator's model catalogue.
- `store`: the files' bytes in a data root or object store, streamed, never whole in memory.
- `config`: the catalogue, the keys and their quotas, the limits.
- `metrics`: what it exports to Prometheus.
"""
