"""The worker: it leases shards, runs them through the job's pipeline of stage processes and
commits each shard's output exactly once.

The folders are its execution contexts and layers, each importing only those below it
(import-linter keeps the order, pyproject.toml):

- here, on the event loop: `entry` (the process: start the fork server, connect, serve),
  `service` (its loop: one job session after another), `session` (one job: its pipeline and its
  leases), `attempt` (one shard, read -> pipeline -> write -> commit, no NATS in it), `leases`
  with `progress` (renewals, the shard's rows done), `reports` (to the master), `metrics`;
- `shardio/`, a shard's input and output: `reader`, `textrows`, `writer`, `handoff` (a tier's
  output as the next tier's input);
- `pipeline/`, the router thread and the stage processes it owns: `front` (what the event loop
  calls), `config`, `router` (its loop), `mailbox`, `conveyor`, `joins`, `families`, `ledger`,
  `stagepool`, `processes`, `watchdog`, `scaling`, `elastic`, `stageserver` (the fork server);
- `stage/`, what runs inside a stage process: `loop` (its loop), `batcher`, `metering`,
  `board`, `lifeline`;
- `llm/`, the `llm` stage and its engines (transformers in the stage's process, an
  OpenAI-compatible endpoint, a server the stage runs);
- `modelets/`, what users import and name in a job spec: the API, the built-ins, `Fetch`, the
  model runtimes, `multimodel`;
- `modelcache/`, the node's model cache: its own deployable (`python -m ebb.worker.modelcache`,
  a DaemonSet), and the client the runtimes use;
- `resources/`, the process's share of the host: `cpus`, `devices`;
- `chunks/`, both sides of the pipe between processes: `columns`, `frames`, `shm`, `segments`.
"""
