"""A shard's input and output, called from the event loop (blocking parts in threads).

`reader` (a shard's rows from Parquet, JSONL, CSV or text, as `Columns`), `textrows` (the text
formats' row ranges), `writer` (the output file, written and committed once), `handoff` (a
tier's output as the next tier's input: the Arrow files between tiers). May use `chunks` and
`ebb.common`; knows nothing of the pipeline."""
