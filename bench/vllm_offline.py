"""vLLM's offline engine (`vllm.LLM`) in a process of its own, for section 21: what an
`engine: vllm` stage runs. Started with vLLM's venv's Python (it imports nothing of Ebb's);
loads the model once (its engine core in this process, as `engine: vllm` runs it, unless
VLLM_ENABLE_V1_MULTIPROCESSING says otherwise), prints `{"ready": seconds}`, then for each
line on stdin (a JSON file of [prompt token ids, max_tokens] rows) generates them all in one
`LLM.generate` call, greedy, and prints `{"tokens": made, "seconds": the call's}`. Each answer
is a line that begins with `ANSWER`: vLLM logs to stdout too."""

from __future__ import annotations

import json
import os
import sys
import time


def main(model: str) -> None:
    # As `engine: vllm` runs it (ebb.worker.llm.vllm_engine): the engine core in this process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    # As the server is started in this section: float32, no torch.compile (-O0), 2 GiB of
    # KV cache.
    llm = LLM(
        model=model,
        dtype="float32",
        optimization_level=0,
        kv_cache_memory_bytes=2 << 30,
    )
    print("ANSWER", json.dumps({"ready": time.perf_counter() - started}), flush=True)
    for line in sys.stdin:
        with open(line.strip()) as f:
            rows = json.load(f)
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in rows]
        params = [SamplingParams(max_tokens=m, temperature=0) for _, m in rows]
        began = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        print("ANSWER", json.dumps({"tokens": made, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
