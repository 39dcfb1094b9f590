"""The benchmark harness runs end to end and writes its report (tiny sizes: no figure here
means anything; `make bench` measures)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# A guard against a hang, not a speed check: the smoke run starts a real stack for each
# variant of 23 sections (about 10 minutes on 2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1260)]


def test_bench_smoke_writes_every_section_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    for heading in (
        "## The claims of AntBatchInfer",
        "## 1. One model",
        "## 2. Two models with a fan-out",
        "## 3. A straggler",
        "## 4. Shard master at scale",
        "## 5. Start-up",
        "## 6. Tidal harvesting",
        "## 7. A million rows through a small MLP",
        "## 8. The pipeline's own cost per row",
        "## 9. Text embedding",
        "## 10. MiniLM embeddings",
        "## 11. Object stores",
        "## 12. Every byte read once, every core used once",
        "## 13. N models on one read against N separate jobs",
        "## 14. What the hand-off between tiers costs",
        "## 15. Tiers in the cluster simulation",
        "## 16. LLM generation",
        "## 18. The Batch API",
        "## 19. One Parquet file of one row group",
        "## 23. Embeddings through the Batch API",
    ):
        assert heading in report
    if shutil.which("go") is not None:  # the control plane is built where Go is
        assert "## 22. The tide against kube-scheduler" in report
    assert "| bound (hardware) |" in report
    for plot in (
        "single",
        "fanout",
        "stragglers",
        "scale",
        "tidal",
        "mlp",
        "overhead",
        "embedding",
        "cores",
        "oneread",
        "tiers",
        "tierssim",
        "onegroup",
    ):
        assert (out.parent / "img" / f"{plot}.png").stat().st_size > 1000


def test_oneread_section_compares_one_read_with_separate_jobs(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "oneread", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    assert "## 13. N models on one read against N separate jobs" in report
    rows = {
        cells[0]: cells[1:]
        for line in report.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert rows["variant"] == [
        "wall time, s",
        "slowest single job, s",
        "vs slowest single job",
        "vs the separate jobs",
        "MB read from the input",
        "reads of the input",
    ]
    for n in (2, 4):
        separate, one_read = rows[f"{n} separate jobs"], rows[f"one read, {n} models"]
        one_stage = rows[f"one read, {n} models in one stage"]
        # Each separate job reads the input again; the one-read jobs read it once.
        assert float(one_read[-1]) < float(separate[-1])
        assert float(one_stage[-1]) < float(separate[-1])
    for k in range(4):
        assert f"model_{k}" in rows
    # The one-read jobs' output columns, as the section's note lists them (`_error` may follow).
    assert "2 models: `id, label, p_0, p_1" in report
    assert "4 models: `id, label, p_0, p_1, p_2, p_3" in report
    assert (out.parent / "img" / "oneread.png").stat().st_size > 1000


def test_tierssim_section_runs_both_variants_with_every_row_once(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "tierssim", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    assert "## 15. Tiers in the cluster simulation" in report
    rows = {
        cells[0]: cells[1:]
        for line in report.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for variant in ("one tier", "two tiers"):
        # The real master and controller ran the job to its end, each row in the output once.
        assert rows[variant][-1].endswith("once each"), rows[variant]
    assert (out.parent / "img" / "tierssim.png").stat().st_size > 1000


def test_the_soak_reports_every_kind_of_process_and_keeps_the_chaos_report(
    tmp_path: Path,
) -> None:
    out = tmp_path / "reliability.md"
    out.write_text("# Reliability: the chaos campaign\n\nThe campaign's report.\n")
    # Long enough (some seconds) for the half-second sampler to see stage processes at work.
    sizes = ["--rows", "100000", "--rows-per-shard", "5000"]
    result = subprocess.run(
        [sys.executable, "-m", "bench.soak", *sizes, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Reliability: the chaos campaign\n\nThe campaign's report.")
    assert "A 100,000-row job" in text
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")}
    for kind in ("nats-server", "shard master", "controller", "worker", "stage process"):
        assert kind in rows, text
