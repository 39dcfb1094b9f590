"""`ebb submit`, `status`, `cancel` and `resume`: talking to a running stack."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from rich.table import Table

from ebb.common import envvars
from ebb.common.data.output import OutputStore
from ebb.common.errors import EbbError
from ebb.common.job import JobSpec, load_job_file, parse_job
from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.natsconfig import NatsConfig, nats_config_from_env
from ebb.common.runner import EXIT_FAILED, EXIT_OK

from .display import (
    ProgressView,
    console,
    lost_workers,
    metric_text,
    out,
    summarize,
    tier_text,
    tokens_text,
)
from .runs import CLIENT_ENV, running, runs_home
from .sdk import EbbClient, SubmitPending

DEFAULT_NATS = NatsConfig().url


def read_credentials(path: str) -> dict[str, str]:
    """KEY=VALUE lines, as `ebb up` writes them (and as a shell or a .env file has them)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise EbbError(f"cannot read credentials {path}: {e.strerror}") from e
    pairs = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            pairs[key.strip()] = value.strip()
    return pairs


def _nats(args: argparse.Namespace, job: str | None = None) -> NatsConfig:
    # Precedence: the command line, then the credentials file, then the environment.
    credentials = args.credentials or _stack_credentials(args, job)
    env = {**os.environ, **(read_credentials(credentials) if credentials else {})}
    return nats_config_from_env(
        env,
        url=args.nats,
        prefix=args.prefix,
        first_connect_timeout_s=10.0,  # someone is waiting at a terminal
    )


def _stack_credentials(args: argparse.Namespace, job: str | None) -> str | None:
    """The credentials of the stack named by --stack; where no stack is named at all (no
    --nats, no credentials, no EBB_NATS_URL), those of the `ebb run` running `job` on this
    machine, or of the only `ebb run` running here ("": any job). None: the default NATS
    URL it is (and always for `job` None: a job is never submitted to an `ebb run`'s stack,
    which stops when its own job ends)."""
    if args.stack:
        return str(Path(args.stack) / CLIENT_ENV)
    if job is None or args.nats or os.environ.get(envvars.NATS_URL):
        return None
    stacks = running(runs_home(os.environ))
    if job in stacks:
        return str(stacks[job] / CLIENT_ENV)
    if len(stacks) == 1:
        (folder,) = stacks.values()
        return str(folder / CLIENT_ENV)
    if stacks:
        raise EbbError(
            f"`ebb run` runs {len(stacks)} jobs on this machine ({', '.join(sorted(stacks))}), "
            "each on a stack of its own: name the job, or give --stack DIR (its state folder)"
        )
    return None


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


async def _connect(args: argparse.Namespace, job: str | None = None) -> EbbClient:
    """A client of the stack `args` name (or the `ebb run` stack running `job`). Where every
    server named is this machine and none listens, say so at once: a refused connection on
    localhost is not worth 10 s of retries, and the usual cause is that no stack was
    started."""
    config = _nats(args, job)
    local = [urlsplit(u if "://" in u else f"nats://{u}") for u in config.servers]
    if local and all(u.hostname in _LOCAL_HOSTS for u in local):
        for u in local:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(u.hostname, u.port or 4222), timeout=2
                )
            except (OSError, TimeoutError):  # refused, or nothing answers
                continue
            writer.close()
            break
        else:
            raise EbbError(
                f"nothing listens for NATS at {config.url}: start a stack with `ebb up` (and "
                "name it with `--stack .ebb`), run the job with `ebb run` (found by its job "
                "id while it runs), or "
                f"point --nats or {envvars.NATS_URL} at the one you run"
            )
    return await EbbClient.connect(config)


async def replaced_owner(spec: JobSpec) -> str:
    """The job whose output `--replace` removes from the spec's output root, said to the
    user with what it committed there; "" if the root holds no job's output. The master
    removes it only if that job still owns the root and ended FAILED or CANCELLED."""
    uri = spec.output.uri
    try:
        owner = await asyncio.to_thread(OutputStore(uri).owner_record)
    except (OSError, ValueError) as e:
        raise EbbError(f"cannot tell whose output {uri} holds: {e} (--replace must)") from e
    if owner is None or owner.released:
        console.print(f"{uri} holds no job's output: nothing to replace")
        return ""
    ended = f"{owner.state}, " if owner.state else ""
    console.print(
        f"--replace: the output of job {owner.job} in {uri} ({ended}{owner.shards_done} "
        f"shards, {owner.rows_done:,} rows committed) is removed, if that job ended FAILED "
        "or CANCELLED, and this job computes it anew"
    )
    return owner.job


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_job_file(args.job).with_id()
    replace_output_of = await replaced_owner(spec) if args.replace else ""
    async with await _connect(args) as client:
        try:
            job_id = await client.submit(spec, replace_output_of=replace_output_of)
            out.print(f"job {job_id} accepted")
        except SubmitPending as e:
            # Queued is submitted: saying "failed" here would have the job submitted twice.
            job_id = e.job_id
            out.print(str(e))
        if not args.wait:
            return EXIT_OK
        started = time.monotonic()
        with ProgressView(spec, enabled=True) as view:
            final = await client.wait(job_id, on_update=view.update)
        summarize(final, time.monotonic() - started, None, spec)
        return EXIT_OK if final.state == "SUCCEEDED" else EXIT_FAILED


async def cmd_status(args: argparse.Namespace) -> int:
    async with await _connect(args, args.job) as client:
        if args.job:
            status = await client.job(args.job, include_spec=True)
            spec = parse_job(status.spec) if status.spec else None
            end = status.finished_at or time.time()
            table = Table(show_header=False, box=None)
            for key, value in (
                ("id", status.id),
                ("name", status.name),
                ("state", status.state),
                ("owner", status.owner),
                ("reason", status.reason),
                # A job with tiers says it per tier, below.
                ("waiting", "" if status.tiers else status.waiting),
                ("rows", _rows_text(status)),
                ("error rows", f"{status.error_rows:,}"),
                *(
                    (f"error ({count:,} rows)", message)
                    for message, count in list(status.row_errors.items())[:3]
                ),
                ("tokens", tokens_text(spec, status, end - status.submitted_at)),
                ("shards", ", ".join(f"{k} {v}" for k, v in status.shards.items() if v)),
                ("workers", f"{status.min_workers}..{status.max_workers}"),
                ("workers lost", lost_workers(status)),
                ("advice", status.advice if status.state == "RUNNING" else ""),
                *((f"tier {tier.name}", tier_text(tier)) for tier in status.tiers),
                ("manifest", status.manifest),
                ("mlflow run", _mlflow_text(status)),
                *((f"metric {name}", metric_text(v)) for name, v in status.metrics.items()),
            ):
                if value:
                    table.add_row(key, str(value))
            out.print(table)
            return EXIT_OK
        reply = await client.status()
        # The owner's column where it tells something: the admin's listing of teams' jobs.
        owners = any(job.owner for job in reply.jobs)
        columns = ["job", *(["owner"] if owners else []), "state", "rows", "errors"]
        table = Table(*columns, "shards done", "submitted")
        for job in sorted(reply.jobs, key=lambda j: j.submitted_at):
            table.add_row(
                job.id,
                *([job.owner] if owners else []),
                job.state,
                f"{job.rows_done + job.rows_in_flight:,}/{job.rows_total:,}",
                f"{job.error_rows:,}",
                f"{job.shards.get('DONE', 0)}/{job.shards_total}",
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.submitted_at)),
            )
        out.print(table)
        for job_id, reason in reply.rejected.items():
            out.print(f"[red]rejected[/] {job_id}: {reason}")
        for job in sorted((j for j in reply.jobs if j.waiting), key=lambda j: j.id):
            out.print(f"[yellow]waiting[/] {job.id}: {job.waiting}")
        for job in sorted(
            (j for j in reply.jobs if j.advice and j.state == "RUNNING"), key=lambda j: j.id
        ):
            out.print(f"[yellow]note[/] {job.id}: {job.advice}")
        return EXIT_OK


def _rows_text(status: JobStatus) -> str:
    flight = f" (+{status.rows_in_flight:,} in flight)" if status.rows_in_flight else ""
    return f"{status.rows_done:,}{flight} of {status.rows_total:,}"


def _mlflow_text(status: JobStatus) -> str:
    if status.mlflow_run == "pending" and status.mlflow_error:
        return f"pending (the master keeps trying: {status.mlflow_error})"
    return status.mlflow_run


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with await _connect(args, args.job) as client:
        reply = await client.cancel(args.job)
        out.print(f"job {args.job} {reply.state}")
        return EXIT_OK


async def cmd_resume(args: argparse.Namespace) -> int:
    async with await _connect(args, args.job) as client:
        reply = await client.resume(args.job)
        out.print(
            f"job {args.job} {reply.state}: {reply.shards_done} shards kept, "
            f"{reply.shards_retried} quarantined ones retried, {reply.shards_todo} to run"
        )
        if not args.wait:
            return EXIT_OK
        started = time.monotonic()
        final = await client.wait(args.job)
        summarize(final, time.monotonic() - started, None)
        return EXIT_OK if final.state == "SUCCEEDED" else EXIT_FAILED


# -- wiring --------------------------------------------------------------------------------
