"""docs/benchmarks.md and its plots, from the sections the benchmarks return."""

from __future__ import annotations

import datetime
import re
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .common import Context, Section, machine, median


def _bars(path: Path, title: str, plot: dict[str, Any]) -> None:
    values: dict[str, list[float]] = plot["values"]
    labels = list(values)
    mids = [median(v) for v in values.values()]
    lows = [m - min(v) for m, v in zip(mids, values.values(), strict=True)]
    highs = [max(v) - m for m, v in zip(mids, values.values(), strict=True)]
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(labels)))
    ax.barh(labels, mids, xerr=[lows, highs], color="#4878a8", capsize=3)
    if plot.get("line"):
        ax.axvline(plot["line"], color="#c44e52", linestyle="--", label=plot.get("line_label", ""))
        ax.legend(loc="lower right")
    ax.invert_yaxis()
    ax.set_xlabel(plot["unit"])
    ax.set_title("\n".join(textwrap.wrap(title, 50)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _scale(path: Path, title: str, plot: dict[str, Any]) -> None:
    series: dict[str, dict[str, list[float]]] = plot["series"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, values in series.items():
        left.plot(plot["workers"], values["ops_per_mrow"], marker="o", label=label)
        right.plot(plot["workers"], values["share"], marker="o", label=label)
    left.set_xscale("log")
    left.set_ylim(bottom=0)
    left.set_xlabel("simulated workers")
    left.set_ylabel("requests per million rows")
    left.legend(fontsize=8)
    right.axhline(1.0, color="#c44e52", linestyle="--", label="1%")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("simulated workers")
    right.set_ylabel("master's share of a worker's time, %")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(path: Path, title: str, plot: dict[str, Any]) -> None:
    runs: dict[str, dict[str, list[float]]] = plot["series"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3 * len(runs)), sharex=True)
    for ax, (policy, series) in zip(axes, runs.items(), strict=True):
        hours = [m / 60 for m in range(len(series["load"]))]
        ax.plot(hours, series["load"], label="online load (nodes)", color="#c44e52")
        ax.plot(hours, series["harvested"], label="batch on mixed (nodes)", color="#4878a8")
        ax.plot(hours, [b / 4 for b in series["batch"]], label="batch pods / 4", color="#55a868")
        ax.bar(hours, series["pending"], width=1 / 60, label="online pods pending", color="#8172b2")
        ax.set_ylabel(policy)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("hour of the simulated trace")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lines(path: Path, title: str, plot: dict[str, Any]) -> None:
    """One panel per run, each of its series against the run's `plot["x"]` series."""
    runs: dict[str, dict[str, list[float]]] = plot["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.8 * len(runs)), sharex=True)
    for ax, (run, series) in zip(axes, runs.items(), strict=True):
        x = series[plot["x"]]
        for label, values in series.items():
            if label != plot["x"]:
                ax.plot(x, values, label=label)
        ax.set_ylabel(run)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel(plot["xlabel"])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _claims(sections: dict[str, Section]) -> list[str]:
    rows = ["| AntBatchInfer reports | measured here |", "|---|---|"]
    if "single" in sections:
        s = sections["single"].summary
        rows.append(
            "| pipelining + intra-node scaling: >= 2x over a baseline without them (one model) "
            f"| best Ebb variant {s['speedup']:.2f}x the sequential loop (ONNX Runtime on every "
            f"core), {s['speedup_1_thread']:.2f}x a single-threaded one; {s['efficiency']:.0%} "
            "of the hardware bound |"
        )
    if "fanout" in sections:
        s = sections["fanout"].summary
        rows.append(
            "| two models, multi-stage vs one stage: ~6x (68 -> 398 samples/s) "
            f"| {s['speedup']:.2f}x |"
        )
    if "stragglers" in sections:
        s = sections["stragglers"].summary
        rows.append(
            "| dynamic shard assignment: 12-30% shorter jobs than an even split "
            f"| {s['reduction']:.0%} shorter with small shards and speculation, "
            f"{s['liquid_reduction']:.0%} with the even split and the liquid tail (one worker "
            "at half speed) |"
        )
    if "scale" in sections:
        s = sections["scale"].summary
        sizes = sorted(int(k.rsplit("_", 1)[1]) for k in s if k.startswith("share_fleet_"))
        before = " / ".join(f"{s[f'share_fixed_{w}']:.2%}" for w in sizes)
        after = " / ".join(f"{s[f'share_fleet_{w}']:.2%}" for w in sizes)
        workers = " / ".join(f"{w:,}" for w in sizes)
        rows.append(
            "| linear scaling to 120 nodes | one master, the master's share of a worker's time "
            f"at {workers} simulated workers: {before} with shards of 10,000 rows, {after} "
            "with shards sized for the fleet |"
        )
    return rows


def write(path: Path, sections: list[Section], ctx: Context, *, seconds: float) -> None:
    images = path.parent / "img"
    images.mkdir(parents=True, exist_ok=True)
    by_slug = {s.slug: s for s in sections}
    mode = (
        "quick (small sizes, 1 repeat)" if ctx.quick else f"full ({ctx.repeats} repeats, medians)"
    )
    lines = [
        "# Benchmarks",
        "",
        "Every figure here comes from one run of `make bench` (`python -m bench`; `--quick` for a",
        "small one), on this machine, with variants interleaved (A B A B ...) so that noise hits",
        "them alike. Datasets and models are generated by the benchmarks; nothing is downloaded.",
        "",
        f"- measured: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {mode}, "
        f"{seconds / 60:.1f} minutes",
        f"- machine: {machine()}; "
        + (
            "GPU variants of benchmarks 1 and 2 included"
            if ctx.device == "cuda"
            else "no GPU (for ONNX Runtime), so the GPU variants of 1 and 2 did not run"
        ),
        "",
        "## The claims of AntBatchInfer, measured on Ebb here",
        "",
        *_claims(by_slug),
        "",
    ]
    for section in sections:
        lines += _render(section, images)
    path.write_text("\n".join(lines).rstrip() + "\n")


def update(path: Path, sections: list[Section]) -> None:
    """Replace these sections in an existing report (matched by their number, "## 6."), and
    leave every other line of it as it is: one benchmark rerun does not erase the others."""
    images = path.parent / "img"
    images.mkdir(parents=True, exist_ok=True)
    blocks: list[list[str]] = [[]]
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            blocks.append([])
        blocks[-1].append(line)
    for section in sections:
        number = section.title.split(" ", 1)[0]
        rendered = _render(section, images)
        at = next((i for i, b in enumerate(blocks) if b and b[0].startswith(f"## {number} ")), None)
        if at is None:
            blocks.append(rendered)
        else:
            blocks[at] = rendered
    path.write_text("\n\n".join("\n".join(b).strip("\n") for b in blocks if b) + "\n")


def _render(section: Section, images: Path) -> list[str]:
    # A docstring's first sentence ("Benchmark 6: tidal harvesting...") repeats the section's
    # title, however many lines it takes; without one (a title alone), its first paragraph.
    head, _, rest = textwrap.dedent(section.intro).strip().partition("\n\n")
    first = re.match(r"(?s).*?[^\d\s]\.(?:\s+|$)", head)
    intro = f"{head[first.end() :]}\n\n{rest}".strip() if first else rest.strip()
    lines = [f"## {section.title}", "", intro, ""]
    for t in section.tables:
        lines += [t, ""]
    if section.plot:
        name = f"{section.slug}.png"
        if section.plot["kind"] == "bars":
            _bars(images / name, section.title, section.plot)
        elif section.plot["kind"] == "timeline":
            _timeline(images / name, section.title, section.plot)
        elif section.plot["kind"] == "lines":
            _lines(images / name, section.title, section.plot)
        else:
            _scale(images / name, section.title, section.plot)
        lines += [f"![{section.title}](img/{name})", ""]
    for note in section.notes:
        lines += [note, ""]
    return lines
