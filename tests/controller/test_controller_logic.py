"""The controller's pure parts: quantities, placement, failure classes, the tide."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ebb.common.messaging.api import MasterClient
from ebb.controller.backend import ClusterBackend, WorkerInfo
from ebb.controller.policy.capacity import Bin, Demand, allocate, parse_quantity
from ebb.controller.policy.failures import classify
from ebb.controller.policy.setupfailures import SetupFailures, SetupPolicy
from ebb.controller.policy.tidal import ForecastTide, MixedNode, TidalConfig, Tide
from ebb.controller.reconcile import Reconciler, ReconcilerConfig


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", 0.5),
        ("2", 2.0),
        ("1.5", 1.5),
        ("2Gi", 2 * 2**30),
        ("100Mi", 100 * 2**20),
        ("1k", 1000.0),
        ("1e3", 1000.0),
        (4, 4.0),
    ],
)
def test_kubernetes_quantities(text: Any, value: float) -> None:
    assert parse_quantity(text) == value


def test_a_bad_quantity_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("lots")


def demand(
    job: str,
    *,
    want: int,
    cpu: float,
    priority: int = 0,
    lo: int = 0,
    pool: str | None = None,
    first: str = "offline",
) -> Demand:
    return Demand(
        job=job,
        want=want,
        min_workers=lo,
        priority=priority,
        submitted_at=0.0,
        shape={"cpu": cpu},
        eligible=(lambda b: b.name.startswith(pool)) if pool else (lambda b: True),
        prefer=lambda b: 0 if b.pool == first else 1,
    )


def test_allocation_packs_by_shape_and_fills_preferred_bins_first() -> None:
    bins = [Bin("mixed-1", {"cpu": 8.0}, pool="mixed"), Bin("offline-1", {"cpu": 5.0}, "offline")]
    # 3-core workers: one fits the offline node (5 cores), two the mixed one.
    assert allocate([demand("a", want=10, cpu=3)], bins) == {"a": 3}
    # A 6-core worker only fits the mixed node.
    assert allocate([demand("a", want=10, cpu=6)], bins) == {"a": 1}


def test_allocation_honours_priority_minimums_and_eligibility() -> None:
    bins = [Bin("offline-1", {"cpu": 8.0}), Bin("gpu-1", {"cpu": 8.0})]
    jobs = [
        demand("low", want=8, cpu=2, priority=0, lo=1),
        demand("high", want=8, cpu=2, priority=9),
        demand("gpu-only", want=8, cpu=2, pool="gpu"),
    ]
    got = allocate(jobs, bins)
    assert got["low"] == 1  # its minimum, before anyone's extra
    assert got["high"] + got["low"] + got["gpu-only"] == 8
    assert got["high"] >= 6  # priority takes the rest of what it can use


def pod(phase: str = "Failed", **status: Any) -> dict[str, Any]:
    return {"status": {"phase": phase, **status}}


def terminated(code: int, reason: str = "Error", message: str = "") -> dict[str, Any]:
    return {"state": {"terminated": {"exitCode": code, "reason": reason, "message": message}}}


@pytest.mark.parametrize(
    ("obj", "kind", "text"),
    [
        (pod(reason="Evicted", message="low on memory"), "capacity", "Evicted"),
        (pod(reason="NodeLost"), "capacity", "NodeLost"),
        (
            pod(
                conditions=[
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "PreemptionByScheduler",
                    }
                ]
            ),
            "capacity",
            "Preemption",
        ),
        (pod(containerStatuses=[terminated(137, "OOMKilled")]), "oom", "OOMKilled"),
        (
            pod(containerStatuses=[terminated(3, "Error", "stage 'm' failed")]),
            "fatal",
            "stage 'm' failed",
        ),
        (pod(containerStatuses=[terminated(1)]), "crash", "exit code 1"),
        (
            pod(containerStatuses=[terminated(4, "Error", "stage 'm': RuntimeError: no GPU")]),
            "setup",
            "RuntimeError: no GPU",
        ),
        (
            pod(
                "Pending",
                containerStatuses=[
                    {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "nope"}}}
                ],
            ),
            "fatal",
            "ImagePullBackOff",
        ),
        (
            pod(
                "Running",
                containerStatuses=[
                    {
                        "restartCount": 5,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": terminated(2)["state"],
                    }
                ],
            ),
            "crash",
            "keeps crashing",
        ),
    ],
)
def test_failure_classes(obj: dict[str, Any], kind: str, text: str) -> None:
    failure = classify(obj)
    assert failure is not None and failure.kind == kind and text in failure.reason


def test_healthy_and_finished_pods_have_no_failure() -> None:
    assert classify(pod("Running")) is None
    assert classify(pod("Succeeded")) is None


def nodes(*states: str, batch: int = 0) -> list[MixedNode]:
    return [MixedNode(name=f"m{i}", state=s, batch_pods=batch) for i, s in enumerate(states)]  # type: ignore[arg-type]


def test_the_tide_lends_when_quiet_and_smooths_out_a_spike() -> None:
    tide = Tide(
        TidalConfig(policy="threshold", lend_below=0.5, reclaim_above=0.8, window=3, cooldown_s=0)
    )
    # Quiet: 1 node's worth of online load on 4 nodes -> keep 2 (50%), lend 2.
    moves = tide.decide(
        0, online_load=1.0, pending_online=0, nodes=nodes("online", "online", "online", "online")
    )
    assert sorted(m.to for m in moves) == ["online2offline", "online2offline"]
    state = nodes("online", "online", "offline", "offline")
    # One sample of a spike that the online nodes can take: the median ignores it.
    assert tide.decide(1, online_load=1.5, pending_online=0, nodes=state) == []
    assert tide.decide(2, online_load=1.0, pending_online=0, nodes=state) == []


def test_the_tide_reclaims_at_once_fewest_batch_pods_first() -> None:
    tide = Tide(
        TidalConfig(policy="threshold", lend_below=0.5, reclaim_above=0.8, window=3, cooldown_s=100)
    )
    state = [
        MixedNode(name="busy", state="offline", batch_pods=4),
        MixedNode(name="light", state="offline", batch_pods=1),
        MixedNode(name="on", state="online", batch_pods=0),
    ]
    moves = tide.decide(0, online_load=0.9, pending_online=0, nodes=state)  # 90% on one node
    assert [(m.node, m.to) for m in moves] == [("light", "offline2online")]
    # After a reclaim, nothing is lent during the cool-down, however quiet it gets.
    quiet = [
        MixedNode(name="busy", state="offline", batch_pods=4),
        MixedNode(name="light", state="online", batch_pods=0),
        MixedNode(name="on", state="online", batch_pods=0),
    ]
    assert tide.decide(50, online_load=0.0, pending_online=0, nodes=quiet) == []
    assert tide.decide(101, online_load=0.0, pending_online=0, nodes=quiet) != []


def test_pending_online_pods_reclaim_enough_nodes_for_them() -> None:
    tide = Tide(TidalConfig(policy="threshold", reclaim_above=0.8))
    state = nodes("online", "offline", "offline", "offline", batch=2)
    moves = tide.decide(0, online_load=0.5, pending_online=3, nodes=state, pending_load=1.5)
    assert len([m for m in moves if m.to == "offline2online"]) == 2  # ceil(2.0/0.8) - 1 online


def test_a_reclaimed_node_is_online_again_once_its_batch_pods_are_gone() -> None:
    tide = Tide(TidalConfig(policy="threshold"))
    draining = [MixedNode(name="m0", state="offline2online", batch_pods=1)]
    assert all(
        m.to != "online" for m in tide.decide(0, online_load=0.0, pending_online=0, nodes=draining)
    )
    drained = [MixedNode(name="m0", state="offline2online", batch_pods=0)]
    assert [
        (m.node, m.to) for m in tide.decide(1, online_load=0.0, pending_online=0, nodes=drained)
    ][:1] == [("m0", "online")]


def forecast_tide(**config: Any) -> ForecastTide:
    defaults: dict[str, Any] = {"sample_s": 1.0, "lead_s": 3.0, "headroom": 0.0, "window": 3}
    return ForecastTide(TidalConfig(**{**defaults, **config}))


def budget_after(
    tide: ForecastTide, loads: list[float], *, start: int = 0, total: int = 8
) -> float:
    """The CPU budget, in nodes of one core, after these samples of online CPU demand."""
    for t, load in enumerate(loads, start=start):
        tide.decide(
            t,
            demand={"cpu": load},
            capacity={"cpu": float(total)},
            nodes=nodes(*["online"] * total),
        )
    return tide.budget["cpu"]


def test_the_forecast_budget_ignores_a_spike_and_reclaims_ahead_of_a_rise() -> None:
    tide = forecast_tide(headroom=0.25)
    # Flat at 2 nodes of 8, a quarter kept free: 4 nodes' worth for batch pods.
    assert budget_after(tide, [2.0] * 12) == pytest.approx(4.0)
    # One sample of a spike: preemption's business, the budget does not move.
    assert budget_after(tide, [6.0], start=12) == pytest.approx(4.0)
    # A steady rise of 0.2 a sample: the budget leaves room for where it will be 3 samples on.
    tide = forecast_tide()
    ramp = [1.0 + 0.2 * t for t in range(12)]
    assert budget_after(tide, ramp) == pytest.approx(8 - (ramp[-2] + 0.2 * 3), abs=0.05)


def test_the_forecast_remembers_the_same_time_on_earlier_days() -> None:
    # A "day" of 20 samples: quiet, then a rise at samples 10-14, every day.
    day = [1.0] * 10 + [5.0] * 5 + [1.0] * 5
    tide = forecast_tide(period_s=20.0)
    budget_after(tide, day)
    # Day two, sample 8: still quiet, no trend, but yesterday rose at 10 (within the lead).
    assert budget_after(tide, day[:9], start=20) == pytest.approx(8 - 5.0)
    # Without the memory of a day, the same samples leave the whole quiet pool to batch.
    assert budget_after(forecast_tide(period_s=20.0), day[:9]) == pytest.approx(8 - 1.0)


def test_the_forecast_tide_lends_all_but_min_online_and_returns_only_empty_nodes() -> None:
    tide = forecast_tide(min_online=1)
    state = [
        MixedNode(name="busy", state="online", batch_pods=0, online_use=0.6),
        MixedNode(name="quiet", state="online", batch_pods=0, online_use=0.1),
        MixedNode(name="lent", state="online2offline", batch_pods=0),
    ]
    moves = tide.decide(0, demand={"cpu": 0.7}, capacity={"cpu": 3.0}, nodes=state)
    assert sorted((m.node, m.to) for m in moves) == [
        ("lent", "offline"),
        ("quiet", "online2offline"),  # the busiest stays online
    ]
    # No budget left (the pool is full of online load): lent nodes without batch pods go back
    # at no cost; one with batch pods stays lent, for preemption or the budget's drain.
    full = [
        MixedNode(name="busy", state="online", batch_pods=0, online_use=1.0),
        MixedNode(name="empty", state="offline", batch_pods=0, online_use=1.0),
        MixedNode(name="working", state="offline", batch_pods=2, online_use=0.5),
    ]
    moves = tide.decide(1, demand={"cpu": 3.0}, capacity={"cpu": 3.0}, nodes=full)
    assert [(m.node, m.to) for m in moves] == [("empty", "offline2online")]


def test_the_forecast_tide_keeps_a_budget_per_resource() -> None:
    # Two 8-GPU nodes of 64 cores: online pods serve models on 12 GPUs but use few cores.
    tide = forecast_tide(headroom=0.25)
    capacity = {"cpu": 128.0, "memory": 2.0 * 2**40, "nvidia.com/gpu": 16.0}
    state = [MixedNode(name=f"g{i}", state="online", batch_pods=0) for i in range(2)]
    for t in range(5):
        moves = tide.decide(
            t, demand={"cpu": 16.0, "nvidia.com/gpu": 12.0}, capacity=capacity, nodes=state
        )
    # GPUs: 16 - 12 - 4 of headroom leaves none; cores: 128 - 16 - 32 leaves 80.
    assert tide.budget["nvidia.com/gpu"] == pytest.approx(0.0)
    assert tide.budget["cpu"] == pytest.approx(80.0)
    assert tide.drain_above["nvidia.com/gpu"] == pytest.approx(4.0)
    # CPU and memory have room: a node is lent, for CPU-only batch pods on a GPU node.
    assert [m.to for m in moves] == ["online2offline"]
    # At night the GPUs go quiet: their budget opens without the cores' moving.
    for t in range(5, 10):
        tide.decide(t, demand={"cpu": 16.0, "nvidia.com/gpu": 1.0}, capacity=capacity, nodes=state)
    assert tide.budget["nvidia.com/gpu"] == pytest.approx(11.0)
    assert tide.budget["cpu"] == pytest.approx(80.0)
    # A pool without GPUs has no GPU budget at all, rather than a budget of none.
    cpu_only = forecast_tide()
    cpu_only.decide(0, demand={"cpu": 1.0}, capacity={"cpu": 8.0, "nvidia.com/gpu": 0.0}, nodes=[])
    assert "nvidia.com/gpu" not in cpu_only.budget


def test_no_node_is_lent_while_cpu_or_memory_has_no_budget() -> None:
    tide = forecast_tide(headroom=0.0)
    state = [MixedNode(name=f"m{i}", state="online", batch_pods=0) for i in range(3)]
    # Online pods ask for all the memory, a little CPU: nothing a batch pod could use.
    full_memory = {"cpu": 1.0, "memory": 96.0}
    moves = tide.decide(0, demand=full_memory, capacity={"cpu": 24.0, "memory": 96.0}, nodes=state)
    assert moves == []


def _reconciler() -> Reconciler:
    # `account` consults neither the master nor the backend for crashes and signals.
    return Reconciler(
        master=cast(MasterClient, None),
        backend=cast(ClusterBackend, None),
        config=ReconcilerConfig(max_crashes=3, healthy_after_s=60.0),
    )


def _ended(
    code: int, *, failure: Any = None, started_at: float = 0.0, worker: str = "", node: str = ""
) -> WorkerInfo:
    return WorkerInfo(
        id=worker or f"w{code}",
        job="j",
        phase="failed",
        started_at=started_at,
        exit_code=code,
        reason=f"exit code {code}: ValueError: bad weights",
        failure=failure,
        node=node,
    )


def test_workers_that_crash_in_a_row_without_progress_fail_the_job_with_the_evidence() -> None:
    r = _reconciler()
    for _ in range(3):
        r.account(_ended(1), 10.0, rows_done=500)
    assert "3 workers crashed in a row" in r.failed_jobs["j"]
    assert r.failed_jobs["j"].count("exit code 1: ValueError: bad weights") == 3


def test_a_committed_shard_between_crashes_starts_the_count_again() -> None:
    r = _reconciler()
    for rows in range(0, 10_000, 1_000):  # each worker got a shard done before it died
        r.account(_ended(1), 10.0, rows_done=rows)
    assert r.failed_jobs == {}
    assert r.failures["j"] == 1


def test_workers_killed_from_outside_are_not_crashes() -> None:
    r = _reconciler()
    r.account(_ended(1), 10.0, rows_done=0)
    r.account(_ended(1), 10.0, rows_done=0)
    for _ in range(10):  # SIGKILLed by the OOM killer, an operator, a chaos test...
        r.account(_ended(-9, failure="capacity"), 10.0, rows_done=0)
    r.account(_ended(1), 10.0, rows_done=0)
    assert r.failed_jobs == {}
    assert r.failures["j"] == 1  # the kills cleared the two crashes before them


def test_a_resumed_job_starts_with_a_clean_crash_count() -> None:
    r = _reconciler()
    for _ in range(3):
        r.account(_ended(1), 10.0, rows_done=0)
    assert "j" in r.failed_jobs and r.failures["j"] == 3
    r.forget_ended({"other"})  # "j" no longer runs: it FAILED
    assert ("j" in r.failures, "j" in r.crashes, "j" in r.not_before) == (False, False, False)
    # Resumed: one more crash is its first, not its fourth.
    r.failed_jobs.clear()
    r.account(_ended(1), 20.0, rows_done=0)
    assert r.failures["j"] == 1 and r.failed_jobs == {}


@pytest.mark.parametrize(
    ("failed_on", "ready", "available", "verdict"),
    [
        ([("w1", "n1"), ("w2", "n1")], False, 1, False),  # two workers: maybe a bad node
        ([("w1", "n1"), ("w2", "n1"), ("w3", "n1")], False, 1, True),  # the only node
        ([("w1", "n1"), ("w1", "n1"), ("w1", "n1")], False, 1, False),  # one worker, told 3x
        ([("w1", "n1"), ("w2", "n1"), ("w3", "n1")], False, 3, False),  # other nodes to try
        ([("w1", "n1"), ("w2", "n2"), ("w3", "n1")], False, 3, True),  # two nodes: the job's
        ([("w1", "n1"), ("w2", "n2"), ("w3", "n3")], True, 3, False),  # it ran somewhere
    ],
)
def test_a_pipeline_that_cannot_start_is_the_nodes_fault_until_it_is_everyones(
    failed_on: list[tuple[str, str]], ready: bool, available: int, verdict: bool
) -> None:
    failures = SetupFailures()
    for worker, node in failed_on:
        failures.note(worker=worker, node=node, reason=f"{worker}: RuntimeError: no model")
    said = failures.verdict(SetupPolicy(), ever_ready=ready, nodes_available=available)
    assert bool(said) == verdict
    if verdict:
        assert "could not start on 3 workers" in said and "RuntimeError: no model" in said


def test_setup_failures_relaunch_soon_and_fail_the_job_only_on_the_evidence() -> None:
    r = _reconciler()
    for n in range(2):
        r.account(_ended(4, failure="setup", worker=f"w{n}", node="local"), 10.0, rows_done=0)
    assert r.failed_jobs == {} and r.not_before["j"] <= 10.0 + 5.0
    r.account(_ended(4, failure="setup", worker="w2", node="local"), 10.0, rows_done=0)
    assert "could not start on 3 workers on 1 node" in r.failed_jobs["j"]
    # A job some worker of which started its pipeline is never failed so: a flaky node.
    r = _reconciler()
    for n in range(10):
        r.account(
            _ended(4, failure="setup", worker=f"w{n}", node="local"), 10.0, rows_done=0, ready=True
        )
    assert r.failed_jobs == {} and r.failures.get("j", 0) == 0


def test_the_master_is_to_hear_of_every_worker_that_ended_badly_and_whom_to_blame() -> None:
    grown: list[str] = []
    r = Reconciler(
        master=cast(MasterClient, None),
        backend=cast(ClusterBackend, SimpleNamespace(grow_memory=grown.append)),
        config=ReconcilerConfig(),
    )
    r.account(_ended(-9, failure="capacity", worker="gone"), 10.0, rows_done=0)
    r.account(_ended(1, worker="crashed"), 10.0, rows_done=0)
    r.account(_ended(137, failure="oom", worker="oom"), 10.0, rows_done=0)
    r.account(_ended(4, failure="setup", worker="nosetup"), 10.0, rows_done=0)
    r.account(replace(_ended(0, worker="fine"), phase="succeeded"), 10.0, rows_done=0)
    r.account(replace(_ended(0, worker="told"), phase="succeeded", drained=True), 10.0, rows_done=0)
    told = {worker: notice.blame for (_, worker), notice in r.to_tell.items()}
    assert told == {"gone": False, "crashed": True, "oom": True, "nosetup": False, "told": False}
    assert r.to_tell[("j", "told")].kind == "drained"  # counted apart from the lost
    assert grown == ["j"]
