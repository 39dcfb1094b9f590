"""Both sides of the pipe between the router and the stage processes.

`columns` (`Columns`: a batch of rows as named arrays), `frames` (a chunk's wire format),
`shm` (shared-memory segments for large chunks), `segments` (their lifetimes). The bottom of
the worker: imports nothing of it but `metrics`."""
