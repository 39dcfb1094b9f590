"""The node's model cache: a server per node (a DaemonSet, `python -m ebb.worker.modelcache`)
and the client workers use to reach it.

`server` (the HTTP server and its fetches), `command` (its command line), `metrics`,
`protocol` (its requests and replies), `store` (the cache's files on disk), `index` (what is
in it), `client` (a worker's side, with its fallback to reading the store itself). Imports
nothing of the worker."""
