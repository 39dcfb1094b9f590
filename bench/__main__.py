"""`python -m bench` (`make bench`): every benchmark, side by side, into docs/benchmarks.md.

python -m bench            the full run (about 12 minutes on 2 cores)
python -m bench --quick    small sizes, one repeat each (about 3 minutes)
python -m bench --only single,stragglers   (only these sections of the report are replaced)
python -m bench --smoke    tiny sizes, the harness only: its report goes to the scratch folder
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import report
from .common import REPO, Context, Section, gpu

# Each section by its name, the module that measures it; modules are imported only when their
# section runs, so one section needs only its own packages (the GPU machine has no peers).
SECTIONS = {
    "single": "single_model",
    "fanout": "fanout",
    "stragglers": "stragglers",
    "scale": "master_scale",
    "startup": "startup",
    "tidal": "tidal_sim",
    "mlp": "mlp",
    "overhead": "overhead",
    "embedding": "embedding",
    "minilm": "minilm",
    "objectstore": "objectstore",
    "cores": "cores",
    "oneread": "one_read",
    "tiers": "tiers",
    "tierssim": "tiers_sim",
    "llm": "llm",
    "llmgpu": "llm_gpu",
    "gateway": "gateway",
    "onegroup": "one_group",
    "hostile": "hostile",
    "vllm": "llm_vllm",
    "tidalplane": "tidal_plane",
    "gatewayembed": "gateway_embed",
}
ORDER = list(SECTIONS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: the harness only")
    p.add_argument("--only", default=",".join(ORDER), help=f"some of: {','.join(ORDER)}")
    p.add_argument("--repeats", type=int, default=None, help="runs of each variant (median)")
    p.add_argument(
        "--out",
        default=None,
        help="the report (default: docs/benchmarks.md; with --smoke, one in the scratch folder)",
    )
    p.add_argument("--workdir", default=None, help="scratch space (default: a temporary folder)")
    args = p.parse_args(argv)
    chosen = [name for name in ORDER if name in args.only.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ebb-bench-"))
    # Smoke figures measure nothing: they never replace the report's unless asked to.
    default_out = workdir / "benchmarks.md" if args.smoke else REPO / "docs" / "benchmarks.md"
    out = Path(args.out) if args.out else default_out
    ctx = Context(
        quick=args.quick or args.smoke,
        smoke=args.smoke,
        workdir=workdir,
        docs=out.parent,
        repeats=args.repeats or (1 if args.quick or args.smoke else 3),
        log=lambda line: print(line, flush=True),
        device=gpu() or "cpu",
    )
    started = time.perf_counter()
    sections: list[Section] = []
    try:
        rows_per_s: float | None = None
        skipped: list[str] = []
        for name in chosen:
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            module = importlib.import_module(f"bench.{SECTIONS[name]}")
            found: Section | None
            if name == "scale":
                found = module.run(ctx, rows_per_s_per_worker=rows_per_s)
            else:
                found = module.run(ctx)
            if found is None:  # it cannot run here (no GPU): the report keeps it as it was
                skipped.append(name)
                continue
            section = found
            if name == "single":
                rows_per_s = float(section.summary["ebb_rows_per_s"])
            print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
            for t in section.tables:
                print(t, flush=True)
            sections.append(section)
        if (set(chosen) != set(ORDER) or skipped) and out.exists():
            report.update(out, sections)  # the other sections' figures stay as they were
        else:
            report.write(out, sections, ctx, seconds=time.perf_counter() - started)
        print(f"wrote {out} in {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
