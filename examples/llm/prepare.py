"""Make what `job.yaml` reads: a model folder (`model/`) and the prompts (`prompts.jsonl`).

    python prepare.py [--rows N] [--dir DIR]

Nothing is downloaded: the model is built here from a config, its tokenizer trained here
(tiny_model.py). The prompts are of two tasks, as an evaluation or a labelling job mixes them:
short labelling chats (an answer of a few tokens) and longer summaries (up to 96 tokens).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import tiny_model

HERE = Path(__file__).resolve().parent


def prompts(rows: int, seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    texts = tiny_model.corpus(rows, seed=seed)
    out: list[dict[str, object]] = []
    for i, text in enumerate(texts):
        if rng.random() < 0.75:
            chat = [
                {"role": "system", "content": "Answer with one word: positive or negative."},
                {"role": "user", "content": text},
            ]
            out.append({"id": i, "task": "label", "prompt": chat, "max_tokens": 4})
        else:
            chat = [{"role": "user", "content": f"Summarise: {text}"}]
            out.append({"id": i, "task": "summary", "prompt": chat, "max_tokens": 96})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=2_000)
    p.add_argument("--dir", type=Path, default=HERE)
    args = p.parse_args()
    tiny_model.build_tiny_llm(args.dir / "model", layers=4, hidden=256, vocab=2000, context=512)
    lines = "".join(json.dumps(r) + "\n" for r in prompts(args.rows))
    (args.dir / "prompts.jsonl").write_text(lines)
    print(f"wrote {args.dir / 'model'} and {args.rows:,} prompts to {args.dir / 'prompts.jsonl'}")


if __name__ == "__main__":
    main()
