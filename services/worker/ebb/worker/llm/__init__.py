"""Generation: a stage that keeps an engine full, and the engines behind it.

`engine` (what every engine offers: requests in, generations out as each finishes),
`prompts` (a model's prompts, token ids and context, for every engine), `hf` (the Hugging
Face `transformers` engine: a step loop that admits and retires sequences between decoding
steps) with `batch` (the left-padded KV cache of the sequences decoding together) and
`sampling` (each row's next token), `remote` (an OpenAI-compatible server fed over HTTP),
`managed` (such a server the stage runs beside it), `structured` (structured output: a shape
enforced token by token and checked), `stage` (the `llm` stage: prompts to token ids, the
context check, the engine and its restarts, the output columns), `provenance` (what generated
a shard's text, for its commit record, read in the worker process). Imports `torch` and
`transformers` only when a stage is built: importing Ebb never does. May use `modelets` and
`chunks`."""
