"""The `ebb` command, run as a user runs it: a subprocess, an exit code, what it prints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ebb.client.cli import lost_workers
from ebb.common.embedded import EmbeddedNats
from ebb.common.messages import JobStatus

from .helpers import free_port, job_spec, write_dataset, write_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EBB = [sys.executable, "-m", "ebb.client.cli"]


def ebb(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EBB, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_run_a_job_to_the_end(tmp_path: Path) -> None:
    write_dataset(tmp_path / "data", rows=6_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    job_spec(tmp_path, rows_per_shard=1_000, workers=(1, 2))
    result = ebb(
        "run",
        "job.yaml",
        "--max-workers",
        "2",
        "--data-root",
        str(Path(__file__).parent),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCEEDED" in result.stdout
    assert "6,000" in result.stdout
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["rows"] == 6_000


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


def test_a_failed_job_exits_1_and_says_why(tmp_path: Path) -> None:
    write_dataset(tmp_path / "data", rows=1_000, row_group_size=1_000)
    job_spec(
        tmp_path, stages=[{"modelet": "ebbtest_modelets:BrokenSetup"}], fault={"max_attempts": 1}
    )
    result = ebb("run", "job.yaml", "--data-root", str(Path(__file__).parent), cwd=tmp_path)
    assert result.returncode == 1
    assert "FAILED" in result.stdout and "weights not found" in result.stdout
    assert "logs" in result.stdout


def test_demo(tmp_path: Path) -> None:
    result = ebb("demo", "demo", "--rows", "20000", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCEEDED" in result.stdout
    manifest = json.loads((tmp_path / "demo" / "out" / "_manifest.json").read_text())
    assert manifest["rows"] == 20_000 and manifest["error_rows"] == 0


def test_up_submit_status_cancel(tmp_path: Path, prefix: str) -> None:
    write_dataset(tmp_path / "data", rows=4_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 1.0}, "batch_size": 10}
    ]
    job_spec(tmp_path, rows_per_shard=1_000, stages=stages)
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    up = subprocess.Popen(
        [
            *EBB,
            "up",
            "--port",
            str(port),
            "--state-dir",
            "state",
            "--prefix",
            prefix,
            "--data-root",
            str(Path(__file__).parent),
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

        # Without the stack's credentials: refused, at once and clearly.
        stranger = ebb("status", "--nats", url, "--prefix", prefix, cwd=tmp_path)
        assert stranger.returncode == 1 and "refused" in stranger.stderr

        creds = ["--credentials", str(tmp_path / "state" / "client.env")]
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
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        if up.stdout is not None:
            up.stdout.close()
    assert not os.path.exists(tmp_path / "state" / "nats" / "LOCK")


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


def test_a_run_interrupted_is_refused_again_but_finished_with_resume(tmp_path: Path) -> None:
    write_dataset(tmp_path / "data", rows=6_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    slow = {"seconds_per_batch": 0.2}
    stages = [{"modelet": "ebbtest_modelets:Slow", "params": slow, "batch_size": 100}]
    job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(1, 1))
    roots = ["--data-root", str(Path(__file__).parent), "--max-workers", "1"]
    first = subprocess.Popen(
        [*EBB, "run", "job.yaml", "--quiet", *roots],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    commits = tmp_path / "out" / "_commits"
    try:
        deadline = time.monotonic() + 180
        while not (commits.exists() and any(commits.iterdir())):
            assert first.poll() is None and time.monotonic() < deadline, "no shard committed"
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGINT)
        output = first.communicate(timeout=120)[0]
    assert first.returncode == 130, output
    assert "CANCELLED" in output
    before = {p.name: p.read_text() for p in commits.iterdir()}

    refused = ebb("run", "job.yaml", *roots, cwd=tmp_path)
    assert refused.returncode == 1
    said = refused.stdout + refused.stderr
    assert "holds the output of job" in said and "--resume" in said, said

    resumed = ebb("run", "job.yaml", "--resume", *roots, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stderr and "SUCCEEDED" in resumed.stdout
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["rows"] == 6_000 and manifest["error_rows"] == 0
    after = {p.name: p.read_text() for p in commits.iterdir()}
    assert {name: after[name] for name in before} == before  # the first run's shards kept
    assert len(after) == 6


def test_a_jobs_lost_workers_are_summed_up_by_kind() -> None:
    status = JobStatus(
        id="j",
        name="j",
        state="SUCCEEDED",
        workers_lost={"setup": 1, "capacity": 4},
        attempts_forgiven=6,
    )
    assert lost_workers(status) == "5 lost (4 capacity, 1 setup), 6 attempts forgiven"
