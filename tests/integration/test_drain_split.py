"""Work kept when a worker must go, end to end on the embedded stack: a worker SIGTERMed
mid-shard with a grace period too short to finish commits the rows it has done as a part of
the shard, the rest runs elsewhere, and every row is in the output exactly once; with the
master killed between the split and the next lease too, and with a worker killed before or
after a part's commit record. The liquid tail splits a straggler's shard for an idle worker."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack
from ebb.common import envvars, failpoints
from ebb.common.data.layout import COMMITS_DIR
from ebb.common.job import parse_job
from ebb.common.messaging.messages import LeaseInfo

from ..e2e.test_e2e import _pid_of as pid_of
from ..e2e.test_e2e import assert_exactly_once, slow_stages
from ..helpers import embedded_stack, job_spec, wait_until, write_dataset, write_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 8_000
SHARD_ROWS = 4_000


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Workers of the stack get 3 s to drain (1.5 s of it kept to commit parts), read 500
    rows at a time (so they tell progress often); failpoints may be armed in the folder."""
    monkeypatch.setenv(envvars.SHUTDOWN_GRACE_S, "3")
    monkeypatch.setenv(envvars.CHUNK_ROWS, "500")
    armed = tmp_path / "failpoints"
    armed.mkdir()
    monkeypatch.setenv(envvars.FAILPOINT_DIR, str(armed))
    return armed


@pytest.fixture
async def stack(tmp_path: Path, prefix: str, short_grace: Path) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=1) as s:
        yield s


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(stack.nats_config) as c:
        yield c


async def _submit(tmp_path: Path, client: EbbClient, **fault: Any) -> str:
    """Two shards of 4,000 rows that take 10 s each on one worker."""
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=SHARD_ROWS)
    write_model(tmp_path / "model.onnx")
    spec = job_spec(
        tmp_path,
        rows_per_shard=SHARD_ROWS,
        stages=slow_stages(tmp_path, 0.25),
        fault={"lease_s": 6, **fault},
    )
    return await client.submit(parse_job(spec))


async def _holder_with_rows_done(client: EbbClient, job_id: str) -> tuple[LeaseInfo, int]:
    async def found() -> tuple[LeaseInfo, int] | None:
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
        for lease in status.leases:
            pid = pid_of(lease.worker)
            if lease.rows_done >= 500 and pid is not None:
                return lease, pid
        return None

    held: tuple[LeaseInfo, int] = await wait_until(
        found, timeout=90, what="a worker with rows of its shard done"
    )
    return held


def _commits(tmp_path: Path) -> dict[int, dict[str, Any]]:
    folder = tmp_path / "out" / COMMITS_DIR
    return {
        int(p.stem.split("=")[1]): json.loads(p.read_text()) for p in folder.glob("shard=*.json")
    }


async def test_a_worker_told_to_go_mid_shard_keeps_its_rows_and_the_rest_runs_after(
    tmp_path: Path, client: EbbClient
) -> None:
    job_id = await _submit(tmp_path, client)
    lease, pid = await _holder_with_rows_done(client, job_id)
    assert lease.rows == SHARD_ROWS and lease.rows_done < SHARD_ROWS
    os.kill(pid, signal.SIGTERM)

    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == ROWS
    assert_exactly_once(tmp_path, ROWS)
    commits = _commits(tmp_path)
    part = commits[lease.shard]
    assert part["worker"] == lease.worker and part["attempt"] == lease.attempt
    assert lease.rows_done <= part["split_at"] < SHARD_ROWS, "the rows done by the signal kept"
    assert sum(f["rows"] for f in part["files"]) == part["split_at"]
    # Each part's rest is a shard of its own (the worker's second shard may have been split
    # too: it computes beside the first).
    parts = [c for c in commits.values() if c["split_at"]]
    assert final.shards_total == 2 + len(parts) == len(commits)


async def test_a_master_killed_between_the_split_and_the_next_lease_loses_nothing(
    tmp_path: Path, stack: LocalStack, client: EbbClient, short_grace: Path
) -> None:
    job_id = await _submit(tmp_path, client)
    lease, pid = await _holder_with_rows_done(client, job_id)
    # The next shard the master records DONE is the part: it dies right after.
    failpoints.arm(short_grace, failpoints.MASTER_AFTER_RECORDING_DONE)
    os.kill(pid, signal.SIGTERM)
    await wait_until(
        lambda: failpoints.fired(short_grace, failpoints.MASTER_AFTER_RECORDING_DONE),
        timeout=60,
        what="the master to die after recording the part",
    )
    await stack.processes["master"].wait()
    await stack.restart("master")
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == ROWS
    assert_exactly_once(tmp_path, ROWS)
    commits = _commits(tmp_path)
    assert commits[lease.shard]["split_at"] > 0
    assert final.shards_total == 2 + sum(1 for c in commits.values() if c["split_at"])


@pytest.mark.parametrize(
    "point", [failpoints.WORKER_BEFORE_COMMIT_RECORD, failpoints.WORKER_AFTER_COMMIT_RECORD]
)
async def test_a_worker_killed_around_its_part_s_commit_record_loses_and_doubles_nothing(
    tmp_path: Path, client: EbbClient, short_grace: Path, point: str
) -> None:
    """Killed with the part's files written but no commit record: nothing of it is listed,
    the shard runs again whole. Killed after the record, before the master heard: the part
    is adopted (its lease runs out, and the master finds the record)."""
    job_id = await _submit(tmp_path, client)
    lease, pid = await _holder_with_rows_done(client, job_id)
    failpoints.arm(short_grace, point)
    os.kill(pid, signal.SIGTERM)
    await wait_until(
        lambda: failpoints.fired(short_grace, point) == pid, timeout=60, what=f"{point} to fire"
    )
    # The shard whose part it was: the failpoint says.
    (fired,) = short_grace.glob(f"{point}.fired-*")
    shard = int(fired.read_text())
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == ROWS
    assert_exactly_once(tmp_path, ROWS)
    commits = _commits(tmp_path)
    record = commits[shard]
    if point == failpoints.WORKER_BEFORE_COMMIT_RECORD:
        assert record["worker"] != lease.worker and record["split_at"] == 0, "run again whole"
    else:
        assert record["worker"] == lease.worker and record["split_at"] > 0, "adopted"
    # Each part adds the shard of its rest; the other shard may be split at the tail too,
    # for the worker the controller started in place of the one killed.
    assert final.shards_total == 2 + sum(1 for c in commits.values() if c["split_at"])


async def test_a_part_whose_done_lost_its_answer_keeps_its_rest_once(
    tmp_path: Path, client: EbbClient, short_grace: Path
) -> None:
    """The master's write of a part's DONE (naming its rest) lands in KV and its answer is
    lost (in the real store, over a real nats-server): the master loads KV again, creates the
    rest once, and gives its index to no other shard."""
    job_id = await _submit(tmp_path, client)
    lease, pid = await _holder_with_rows_done(client, job_id)
    failpoints.arm(short_grace, failpoints.MASTER_KV_ANSWER_LOST, when="DONE split")
    os.kill(pid, signal.SIGTERM)
    await wait_until(
        lambda: failpoints.fired(short_grace, failpoints.MASTER_KV_ANSWER_LOST),
        timeout=60,
        what="the part's DONE to lose its answer",
    )
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == ROWS
    table = assert_exactly_once(tmp_path, ROWS)
    assert len(table) == ROWS
    commits = _commits(tmp_path)
    assert commits[lease.shard]["split_at"] > 0
    assert final.shards_total == 2 + sum(1 for c in commits.values() if c["split_at"])


async def test_at_the_tail_a_straggler_s_shard_is_split_for_the_idle_worker(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers, one four times slower than the other. The fast one ends its shards and
    asks for more while the slow one is still at its own: the master asks the straggler (on
    a renewal's reply) to commit the rows it has done, and the fast one runs the rest.
    Speculation is off: nothing is computed twice."""
    monkeypatch.setenv(envvars.CHUNK_ROWS, "500")
    rows = 4 * SHARD_ROWS
    write_dataset(tmp_path / "data", rows=rows, row_group_size=SHARD_ROWS)
    write_model(tmp_path / "model.onnx")
    stages = slow_stages(tmp_path, 0.1)
    stages[0] = {
        **stages[0],
        "modelet": "ebbtest_modelets:Straggler",
        "params": {"seconds_per_batch": 0.1, "factor": 4, "claim": str(tmp_path / "straggler")},
    }
    spec = job_spec(
        tmp_path,
        rows_per_shard=SHARD_ROWS,
        stages=stages,
        workers=(2, 2),
        fault={"lease_s": 6, "speculative": False},
    )
    async with (
        embedded_stack(tmp_path, prefix, max_workers=2) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        job_id = await client.submit(parse_job(spec))
        final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == rows
    assert_exactly_once(tmp_path, rows)
    commits = _commits(tmp_path)
    parts = [c for c in commits.values() if c["split_at"]]
    assert parts, "the straggler's shard was split"
    straggler = (tmp_path / "straggler").read_text()
    assert all(pid_of(c["worker"]) in (None, int(straggler)) for c in parts)
    assert final.shards_total == 4 + len(parts)
    assert all(c["attempt"] == 1 for c in commits.values()), "no shard computed twice"


def _one_row_group_job(tmp_path: Path, rows: int) -> dict[str, Any]:
    """One file of one row group, 32 s of work for one worker: a half of the rest is worth
    more than its cost when the second worker asks (HALVE_COST_S + the master's 5 s)."""
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_048_576)
    write_model(tmp_path / "model.onnx")
    stages = slow_stages(tmp_path, 0.2)
    stages[1]["threads"] = 1  # each worker's model on a core of its own
    return job_spec(
        tmp_path,
        stages=stages,
        workers=(2, 2),
        fault={"lease_s": 6, "speculative": False},
    )


async def test_one_file_of_one_row_group_is_computed_by_every_worker(
    tmp_path: Path, prefix: str
) -> None:
    """A Parquet file as pyarrow writes it by default (one row group) is one shard: the
    second worker has nothing queued, so the master has the holder split it and cuts the
    rest in two, a half for each, and again while halves are worth it. Speculation is off:
    nothing is computed twice."""
    rows = 16_000
    spec = _one_row_group_job(tmp_path, rows)
    async with (
        embedded_stack(tmp_path, prefix, max_workers=2) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        job_id = await client.submit(parse_job(spec))
        final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == rows
    assert_exactly_once(tmp_path, rows)
    commits = _commits(tmp_path)
    assert any(c["split_at"] for c in commits.values()), "the one shard was split"
    # A rest cut in two: the part and both halves, at least (a rest moved whole makes 2).
    assert final.shards_total >= 3 and len(commits) == final.shards_total
    workers = {c["worker"] for c in commits.values() if sum(f["rows"] for f in c["files"])}
    assert len(workers) == 2, f"rows committed by {workers}"
    assert all(c["attempt"] == 1 for c in commits.values()), "no shard computed twice"


async def test_a_part_committed_by_a_worker_killed_after_is_kept(
    tmp_path: Path, prefix: str
) -> None:
    """The holder of a one-row-group file commits a part for the idle worker and is then
    killed (SIGKILL, whatever else it holds): the part stays as it was committed, its rows
    are not computed again, and every row is in the output once."""
    rows = 16_000
    spec = _one_row_group_job(tmp_path, rows)

    def part() -> tuple[int, dict[str, Any], int] | None:
        for shard, commit in _commits(tmp_path).items():
            if commit["split_at"] and (pid := pid_of(commit["worker"])) is not None:
                return shard, commit, pid
        return None

    async with (
        embedded_stack(tmp_path, prefix, max_workers=2) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        job_id = await client.submit(parse_job(spec))
        shard, committed, pid = await wait_until(
            part, timeout=120, what="a part committed by a live worker"
        )
        os.kill(pid, signal.SIGKILL)
        final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == rows
    assert_exactly_once(tmp_path, rows)
    assert _commits(tmp_path)[shard] == committed, "the part as it was committed"
