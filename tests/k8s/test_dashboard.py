"""The Grafana dashboard in k8s/, every query of it run by a real Prometheus that scrapes a
real shard master, a controller on the Kubernetes backend (fake API server) and a real worker
in the middle of a job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from prometheus_client import start_http_server

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.natsconfig import NatsConfig, nats_environment
from ebb.controller.kube.backend import KubeConfig, KubernetesBackend
from ebb.controller.policy.tidal import TidalConfig
from ebb.controller.service import Controller, ControllerConfig
from ebb.gateway.config import ApiKey, CatalogueModel, GatewayConfig
from ebb.gateway.service import Gateway, GatewaySettings
from ebb.worker.modelcache.server import CacheServerConfig, ModelCacheServer
from tests.helpers import free_port, job_spec, wait_until, write_dataset, write_model
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.harness import NS, offline
from tests.k8s.manifests import BASE

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="needs prometheus (`make test` installs it)"),
    pytest.mark.timeout(180),
]

DASHBOARD = BASE / "grafana" / "ebb-dashboard.json"

MAY_BE_EMPTY = {
    # Series that only exist once something goes wrong (or a GPU is there).
    "Shards sent back to the queue",
    "Refused messages",
    "Workers lost, by kind, and attempts forgiven",
    "Stage processes replaced",
    "Kubernetes API errors",
    "Idle GPUs, by pool",
    "Lease renewals and expiries per second",  # no renewal is due in a short run
    "Shards split, and rows their parts kept",  # no worker drained, no straggler
    # Jobs in tiers only (this job has none: tests/integration/test_tiers.py runs them).
    "Rows per second, by tier",
    "Backlog, by tier",
    "Workers, by tier",
    # Jobs with an llm stage only (tests/worker/test_llm_metrics.py checks these metrics).
    "Tokens per second, by llm stage",
    "Rows in flight and the KV tokens they hold, by llm stage",
    "Engines restarted, by llm stage",
}


# What prometheus-nats-exporter (-jsz=all, the sidecar on the NATS pods) exports: the names
# its JetStream collector defines.
NATS_EXPORTER_METRICS = {
    f"jetstream_{name}"
    for name in (
        "server_jetstream_disabled",
        "server_total_streams",
        "server_total_consumers",
        "server_total_messages",
        "server_total_message_bytes",
        "server_max_memory",
        "server_max_storage",
        "stream_total_messages",
        "stream_total_bytes",
        "stream_first_seq",
        "stream_last_seq",
        "stream_consumer_count",
        "consumer_delivered_consumer_seq",
        "consumer_delivered_stream_seq",
        "consumer_num_ack_pending",
        "consumer_num_redelivered",
        "consumer_num_waiting",
        "consumer_num_pending",
        "consumer_ack_floor_stream_seq",
        "consumer_ack_floor_consumer_seq",
    )
}


def all_panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def is_nats(panel: dict[str, Any]) -> bool:
    return any("jetstream_" in t["expr"] for t in panel["targets"])


def panels() -> list[dict[str, Any]]:
    """The panels of Ebb's own metrics."""
    return [p for p in all_panels() if not is_nats(p)]


def nats_panels() -> list[dict[str, Any]]:
    """The panels of NATS's metrics, from its exporter."""
    return [p for p in all_panels() if is_nats(p)]


def as_prometheus(expr: str) -> str:
    """A panel's query as Grafana sends it: its variables filled in."""
    return (
        expr.replace("$__rate_interval", "20s").replace("$__range", "5m").replace("$job_id", ".*")
    )


def _read(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:  # a refused query: Prometheus says why, in JSON
        with e:
            return json.load(e)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """A Prometheus scraping this process (master, controller) and one worker, every second."""
    ours, _ = start_http_server(0, addr="127.0.0.1")
    worker_port = free_port()
    targets = [f"127.0.0.1:{ours.server_address[1]}", f"127.0.0.1:{worker_port}"]
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: ebb\n    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
    )
    assert PROMETHEUS is not None
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        yield f"http://127.0.0.1:{web}", [str(worker_port)]
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        ours.shutdown()
        ours.server_close()


@pytest.fixture
async def worker_process(
    nats_config: NatsConfig, prometheus: tuple[str, list[str]]
) -> AsyncIterator[Any]:
    """Starts `python -m ebb.worker` for a job, serving metrics where Prometheus looks."""
    started: list[asyncio.subprocess.Process] = []
    (port,) = prometheus[1]

    async def start(job: str) -> asyncio.subprocess.Process:
        env = {
            **os.environ,
            **nats_environment(nats_config),
            "EBB_METRICS_PORT": port,
            "EBB_LOG_LEVEL": "WARNING",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ebb.worker", "--job", job, "--id", "dash-w", env=env
        )
        started.append(process)
        return process

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        await process.wait()


async def test_every_panel_queries_metrics_ebb_exports(
    kube: FakeKubeAPI,
    ebb: EbbClient,
    nats_config: NatsConfig,
    tmp_path: Path,
    prometheus: tuple[str, list[str]],
    worker_process: Any,
) -> None:
    url, _ = prometheus
    # A cluster with an offline node and a quiet mixed pool: the tide lends, capacity shows.
    kube.add_namespace(NS)
    offline(kube, "off-0", cpu="4")
    for n in range(2):
        kube.add_node(
            f"mix-{n}",
            labels={"ebb.io/pool": "mixed"},
            allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        )
    # A job slow enough to be running while Prometheus looks; its model stage elastic.
    write_dataset(tmp_path / "data", rows=20_000, row_group_size=500)
    write_model(tmp_path / "model.onnx")
    stages = [
        {
            "name": "slow",
            "modelet": "ebbtest_modelets:Slow",
            "params": {"seconds_per_batch": 0.05},
            "batch_size": 50,
        },
        {
            "name": "model",
            "model": str(tmp_path / "model.onnx"),
            "batch_size": 100,
            "min_workers": 1,
            "max_workers": 2,
        },
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 100},
    ]
    job = await ebb.submit(parse_job(job_spec(tmp_path, rows_per_shard=500, stages=stages)))
    client = kube.api_client()
    backend = KubernetesBackend(
        KubeConfig(namespace=NS, nats=nats_config, tidal=TidalConfig(sample_s=0.2)), client
    )
    controller = Controller(ControllerConfig(nats=nats_config, resync_s=0.2), backend)
    running = asyncio.create_task(controller.run())
    worker = await worker_process(job)
    # A node's model cache (in this process, where Prometheus scrapes it) that has sent a
    # worker one model from a store.
    root = f"memory://dash-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("memory").pipe_file(f"{root}/model.onnx", b"an onnx model's bytes")
    cache = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node-cache"),
            max_bytes=1 << 20,
            model_roots=[root],
            host="127.0.0.1",
            port=0,
        )
    )
    await cache.start()
    query = urllib.parse.urlencode({"uri": f"{root}/model.onnx"})
    sent = await asyncio.to_thread(_read, f"http://127.0.0.1:{cache.port}/models?{query}")
    assert sent == b"an onnx model's bytes"
    # The Batch API gateway (in this process too), sent a batch by the official client.
    gateway, serving = await batch_api(tmp_path, nats_config)
    try:
        queries = {
            (p["title"], t["refId"]): as_prometheus(t["expr"])
            for p in panels()
            for t in p["targets"]
        }

        async def answers() -> dict[tuple[str, str], Any]:
            out = {}
            for key, expr in queries.items():
                query = urllib.parse.urlencode({"query": expr})
                out[key] = await asyncio.to_thread(_get, f"{url}/api/v1/query?{query}")
            return out

        last: dict[tuple[str, str], Any] = {}

        async def probe() -> dict[tuple[str, str], Any] | None:
            try:
                found = await answers()
            except OSError:  # Prometheus still starting
                return None
            last.update(found)
            refused = {k: a.get("error") for k, a in found.items() if a["status"] != "success"}
            assert not refused, f"queries Prometheus refused: {refused}"
            empty = [k for k, a in found.items() if not a["data"]["result"]]
            return None if any(title not in MAY_BE_EMPTY for title, _ in empty) else found

        try:
            found = await wait_until(probe, timeout=90, interval=1.0, what="data in every panel")
        except AssertionError as e:
            empty = sorted(
                title
                for (title, _), a in last.items()
                if a.get("data", {}).get("result") == [] and title not in MAY_BE_EMPTY
            )
            raise AssertionError(f"{e}; panels without data: {empty}") from None
        # Every query is valid PromQL that Prometheus evaluated...
        assert all(a["status"] == "success" for a in found.values())
        # ...and every metric it names is one Ebb exports (the empty ones included).
        metadata = await asyncio.to_thread(_get, f"{url}/api/v1/metadata")
        exported = set(metadata["data"])
        named = {
            re.sub(r"_(total|bucket|sum|count)$", "", m)
            for expr in queries.values()
            for m in re.findall(r"\bebb_[a-z_]+", expr)
        }
        assert named <= exported, named - exported
        assert worker.returncode is None  # it was the live worker that Prometheus scraped
    finally:
        controller.request_stop()
        await running
        await client.close()
        await cache.close()
        gateway.request_stop()
        await serving


async def batch_api(tmp: Path, nats_config: NatsConfig) -> tuple[Gateway, asyncio.Task[None]]:
    """A gateway that has answered a few requests and ended one batch (its one request
    refused: no job runs)."""
    import openai

    config = GatewayConfig(
        root=str(tmp / "gateway"),
        models={"m": CatalogueModel(stage={"llm": {"model": str(tmp / "no-model")}})},
        keys=[ApiKey(owner="team", key="sk-team")],
    )
    gateway = Gateway(GatewaySettings(nats=nats_config, config=config, port=0, poll_s=0.2))
    serving = asyncio.create_task(gateway.run())
    await asyncio.wait_for(gateway.serving.wait(), 30)
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="sk-team")
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "x"}}
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("in.jsonl", json.dumps(line).encode()), purpose="batch"
    )
    batch = await asyncio.to_thread(
        oa.batches.create,
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window="24h",
    )

    async def ended() -> bool:
        return (await asyncio.to_thread(oa.batches.retrieve, batch.id)).status == "completed"

    await wait_until(ended, timeout=30, what="the batch to end")
    oa.close()
    return gateway, serving


def test_the_nats_panels_show_jetstream_storage_and_consumer_lag() -> None:
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in nats_panels()}
    assert any("max_storage" in e and "total_message_bytes" in e for e in exprs.values()), exprs
    assert any("consumer_num_pending" in e for e in exprs.values()), exprs
    for title, expr in exprs.items():
        named = set(re.findall(r"\bjetstream_[a-z_]+", expr))
        assert named and named <= NATS_EXPORTER_METRICS, (title, named - NATS_EXPORTER_METRICS)
        assert not re.findall(r"\bebb_[a-z_]+", expr), title


async def test_prometheus_evaluates_every_nats_panel_query(
    prometheus: tuple[str, list[str]],
) -> None:
    """Valid PromQL that Prometheus evaluates (without an exporter to scrape here, on no
    data: a query that does not parse, or mixes types wrongly, is refused all the same)."""
    url, _ = prometheus
    queries = {
        (p["title"], t["refId"]): as_prometheus(t["expr"])
        for p in nats_panels()
        for t in p["targets"]
    }
    assert queries

    async def answers() -> dict[tuple[str, str], Any] | None:
        try:
            return {
                key: await asyncio.to_thread(
                    _get, f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
                )
                for key, expr in queries.items()
            }
        except OSError:  # Prometheus still starting
            return None

    found = await wait_until(answers, timeout=60, interval=0.5, what="Prometheus answering")
    refused = {k: a.get("error") for k, a in found.items() if a["status"] != "success"}
    assert not refused, f"queries Prometheus refused: {refused}"
    # The same Prometheus refuses a broken one: the check can fail.
    broken = await asyncio.to_thread(
        _get, f"{url}/api/v1/query?{urllib.parse.urlencode({'query': 'max by (x (y)'})}"
    )
    assert broken["status"] == "error"
