"""The controller's pure parts: quantities, placement, failure classes, the tide."""

from __future__ import annotations

from typing import Any

import pytest

from ebb.controller.capacity import Bin, Demand, allocate, parse_quantity
from ebb.controller.failures import classify
from ebb.controller.tidal import MixedNode, TidalConfig, Tide


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
    job: str, *, want: int, cpu: float, priority: int = 0, lo: int = 0, pool: str | None = None
) -> Demand:
    return Demand(
        job=job,
        want=want,
        min_workers=lo,
        priority=priority,
        submitted_at=0.0,
        shape={"cpu": cpu},
        eligible=(lambda b: b.name.startswith(pool)) if pool else (lambda b: True),
    )


def test_allocation_packs_by_shape_and_fills_preferred_bins_first() -> None:
    bins = [Bin("mixed-1", {"cpu": 8.0}, rank=1), Bin("offline-1", {"cpu": 5.0}, rank=0)]
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
    tide = Tide(TidalConfig(lend_below=0.5, reclaim_above=0.8, window=3, cooldown_s=0))
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
    tide = Tide(TidalConfig(lend_below=0.5, reclaim_above=0.8, window=3, cooldown_s=100))
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
    tide = Tide(TidalConfig(reclaim_above=0.8))
    state = nodes("online", "offline", "offline", "offline", batch=2)
    moves = tide.decide(0, online_load=0.5, pending_online=3, nodes=state, pending_load=1.5)
    assert len([m for m in moves if m.to == "offline2online"]) == 2  # ceil(2.0/0.8) - 1 online


def test_a_reclaimed_node_is_online_again_once_its_batch_pods_are_gone() -> None:
    tide = Tide(TidalConfig())
    draining = [MixedNode(name="m0", state="offline2online", batch_pods=1)]
    assert all(
        m.to != "online" for m in tide.decide(0, online_load=0.0, pending_online=0, nodes=draining)
    )
    drained = [MixedNode(name="m0", state="offline2online", batch_pods=0)]
    assert [
        (m.node, m.to) for m in tide.decide(1, online_load=0.0, pending_online=0, nodes=drained)
    ][:1] == [("m0", "online")]
