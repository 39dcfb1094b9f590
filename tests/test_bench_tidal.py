"""The tidal simulator's count of what a batch pod's end costs: with whole shards, the rows
done of its shard, however it ends; with splitting, only those of a pod killed without notice
or cut short in its drain."""

from __future__ import annotations

from bench.tidal_sim import DRAIN_S, ROWS_PER_MINUTE, Simulator
from ebb.controller.kube.podspec import APP, APP_LABEL
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import PODS

MINUTE_S = 0.4
"""A simulated minute here: the fake kubelet ends a deleted pod DRAIN_S of it later."""


def _batch_pod(name: str) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": {APP_LABEL: APP}},
        "spec": {
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {"name": "worker", "image": "ebb", "resources": {"requests": {"cpu": "1"}}}
            ],
        },
    }


async def test_a_graceful_end_commits_its_rows_and_only_a_kill_loses_them() -> None:
    async with FakeKubeAPI(start_delay=0.0, terminate_delay=DRAIN_S / 60 * MINUTE_S) as kube:
        kube.add_namespace("ebb")
        kube.add_node("mixed-0", allocatable={"cpu": "8", "memory": "64Gi"})
        sim = Simulator(kube.store, "ebb", minute_s=MINUTE_S)
        names = ["drained", "preempted", "deleted-at-once", "evicted", "cut-short", "last"]
        for name in names:
            kube.add_pod(_batch_pod(name), "ebb")

        def running() -> bool:
            pods = kube.store.view(PODS, "ebb")
            return len(pods) == len(names) and all(
                p["status"].get("phase") == "Running" for p in pods
            )

        await kube.wait_for(running, what="every batch pod Running")
        for _ in range(3):
            sim.minute(0.0)
        assert sim.progress == dict.fromkeys(names, 3)

        kube.store.delete(PODS, "ebb", "drained", grace_period=30)
        kube.preempt("preempted", "ebb")
        kube.store.delete(PODS, "ebb", "deleted-at-once", grace_period=0)
        kube.evict("evicted", "ebb")
        kube.store.delete(PODS, "ebb", "cut-short", grace_period=30)
        kube.store.delete(PODS, "ebb", "cut-short", grace_period=0)  # killed in its drain
        kube.store.delete(PODS, "ebb", "last", grace_period=30)
        sim.finish()  # the trace ends while "last" drains: nothing cuts it short
        await kube.wait_for(
            lambda: not sim.draining and len(kube.store.view(PODS, "ebb")) == 1,
            what="the drains over",
        )

    r, shard_part = sim.result, 3 * ROWS_PER_MINUTE
    assert (r.drained, r.preempted, r.killed) == (4, 1, 2)
    assert (r.shards_lost, r.rows_lost) == (6, 6 * shard_part)
    # Lost with splitting: the pod deleted at once, the evicted one, the one cut short.
    assert r.rows_lost_split == 3 * shard_part
    assert (r.parts, r.rows_in_parts) == (3, 3 * shard_part)
    assert r.rows_with_splitting == r.rows + 3 * shard_part
    assert r.shortest_drain_s < DRAIN_S  # the one cut short
