"""The controller's pure decisions: functions of plain values, no I/O, no clock of their own.

`capacity` (what the cluster can spare, bin by bin), `failures` (how a worker's end reads:
the cluster's fault, an OOM, a crash), `setupfailures` (a pipeline that cannot start: the
node's fault until it is everyone's), `avoidance` (nodes that keep failing), `pools` (where a
job's workers run, WPAI), `tidal` (the tide: which mixed nodes to lend or reclaim)."""
