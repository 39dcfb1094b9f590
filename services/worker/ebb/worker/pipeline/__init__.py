"""The pipeline: the router thread and the stage processes it starts, feeds and watches.

`front` is what the event loop calls (`Pipeline`: submit a shard's rows, await its results);
`config` its settings. On the router thread: `router` (its loop), `mailbox` (requests from the
event loop), `conveyor` (chunks along the stages), `joins` and `families` (branches meeting
again; a row and the rows it became), `ledger` (which uid is where). Stage processes:
`stagepool` and `processes` (start, stop, recycle), `watchdog` (a stage that hangs),
`enginemeter` (llm stages' engines, read into the worker's metrics), `scaling`
and `elastic` (processes per stage as the load moves), `stageserver` (the fork server they
come from). May use `stage`, `modelets`, `resources`, `chunks`."""
