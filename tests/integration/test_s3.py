"""Object stores: Ebb against a real S3-protocol server on loopback (moto's standalone server),
through a proxy that injects throttling, dropped connections and stalled uploads."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import envvars
from ebb.common.data.layout import MANIFEST, OutputFile
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.data.storage import STORE_RETRIES, RetryPolicy, StoreError, retrying
from ebb.common.job import parse_job
from ebb.common.messaging.messages import ShardSpec
from ebb.worker.modelcache.store import fetch_model
from ebb.worker.shardio.reader import ShardReadError, read_shard

from ..helpers import ASSETS, job_spec, wait_until, write_dataset, write_model
from ..objectstore import (
    Fault,
    FaultyProxy,
    MotoS3,
    assert_exactly_once,
    create_bucket,
    environment,
    output_commits,
    s3,
    s3_environment,
    upload,
)


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(moto: MotoS3) -> Iterator[FaultyProxy]:
    p = FaultyProxy(upstream=moto.url).start()
    try:
        with environment(s3_environment(p.url)):
            yield p
    finally:
        p.stop()


@pytest.fixture
def bucket(moto: MotoS3) -> str:
    name = f"ebb-{uuid.uuid4().hex[:12]}"
    create_bucket(moto.url, name)
    return name


def _fast() -> RetryPolicy:
    return RetryPolicy(attempts=6, base_s=0.01, throttled_base_s=0.02, cap_s=0.1)


def _record(shard: int, attempt: int, worker: str) -> Any:
    files = [OutputFile(path=f"data/shard={shard:05d}/attempt={attempt}/x.parquet", rows=1)]
    return new_commit(job="j", shard=shard, attempt=attempt, files=files, worker=worker)


# -- the commit protocol on S3 -----------------------------------------------------------------


def test_two_attempts_racing_to_commit_one_shard_one_wins(proxy: FaultyProxy, bucket: str) -> None:
    store = OutputStore(f"s3://{bucket}/out")
    barrier = threading.Barrier(8)
    outcomes: dict[int, tuple[bool, int]] = {}

    def attempt(n: int) -> None:
        barrier.wait()
        won, record = OutputStore(f"s3://{bucket}/out").create_commit(_record(3, n, f"w{n}"))
        outcomes[n] = (won, record.attempt)

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [n for n, (won, _) in outcomes.items() if won]
    assert len(winners) == 1
    # Every loser was told who won, and the record in the store names the winner.
    assert {attempt for _, attempt in outcomes.values()} == set(winners)
    stored = store.read_commit(3)
    assert stored is not None and stored.attempt == winners[0]
    # The store refused the losers' conditional PUTs: If-None-Match reached it and held.
    assert proxy.count("PUT", r"_commits/shard=00003\.json") == 8
    refused = [s for m, p, s in proxy.seen if m == "PUT" and "_commits" in p and s == 412]
    assert len(refused) == 7


def test_a_retried_commit_whose_first_answer_was_lost_counts_as_ours(
    proxy: FaultyProxy, bucket: str
) -> None:
    store = OutputStore(f"s3://{bucket}/out")
    record = _record(1, 2, "w")
    assert store.create_commit(record)[0]
    # The same attempt asks again (as a retry after a dropped answer would): still ours.
    won, again = store.create_commit(record)
    assert won and again.attempt == 2
    # Another attempt loses.
    won, other = store.create_commit(_record(1, 3, "v"))
    assert not won and other.attempt == 2


# -- retries -----------------------------------------------------------------------------------


def test_throttling_and_dropped_connections_are_retried(proxy: FaultyProxy, bucket: str) -> None:
    store = OutputStore(f"s3://{bucket}/out")
    before = STORE_RETRIES.labels("throttled")._value.get()
    proxy.add(Fault("slowdown", method="PUT", path=r"part-0\.bin", times=6))
    proxy.add(Fault("drop", method="GET", path=r"part-0\.bin", times=3))
    data = os.urandom(100_000)
    store.write_file("data/part-0.bin", data)
    assert store.fs.cat_file(store.full("data/part-0.bin")) == data
    throttled = [s for m, p, s in proxy.seen if m == "PUT" and "part-0" in p and s == 503]
    assert len(throttled) == 6
    assert STORE_RETRIES.labels("throttled")._value.get() > before
    dropped = [s for m, p, s in proxy.seen if m == "GET" and "part-0" in p and s == 0]
    assert len(dropped) == 3


def test_a_shard_read_is_retried_through_faults(proxy: FaultyProxy, bucket: str) -> None:
    table = pa.table({"id": list(range(1000)), "x": [float(i) for i in range(1000)]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=250)
    s3(proxy.url).pipe_file(f"{bucket}/in/a.parquet", buffer.getvalue())
    proxy.add(Fault("slowdown", method="GET", path=r"a\.parquet", times=3))
    proxy.add(Fault("drop", method="GET", path=r"a\.parquet", times=2))
    shard = ShardSpec(
        index=0, path=f"s3://{bucket}/in/a.parquet", format="parquet", rows=500, row_groups=[1, 2]
    )
    data = read_shard(shard, ["id"])
    assert data.table.column("id").to_pylist() == list(range(250, 750))
    faults = [s for m, p, s in proxy.seen if "a.parquet" in p and s in (0, 503)]
    assert len(faults) == 5


def test_a_permanent_error_fails_at_once_with_the_stores_message(
    proxy: FaultyProxy, bucket: str
) -> None:
    s3(proxy.url).pipe_file(f"{bucket}/in/b.csv", b"id,x\n1,2\n")
    proxy.add(Fault("error", method="GET", path=r"b\.csv", times=100))
    shard = ShardSpec(
        index=4, path=f"s3://{bucket}/in/b.csv", format="csv", rows=1, byte_start=5, byte_end=9
    )
    with pytest.raises(ShardReadError, match=r"shard 4 .*Access Denied \(injected\)"):
        read_shard(shard, None)
    # Not retried: one request, one answer.
    assert proxy.count("GET", r"b\.csv") == 1


def test_retries_give_up_after_the_policy_s_attempts() -> None:
    calls: list[float] = []

    def throttled() -> None:
        raise OSError("An error occurred (SlowDown) when calling the PutObject operation")

    with pytest.raises(StoreError, match="SlowDown") as caught:
        retrying("put x", throttled, policy=_fast(), sleep=calls.append)
    assert caught.value.kind == "throttled"
    assert len(calls) == 5  # 6 tries, 5 pauses
    assert all(0 <= d <= 0.1 for d in calls)


# -- the model cache ---------------------------------------------------------------------------


def test_a_model_is_fetched_once_into_the_cache_by_concurrent_workers(
    proxy: FaultyProxy, bucket: str, tmp_path: Path
) -> None:
    blob = os.urandom(3_000_000)
    s3(proxy.url).pipe_file(f"{bucket}/models/m.onnx", blob)
    cache = str(tmp_path / "cache")
    barrier = threading.Barrier(4)
    results: list[Any] = []

    def load() -> None:
        barrier.wait()
        results.append(fetch_model(f"s3://{bucket}/models/m.onnx", cache))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.fetched for r in results) == 1
    assert len({r.path for r in results}) == 1
    assert Path(results[0].path).read_bytes() == blob
    assert proxy.count("GET", r"models/m\.onnx") == 1
    # A changed object (a new ETag) is fetched anew.
    s3(proxy.url).pipe_file(f"{bucket}/models/m.onnx", blob[::-1])
    again = fetch_model(f"s3://{bucket}/models/m.onnx", cache)
    assert again.fetched and Path(again.path).read_bytes() == blob[::-1]


def test_an_llm_model_folder_comes_from_the_store_once_and_generates_as_the_local_one(
    proxy: FaultyProxy, bucket: str, tmp_path: Path
) -> None:
    """A Hugging Face model folder in the store (config, weights, tokenizer files): the llm
    stage copies each file once into the worker's model cache and loads the folder they make,
    whose text is the local folder's."""
    import numpy as np

    from ebb.common.job import LLMSpec, SamplingSpec, StageSpec
    from ebb.worker.llm.stage import LLMStage

    from ..llm_model import build_tiny_llm, corpus

    local = build_tiny_llm(tmp_path / "tiny")
    store = s3(proxy.url)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.pipe_file(f"{bucket}/models/tiny/{path.relative_to(local)}", path.read_bytes())
    prompts = {"prompt": np.array(corpus(5, seed=4), dtype=object)}
    texts = []
    with environment({envvars.MODEL_CACHE_DIR: str(tmp_path / "model-cache")}):
        for model in (str(local), f"s3://{bucket}/models/tiny", f"s3://{bucket}/models/tiny"):
            stage = LLMStage(
                StageSpec(name="gen", llm=LLMSpec(model=model, sampling=SamplingSpec(max_tokens=6)))
            )
            stage.setup()
            texts.append(list(stage.process_columns(dict(prompts))["text"]))
            if model.startswith("s3://"):
                assert stage.model_dir.startswith(str(tmp_path / "model-cache"))
    assert texts[0] == texts[1] == texts[2]
    from ebb.worker.llm.provenance import generation_record

    record = generation_record(
        StageSpec(name="gen", llm=LLMSpec(model=f"s3://{bucket}/models/tiny"))
    )
    assert record["model_sha256"] is None and len(record["model_version"]) == 64
    # Each file once, though two stages loaded the folder.
    assert proxy.count("GET", r"models/tiny/config\.json") == 1
    assert proxy.count("GET", r"models/tiny/model\.safetensors") == 1


# -- jobs end to end ---------------------------------------------------------------------------


@pytest.fixture
async def stack(
    tmp_path: Path, prefix: str, proxy: FaultyProxy, bucket: str
) -> AsyncIterator[LocalStack]:
    s = LocalStack(
        StackConfig(
            state_dir=tmp_path / "state",
            data_roots=[str(tmp_path), str(ASSETS), f"s3://{bucket}"],
            max_workers=2,
            worker_grace_s=10,
            prefix=prefix,
        )
    )
    with environment({envvars.MODEL_CACHE_DIR: str(tmp_path / "model-cache")}):
        await s.start()
        try:
            yield s
        finally:
            await s.stop()


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[EbbClient]:
    c = await EbbClient.connect(stack.nats_config)
    try:
        yield c
    finally:
        await c.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_parquet_job_from_s3_to_s3_under_faults_exactly_once(
    tmp_path: Path, client: EbbClient, proxy: FaultyProxy, bucket: str
) -> None:
    rows = 12_000
    fs = s3(proxy.url)
    write_dataset(tmp_path / "data", rows=rows, files=2, row_group_size=1_000)
    upload(fs, tmp_path / "data", f"{bucket}/in")
    write_model(tmp_path / "model.onnx")
    fs.pipe_file(f"{bucket}/models/model.onnx", (tmp_path / "model.onnx").read_bytes())
    spec = job_spec(
        tmp_path,
        rows_per_shard=2_000,
        workers=(2, 2),
        input_uri=f"s3://{bucket}/in",
        output_uri=f"s3://{bucket}/out",
    )
    spec["pipeline"]["stages"][1]["model"] = f"s3://{bucket}/models/model.onnx"
    # The store misbehaves all along: throttled writes and reads, dropped connections.
    proxy.add(Fault("slowdown", method="PUT", path=r"/out/data/", times=4))
    proxy.add(Fault("slowdown", method="GET", path=r"/in/part-", times=4))
    proxy.add(Fault("drop", method="GET", path=r"/in/part-", times=3))
    proxy.add(Fault("drop", method="PUT", path=r"/out/_commits/", times=2))
    final = await client.wait(await client.submit(parse_job(spec)))
    assert final.state == "SUCCEEDED", final.reason
    assert (final.rows_done, final.error_rows) == (rows, 0)
    table = assert_exactly_once(fs, f"{bucket}/out", rows)
    assert table.column("_error").null_count == rows
    assert all(f.hits == f.times for f in proxy.faults), "every fault was met and overcome"
    # Two workers loaded the model; the store served it once: the node's cache did the rest.
    assert proxy.count("GET", r"/models/model\.onnx") == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_csv_job_from_s3_to_jsonl_files_on_s3_exactly_once(
    tmp_path: Path, client: EbbClient, proxy: FaultyProxy, bucket: str
) -> None:
    rows = 5_000
    fs = s3(proxy.url)
    table = pa.table({"id": list(range(rows)), "weight": [i / 4 for i in range(rows)]})
    buffer = io.BytesIO()
    pacsv.write_csv(table, buffer)
    fs.pipe_file(f"{bucket}/csv/rows.csv", buffer.getvalue())
    spec = job_spec(
        tmp_path,
        rows_per_shard=700,
        stages=[{"modelet": "ebb.worker.modelets:Features", "params": {"columns": ["weight"]}}],
        workers=(2, 2),
        input_uri=f"s3://{bucket}/csv/rows.csv",
        output_uri=f"s3://{bucket}/out",
        carryover=["id", "weight"],
    )
    spec["input"] = {"uri": f"s3://{bucket}/csv/rows.csv", "format": "csv", "rows_per_shard": 700}
    spec["output"].update(format="jsonl", max_rows_per_file=300)
    final = await client.wait(await client.submit(parse_job(spec)))
    assert final.state == "SUCCEEDED", final.reason
    out = assert_exactly_once(fs, f"{bucket}/out", rows)
    manifest = json.loads(fs.cat_file(f"{bucket}/out/{MANIFEST}"))
    assert all(f["path"].endswith(".jsonl") and f["rows"] <= 300 for f in manifest["files"])
    assert len(manifest["files"]) > final.shards["DONE"]  # shards of ~700 rows in parts
    by_id = {r["id"]: r for r in out.to_pylist()}
    assert by_id[4_001]["weight"] == 4_001 / 4


def _pid_of(worker_id: str) -> int | None:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "ebb.worker" in cmdline and worker_id in cmdline:
            return int(proc.pid)
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_worker_killed_mid_upload_leaves_nothing_the_manifest_lists(
    tmp_path: Path, client: EbbClient, proxy: FaultyProxy, bucket: str
) -> None:
    rows = 8_000
    fs = s3(proxy.url)
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    upload(fs, tmp_path / "data", f"{bucket}/in")
    write_model(tmp_path / "model.onnx")
    spec = job_spec(
        tmp_path,
        rows_per_shard=2_000,
        workers=(2, 2),
        fault={"lease_s": 3},
        input_uri=f"s3://{bucket}/in",
        output_uri=f"s3://{bucket}/out",
    )
    # The first upload of a data file hangs mid-request, as a slow link would.
    proxy.add(Fault("stall", method="PUT", path=r"/out/data/shard=", times=1))
    job_id = await client.submit(parse_job(spec))
    stalled = await wait_until(lambda: list(proxy.stalled), timeout=120, what="a stalled upload")
    match = re.search(r"shard=(\d+)/attempt=(\d+)/", stalled[0][1])
    assert match is not None
    shard, attempt = int(match.group(1)), int(match.group(2))

    async def uploader() -> Any:
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
        for lease in status.leases:
            if (lease.shard, lease.attempt) == (shard, attempt):
                return lease.worker, _pid_of(lease.worker)
        return None

    worker, pid = await wait_until(uploader, timeout=30, what="the uploading worker")
    os.kill(pid, signal.SIGKILL)
    final = await client.wait(job_id)
    proxy.release_stalled()
    assert final.state == "SUCCEEDED", final.reason
    root = f"{bucket}/out"
    assert_exactly_once(fs, root, rows)
    killed_path = f"data/shard={shard:05d}/attempt={attempt}/"
    manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    assert not any(f["path"].startswith(killed_path) for f in manifest["files"])
    # No commit record for the killed attempt: its shard was won by another attempt.
    records = {r["shard"]: r for r in output_commits(fs, root)}
    assert (records[shard]["attempt"], records[shard]["worker"]) != (attempt, worker)
    assert not fs.exists(f"{root}/{killed_path}part-00000.parquet")


# -- a column of URLs --------------------------------------------------------------------------


async def test_a_url_column_is_fetched_with_retries_and_per_item_errors(
    proxy: FaultyProxy, bucket: str
) -> None:
    from ebb.common.job import StageSpec
    from ebb.worker.pipeline.front import Pipeline, PipelineConfig

    fs = s3(proxy.url)
    for i in range(40):
        fs.pipe_file(f"{bucket}/docs/{i}.txt", f"document {i}".encode())
    urls = [f"s3://{bucket}/docs/{i}.txt" for i in range(40)]
    urls[7] = f"s3://{bucket}/docs/missing.txt"
    proxy.add(Fault("slowdown", method="GET", path=r"/docs/1\d\.txt", times=5))
    proxy.add(Fault("drop", method="GET", path=r"/docs/2\d\.txt", times=3))
    proxy.add(Fault("error", method="GET", path=r"/docs/33\.txt", times=100))
    stage = StageSpec(
        name="fetch",
        modelet="ebb.worker.modelets:Fetch",
        params={"column": "url", "output": "content", "concurrency": 8},
        batch_size=40,
        batch_wait_s=0.5,
    )
    pipeline = Pipeline(PipelineConfig(stages=[stage]))
    try:
        await pipeline.start()
        outcomes = await pipeline.run([{"id": i, "url": u} for i, u in enumerate(urls)])
    finally:
        await pipeline.stop()
    failed = {i: str(v) for i, (ok, v) in enumerate(outcomes) if not ok}
    assert sorted(failed) == [7, 33]
    assert "missing.txt" in failed[7]
    assert "Access Denied (injected)" in failed[33]
    for i, (ok, value) in enumerate(outcomes):
        if ok:
            assert value["content"] == f"document {i}".encode()
    # Throttled and dropped reads were retried; the bisection did not read good objects again.
    good_reads = [p for m, p, s in proxy.seen if m == "GET" and "/docs/" in p and s in (200, 206)]
    assert len(good_reads) == len(set(good_reads)) == 38
