"""The `ebb` command.

ebb run JOB.yaml              run a job on this machine, on an embedded stack, and wait
ebb demo [DIR]                write a sample dataset, model and job into DIR, then run it
ebb up                        the embedded stack in the foreground, for submit/status/cancel
ebb submit JOB.yaml           submit to a running stack (--nats URL, or --credentials FILE)
ebb status [JOB]              jobs, or one job in detail
ebb cancel JOB                cancel a job
ebb resume JOB                finish a FAILED or CANCELLED job: committed shards are kept
ebb run JOB.yaml --resume     finish, on this machine, the job whose output JOB.yaml names
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ebb.common import envvars
from ebb.common import log as logsetup
from ebb.common.bus import NatsConfig, nats_config_from_env
from ebb.common.errors import BusError, EbbError, ErrorCode, RemoteError, SpecError
from ebb.common.messages import TERMINAL_JOB_STATES, JobStatus
from ebb.common.output import OutputStore
from ebb.common.runner import EXIT_FAILED, EXIT_OK, EXIT_USAGE, run
from ebb.common.spec import JobSpec, check_roots, load_job_file

from .runs import RUNS_KEPT, RunFolder, runs_home
from .sdk import EbbClient, SubmitError, SubmitPending
from .stack import LocalStack, StackConfig, StackError

EXIT_SIGNALLED = 128
"""`ebb run` stopped by a signal exits 128 + its number, as a shell reports it: 130 for
Ctrl-C (SIGINT), 143 for SIGTERM."""
DEFAULT_NATS = NatsConfig().url

# Piped output (scripts, CI logs) gets wide lines rather than tables wrapped at 80 columns.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
out = Console(width=None if sys.stdout.isatty() else 200)


def _load(path: str, roots: list[str]) -> JobSpec:
    spec = load_job_file(path).with_id()
    try:
        check_roots(spec, roots)
    except SpecError as e:
        raise SpecError(e.path, f"{e.problem} (allow more with --data-root DIR)") from None
    return spec


# -- ebb run / ebb demo --------------------------------------------------------------------


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

    def __enter__(self) -> ProgressView:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.stop()

    def update(self, status: JobStatus) -> None:
        elapsed = max(1e-6, time.monotonic() - self.started)
        rate = f"{status.rows_done / elapsed:,.0f}"
        total = max(status.rows_total, status.rows_done) or None
        self.progress.update(
            self.task,
            completed=status.rows_done,
            total=total,
            rate=rate,
            errors=status.error_rows,
            description=f"{status.name} {status.state.lower()}",
        )
        now = time.monotonic()
        if self.enabled and not self.live and now - self._last_line >= 5.0:
            self._last_line = now
            done = status.shards.get("DONE", 0)
            console.print(
                f"{status.state.lower()}: {status.rows_done:,}/{status.rows_total:,} rows, "
                f"{done}/{status.shards_total} shards, {status.error_rows:,} errors, {rate} rows/s"
            )


def lost_workers(status: JobStatus) -> str:
    """How many workers ended badly and why, and what that cost the job's shards."""
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(status.workers_lost.items()))
    return (
        f"{sum(status.workers_lost.values())} lost ({kinds}), "
        f"{status.attempts_forgiven} attempts forgiven"
    )


def summarize(status: JobStatus, seconds: float, logs: Path | None) -> None:
    colour = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow"}.get(status.state, "")
    rate = status.rows_done / seconds if seconds > 0 else 0.0
    out.print(f"job [bold]{status.id}[/] [{colour}]{status.state}[/] in {seconds:.1f}s")
    out.print(f"  rows     {status.rows_done:,} ({rate:,.0f} rows/s), {status.error_rows:,} errors")
    out.print(
        f"  shards   {status.shards.get('DONE', 0)} done, "
        f"{status.shards.get('QUARANTINED', 0)} quarantined, of {status.shards_total}"
    )
    if status.workers_lost:
        out.print(f"  workers  {lost_workers(status)}")
    if status.manifest:
        out.print(f"  output   {status.manifest}")
    if status.reason:
        out.print(f"  reason   {status.reason}")
    if logs is not None and status.state != "SUCCEEDED":
        out.print(f"  logs     {logs}")


async def run_job(args: argparse.Namespace, job_file: str) -> int:
    # The job file's folder and the one the user stands in, then any named: each once.
    here = [str(Path(job_file).resolve().parent), os.getcwd()]
    roots = list(dict.fromkeys([*here, *args.data_root]))
    spec = _load(job_file, roots)
    folder = None if args.state_dir else _run_folder(spec)
    state_dir = Path(args.state_dir) if folder is None else folder.path
    stack = LocalStack(
        StackConfig(
            state_dir=state_dir,
            data_roots=roots,
            max_workers=args.max_workers or (os.cpu_count() or 1),
            pin_cpus=args.pin_cpus,
            prefix=args.prefix,
            log_level=args.log_level,
        )
    )
    signals: list[int] = []
    interrupted = asyncio.Event()

    def on_signal(signum: int) -> None:
        signals.append(signum)
        interrupted.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    started = time.monotonic()
    keep = True  # until the run knows better: what went wrong is worth a look
    supervisor: asyncio.Task[None] | None = None
    try:
        with console.status("starting the embedded stack"):
            await stack.start()
        supervisor = asyncio.create_task(stack.supervise(), name="stack-supervisor")
        async with await EbbClient.connect(stack.nats_config) as client:
            try:
                if getattr(args, "resume", False):
                    job_id = await resume_here(client, spec)
                else:
                    job_id = await submit_here(client, spec)
            except SubmitPending:
                raise
            except SubmitError as e:
                # Refused before anything ran: nothing of this run is worth keeping.
                console.print(f"[red]error:[/] {e}")
                keep = False
                return EXIT_FAILED
            if job_id is None:
                keep = False
                return EXIT_OK
            with ProgressView(spec, enabled=not args.quiet) as view:
                waiting = asyncio.ensure_future(client.wait(job_id, on_update=view.update))
                stopper = asyncio.ensure_future(interrupted.wait())
                await asyncio.wait([waiting, stopper], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not waiting.done():
                    waiting.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiting
                    how = (
                        "Ctrl-C" if signals[0] == signal.SIGINT else signal.Signals(signals[0]).name
                    )
                    console.print("interrupted: cancelling the job")
                    await client.cancel(job_id, f"interrupted ({how})")
                    final = await client.job(job_id)
                    summarize(final, time.monotonic() - started, stack.logs)
                    keep = args.keep_state  # the user stopped it: nothing went wrong
                    return EXIT_SIGNALLED + signals[0]
                final = waiting.result()
        summarize(final, time.monotonic() - started, stack.logs)
        if final.state != "SUCCEEDED":
            return EXIT_FAILED
        keep = args.keep_state
        return EXIT_OK
    except (StackError, SubmitError) as e:
        console.print(f"[red]error:[/] {e}")
        return EXIT_FAILED
    finally:
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        with console.status("stopping the embedded stack"):
            await stack.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if folder is not None:
            if keep:
                folder.keep()
                console.print(
                    f"state and logs kept in {folder.path}; the newest {RUNS_KEPT} such runs "
                    f"stay in {folder.path.parent} ({envvars.RUNS_DIR} sets another place)"
                )
            else:
                folder.discard()


def _run_folder(spec: JobSpec) -> RunFolder:
    home = runs_home(os.environ)
    try:
        return RunFolder.create(home, spec.id)
    except OSError as e:
        raise EbbError(
            f"cannot make a state folder in {home}: {e.strerror or e} (set "
            f"{envvars.RUNS_DIR}, or give --state-dir)"
        ) from e


async def submit_here(client: EbbClient, spec: JobSpec) -> str:
    """Submit the job to this run's stack, saying so, and saying whose output root it took
    over if it did (one whose job ended with nothing committed)."""
    job_id = await client.submit(spec)
    console.print(f"job {job_id} submitted ({spec.input.uri} -> {spec.output.uri})")
    try:
        owner = await asyncio.to_thread(OutputStore(spec.output.uri).owner_record)
    except (OSError, ValueError):  # a note only: the master took the root, or refused it
        return job_id
    if owner is not None and owner.job == job_id and owner.took_over_from not in ("", job_id):
        console.print(
            f"{spec.output.uri} belonged to job {owner.took_over_from}, which ended with "
            f"nothing committed: job {job_id} takes it over"
        )
    return job_id


async def resume_here(client: EbbClient, spec: JobSpec) -> str | None:
    """Carry on with the job that owns the spec's output root, on this stack; None if there
    is nothing to run (the job succeeded already).

    A stack that still knows the job (the same --state-dir) resumes it; a new one gets the
    job submitted again under its own id. Either way the shards that job committed are kept:
    their commit records in the output root are what every attempt checks first. A root that
    no job owns (any more: its job committed nothing) gets the job from the start."""
    output = OutputStore(spec.output.uri)
    owner = await asyncio.to_thread(output.owner_record)
    if owner is None or owner.released:
        before = f" (job {owner.job} ended {owner.state} before it committed any)" if owner else ""
        console.print(f"no shard is committed in {spec.output.uri}{before}: running the job anew")
        return await submit_here(client, spec)
    succeeded = owner.state == "SUCCEEDED" or (
        not owner.state and await asyncio.to_thread(output.read_manifest) is not None
    )
    if succeeded:
        console.print(
            f"job {owner.job} SUCCEEDED already: its output in {spec.output.uri} is "
            "complete, nothing to resume"
        )
        return None
    try:
        status = await client.job(owner.job)
    except RemoteError as e:
        if e.code not in (ErrorCode.NOT_FOUND, ErrorCode.REJECTED):
            raise
        job_id = await client.submit(replace(spec, id=owner.job))
        console.print(f"job {job_id} resumed from its output in {spec.output.uri}")
        return job_id
    if status.state in ("FAILED", "CANCELLED"):
        reply = await client.resume(owner.job)
        console.print(
            f"job {owner.job} resumed: {reply.shards_done} shards kept, "
            f"{reply.shards_retried} quarantined ones retried, {reply.shards_todo} to run"
        )
    elif status.state in TERMINAL_JOB_STATES:
        console.print(f"job {owner.job} is {status.state} already")
    return owner.job


async def cmd_run(args: argparse.Namespace) -> int:
    return await run_job(args, args.job)


async def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import write_demo

    folder = Path(args.dir).resolve()
    if (folder / "out").exists():
        # A demo is meant to be run again and again: start each run from a clean output.
        shutil.rmtree(folder / "out")
    with console.status(f"writing the demo into {folder}"):
        job = await asyncio.to_thread(write_demo, folder, rows=args.rows)
    console.print(f"demo: {args.rows:,} rows, an ONNX model and a job spec in {folder}")
    return await run_job(args, str(job))


# -- ebb up --------------------------------------------------------------------------------


async def cmd_up(args: argparse.Namespace) -> int:
    roots = [os.getcwd(), *args.data_root]
    stack = LocalStack(
        StackConfig(
            state_dir=Path(args.state_dir or ".ebb").resolve(),
            data_roots=roots,
            port=args.port,
            max_workers=args.max_workers or (os.cpu_count() or 1),
            pin_cpus=args.pin_cpus,
            prefix=args.prefix,
            log_level=args.log_level,
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor: asyncio.Task[None] | None = None
    try:
        await stack.start()
        supervisor = asyncio.create_task(stack.supervise(), name="stack-supervisor")
        credentials = write_credentials(stack.config.state_dir / "client.env", stack)
        out.print(f"Ebb is up: NATS at {stack.nats.url}; logs in {stack.logs}")
        out.print(f"  ebb submit job.yaml --credentials {credentials}")
        out.print("Ctrl-C stops it (unfinished jobs resume at the next `ebb up`).")
        await stop.wait()
        return EXIT_OK
    except StackError as e:
        console.print(f"[red]error:[/] {e}")
        return EXIT_FAILED
    finally:
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        await stack.stop()


# -- talking to a running stack ------------------------------------------------------------


def write_credentials(path: Path, stack: LocalStack) -> Path:
    """The client's connection settings for this stack, readable by its owner only."""
    environment = stack.client_environment()
    creds = environment.pop(envvars.NATS_CREDENTIALS, None)
    if creds is not None:
        # A .creds text spans lines: it goes in a file of its own, named by the variables.
        creds_file = path.with_suffix(".creds")
        _write_private(creds_file, creds)
        environment[envvars.NATS_CREDS] = str(creds_file)
    _write_private(path, "".join(f"{k}={v}\n" for k, v in environment.items()))
    return path


def _write_private(path: Path, text: str) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)


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


def _nats(args: argparse.Namespace) -> NatsConfig:
    # Precedence: the command line, then the credentials file, then the environment.
    env = {**os.environ, **(read_credentials(args.credentials) if args.credentials else {})}
    return nats_config_from_env(
        env,
        url=args.nats,
        prefix=args.prefix,
        first_connect_timeout_s=10.0,  # someone is waiting at a terminal
    )


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


async def _connect(args: argparse.Namespace) -> EbbClient:
    """A client of the stack `args` name. Where every server named is this machine and none
    listens, say so at once: a refused connection on localhost is not worth 10 s of retries,
    and the usual cause is that no stack was started."""
    config = _nats(args)
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
                f"nothing listens for NATS at {config.url}: start a stack with `ebb up` "
                f"(and use the credentials it writes, `--credentials .ebb/client.env`), or "
                f"point --nats or {envvars.NATS_URL} at the one you run"
            )
    return await EbbClient.connect(config)


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_job_file(args.job)
    async with await _connect(args) as client:
        try:
            job_id = await client.submit(spec)
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
        summarize(final, time.monotonic() - started, None)
        return EXIT_OK if final.state == "SUCCEEDED" else EXIT_FAILED


async def cmd_status(args: argparse.Namespace) -> int:
    async with await _connect(args) as client:
        if args.job:
            status = await client.job(args.job)
            table = Table(show_header=False, box=None)
            for key, value in (
                ("id", status.id),
                ("name", status.name),
                ("state", status.state),
                ("reason", status.reason),
                ("rows", f"{status.rows_done:,} of {status.rows_total:,}"),
                ("error rows", f"{status.error_rows:,}"),
                ("shards", ", ".join(f"{k} {v}" for k, v in status.shards.items() if v)),
                ("workers", f"{status.min_workers}..{status.max_workers}"),
                ("workers lost", lost_workers(status) if status.workers_lost else ""),
                ("manifest", status.manifest),
            ):
                if value:
                    table.add_row(key, str(value))
            out.print(table)
            return EXIT_OK
        reply = await client.status()
        table = Table("job", "state", "rows", "errors", "shards done", "submitted")
        for job in sorted(reply.jobs, key=lambda j: j.submitted_at):
            table.add_row(
                job.id,
                job.state,
                f"{job.rows_done:,}/{job.rows_total:,}",
                f"{job.error_rows:,}",
                f"{job.shards.get('DONE', 0)}/{job.shards_total}",
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.submitted_at)),
            )
        out.print(table)
        for job_id, reason in reply.rejected.items():
            out.print(f"[red]rejected[/] {job_id}: {reason}")
        return EXIT_OK


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with await _connect(args) as client:
        reply = await client.cancel(args.job)
        out.print(f"job {args.job} {reply.state}")
        return EXIT_OK


async def cmd_resume(args: argparse.Namespace) -> int:
    async with await _connect(args) as client:
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


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="ebb",
        description="Offline batch inference, exactly once.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="command", required=True)

    def local_options(c: argparse.ArgumentParser) -> None:
        c.add_argument(
            "--state-dir",
            help=f"keep NATS state and logs here (default: a folder of its own under "
            f"${envvars.RUNS_DIR} or ~/.local/state/ebb/runs, kept if the run fails)",
        )
        c.add_argument("--keep-state", action="store_true", help="keep it even if it succeeds")
        c.add_argument("--data-root", action="append", default=[], help="allow data under DIR")
        c.add_argument(
            "--max-workers", type=int, default=0, help="workers at once (default: cores)"
        )
        c.add_argument(
            "--pin-cpus", action="store_true", help="pin each worker to cores of its own"
        )
        c.add_argument("--quiet", action="store_true", help="no progress display")
        c.add_argument("--prefix", default=env(envvars.PREFIX, "ebb"), help=argparse.SUPPRESS)
        c.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))

    def remote_options(c: argparse.ArgumentParser) -> None:
        c.add_argument("--nats", default=None, help=f"NATS URL (default {DEFAULT_NATS})")
        c.add_argument("--prefix", default=None, help="subject prefix (default ebb)")
        c.add_argument(
            "--credentials",
            default=env(envvars.CREDENTIALS),
            help="a file of EBB_NATS_* settings (`ebb up` writes one)",
        )

    c = sub.add_parser("run", help="run a job on an embedded stack and wait for it")
    c.add_argument("job", help="job spec (YAML or JSON)")
    c.add_argument(
        "--resume",
        action="store_true",
        help="finish the job that owns the output root instead (committed shards are kept)",
    )
    local_options(c)
    c.set_defaults(handler=cmd_run)

    c = sub.add_parser("demo", help="write a sample job and run it")
    c.add_argument("dir", nargs="?", default="ebb-demo")
    c.add_argument("--rows", type=int, default=100_000)
    local_options(c)
    c.set_defaults(handler=cmd_demo)

    c = sub.add_parser("up", help="run the embedded stack in the foreground")
    c.add_argument("--port", type=int, default=4222)
    c.add_argument("--state-dir", default=None, help="default: ./.ebb")
    c.add_argument("--data-root", action="append", default=[])
    c.add_argument("--max-workers", type=int, default=0)
    c.add_argument("--pin-cpus", action="store_true", help="pin each worker to cores of its own")
    c.add_argument("--prefix", default=env(envvars.PREFIX, "ebb"), help="subject prefix")
    c.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    c.set_defaults(handler=cmd_up)

    c = sub.add_parser("submit", help="submit a job to a running stack")
    c.add_argument("job")
    c.add_argument("--wait", action="store_true", help="follow it to the end")
    remote_options(c)
    c.set_defaults(handler=cmd_submit)

    c = sub.add_parser("status", help="show jobs, or one job")
    c.add_argument("job", nargs="?", default="")
    remote_options(c)
    c.set_defaults(handler=cmd_status)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job")
    remote_options(c)
    c.set_defaults(handler=cmd_cancel)

    c = sub.add_parser("resume", help="finish a FAILED or CANCELLED job, keeping its output")
    c.add_argument("job")
    c.add_argument("--wait", action="store_true", help="follow it to the end")
    remote_options(c)
    c.set_defaults(handler=cmd_resume)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The services log to their own files; here only what the user must see.
    logsetup.setup(os.environ.get(envvars.CLI_LOG_LEVEL, "WARNING"))

    async def guarded() -> int:
        try:
            code: int = await args.handler(args)
            return code
        except SpecError as e:
            console.print(f"[red]invalid job spec:[/] {e}")
            return EXIT_USAGE
        except RemoteError as e:
            console.print(f"[red]error:[/] {e.message} ({e.code})")
            return EXIT_FAILED
        except (SubmitError, BusError, EbbError) as e:
            console.print(f"[red]error:[/] {e}")
            return EXIT_FAILED

    return run(guarded())


if __name__ == "__main__":
    sys.exit(main())
