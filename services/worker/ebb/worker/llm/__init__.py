"""Generation: a stage that keeps an engine full, and the engines behind it.

`engine` (what every engine offers: requests in, generations out as each finishes), `batch`
(the left-padded KV cache of the sequences decoding together), `sampling` (each row's next
token), `hf` (the Hugging Face `transformers` engine: a step loop that admits and retires
sequences between decoding steps), `stage` (the `llm` stage: prompts to token ids, the
context check, the engine, the output columns). Imports `torch` and `transformers` only when
a stage is built: importing Ebb never does. May use `modelets` and `chunks`."""
