"""The worker's parts, each on its own: attempts, the pipeline and its stage processes, frames and
chunks, shard I/O, the node model cache (real processes and files, no master)."""
