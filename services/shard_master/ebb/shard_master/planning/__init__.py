"""How an input is cut into shards: `planner` reads a dataset's metadata (never its rows) and
plans shards of whole row groups or byte ranges; `sizing` sizes them for the fleet. Blocking
and free of NATS: the table runs it in a thread."""
