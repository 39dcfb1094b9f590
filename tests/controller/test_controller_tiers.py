"""The controller scales each tier of a job as a group of its own: what each group wants, the
plan per group, the evidence of its failures; and the local backend running a process per
worker of each tier, with `--tier`.

A job's tiers come from `JobStatus.tiers` (the master's) and `JobSpec.tiers` (their
resources). The local backend test talks to a scripted master over a real nats-server
(tests/scripted_master.py) and starts real processes: a stand-in for the worker that tells
how it was started and drains on SIGTERM.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from nats.aio.client import Client as NATS

from ebb.common import envvars
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import JobStatus, TierStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import WORKER_ID_RE
from ebb.controller.backend import Capacity, ClusterBackend, WorkerInfo
from ebb.controller.groups import Group, groups_of, new_worker_id, wanted
from ebb.controller.kube.podspec import pod_name
from ebb.controller.local.backend import LocalBackend, LocalConfig
from ebb.controller.policy.capacity import Bin
from ebb.controller.reconcile import Reconciler, ReconcilerConfig, ever_ready, plan, share

from ..helpers import job_spec, wait_until
from ..scripted_master import ScriptedMaster

pytestmark = pytest.mark.timeout(120)


def tiered_spec(
    folder: Path, *, cpu: tuple[int, int] = (1, 8), gpu: tuple[int, int] = (1, 2)
) -> dict[str, Any]:
    """Decoding in a `cpu` tier, the model in a `gpu` tier: (min, max) workers of each."""
    stages: list[dict[str, Any]] = [
        {
            "name": "decode",
            "modelet": "ebb.worker.modelets:Features",
            "params": {"columns": ["features"]},
        },
        {"name": "model", "model": str(folder / "model.onnx")},
    ]
    spec = job_spec(folder, stages=stages, workers=(1, 8))
    spec["id"] = "j"
    spec["tiers"] = [
        {
            "name": "cpu",
            "stages": ["decode"],
            "resources": {"min_workers": cpu[0], "max_workers": cpu[1], "cpu": 2},
        },
        {
            "name": "gpu",
            "stages": ["model"],
            "resources": {"min_workers": gpu[0], "max_workers": gpu[1], "gpu": 1},
        },
    ]
    return spec


def tiered(
    spec: dict[str, Any],
    *,
    cpu: dict[str, int],
    gpu: dict[str, int],
    held: bool = False,
    state: str = "RUNNING",
) -> JobStatus:
    return JobStatus(
        id="j",
        name="j",
        state=state,  # type: ignore[arg-type]
        min_workers=1,
        max_workers=8,
        spec=spec,
        tiers=[
            TierStatus(name="cpu", shards=cpu, held_back=held),
            TierStatus(name="gpu", shards=gpu),
        ],
    )


def worker(worker_id: str, tier: str, *, started: float = 0.0) -> WorkerInfo:
    return WorkerInfo(id=worker_id, job="j", phase="running", started_at=started, tier=tier)


def by_tier(groups: list[Group], have: dict[str, int] | None = None) -> dict[str, int]:
    return {g.tier: wanted(g, have=(have or {}).get(g.tier, 0)) for g in groups}


@pytest.mark.parametrize(
    ("cpu", "gpu", "held", "have", "want"),
    [
        # The model's tier keeps its min, waiting for hand-offs, while decoding has work.
        ({"TODO": 20}, {}, False, {}, {"cpu": 8, "gpu": 1}),
        ({"TODO": 3, "DOING": 2}, {"TODO": 1}, False, {}, {"cpu": 5, "gpu": 1}),
        ({"DONE": 20}, {"TODO": 5}, False, {}, {"cpu": 0, "gpu": 2}),  # decoding is done
        ({"DONE": 20}, {"DONE": 20}, False, {}, {"cpu": 0, "gpu": 0}),
        ({"DONE": 20, "QUARANTINED": 1}, {"DOING": 1}, False, {}, {"cpu": 0, "gpu": 1}),
        # Held back: no more workers than it has, whatever its backlog.
        ({"TODO": 20}, {"TODO": 2}, True, {"cpu": 3}, {"cpu": 3, "gpu": 2}),
        ({"TODO": 20}, {"TODO": 2}, True, {}, {"cpu": 0, "gpu": 2}),
        ({"TODO": 2}, {"TODO": 2}, True, {"cpu": 5}, {"cpu": 2, "gpu": 2}),
    ],
)
def test_each_tier_wants_workers_for_its_own_backlog(
    tmp_path: Path,
    cpu: dict[str, int],
    gpu: dict[str, int],
    held: bool,
    have: dict[str, int],
    want: dict[str, int],
) -> None:
    job = tiered(tiered_spec(tmp_path), cpu=cpu, gpu=gpu, held=held)
    assert by_tier(groups_of(job), have) == want


def test_a_tiered_job_that_does_not_run_wants_nothing(tmp_path: Path) -> None:
    job = tiered(tiered_spec(tmp_path), cpu={"TODO": 5}, gpu={"TODO": 5}, state="SUBMITTED")
    assert by_tier(groups_of(job)) == {"cpu": 0, "gpu": 0}


def test_a_job_without_tiers_is_one_group_keyed_by_its_id() -> None:
    job = JobStatus(
        id="a", name="a", state="RUNNING", shards={"TODO": 9}, min_workers=1, max_workers=4
    )
    (group,) = groups_of(job)
    assert (group.key, group.tier, wanted(group)) == ("a", "", 4)


def test_a_job_scales_on_the_workers_its_shards_can_keep_busy(tmp_path: Path) -> None:
    """One running shard that the master may cut in halves for idle workers (a Parquet file
    of one row group): the job wants the workers the master says it can use, within its
    max; a master that does not say (0) leaves the shards' count."""
    one = {"DOING": 1}
    job = JobStatus(id="a", name="a", state="RUNNING", shards=one, min_workers=1, max_workers=4)
    assert wanted(groups_of(job)[0]) == 1
    assert wanted(groups_of(replace(job, workers_usable=3))[0]) == 3
    tiers = tiered(tiered_spec(tmp_path), cpu=one, gpu={})
    tiers = replace(tiers, tiers=[replace(tiers.tiers[0], workers_usable=6), tiers.tiers[1]])
    assert by_tier(groups_of(tiers)) == {"cpu": 6, "gpu": 1}


def test_tiers_share_slots_as_jobs_do(tmp_path: Path) -> None:
    job = tiered(tiered_spec(tmp_path), cpu={"TODO": 20}, gpu={"TODO": 1})
    other = JobStatus(
        id="o",
        name="o",
        state="RUNNING",
        shards={"TODO": 9},
        min_workers=1,
        max_workers=4,
        submitted_at=1.0,
    )
    # Minimums first (the tiers', then the other job's), then one at a time, the least-served
    # job first: a job in two tiers is one job, its tiers' workers counted together.
    assert share([job, other], 3) == {"j/cpu": 1, "j/gpu": 1, "o": 1}
    assert share([job, other], 8) == {"j/cpu": 3, "j/gpu": 1, "o": 4}
    # Within the job, its least-served tier first.
    both = tiered(tiered_spec(tmp_path, gpu=(1, 8)), cpu={"TODO": 20}, gpu={"TODO": 20})
    assert share([both], 6) == {"j/cpu": 3, "j/gpu": 3}


def test_the_plan_launches_and_drains_per_tier(tmp_path: Path) -> None:
    job = tiered(tiered_spec(tmp_path), cpu={"DONE": 20}, gpu={"TODO": 4})
    workers = [
        worker("c1", "cpu", started=1.0),
        worker("c2", "cpu", started=2.0),
        worker("g1", "gpu"),
        worker("x1", "no-such-tier"),
    ]
    decided = plan(
        jobs=[job],
        workers=workers,
        capacity=Capacity.slots(8),
        now=10.0,
        not_before={"j/gpu": 11.0},
    )
    assert decided.desired == {"j/cpu": 0, "j/gpu": 2}
    assert sorted(decided.terminate) == ["c1", "c2", "x1"]
    # The GPU tier waits out its relaunch backoff; the CPU tier's would not hold it.
    assert decided.launch == {} and decided.held_back == {"j/gpu": 1.0}
    assert plan(
        jobs=[job], workers=workers, capacity=Capacity.slots(8), now=12.0, not_before={}
    ).launch == {"j/gpu": 1}


def test_each_tier_is_placed_by_its_own_shape_on_the_nodes_it_may_use(tmp_path: Path) -> None:
    """A CPU node and a GPU node: decoding fills the CPU node, the model takes the GPU."""
    job = tiered(tiered_spec(tmp_path, cpu=(1, 20), gpu=(1, 4)), cpu={"TODO": 20}, gpu={"TODO": 4})
    shapes = {"cpu": {"cpu": 2.0}, "gpu": {"cpu": 2.0, "nvidia.com/gpu": 1.0}}
    capacity = Capacity(
        bins=[Bin("cpu-0", {"cpu": 8.0}), Bin("gpu-0", {"cpu": 4.0, "nvidia.com/gpu": 1.0})],
        shape=lambda _job, tier: shapes[tier],
        eligible=lambda _job, tier: lambda b: b.name.startswith(tier),
    )
    decided = plan(jobs=[job], workers=[], capacity=capacity, now=0.0, not_before={})
    assert decided.desired == {"j/cpu": 4, "j/gpu": 1}


def test_a_failed_tier_worker_holds_back_its_tier_and_its_memory_grows_alone() -> None:
    grown: list[str] = []
    r = Reconciler(
        master=cast(MasterClient, None),
        backend=cast(ClusterBackend, SimpleNamespace(grow_memory=grown.append)),
        config=ReconcilerConfig(max_crashes=3),
    )
    ended = WorkerInfo(
        id="g1",
        job="j",
        phase="failed",
        started_at=0.0,
        failure="oom",
        reason="OOMKilled",
        tier="gpu",
    )
    r.account(ended, 10.0, rows_done=0)
    assert grown == ["j/gpu"] and set(r.not_before) == {"j/gpu"}
    assert r.failures["j"] == 1  # the evidence of crashes in a row is the job's
    r.forget_ended({"other"})
    assert r.not_before == {} and r.progress == {}


def test_a_tier_whose_pipeline_cannot_start_fails_the_job_though_another_tier_runs() -> None:
    """One tier's workers starting their pipeline says nothing of another's: a GPU tier with a
    model path that does not exist fails the job while its CPU tier computes."""
    r = Reconciler(
        master=cast(MasterClient, None),
        backend=cast(ClusterBackend, SimpleNamespace(grow_memory=lambda _job: None)),
        config=ReconcilerConfig(),
    )
    job = JobStatus(
        id="j",
        name="j",
        state="RUNNING",
        workers_ready=2,
        rows_done=0,
        tiers=[
            TierStatus(name="cpu", shards={"DONE": 3}, rows_done=3_000, workers_ready=2),
            TierStatus(name="gpu", shards={"TODO": 3}),
        ],
    )
    assert ever_ready(job, "cpu") and not ever_ready(job, "gpu") and ever_ready(job)
    for n in range(3):
        failed = WorkerInfo(
            id=f"g{n}",
            job="j",
            phase="failed",
            started_at=0.0,
            failure="setup",
            reason="RuntimeError: no model at /models/x.onnx",
            node="local",
            tier="gpu",
        )
        r.account(failed, 10.0, rows_done=0, ready=ever_ready(job, "gpu"), nodes={"local"})
    assert "could not start on 3 workers" in r.failed_jobs["j"]
    assert "no model at /models/x.onnx" in r.failed_jobs["j"]


def test_a_tier_workers_id_names_its_tier_and_makes_a_pod_name() -> None:
    long_job = "j" * 64
    for tier in ("gpu", "Decode.Stage With Spaces", "x" * 80):
        worker_id = new_worker_id(long_job, tier)
        assert WORKER_ID_RE.match(worker_id), worker_id
        assert len(worker_id) <= 63 and pod_name(worker_id) == worker_id.lower()
    assert new_worker_id("job", "gpu").startswith("job-gpu-")
    assert new_worker_id("job", "").count("-") == 1


_STAND_IN = """\
#!{python}
# A worker's stand-in: writes how it was started, then drains on SIGTERM (exit 0).
import json, os, signal, sys
from pathlib import Path

signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
worker = sys.argv[sys.argv.index("--id") + 1]
told = {{"argv": sys.argv[1:], "preload": os.environ.get("{preload}")}}
folder = Path(os.environ["TIERS_TEST_OUT"])
(folder / (worker + ".tmp")).write_text(json.dumps(told))
(folder / (worker + ".tmp")).rename(folder / (worker + ".json"))
signal.sigwait({{signal.SIGTERM}})
"""


@pytest.fixture
async def master(nc: NATS, nats_config: NatsConfig) -> AsyncIterator[ScriptedMaster]:
    scripted = ScriptedMaster(nc, nats_config)
    await scripted.start()
    yield scripted
    await scripted.close()


async def test_local_workers_of_each_tier_run_with_their_tier(
    tmp_path: Path, nc: NATS, nats_config: NatsConfig, master: ScriptedMaster
) -> None:
    stand_in = tmp_path / "worker"
    stand_in.write_text(_STAND_IN.format(python=sys.executable, preload=envvars.STAGE_PRELOAD))
    stand_in.chmod(0o755)
    told_dir = tmp_path / "told"
    told_dir.mkdir()
    spec = tiered_spec(tmp_path, cpu=(1, 3), gpu=(1, 2))
    master.set(tiered(spec, cpu={"TODO": 10}, gpu={}))
    backend = LocalBackend(
        LocalConfig(
            nats=nats_config,
            max_workers=4,
            python=str(stand_in),
            log_dir=str(tmp_path / "logs"),
            env={"TIERS_TEST_OUT": str(told_dir)},
        )
    )
    reconciler = Reconciler(
        master=MasterClient(nc, nats_config, backoff=Backoff(attempts=1)),
        backend=backend,
        config=ReconcilerConfig(worker_grace_s=5),
    )

    def told() -> dict[str, dict[str, Any]]:
        return {p.stem: json.loads(p.read_text()) for p in told_dir.glob("*.json")}

    async def tiers_running() -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in await backend.observe():
            if w.alive:
                counts[w.tier] = counts.get(w.tier, 0) + 1
        return counts

    try:
        first = await reconciler.reconcile_once()
        assert first.launch == {"j/cpu": 3, "j/gpu": 1}
        said = await wait_until(lambda: len(told()) == 4 and told(), what="4 workers started")
        for worker_id, started in said.items():
            tier = "cpu" if "-cpu-" in worker_id else "gpu"
            assert started["argv"] == [
                "-m",
                "ebb.worker",
                "--job",
                "j",
                "--id",
                worker_id,
                "--tier",
                tier,
            ]
            # The model's runtime is imported ahead by the GPU tier's workers alone.
            assert started["preload"] == ("onnxruntime" if tier == "gpu" else None)
        assert await tiers_running() == {"cpu": 3, "gpu": 1}
        # Decoding is done, hand-offs wait for the model: the CPU tier drains, the GPU grows.
        master.set(tiered(spec, cpu={"DONE": 10}, gpu={"TODO": 6}))

        async def settled() -> bool:
            await reconciler.reconcile_once()
            return await tiers_running() == {"gpu": 2} and len(backend.pids()) == 2

        await wait_until(settled, timeout=30, what="the CPU tier drained, 2 GPU-tier workers")

        # Drained: they exited 0 once told to go, and the master hears so (counted apart from
        # lost workers, blaming no shard).
        async def heard() -> list[Any]:
            await reconciler.reconcile_once()
            return list(master.ended) if len(master.ended) == 3 else []

        told_ended = await wait_until(heard, timeout=30, what="the master to hear of 3 drains")
        assert {(e.kind, e.blame) for e in told_ended} == {("drained", False)}
        assert all("-cpu-" in e.worker for e in told_ended)
    finally:
        await backend.close(grace_s=5)
