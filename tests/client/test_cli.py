"""The `ebb` command, run as a user runs it: a subprocess, an exit code, what it prints."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ebb.client import remote
from ebb.client.cli import build_parser
from ebb.client.display import lost_workers, tier_text
from ebb.client.remote import DEFAULT_NATS, read_credentials
from ebb.client.runs import CLIENT_ENV, LOCK, RUNS_KEPT, RunFolder, running
from ebb.common import envvars
from ebb.common.data.layout import COMMITS_DIR, MANIFEST, OWNER
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.messages import JobStatus, TierStatus

from ..helpers import (
    ASSETS,
    command_line,
    free_port,
    job_spec,
    read_output,
    write_dataset,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EBB = [sys.executable, "-m", "ebb.client.cli"]


@pytest.fixture(autouse=True)
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where `ebb run` keeps its runs' state in this test; and a temporary folder of the
    test's own, which every test leaves as it found it (no `ebb-run-*` in it)."""
    home = tmp_path / "runs"
    monkeypatch.setenv(envvars.RUNS_DIR, str(home))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    yield home
    assert not list(scratch.glob("ebb-run-*"))


def run_folders(home: Path) -> list[Path]:
    return sorted(p for p in home.iterdir() if p.is_dir()) if home.exists() else []


def ebb(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EBB, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def said(result: subprocess.CompletedProcess[str]) -> str:
    """All it printed, on one line: a long message may be wrapped where a space was."""
    return " ".join((result.stdout + result.stderr).split())


def owner_of(out: Path) -> str:
    return str(json.loads((out / OWNER).read_text())["job"])


ROOTS = ["--data-root", str(ASSETS)]


def test_run_a_job_to_the_end(tmp_path: Path, runs: Path) -> None:
    write_dataset(tmp_path / "data", rows=6_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    job_spec(tmp_path, rows_per_shard=1_000, workers=(1, 2))
    result = ebb(
        "run",
        "job.yaml",
        "--max-workers",
        "2",
        *ROOTS,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCEEDED" in result.stdout
    assert "6,000" in result.stdout
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["rows"] == 6_000
    assert run_folders(runs) == []  # a run that succeeded leaves nothing behind


def test_run_refuses_a_bad_spec_with_the_field_and_code_2(tmp_path: Path) -> None:
    spec = {
        "name": "x",
        "input": {"uri": "in.parquet"},
        "pipeline": {"stages": [{"model": "m.onnx", "workers": 0}]},
        "output": {"uri": "out"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = ebb("run", "job.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "pipeline.stages[0].workers: must be > 0" in result.stderr


def test_run_refuses_paths_outside_the_data_roots(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    spec = {
        "name": "x",
        "input": {"uri": "/var/data/in.parquet"},
        "pipeline": {"stages": [{"model": "m.onnx"}]},
        "output": {"uri": "out"},
    }
    (tmp_path / "job" / "job.yaml").write_text(yaml.safe_dump(spec))
    result = ebb("run", "job/job.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "input.uri" in result.stderr and "--data-root" in result.stderr
    # From the job's own folder, the folder it is in and the one the user stands in are one.
    result = ebb("run", "job.yaml", cwd=tmp_path / "job")
    assert result.returncode == 2
    assert f"outside the allowed data roots: {tmp_path / 'job'} (allow more" in said(result)


@pytest.mark.parametrize("again", [[], ["--resume"]], ids=["run", "run --resume"])
def test_a_failed_jobs_state_is_kept_and_its_empty_output_taken_by_the_next_run(
    tmp_path: Path, runs: Path, again: list[str]
) -> None:
    write_dataset(tmp_path / "data", rows=1_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    before: list[Path] = []  # failed runs of before, as many as are kept, each older
    for n in range(RUNS_KEPT):
        run = RunFolder.create(runs, f"before-{n}")
        began = time.time() - 1_000 + n
        os.utime(run.path / LOCK, (began, began))
        run.keep()
        before.append(run.path)
    job_spec(
        tmp_path, stages=[{"modelet": "ebbtest_modelets:BrokenSetup"}], fault={"max_attempts": 1}
    )
    failed = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    assert failed.returncode == 1, said(failed)
    assert "FAILED" in failed.stdout and "weights not found" in failed.stdout
    first = owner_of(tmp_path / "out")
    (kept,) = [p for p in run_folders(runs) if p.name.startswith(f"{first}-")]
    assert f"logs {kept / 'logs'}" in said(failed)
    assert f"state and logs kept in {kept}; the newest {RUNS_KEPT} such runs stay in {runs} (" in (
        said(failed)
    )
    assert run_folders(runs) == sorted([*before[1:], kept])  # the oldest went

    # The spec fixed, and run again: the folder that job failed to fill is free.
    job_spec(tmp_path)
    fixed = ebb("run", "job.yaml", *again, *ROOTS, cwd=tmp_path)
    assert fixed.returncode == 0, said(fixed)
    assert "SUCCEEDED" in fixed.stdout
    second = owner_of(tmp_path / "out")
    assert second != first
    assert (
        f"{tmp_path / 'out'} belonged to job {first}, which ended with nothing committed: "
        f"job {second} takes it over"
    ) in said(fixed)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["rows"] == 1_000
    assert run_folders(runs) == sorted([*before[1:], kept])


def test_a_finished_jobs_output_is_complete_and_another_run_into_it_is_refused(
    tmp_path: Path, runs: Path
) -> None:
    write_dataset(tmp_path / "data", rows=3_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    job_spec(tmp_path, rows_per_shard=1_000)
    first = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    assert first.returncode == 0, said(first)
    job = owner_of(tmp_path / "out")

    again = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    assert again.returncode == 1, said(again)
    assert (
        f"holds the complete output of job {job} (SUCCEEDED, 3 of 3 shards, 3,000 rows "
        "committed): there is nothing to finish there"
    ) in said(again)
    assert "resume" not in said(again)

    resumed = ebb("run", "job.yaml", "--resume", *ROOTS, cwd=tmp_path)
    assert resumed.returncode == 0, said(resumed)
    assert f"job {job} SUCCEEDED already" in said(resumed)
    assert run_folders(runs) == []  # refused, or with nothing to do: nothing kept


def test_replace_removes_a_failed_jobs_output_and_never_a_complete_one(
    tmp_path: Path, runs: Path
) -> None:
    write_dataset(tmp_path / "data", rows=3_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    out = tmp_path / "out"
    # Half the rows fail (not every row: no mistake of the spec), and the first shard
    # committed fails the job.
    broken = job_spec(tmp_path, rows_per_shard=1_000)
    broken["pipeline"]["stages"][0] = {
        "name": "preprocess",
        "modelet": "ebbtest_modelets:FailOn",
        "params": {"ids": list(range(0, 3_000, 2)), "message": "no such customer"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(broken))
    failed = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    assert failed.returncode == 1, said(failed)
    assert "FAILED" in failed.stdout
    # The summary quotes the error its rows failed with, and how many did.
    errors = re.search(r"([\d,]+) errors\n", failed.stdout)
    assert errors is not None and int(errors[1].replace(",", "")) >= 500, failed.stdout
    quoted = rf"error +{errors[1]} rows: stage 'preprocess': ValueError: no such customer"
    assert re.search(quoted, said(failed)), said(failed)
    first = owner_of(out)
    assert list((out / COMMITS_DIR).glob("*.json"))  # it committed (error) rows

    job_spec(tmp_path, rows_per_shard=1_000)  # fixed
    refused = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    assert refused.returncode == 1, said(refused)
    assert f"holds the unfinished output of job {first} (FAILED" in said(refused)
    assert "`--replace` (`ebb run` or `ebb submit`) removes it" in said(refused)
    assert owner_of(out) == first

    replaced = ebb("run", "job.yaml", "--replace", *ROOTS, cwd=tmp_path)
    assert replaced.returncode == 0, said(replaced)
    assert f"--replace: the output of job {first} in {out} (FAILED, " in said(replaced)
    second = owner_of(out)
    assert second != first and "SUCCEEDED" in replaced.stdout
    table, manifest = read_output(out)
    assert sorted(table.column("id").to_numpy().tolist()) == list(range(3_000))
    assert manifest["error_rows"] == 0
    assert {json.loads(p.read_text())["job"] for p in (out / COMMITS_DIR).glob("*.json")} == {
        second
    }
    assert json.loads((out / OWNER).read_text())["took_over_from"] == first

    # A complete output is never removed, --replace or not.
    again = ebb("run", "job.yaml", "--replace", *ROOTS, cwd=tmp_path)
    assert again.returncode == 1, said(again)
    assert f"holds the complete output of job {second} (SUCCEEDED" in said(again)
    assert "never a complete one" in said(again)
    assert owner_of(out) == second and read_output(out)[1] == manifest


def _scored(label: str = "label", truth: str = "Labelled") -> list[dict[str, Any]]:
    """A truth stage and a model scored against it by AUC (the evaluation example's shape)."""
    return [
        {"name": "truth", "modelet": f"ebbtest_modelets:{truth}"},
        {
            "name": "model",
            "modelet": "ebbtest_modelets:Probability",
            "params": {"weights": [1.0, 0.5, -0.5, 0.2, 0.0, 0.1, -0.1, 0.3], "out": "score"},
            "metrics": {"auc": {"kind": "auc", "label": label, "score": "score"}},
        },
    ]


@pytest.mark.parametrize(
    ("stages", "said_first", "field"),
    [
        (
            _scored(label="clicked"),
            "metric 'auc': auc metric, column 'clicked': no such column among the rows'",
            "pipeline.stages[1].metrics.auc",
        ),
        (
            _scored(truth="WordLabelled"),
            "metric 'auc': auc metric, column 'label': expected",
            "pipeline.stages[1].metrics.auc",
        ),
        (
            [
                {"name": "truth", "modelet": "ebbtest_modelets:Labelled"},
                {"name": "model", "model": "MODEL", "input": "pixels"},
            ],
            "stage 'model': TypeError: rows have no field 'pixels'",
            "pipeline.stages[1]",
        ),
    ],
    ids=["metric-on-a-missing-column", "metric-on-a-label-of-words", "model-input-no-field"],
)
def test_a_mistake_every_row_repeats_fails_the_job_at_once_naming_the_field(
    tmp_path: Path, stages: list[dict[str, Any]], said_first: str, field: str
) -> None:
    write_dataset(tmp_path / "data", rows=20_000, row_group_size=5_000)
    write_model(tmp_path / "model.onnx")
    for stage in stages:
        if stage.get("model") == "MODEL":
            stage["model"] = str(tmp_path / "model.onnx")
    job_spec(tmp_path, rows_per_shard=5_000, stages=stages, workers=(1, 2))
    result = ebb("run", "job.yaml", *ROOTS, "--max-workers", "2", cwd=tmp_path)
    assert result.returncode == 1, said(result)
    assert "FAILED" in result.stdout
    assert "every row fails alike, of a mistake in the spec or its code" in said(result)
    assert said_first in said(result) and f"(the spec's {field})" in said(result)
    # Not written as error rows: nothing committed, and the output root is free.
    out = tmp_path / "out"
    assert not list(out.glob(f"{COMMITS_DIR}/*.json"))
    assert json.loads((out / OWNER).read_text())["released"] is True


@pytest.mark.parametrize("columns", [["id", "features"], None], ids=["named", "all"])
def test_a_stage_reading_a_column_the_input_lacks_is_refused_before_a_row_is_read(
    tmp_path: Path, columns: list[str] | None
) -> None:
    write_dataset(tmp_path / "data", rows=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [{"name": "model", "model": str(tmp_path / "model.onnx"), "input": "pixels"}]
    spec = job_spec(tmp_path, stages=stages)
    spec["input"]["columns"] = columns
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    if columns is not None:  # the spec alone tells: refused as it is read
        assert result.returncode == 2, said(result)
        assert (
            "pipeline.stages[0].input: 'pixels' is not among input.columns ['id', 'features']"
        ) in said(result)
    else:  # the files tell: refused as the job is planned
        assert result.returncode == 1, said(result)
        assert "has no column 'pixels' (pipeline.stages[0].input): it has [" in said(result)
    assert not (tmp_path / "out" / COMMITS_DIR).exists()


def test_a_run_that_cannot_use_its_workers_says_so_and_what_to_change(tmp_path: Path) -> None:
    write_dataset(tmp_path / "data", rows=20_000, row_group_size=1_048_576)  # pyarrow's default
    write_model(tmp_path / "model.onnx")
    job_spec(tmp_path, rows_per_shard=5_000, workers=(1, 2))
    result = ebb("run", "job.yaml", *ROOTS, "--max-workers", "2", cwd=tmp_path)
    assert result.returncode == 0, said(result)
    assert (
        "note: the input makes 1 shard for up to 2 workers: 1 waits until a running shard is "
        "split for it. Its Parquet files hold 1 row group (the largest of 20,000 rows), and "
        "a row group is not cut before the job starts: for every worker to start at once, "
        "write the files with row groups of 10,000 rows or less"
    ) in said(result)


def test_demo(tmp_path: Path) -> None:
    result = ebb("demo", "demo", "--rows", "20000", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCEEDED" in result.stdout
    manifest = json.loads((tmp_path / "demo" / "out" / "_manifest.json").read_text())
    assert manifest["rows"] == 20_000 and manifest["error_rows"] == 0


@contextlib.contextmanager
def stack_up(
    tmp_path: Path, prefix: str, *more: str
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`ebb up` in `tmp_path` (state in `state/`), up; stopped with Ctrl-C after, cleanly.
    `more`: its options beside."""
    port = free_port()
    up = subprocess.Popen(
        [
            *EBB,
            *("up", "--port", str(port), "--state-dir", "state", "--prefix", prefix),
            *("--data-root", str(Path(__file__).parent.parent)),
            *more,
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        first = up.stdout.readline()  # blocks until the stack is up (or up died)
        assert "Ebb is up" in first, first + up.stdout.read()
        yield up, f"nats://127.0.0.1:{port}"
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        if up.stdout is not None:
            up.stdout.close()


def test_up_submit_status_cancel(tmp_path: Path, prefix: str) -> None:
    write_dataset(tmp_path / "data", rows=4_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 1.0}, "batch_size": 10}
    ]
    job_spec(tmp_path, rows_per_shard=1_000, stages=stages)
    with stack_up(tmp_path, prefix) as (up, url):
        # Without the stack's credentials: refused, at once and clearly.
        stranger = ebb("status", "--nats", url, "--prefix", prefix, cwd=tmp_path)
        assert stranger.returncode == 1 and "refused" in stranger.stderr

        creds = ["--credentials", str(tmp_path / "state" / "client.env")]
        assert up.stdout is not None
        how = up.stdout.readline()
        assert "--credentials" in how and "client.env" in how, how
        submitted = ebb("submit", "job.yaml", *creds, cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.split()[1]

        listing = ebb("status", *creds, cwd=tmp_path)
        assert listing.returncode == 0 and job_id in listing.stdout

        cancelled = ebb("cancel", job_id, *creds, cwd=tmp_path)
        assert cancelled.returncode == 0 and "CANCELLED" in cancelled.stdout

        detail = ebb("status", job_id, *creds, cwd=tmp_path)
        assert "CANCELLED" in detail.stdout and "cancelled by user" in detail.stdout

        resumed = ebb("resume", job_id, *creds, cwd=tmp_path)
        assert resumed.returncode == 0 and "RUNNING" in resumed.stdout, resumed.stderr
        again = ebb("resume", job_id, *creds, cwd=tmp_path)
        assert again.returncode == 1 and "is RUNNING" in again.stderr
        assert "not_resumable" in again.stderr
        assert ebb("cancel", job_id, *creds, cwd=tmp_path).returncode == 0

        missing = ebb("status", "no-such-job", *creds, cwd=tmp_path)
        assert missing.returncode == 1 and "no job 'no-such-job'" in missing.stderr
    assert not os.path.exists(tmp_path / "state" / "nats" / "LOCK")


def test_up_writes_teams_credentials_each_of_which_sees_its_own_jobs_alone(
    tmp_path: Path, prefix: str
) -> None:
    write_dataset(tmp_path / "data", rows=2_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 1.0}, "batch_size": 10}
    ]
    job_spec(tmp_path, rows_per_shard=1_000, stages=stages)
    with stack_up(tmp_path, prefix, "--team", "team-a", "--team", "team-b") as (up, _):
        assert up.stdout is not None
        told = [up.stdout.readline() for _ in range(3)]
        teams = tmp_path / "state" / "teams"
        assert "client.env" in told[0], told
        for line, team in zip(told[1:], ("team-a", "team-b"), strict=True):
            assert f"as team {team}" in line and str(teams / f"{team}.env") in line, line
        a, b = (["--credentials", str(teams / f"{t}.env")] for t in ("team-a", "team-b"))
        admin = ["--credentials", str(tmp_path / "state" / "client.env")]

        submitted = ebb("submit", "job.yaml", *a, cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.split()[1]
        mine = ebb("status", job_id, *a, cwd=tmp_path)
        assert mine.returncode == 0 and "team-a" in mine.stdout, mine.stderr
        assert job_id in ebb("status", *a, cwd=tmp_path).stdout

        # Team B: no such job, in the words of one that does not exist; nothing listed.
        for command in (("status", job_id), ("cancel", job_id), ("resume", job_id)):
            refused = ebb(*command, *b, cwd=tmp_path)
            assert refused.returncode == 1, refused.stdout
            assert f"no job '{job_id}'" in refused.stderr and "not_found" in refused.stderr
        listing = ebb("status", *b, cwd=tmp_path)
        assert listing.returncode == 0 and job_id not in listing.stdout

        # The admin lists it, with its owner; its team cancels it.
        everyone = ebb("status", *admin, cwd=tmp_path)
        assert everyone.returncode == 0 and "owner" in everyone.stdout
        assert job_id in everyone.stdout and "team-a" in everyone.stdout
        cancelled = ebb("cancel", job_id, *a, cwd=tmp_path)
        assert cancelled.returncode == 0 and "CANCELLED" in cancelled.stdout
    bad = ebb("up", "--team", "a.b", cwd=tmp_path)
    assert bad.returncode == 2 and "bad owner" in bad.stderr


JS_CLIENT = Path(__file__).parent.parent / "js"


@pytest.mark.skipif(shutil.which("node") is None, reason="no node here")
def test_a_client_that_is_not_ebbs_submits_with_the_client_inbox_prefix(
    tmp_path: Path, prefix: str
) -> None:
    """nats.js (npm `nats`, installed by `make test`) with the credentials `ebb up` writes:
    the JetStream ack comes back on the client role's inbox prefix, a resubmission with the
    same Nats-Msg-Id is a duplicate, and a body that is not a job is refused, by its id."""
    assert (JS_CLIENT / "node_modules" / "nats").is_dir(), "make test installs tests/js"
    write_dataset(tmp_path / "data", rows=2_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    job = {**job_spec(tmp_path, rows_per_shard=1_000), "id": "from-node-1"}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "bad.json").write_text('{"name": "no input, no pipeline"')

    def submit(url: str, body: str, msg_id: str) -> dict[str, Any]:
        node = subprocess.run(
            [
                "node",
                str(JS_CLIENT / "submit.mjs"),
                url,
                "state/client.creds",
                prefix,
                body,
                msg_id,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert node.returncode == 0, node.stdout + node.stderr
        ack: dict[str, Any] = json.loads(node.stdout)
        return ack

    creds = ["--credentials", str(tmp_path / "state" / "client.env")]
    with stack_up(tmp_path, prefix) as (_, url):
        assert submit(url, "job.json", "from-node-1")["duplicate"] is False
        assert submit(url, "job.json", "from-node-1")["duplicate"] is True
        assert submit(url, "bad.json", "not-a-job-1")["duplicate"] is False

        def status(job_id: str) -> str:
            return said(ebb("status", job_id, *creds, cwd=tmp_path))

        deadline = time.monotonic() + 120
        while "SUCCEEDED" not in status("from-node-1") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "SUCCEEDED" in status("from-node-1")
        while "rejected" not in status("not-a-job-1") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "rejected" in status("not-a-job-1"), status("not-a-job-1")
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["rows"] == 2_000


def test_submit_to_a_nats_server_without_ebb_says_so(
    tmp_path: Path, nats_server: EmbeddedNats, prefix: str
) -> None:
    write_dataset(tmp_path / "data", rows=1_000)
    write_model(tmp_path / "model.onnx")
    job_spec(tmp_path)
    result = ebb("submit", "job.yaml", "--nats", nats_server.url, "--prefix", prefix, cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert f"no Ebb stack answers at {nats_server.url}" in result.stdout + result.stderr


@pytest.mark.parametrize("command", [["status"], ["submit", "job.yaml"]])
def test_a_command_where_no_stack_runs_on_this_machine_says_how_to_start_one(
    tmp_path: Path, command: list[str]
) -> None:
    write_dataset(tmp_path / "data", rows=1_000)
    write_model(tmp_path / "model.onnx")
    job_spec(tmp_path)
    url = f"nats://127.0.0.1:{free_port()}"
    result = ebb(*command, "--nats", url, cwd=tmp_path)
    assert result.returncode == 1, said(result)
    assert f"nothing listens for NATS at {url}: start a stack with `ebb up`" in said(result)
    assert "retrying" not in said(result)  # at once, not after the connection's retries
    assert "Traceback" not in said(result)


def slow_stages(
    tmp: Path, *, seconds_per_batch: float, batch_size: int = 0, model: str = "model.onnx"
) -> list[Any]:
    """Features slowed down, the ONNX model at `tmp/<model>`, the top class: a job that
    keeps its shards in flight a while."""
    slow: dict[str, Any] = {
        "modelet": "ebbtest_modelets:Slow",
        "params": {"seconds_per_batch": seconds_per_batch},
    }
    onnx: dict[str, Any] = {"model": str(tmp / model)}
    if batch_size:
        slow["batch_size"] = onnx["batch_size"] = batch_size
    return [slow, onnx, {"modelet": "ebb.worker.modelets:TopClass"}]


def while_running(
    run: subprocess.Popen[Any], probe: Callable[[], Any], what: str, *, timeout_s: float = 180
) -> Any:
    """What `probe` returns once it is truthy, while `run` (an `ebb run`) runs: it must not
    end first."""
    deadline = time.monotonic() + timeout_s
    while not (found := probe()):
        assert run.poll() is None and time.monotonic() < deadline, f"no {what}"
        time.sleep(0.1)
    return found


def until_a_commit(run: subprocess.Popen[Any], commits: Path, *, timeout_s: float = 180) -> None:
    """Until `run` (an `ebb run`) has committed a shard; it must not end first."""
    while_running(
        run,
        lambda: commits.exists() and any(commits.iterdir()),
        "shard committed",
        timeout_s=timeout_s,
    )


def test_a_run_interrupted_exits_130_and_resume_finishes_it_with_other_batching(
    tmp_path: Path, runs: Path
) -> None:
    write_dataset(tmp_path / "data", rows=6_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    write_model(tmp_path / "other.onnx", seed=4)

    def write_job(*, model: str = "model.onnx", batch_size: int = 100) -> None:
        stages = slow_stages(tmp_path, seconds_per_batch=0.2, batch_size=batch_size, model=model)
        job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(1, 1))

    write_job()
    roots = [*ROOTS, "--max-workers", "1"]
    first = subprocess.Popen(
        [*EBB, "run", "job.yaml", "--quiet", *roots],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    commits = tmp_path / "out" / "_commits"
    try:
        until_a_commit(first, commits)
    finally:
        first.send_signal(signal.SIGINT)
        output = first.communicate(timeout=120)[0]
    assert first.returncode == 130, output
    assert "CANCELLED" in output
    job = owner_of(tmp_path / "out")
    before = {p.name: p.read_text() for p in commits.iterdir()}

    refused = ebb("run", "job.yaml", *roots, cwd=tmp_path)
    assert refused.returncode == 1
    assert re.search(
        rf"holds the unfinished output of job {job} \(CANCELLED, \d of 6 shards, [\d,]+ rows "
        r"committed\)\. `ebb run JOB.yaml --resume` finishes it on this machine",
        said(refused),
    ), said(refused)
    assert run_folders(runs) == []  # interrupted, then refused: nothing kept

    write_job(model="other.onnx")
    changed = ebb("run", "job.yaml", "--resume", *roots, cwd=tmp_path)
    assert changed.returncode == 1
    assert "pipeline.stages[1].model differs" in said(changed), said(changed)

    write_job(batch_size=250)  # how fast is the run's own business
    resumed = ebb("run", "job.yaml", "--resume", *roots, cwd=tmp_path)
    assert resumed.returncode == 0, said(resumed)
    assert "resumed" in resumed.stderr and "SUCCEEDED" in resumed.stdout
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["rows"] == 6_000 and manifest["error_rows"] == 0
    after = {p.name: p.read_text() for p in commits.iterdir()}
    assert {name: after[name] for name in before} == before  # the first run's shards kept
    assert len(after) == 6
    assert run_folders(runs) == []


def test_status_and_cancel_find_the_stack_of_a_running_ebb_run(tmp_path: Path, runs: Path) -> None:
    write_dataset(tmp_path / "data", rows=6_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = slow_stages(tmp_path, seconds_per_batch=0.2)
    job_spec(tmp_path, rows_per_shard=1_000, stages=stages)
    run = subprocess.Popen(
        [*EBB, "run", "job.yaml", "--quiet", *ROOTS, "--max-workers", "1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        (job,) = while_running(run, lambda: list(running(runs)), "stack found")
        # Its NATS server listens on a port of its own, not the default (an `ebb up`'s).
        client_env = read_credentials(str(running(runs)[job] / CLIENT_ENV))
        assert client_env[envvars.NATS_URL] != DEFAULT_NATS
        # From another terminal, anywhere on the machine: no URL, no credentials named.
        listed = ebb("status", cwd=tmp_path.parent)
        assert listed.returncode == 0, said(listed)
        assert job in listed.stdout and "RUNNING" in listed.stdout
        shown = ebb("status", job, cwd=tmp_path.parent)
        assert shown.returncode == 0, said(shown)
        assert re.search(rf"id\s+{job}", shown.stdout) and "of 6,000" in shown.stdout
        cancelled = ebb("cancel", job, cwd=tmp_path.parent)
        assert cancelled.returncode == 0, said(cancelled)
        assert f"job {job} CANCELLED" in said(cancelled)
        output = run.communicate(timeout=120)[0]
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 1, output
    assert f"from another terminal: `ebb status {job}`, `ebb cancel {job}`" in output
    assert f"job {job} CANCELLED" in " ".join(output.split())
    # Its stack is gone with it, and nothing finds it any more: the job's status is asked
    # where it would be with no `ebb run` on this machine, at the default URL (whatever
    # listens there, an `ebb up` or nothing, is not this test's).
    assert running(runs) == {}
    status = build_parser().parse_args(["status", job])
    assert remote._nats(status, job).url == DEFAULT_NATS


def test_progress_counts_the_rows_a_shard_has_done_before_it_commits(
    tmp_path: Path, runs: Path
) -> None:
    write_dataset(tmp_path / "data", rows=6_000, row_group_size=500)
    write_model(tmp_path / "model.onnx")
    stages = slow_stages(tmp_path, seconds_per_batch=0.25)
    job_spec(tmp_path, rows_per_shard=6_000, stages=stages)  # one shard: one commit, at the end
    result = ebb("run", "job.yaml", *ROOTS, "--max-workers", "1", cwd=tmp_path)
    assert result.returncode == 0, said(result)
    lines = re.findall(r"running: ([\d,]+)/6,000 rows \(([\d,]+) committed\)", result.stderr)
    before_commit = [int(n.replace(",", "")) for n, done in lines if done == "0"]
    assert any(0 < n < 6_000 for n in before_commit), result.stderr


def test_a_jobs_lost_workers_are_summed_up_by_kind() -> None:
    status = JobStatus(
        id="j",
        name="j",
        state="SUCCEEDED",
        workers_lost={"setup": 1, "capacity": 4},
        attempts_forgiven=6,
    )
    assert lost_workers(status) == "5 lost (4 capacity, 1 setup), 6 attempts forgiven"
    drained = replace(status, workers_drained=2)
    assert lost_workers(drained) == "5 lost (4 capacity, 1 setup), 6 attempts forgiven; 2 drained"
    assert lost_workers(replace(drained, workers_lost={}, attempts_forgiven=0)) == "2 drained"


def test_a_tier_waiting_for_a_node_says_why() -> None:
    tier = TierStatus(name="gpu", shards={"TODO": 4}, waiting="gpu_type H100: no node has it")
    assert tier_text(tier) == "TODO 4; 0 rows; waiting: gpu_type H100: no node has it"
    assert "waiting" not in tier_text(TierStatus(name="gpu", shards={"TODO": 4}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_gpu_stage_where_no_gpu_is_says_what_to_change(tmp_path: Path, runs: Path) -> None:
    write_dataset(tmp_path / "data", rows=1_000, row_group_size=1_000)
    torch.jit.save(torch.jit.script(torch.nn.Linear(8, 3)), str(tmp_path / "model.pt"))
    stages: list[dict[str, Any]] = [
        {"modelet": "ebb.worker.modelets:Features", "params": {"columns": ["features"]}},
        {"name": "model", "model": str(tmp_path / "model.pt"), "device": "cuda"},
    ]
    job_spec(tmp_path, stages=stages)
    failed = ebb("run", "job.yaml", *ROOTS, cwd=tmp_path)
    assert failed.returncode == 1, said(failed)
    assert "FAILED" in failed.stdout
    assert (
        "stage 'model' runs on cuda, and no CUDA device is visible to this worker: set "
        "`device: cpu` on it, or run the job where a GPU is"
    ) in said(failed)
    assert "map_location" not in said(failed)  # torch's own advice is not what to change


def test_a_run_killed_leaves_no_process_behind_and_resume_finishes_it_exactly_once(
    tmp_path: Path, runs: Path
) -> None:
    """`ebb run` SIGKILLed mid-job (the OOM killer, a CI runner's timeout): every process of
    its stack ends within seconds (its reaper), and `--resume` finishes the job, each row
    once, the shards committed before kept."""
    import psutil

    write_dataset(tmp_path / "data", rows=6_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages: list[dict[str, Any]] = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0.2}},
        {"model": str(tmp_path / "model.onnx"), "batch_size": 100},
        {"modelet": "ebb.worker.modelets:TopClass"},
    ]
    job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(1, 2))
    roots = [*ROOTS, "--max-workers", "2"]
    first = subprocess.Popen(
        [*EBB, "run", "job.yaml", "--quiet", *roots],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    commits = tmp_path / "out" / "_commits"
    stack: list[psutil.Process] = []
    try:
        until_a_commit(first, commits)
        stack = psutil.Process(first.pid).children(recursive=True)
        names = " ".join(command_line(p) for p in stack)
        for part in ("ebb.common.reaper", "nats-server", "ebb.shard_master", "ebb.controller"):
            assert part in names
        assert "ebb.worker" in names
    finally:
        first.kill()
        first.wait(timeout=30)

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in stack):
        left = [str(p.pid) for p in stack if alive(p)]  # cmdline() raises on a zombie
        assert time.monotonic() < deadline, f"still running after the kill: {left}"
        time.sleep(0.2)
    before = {p.name: p.read_text() for p in commits.iterdir()}

    resumed = ebb("run", "job.yaml", "--resume", *roots, cwd=tmp_path)
    assert resumed.returncode == 0, said(resumed)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["rows"] == 6_000 and manifest["error_rows"] == 0
    paths = [f["path"] for f in manifest["files"]]
    assert len(paths) == len(set(paths))  # a shard drained as the stack went is in parts
    assert sum(f["rows"] for f in manifest["files"]) == 6_000
    after = {p.name: p.read_text() for p in commits.iterdir()}
    assert {name: after[name] for name in before} == before  # the first run's shards kept
