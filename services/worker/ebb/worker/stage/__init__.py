"""What runs inside a stage process: `loop` (its loop: read a chunk, batch, call the modelet,
send the results), `batcher` (adaptive batches by size and wait), `metering` (the stage's
metric columns), `board` (what the process tells the router it is doing), `lifeline` (the
process ends when its router does). May use `modelets`, `resources`, `chunks`; never the
router's side."""
