"""The Ray Data peer of benchmark 16, a command of its own (no Ebb import: Ray runs in a venv of
its own). `python llm_peers.py MODEL ROWS.json`: generate for ROWS (a JSON list of [prompt ids,
max_tokens]) with Ray Data `map_batches` over `model.generate` in static batches, as section
16's static loop does, twice (the first warms up); print the second's output tokens and
seconds as JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

BATCH = 32


class Generate:
    """A Ray Data actor: the model loaded once, `model.generate` on each batch, left-padded to
    its longest prompt and run to its longest `max_tokens`, each row cut to its own."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)  # as the static loop's process has them
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model.eval()  # type: ignore[no-untyped-call]  # untyped upstream
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos) if isinstance(eos, list) else {eos}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        torch = self.torch
        prompts = [list(p) for p in batch["ids"]]
        budgets = [int(m) for m in batch["m"]]
        longest = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(budgets),
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(self.eos),
            )
        useful = []
        for i, m in enumerate(budgets):
            tokens = out[i, longest : longest + m].tolist()
            useful.append(next((k for k, t in enumerate(tokens) if t in self.eos), len(tokens)))
        return {"useful": np.array(useful)}


def main(model_dir: str, rows_file: str) -> None:
    import ray

    with open(rows_file) as f:
        rows = json.load(f)
    # Fractional CPUs: on 2 cores an actor holding a whole one can starve the read tasks.
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        result = {}
        for _ in range(2):
            started = time.perf_counter()
            ds = ray.data.from_items([{"ids": p, "m": m} for p, m in rows])
            tokens = ds.map_batches(
                Generate,
                fn_constructor_args=(model_dir,),
                batch_size=BATCH,
                concurrency=1,
                num_cpus=0.5,
            ).sum("useful")
            result = {"tokens": int(tokens), "seconds": time.perf_counter() - started}
    finally:
        ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
