"""The controller: the pure plan, and the local backend keeping real workers alive."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import signal
import sys
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient
from ebb.common import envvars
from ebb.common.errors import RemoteError
from ebb.common.job import parse_job
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.backend import Capacity, WorkerInfo
from ebb.controller.local.backend import LocalBackend, LocalConfig, machine_cores
from ebb.controller.reconcile import Reconciler, ReconcilerConfig, plan, share
from ebb.shard_master.service import MasterConfig

from ..helpers import job_spec, read_output, wait_until, write_dataset, write_model
from ..shard_master.test_master import Master

pytestmark = pytest.mark.timeout(180)


def job(
    job_id: str,
    *,
    todo: int = 10,
    doing: int = 0,
    lo: int = 1,
    hi: int = 4,
    priority: int = 0,
    state: str = "RUNNING",
) -> JobStatus:
    return JobStatus(
        id=job_id,
        name=job_id,
        state=state,  # type: ignore[arg-type]
        shards={"TODO": todo, "DOING": doing},
        min_workers=lo,
        max_workers=hi,
        priority=priority,
        submitted_at=float(ord(job_id[0])),
    )


def worker(
    worker_id: str, job_id: str, *, phase: str = "running", started: float = 0.0
) -> WorkerInfo:
    return WorkerInfo(id=worker_id, job=job_id, phase=phase, started_at=started)  # type: ignore[arg-type]


def test_share_gives_mins_first_then_priority_then_equally() -> None:
    jobs = [job("a", lo=1, hi=8), job("b", lo=2, hi=8), job("c", lo=1, hi=8, priority=5)]
    assert share(jobs, 3) == {"c": 1, "a": 1, "b": 1}  # mins in priority order, while they last
    assert share(jobs, 4) == {"c": 1, "a": 1, "b": 2}
    assert share(jobs, 10) == {"c": 7, "a": 1, "b": 2}  # the rest to the highest priority
    assert share(jobs, 20) == {"c": 8, "a": 6, "b": 6}  # then equally


def test_share_never_exceeds_remaining_work_or_max() -> None:
    assert share([job("a", todo=1, doing=1, hi=8)], 8) == {"a": 2}
    assert share([job("a", todo=0, doing=0)], 8) == {"a": 0}
    assert share([job("a", todo=100, hi=3)], 8) == {"a": 3}
    assert share([job("a", state="SUBMITTED")], 8) == {"a": 0}


def test_plan_launches_the_missing_and_drains_the_surplus_youngest_first() -> None:
    jobs = [job("a", hi=2), job("b", hi=1, todo=0, doing=0)]
    workers = [
        worker("a1", "a", started=1.0),
        worker("b1", "b", started=1.0),
        worker("b2", "b", started=2.0),
        worker("z1", "gone-job"),
    ]
    decided = plan(jobs=jobs, workers=workers, capacity=Capacity.slots(8), now=10.0, not_before={})
    assert decided.launch == {"a": 1}
    assert sorted(decided.terminate) == ["b1", "b2", "z1"]


def test_plan_drains_workers_holding_no_lease_before_the_youngest() -> None:
    """At a job's end the worker whose shard is nearly done stays, whatever its age; with
    nothing said of leases, the youngest goes."""
    workers = [worker("a1", "a", started=1.0), worker("a2", "a", started=2.0)]
    told = dataclasses.replace(job("a", todo=0, doing=1), workers_busy=["a2"])
    decided = plan(
        jobs=[told], workers=workers, capacity=Capacity.slots(8), now=10.0, not_before={}
    )
    assert decided.terminate == ["a1"]
    untold = job("a", todo=0, doing=1)
    decided = plan(
        jobs=[untold], workers=workers, capacity=Capacity.slots(8), now=10.0, not_before={}
    )
    assert decided.terminate == ["a2"]


async def test_local_capacity_counts_draining_workers_as_taken(nats_config: NatsConfig) -> None:
    backend = LocalBackend(LocalConfig(nats=nats_config, max_workers=3))
    capacity = await backend.capacity(
        [], [worker("a1", "a"), worker("old", "x", phase="terminating")]
    )
    assert capacity.bins[0].free == {"workers": 2.0}
    await backend.close(grace_s=1)


def test_plan_honours_the_relaunch_backoff() -> None:
    jobs = [job("a", hi=4)]
    workers = [worker("a1", "a")]
    decided = plan(
        jobs=jobs, workers=workers, capacity=Capacity.slots(2), now=10.0, not_before={"a": 12.5}
    )
    assert decided.desired == {"a": 2}
    assert decided.launch == {}
    assert decided.held_back == {"a": 2.5}


@pytest.fixture
async def running_master(nats_config: NatsConfig, tmp_path: Path) -> AsyncIterator[Master]:
    from ..helpers import ASSETS

    config = MasterConfig(nats=nats_config, id="m", data_roots=[str(tmp_path), str(ASSETS)])
    async with Master(config) as m:
        yield m


async def test_local_backend_relaunches_a_worker_that_dies(
    tmp_path: Path, nats_config: NatsConfig, running_master: Master
) -> None:
    write_dataset(tmp_path / "data", rows=12_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [
        {
            "modelet": "ebbtest_modelets:Slow",
            "params": {"seconds_per_batch": 0.05},
            "batch_size": 100,
        },
        {"model": str(tmp_path / "model.onnx"), "batch_size": 100},
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(2, 2)))
    backend = LocalBackend(
        LocalConfig(nats=nats_config, max_workers=4, log_dir=str(tmp_path / "logs"))
    )
    async with await EbbClient.connect(nats_config) as client:
        job_id = await client.submit(spec)
        master = MasterClient(client.nc, nats_config, backoff=Backoff(attempts=1))
        reconciler = Reconciler(
            master=master,
            backend=backend,
            config=ReconcilerConfig(
                relaunch_backoff=Backoff(first_s=0.1, max_s=0.2), worker_grace_s=5
            ),
        )
        try:
            first = await reconciler.reconcile_once()
            assert first.launch == {job_id: 2}
            assert len(backend.pids()) == 2
            # Each is told its share of the machine, and its stage processes come from a
            # fork server whose BLAS pools are one thread each.
            share = f"{machine_cores() / 2:g}"  # two workers at once, whatever the slots
            for pid in backend.pids().values():
                assert _environ(pid)[envvars.CPUS] == share
            pid = next(iter(backend.pids().values()))
            server = await wait_until(
                lambda: next(iter(_fork_servers(pid)), None), what="the worker's fork server"
            )
            assert _environ(server.pid)["OMP_NUM_THREADS"] == "1"
            victim, pid = next(iter(backend.pids().items()))
            os.kill(pid, signal.SIGKILL)
            await wait_until(lambda: victim not in backend.pids(), what="the worker to die")

            async def replaced() -> bool:
                await reconciler.reconcile_once()
                return len(backend.pids()) == 2 and victim not in backend.pids()

            await wait_until(replaced, timeout=30, what="a replacement worker")
            # Killed from outside: replaced, but not counted as a crash of the job's code.
            assert reconciler.failures.get(job_id, 0) == 0

            async def finished() -> bool:
                await reconciler.reconcile_once()
                return (await client.job(job_id)).state == "SUCCEEDED"

            await wait_until(finished, timeout=120, interval=0.5, what="the job to finish")
            # Every worker left on its own once the job ended.
            await wait_until(lambda: not backend.pids(), timeout=30, what="the workers to exit")
        finally:
            await backend.close(grace_s=5)
    table, _ = read_output(tmp_path / "out")
    assert sorted(table.column("id").to_numpy().tolist()) == list(range(12_000))


@pytest.mark.parametrize("workers", [1, 2])
async def test_local_workers_share_the_machine_and_may_be_pinned_to_cores_of_their_own(
    tmp_path: Path, nats_config: NatsConfig, running_master: Master, workers: int
) -> None:
    write_dataset(tmp_path / "data", rows=8_000, row_group_size=1_000)
    stages = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0.2}, "batch_size": 50}
    ]
    spec = parse_job(
        job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(workers, workers))
    )
    backend = LocalBackend(
        LocalConfig(nats=nats_config, max_workers=4, log_dir=str(tmp_path / "logs"), pin_cpus=True)
    )
    async with await EbbClient.connect(nats_config) as client:
        job_id = await client.submit(spec)
        master = MasterClient(client.nc, nats_config, backoff=Backoff(attempts=1))
        reconciler = Reconciler(master=master, backend=backend, config=ReconcilerConfig())
        try:
            assert (await reconciler.reconcile_once()).launch == {job_id: workers}
            cores = machine_cores()
            pinned: list[set[int]] = []
            for pid in backend.pids().values():
                # A job of one worker gets the whole machine, not a slot's worth of it.
                assert _environ(pid)[envvars.CPUS] == f"{cores / workers:g}"
                chosen = {int(c) for c in _environ(pid)[envvars.CPU_SET].split(",")}
                assert len(chosen) == max(1, cores // workers)
                server = await wait_until(
                    functools.partial(_first_fork_server, pid), what="the worker's fork server"
                )
                # The worker pinned itself before its fork server started: the stage
                # processes run on its cores only.
                assert set(psutil.Process(pid).cpu_affinity()) == chosen
                assert set(server.cpu_affinity()) == chosen
                pinned.append(chosen)
            if cores >= workers:  # cores of their own, where there are enough
                assert len(set().union(*pinned)) == sum(len(c) for c in pinned)
        finally:
            await client.cancel(job_id)
            await backend.close(grace_s=5)


async def test_closing_drains_workers_and_they_hand_their_shards_back(
    tmp_path: Path, nats_config: NatsConfig, running_master: Master
) -> None:
    write_dataset(tmp_path / "data", rows=20_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0.5}, "batch_size": 50}
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(1, 1)))
    backend = LocalBackend(
        LocalConfig(
            nats=nats_config,
            max_workers=2,
            log_dir=str(tmp_path / "logs"),
            env={"EBB_SHUTDOWN_GRACE_S": "0.5"},  # the worker's own grace: too short to finish
        )
    )
    async with await EbbClient.connect(nats_config) as client:
        job_id = await client.submit(spec)
        await backend.launch(await client.job(job_id), "w-1")

        async def holds_a_lease() -> bool:
            status = await client.master.status(job_id, include_leases=True)
            return bool(status.jobs[0].leases)

        await wait_until(holds_a_lease, timeout=60, what="the worker to lease a shard")
        await backend.close(grace_s=30)
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
    assert status.leases == [] and status.shards["DOING"] == 0
    # Handed back (the rows done committed as a part, the rest queued), not left to expire.
    assert not REGISTRY.get_sample_value("ebb_lease_expiries_total", {"job_id": job_id})
    log = (tmp_path / "logs" / "w-1.log").read_text()
    assert "grace period ending: committing the rows done" in log


async def test_nothing_is_launched_for_a_job_with_nothing_left(nats_config: NatsConfig) -> None:
    backend = LocalBackend(LocalConfig(nats=nats_config, max_workers=2))
    decided = plan(
        jobs=[job("a", todo=0, doing=0)],
        workers=await backend.observe(),
        capacity=Capacity.slots(2),
        now=0.0,
        not_before={},
    )
    assert decided.launch == {} and decided.terminate == []
    await backend.close(grace_s=1)
    await asyncio.sleep(0)


class RecordingBackend:
    """Room for `slots` workers, that records what it is asked to launch and starts nothing."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.launched: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    async def observe(self) -> list[WorkerInfo]:
        return [worker(w, j) for w, j in self.launched]

    async def capacity(self, jobs: list[JobStatus], workers: list[WorkerInfo]) -> Capacity:
        del jobs, workers
        return Capacity.slots(self.slots)

    async def launch(self, job: JobStatus, worker_id: str, *, tier: str = "") -> None:
        del tier
        assert job.spec is not None, "a worker is launched from its job's spec"
        self.launched.append((worker_id, job.id))

    async def terminate(self, worker_id: str, *, grace_s: float) -> None:
        del worker_id, grace_s

    async def forget(self, worker_id: str) -> None:
        del worker_id

    async def close(self, *, grace_s: float) -> None:
        del grace_s

    def agents(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {}

    def grow_memory(self, job: str) -> None:
        del job


async def test_running_jobs_whose_specs_add_up_past_the_max_payload_all_get_workers(
    tmp_path: Path, nats_config: NatsConfig, running_master: Master
) -> None:
    write_model(tmp_path / "model.onnx")
    big = {"blob": "x" * 400_000}  # each spec fits in a message; three of them do not
    stages = [{"modelet": "ebbtest_modelets:Label", "params": big}]
    backend = RecordingBackend(slots=3)
    async with await EbbClient.connect(nats_config) as client:
        ids = []
        for name in ("a", "b", "c"):
            write_dataset(tmp_path / name / "data", rows=1_000)
            spec = job_spec(tmp_path / name, stages=stages)
            ids.append(await client.submit(parse_job(spec)))
        master = MasterClient(client.nc, nats_config, backoff=Backoff(attempts=1))
        # All at once is refused at once, with the reason, rather than left to time out.
        with pytest.raises(RemoteError) as refused:
            await master.status(active_only=True, include_spec=True)
        assert refused.value.code == "too_large"
        reconciler = Reconciler(master=master, backend=backend, config=ReconcilerConfig())
        decided = await reconciler.reconcile_once()
    assert decided.launch == dict.fromkeys(ids, 1)
    assert sorted(job for _, job in backend.launched) == sorted(ids)


def _environ(pid: int) -> dict[str, str]:
    """The environment a process started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in raw if b"=" in entry)


def _first_fork_server(pid: int) -> psutil.Process | None:
    return next(iter(_fork_servers(pid)), None)


def _fork_servers(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if "forkserver" in " ".join(p.cmdline())]


def _workers_of(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if "ebb.worker" in " ".join(p.cmdline())]


def _all_of(processes: list[psutil.Process], count: int) -> list[psutil.Process]:
    """`processes` once there are `count` of them; until then nothing."""
    return processes if len(processes) == count else []


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_workers_of_a_killed_controller_drain_and_exit(
    tmp_path: Path, nats_config: NatsConfig, running_master: Master
) -> None:
    write_dataset(tmp_path / "data", rows=20_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = [
        {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0.5}, "batch_size": 50}
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000, stages=stages, workers=(2, 2)))
    controller = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ebb.controller",
        "--nats",
        nats_config.url,
        "--prefix",
        nats_config.prefix,
        "--max-workers",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        env={**os.environ, "EBB_SHUTDOWN_GRACE_S": "1"},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    left: list[psutil.Process] = []
    try:
        async with await EbbClient.connect(nats_config) as client:
            job_id = await client.submit(spec)

            async def working() -> bool:
                leases = (await client.master.status(job_id, include_leases=True)).jobs[0].leases
                return len(leases) >= 2

            await wait_until(working, timeout=90, interval=0.2, what="both workers to lease")
            workers = await wait_until(
                lambda: _all_of(_workers_of(controller.pid), 2),
                timeout=10,
                what="the two worker processes",
            )
            left = [*workers, *(c for w in workers for c in w.children(recursive=True))]
            controller.kill()  # no drain, no goodbye: its workers are orphans now
            await controller.wait()
            # The next controller finds them, and counts their slots as taken until they
            # are gone: no more workers than slots.
            successor = LocalBackend(
                LocalConfig(nats=nats_config, max_workers=2, log_dir=str(tmp_path / "logs"))
            )
            try:
                found = await successor.observe()
                assert sorted((w.job, w.phase) for w in found) == [(job_id, "terminating")] * 2
                assert (await successor.capacity([], found)).bins[0].free["workers"] == 0
                # They drain (handing their shards back) and exit on their own, stage
                # processes too: nothing outlives the controller that started them.
                await wait_until(
                    lambda: all(_gone(p) for p in left), timeout=60, what="the orphans to exit"
                )
                assert await successor.observe() == []
                assert (await successor.capacity([], [])).bins[0].free["workers"] == 2
            finally:
                await successor.close(grace_s=5)
            assert not list((tmp_path / "logs").glob("*.pid"))
            status = (await client.master.status(job_id, include_leases=True)).jobs[0]
            assert status.leases == [] and status.shards["DOING"] == 0
    finally:
        if controller.returncode is None:
            controller.kill()
            await controller.wait()
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


@pytest.mark.parametrize(("env", "told"), [({}, "7"), ({"EBB_SHUTDOWN_GRACE_S": "2"}, "2")])
async def test_a_local_worker_is_told_a_grace_shorter_than_the_time_before_its_kill(
    tmp_path: Path,
    nats_config: NatsConfig,
    running_master: Master,
    env: dict[str, str],
    told: str,
) -> None:
    """Its drain, the parts it commits included, must end before the controller kills it."""
    write_dataset(tmp_path / "data", rows=1_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000))
    backend = LocalBackend(LocalConfig(nats=nats_config, max_workers=1, worker_grace_s=12, env=env))
    async with await EbbClient.connect(nats_config) as client:
        job_id = await client.submit(spec)
        await backend.launch(await client.job(job_id), "w-1")
        try:
            pid = backend.pids()["w-1"]
            environ = psutil.Process(pid).environ()
            assert environ["EBB_SHUTDOWN_GRACE_S"] == told
        finally:
            await backend.close(grace_s=30)
