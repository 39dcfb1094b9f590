"""Where a job's rows live: stores, the output root and its exactly-once commit protocol.

`storage` (every read, write and list of a store, retried as its errors say), `layout` (what
an output root holds, and where), `output` (the commit protocol: claims, commit records, the
manifest), `durable` (files complete before they are visible on a local disk), `csvrows`
(where CSV rows end). May use `ebb.common.job` and the foundation; never `messaging`."""
