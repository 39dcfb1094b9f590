"""The `ebb` command.

ebb run JOB.yaml              run a job on this machine, on an embedded stack, and wait
ebb demo [DIR]                write a sample dataset, model and job into DIR, then run it
ebb spec [SECTION]            the job spec's reference: every field, its type and default
ebb up                        the embedded stack in the foreground, for submit/status/cancel
ebb submit JOB.yaml           submit to a running stack (--nats URL, or --credentials FILE)
ebb status [JOB]              jobs, or one job in detail
ebb cancel JOB                cancel a job
ebb resume JOB                finish a FAILED or CANCELLED job: committed shards are kept
ebb run JOB.yaml --resume     finish, on this machine, the job whose output JOB.yaml names
ebb run JOB.yaml --replace    compute it anew where a FAILED or CANCELLED job's output is
"""

from __future__ import annotations

import argparse
import os
import sys

from ebb.common import envvars
from ebb.common import log as logsetup
from ebb.common.errors import BusError, EbbError, RemoteError, SpecError
from ebb.common.job import reference
from ebb.common.messaging.subjects import check_owner
from ebb.common.runner import EXIT_FAILED, EXIT_OK, EXIT_USAGE, run

from .display import console
from .here import cmd_demo, cmd_run, cmd_up
from .remote import DEFAULT_NATS, cmd_cancel, cmd_resume, cmd_status, cmd_submit
from .sdk import SubmitError

REPLACE_HELP = (
    "remove the output of the job that owns the output root, if it FAILED or was CANCELLED, "
    "and compute this job there anew (a complete output is never removed)"
)


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
        c.add_argument(
            "--stack",
            default=None,
            metavar="DIR",
            help="the stack whose state is in DIR (`ebb up`'s .ebb, an `ebb run --state-dir`); "
            "by default the `ebb run` running the job on this machine, if one is",
        )

    c = sub.add_parser("run", help="run a job on an embedded stack and wait for it")
    c.add_argument("job", help="job spec (YAML or JSON)")
    again = c.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="finish the job that owns the output root instead (committed shards are kept)",
    )
    again.add_argument("--replace", action="store_true", help=REPLACE_HELP)
    local_options(c)
    c.set_defaults(handler=cmd_run)

    c = sub.add_parser("demo", help="write a sample job and run it")
    c.add_argument("dir", nargs="?", default="ebb-demo")
    c.add_argument("--rows", type=int, default=100_000)
    local_options(c)
    c.set_defaults(handler=cmd_demo)

    c = sub.add_parser("spec", help="print the job spec's reference (Markdown)")
    c.add_argument(
        "section",
        nargs="?",
        default="",
        help="only this section and those under it: fault, pipeline.stages[], ...",
    )
    c.set_defaults(handler=cmd_spec)

    c = sub.add_parser("up", help="run the embedded stack in the foreground")
    c.add_argument("--port", type=int, default=4222)
    c.add_argument("--state-dir", default=None, help="default: ./.ebb")
    c.add_argument("--data-root", action="append", default=[])
    c.add_argument("--max-workers", type=int, default=0)
    c.add_argument("--pin-cpus", action="store_true", help="pin each worker to cores of its own")
    c.add_argument("--prefix", default=env(envvars.PREFIX, "ebb"), help="subject prefix")
    c.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    c.add_argument(
        "--gateway",
        default=None,
        metavar="CONFIG",
        help="serve the OpenAI Batch API too, with this catalogue and keys (docs/batch-api.md)",
    )
    c.add_argument("--gateway-port", type=int, default=8080)
    c.add_argument(
        "--team",
        action="append",
        default=[],
        metavar="NAME",
        type=_team_name,
        help="write a team's credentials too (STATE_DIR/teams/NAME.env): its jobs alone, "
        "as a team's credential on a shared NATS (repeatable)",
    )
    c.set_defaults(handler=cmd_up)

    c = sub.add_parser("submit", help="submit a job to a running stack")
    c.add_argument("job")
    c.add_argument("--wait", action="store_true", help="follow it to the end")
    c.add_argument("--replace", action="store_true", help=REPLACE_HELP)
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


def _team_name(value: str) -> str:
    try:
        return check_owner(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


async def cmd_spec(args: argparse.Namespace) -> int:
    """The reference as Markdown, as docs/job-spec.md has it: for a pager, or a file."""
    paths = reference.section_paths()
    if args.section and args.section not in paths:
        named = ", ".join(p for p in paths if p)
        console.print(f"[red]error:[/] no section of the job spec is {args.section} ({named})")
        return EXIT_USAGE
    print(reference.render(under=args.section))
    return EXIT_OK


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
