"""The process's share of the host: `cpus` (cores for each stage, BLAS threads, pinning) and
`devices` (which GPU each stage process is handed). Imports nothing of the worker."""
