"""What the `ebb` command shows: a job's progress while it runs, and its summary."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ebb.common.job import JobSpec
from ebb.common.messaging.messages import JobStatus, TierStatus

# Piped output (scripts, CI logs) gets wide lines rather than tables wrapped at 80 columns.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
out = Console(width=None if sys.stdout.isatty() else 200)


class ProgressView:
    """A progress bar (rows, rows/s, ETA, errors) on a terminal; a line every 5 s elsewhere."""

    def __init__(self, job: JobSpec, *, enabled: bool) -> None:
        self.started = time.monotonic()
        self.live = enabled and console.is_terminal
        self.enabled = enabled
        self._last_line = 0.0
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows  {task.fields[rate]} rows/s"),
            TimeRemainingColumn(),
            TextColumn("errors {task.fields[errors]}"),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task(job.name, total=None, rate="-", errors=0)
        self.job = job
        self._advised = False

    def __enter__(self) -> ProgressView:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.stop()

    def update(self, status: JobStatus) -> None:
        if status.advice and not self._advised and self.enabled:
            self._advised = True  # once: it holds for the whole run
            console.print(f"[yellow]note:[/] {status.advice}")
        elapsed = max(1e-6, time.monotonic() - self.started)
        # Rows computed: those committed and those the running shards have done (renewals
        # tell them), so that a long shard shows its progress before it commits.
        computed = status.rows_done + status.rows_in_flight
        rate = f"{computed / elapsed:,.0f}"
        total = max(status.rows_total, computed) or None
        self.progress.update(
            self.task,
            completed=computed,
            total=total,
            rate=rate,
            errors=status.error_rows,
            description=f"{status.name} {status.state.lower()}",
        )
        now = time.monotonic()
        if self.enabled and not self.live and now - self._last_line >= 5.0:
            self._last_line = now
            console.print(progress_line(self.job, status, elapsed))


def progress_line(job: JobSpec | None, status: JobStatus, elapsed: float) -> str:
    """A running job in a line: rows computed of the total (and committed), shards, errors,
    rate and time left; each tier's rows; workers lost so far."""
    computed = status.rows_done + status.rows_in_flight
    rate = computed / elapsed if elapsed > 0 else 0.0
    left = max(status.rows_total - computed, 0)
    eta = f", {_duration(left / rate)} left" if rate > 0 and left else ""
    tokens = tokens_text(job, status, elapsed)
    tiers = "".join(
        f"; tier {t.name}: {t.shards.get('DONE', 0)}/{sum(t.shards.values())} shards, "
        f"{t.rows_done + t.rows_in_flight:,} rows"
        for t in status.tiers
    )
    splits = f", {status.shards_split} split" if status.shards_split else ""
    lost = f"; workers {lost}" if (lost := lost_workers(status)) else ""
    return (
        f"{status.state.lower()}: {computed:,}/{status.rows_total:,} rows "
        f"({status.rows_done:,} committed), {status.shards.get('DONE', 0)}/"
        f"{status.shards_total} shards{splits}, {status.error_rows:,} errors, "
        f"{rate:,.0f} rows/s{eta}" + (f", {tokens}" if tokens else "") + tiers + lost
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def lost_workers(status: JobStatus) -> str:
    """How many workers ended badly and why, and what that cost the job's shards; and how
    many drained (told to go, gone in time: no loss). docs/running-jobs.md explains the
    words."""
    drained = f"{status.workers_drained} drained" if status.workers_drained else ""
    if not status.workers_lost:
        return drained
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(status.workers_lost.items()))
    return (
        f"{sum(status.workers_lost.values())} lost ({kinds}), "
        f"{status.attempts_forgiven} attempts forgiven" + (f"; {drained}" if drained else "")
    )


def tier_text(tier: TierStatus) -> str:
    """A tier of a job in a line: its shards by state, its rows, whether it is held back."""
    shards = ", ".join(f"{state} {n}" for state, n in tier.shards.items() if n) or "no shards yet"
    held = " (held back: the next tier has enough waiting)" if tier.held_back else ""
    waiting = f"; waiting: {tier.waiting}" if tier.waiting else ""
    flight = f" (+{tier.rows_in_flight:,} in flight)" if tier.rows_in_flight else ""
    return f"{shards}; {tier.rows_done:,} rows{flight}{held}{waiting}"


def metric_text(value: Any) -> str:
    """A metric's value in a line: a number as is, a histogram by its counts."""
    if value is None:
        return "n/a (no rows, or one class only)"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict) and "counts" in value:
        under, over = value.get("under", 0), value.get("over", 0)
        return f"histogram {value['counts']} (under {under}, over {over})"
    return str(value)


def token_metrics(spec: JobSpec) -> list[str]:
    """The job's metrics that count the tokens its llm stages made: `sum` metrics over an
    llm stage's `output_tokens` (docs/llm.md), each row's once."""
    return [
        name
        for stage in spec.pipeline.stages
        if stage.llm is not None and not stage.llm.tokenize_only
        for name, metric in stage.metrics.items()
        if metric.kind == "sum" and metric.column == "output_tokens"
    ]


def tokens_text(spec: JobSpec | None, status: JobStatus, seconds: float) -> str:
    """The output tokens of the job's rows done so far and their rate; "" for a job that
    counts none."""
    names = token_metrics(spec) if spec is not None else []
    values = [status.metrics.get(name) for name in names]
    tokens = sum(int(v) for v in values if isinstance(v, int | float))
    if not names:
        return ""
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"{tokens:,} output tokens ({rate:,.0f} tokens/s)"


def summarize(
    status: JobStatus, seconds: float, logs: Path | None, spec: JobSpec | None = None
) -> None:
    colour = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow"}.get(status.state, "")
    rate = status.rows_done / seconds if seconds > 0 else 0.0
    out.print(f"job [bold]{status.id}[/] [{colour}]{status.state}[/] in {seconds:.1f}s")
    out.print(f"  rows     {status.rows_done:,} ({rate:,.0f} rows/s), {status.error_rows:,} errors")
    if status.row_errors:
        # The most common: a mistake every row repeats shows here, not only in `_error`.
        message, count = next(iter(status.row_errors.items()))
        others = len(status.row_errors) - 1
        more = f" (and {others} other error{'s' if others > 1 else ''})" if others else ""
        out.print(f"  error    {count:,} row{'s' if count != 1 else ''}: {message}{more}")
    if tokens := tokens_text(spec, status, seconds):
        out.print(f"  tokens   {tokens}")
    out.print(
        f"  shards   {status.shards.get('DONE', 0)} done, "
        f"{status.shards.get('QUARANTINED', 0)} quarantined, of {status.shards_total}"
    )
    if workers := lost_workers(status):
        out.print(f"  workers  {workers}")
    for name, value in status.metrics.items():
        out.print(f"  metric   {name} = {metric_text(value)}")
    if status.manifest:
        out.print(f"  output   {status.manifest}")
    if status.mlflow_run == "pending":
        out.print(f"  mlflow   [yellow]not logged[/]: {status.mlflow_error or 'not yet'}")
    elif status.mlflow_run:
        out.print(f"  mlflow   run {status.mlflow_run}")
    if status.reason:
        out.print(f"  reason   {status.reason}")
    if logs is not None and status.state != "SUCCEEDED":
        out.print(f"  logs     {logs}")
