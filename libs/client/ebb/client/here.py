"""`ebb run`, `ebb demo` and `ebb up`: jobs on this machine, on an embedded stack."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

from ebb.common import envvars, host
from ebb.common.aio import until
from ebb.common.data.output import OutputStore
from ebb.common.errors import EbbError, ErrorCode, RemoteError, SpecError
from ebb.common.job import JobSpec, check_roots, load_job_file
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, JobStatus
from ebb.common.runner import EXIT_FAILED, EXIT_OK

from .display import ProgressView, console, out, summarize
from .remote import replaced_owner
from .runs import CLIENT_ENV, RUNS_KEPT, TEAMS_DIR, RunFolder, runs_home
from .sdk import EbbClient, SubmitError, SubmitPending
from .stack import LocalStack, StackConfig, StackError

EXIT_SIGNALLED = 128
"""`ebb run` stopped by a signal exits 128 + its number, as a shell reports it: 130 for
Ctrl-C (SIGINT), 143 for SIGTERM."""


def _load(path: str, roots: list[str]) -> JobSpec:
    spec = load_job_file(path).with_id()
    try:
        check_roots(spec, roots)
    except SpecError as e:
        raise SpecError(e.path, f"{e.problem} (allow more with --data-root DIR)") from None
    return spec


async def run_job(args: argparse.Namespace, job_file: str) -> int:
    # The job file's folder and the one the user stands in, then any named: each once.
    here = [str(Path(job_file).resolve().parent), os.getcwd()]
    roots = list(dict.fromkeys([*here, *args.data_root]))
    spec = _load(job_file, roots)
    folder = None if args.state_dir else _run_folder(spec)
    state_dir = Path(args.state_dir) if folder is None else folder.path
    stack = _stack(args, state_dir, roots)
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
    try:
        async with (
            stack.running(status=console.status),
            await EbbClient.connect(stack.nats_config) as client,
        ):
            write_credentials(state_dir / CLIENT_ENV, stack)
            try:
                if getattr(args, "resume", False):
                    job_id = await resume_here(client, spec)
                else:
                    job_id = await submit_here(
                        client, spec, replacing=getattr(args, "replace", False)
                    )
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
            # Found by the job's id while the run lasts (ebb.client.runs.running).
            stack_option = "" if folder is not None else f" --stack {state_dir}"
            console.print(
                f"from another terminal: `ebb status {job_id}{stack_option}`, "
                f"`ebb cancel {job_id}{stack_option}`"
            )
            with ProgressView(spec, enabled=not args.quiet) as view:
                waited = await until(client.wait(job_id, on_update=view.update), interrupted)
                if waited is None:
                    how = (
                        "Ctrl-C" if signals[0] == signal.SIGINT else signal.Signals(signals[0]).name
                    )
                    console.print("interrupted: cancelling the job")
                    await client.cancel(job_id, f"interrupted ({how})")
                    final = await client.job(job_id)
                    summarize(final, time.monotonic() - started, stack.logs, spec)
                    keep = args.keep_state  # the user stopped it: nothing went wrong
                    return EXIT_SIGNALLED + signals[0]
                final = await logged_to_mlflow(client, waited)
        summarize(final, time.monotonic() - started, stack.logs, spec)
        if final.state != "SUCCEEDED":
            return EXIT_FAILED
        keep = args.keep_state
        return EXIT_OK
    except (StackError, SubmitError) as e:
        console.print(f"[red]error:[/] {e}")
        return EXIT_FAILED
    finally:
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


MLFLOW_WAIT_S = 60.0
"""How long `ebb run` waits for its master to log a succeeded job's MLflow run: the stack,
and the master that would go on trying, stop when the run does."""


async def logged_to_mlflow(
    client: EbbClient, status: JobStatus, *, timeout_s: float = MLFLOW_WAIT_S
) -> JobStatus:
    """The job's status once its MLflow run is logged (if it has one due), or as it is after
    `timeout_s` (the summary then says the run was not logged, and why)."""
    if status.mlflow_run != "pending":
        return status
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with console.status("logging the job's metrics to MLflow"):
        while status.mlflow_run == "pending" and loop.time() < deadline:
            await asyncio.sleep(0.5)
            status = await client.job(status.id)
    return status


def _run_folder(spec: JobSpec) -> RunFolder:
    home = runs_home(os.environ)
    try:
        return RunFolder.create(home, spec.id)
    except OSError as e:
        raise EbbError(
            f"cannot make a state folder in {home}: {e.strerror or e} (set "
            f"{envvars.RUNS_DIR}, or give --state-dir)"
        ) from e


async def submit_here(client: EbbClient, spec: JobSpec, *, replacing: bool = False) -> str:
    """Submit the job to this run's stack, saying so, and saying whose output root it took
    over if it did (one whose job ended with nothing committed). `replacing`: the output of
    the job that owns the root, if it ended FAILED or CANCELLED, is removed first (saying
    what goes)."""
    replace_output_of = await replaced_owner(spec) if replacing else ""
    job_id = await client.submit(spec, replace_output_of=replace_output_of)
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
    gateway = Path(args.gateway).resolve() if args.gateway else None
    stack = _stack(
        args,
        Path(args.state_dir or ".ebb").resolve(),
        roots,
        port=args.port,
        gateway=gateway,
        gateway_port=args.gateway_port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with stack.running():
            credentials = write_credentials(stack.config.state_dir / CLIENT_ENV, stack)
            out.print(f"Ebb is up: NATS at {stack.nats.url}; logs in {stack.logs}")
            out.print(f"  ebb submit job.yaml --credentials {credentials}")
            for team in dict.fromkeys(getattr(args, "team", None) or []):
                teams = stack.config.state_dir / TEAMS_DIR
                teams.mkdir(mode=0o700, exist_ok=True)
                path = write_credentials(teams / f"{team}.env", stack, team=team)
                out.print(f"  as team {team} (its jobs alone): --credentials {path}")
            if stack.gateway_url is not None:
                out.print(f"  the OpenAI Batch API at {stack.gateway_url} (OpenAI(base_url=...))")
            out.print("Ctrl-C stops it (unfinished jobs resume at the next `ebb up`).")
            await stop.wait()
        return EXIT_OK
    except StackError as e:
        console.print(f"[red]error:[/] {e}")
        return EXIT_FAILED


def _stack(
    args: argparse.Namespace,
    state_dir: Path,
    roots: list[str],
    *,
    port: int = 0,
    gateway: Path | None = None,
    gateway_port: int = 0,
) -> LocalStack:
    return LocalStack(
        StackConfig(
            state_dir=state_dir,
            data_roots=roots,
            port=port,
            max_workers=args.max_workers or host.core_count(),
            pin_cpus=args.pin_cpus,
            prefix=args.prefix,
            log_level=args.log_level,
            gateway=gateway,
            gateway_port=gateway_port,
        )
    )


def write_credentials(path: Path, stack: LocalStack, *, team: str = "") -> Path:
    """The client's connection settings for this stack (the admin's, or `team`'s), readable
    by its owner only."""
    environment = stack.client_environment(team)
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
