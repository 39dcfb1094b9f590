"""Where a group's workers go, as pure decisions: the pool policy (short, long, unknown,
reclaimed), capacity shared by each job's own order of bins, and why a group could never be
placed on the nodes a cluster has."""

from __future__ import annotations

from typing import Any

import pytest

from ebb.controller.kube.placement import NodeFacts, Placement, unplaceable
from ebb.controller.policy.capacity import Bin, Demand, allocate
from ebb.controller.policy.pools import (
    PoolPolicy,
    allows,
    decide,
    expected_s,
    preference,
    preferred,
)

POLICY = PoolPolicy(short_job_s=1800.0, reclaims_to_offline=3)


@pytest.mark.parametrize(
    ("asked", "expected", "reclaims", "mode"),
    [
        ("auto", 600.0, 0, "mixed"),  # short: mixed nodes first
        ("auto", 1800.0, 0, "mixed"),  # just within
        ("auto", 1801.0, 0, "any"),  # long: the offline pool first
        ("auto", None, 0, "any"),  # unknown: treated as long
        ("auto", 0.0, 0, "mixed"),  # nothing left to do
        ("auto", 600.0, 2, "mixed"),
        ("auto", 600.0, 3, "any"),  # reclaimed often: offline first, however short
        ("auto", 600.0, 9, "any"),
        # What the spec asks is what it gets, whatever the job's kind.
        ("offline", 600.0, 0, "offline"),
        ("mixed", None, 9, "mixed"),
        ("any", 600.0, 0, "any"),
        ("online", 600.0, 0, "any"),  # the legacy name of `any`
    ],
)
def test_the_pool_policy_by_kind_and_reclaims(
    asked: str, expected: float | None, reclaims: int, mode: str
) -> None:
    assert decide(asked, expected=expected, reclaims=reclaims, policy=POLICY) == mode


def test_a_policy_that_sends_every_auto_job_offline_first() -> None:
    never = PoolPolicy(reclaims_to_offline=0)
    assert decide("auto", expected=1.0, reclaims=0, policy=never) == "any"


@pytest.mark.parametrize(
    ("remaining", "max_workers", "shard_s", "expected"),
    [
        (100, 10, 60.0, 600.0),  # 10 waves of 10 workers
        (101, 10, 60.0, 660.0),  # a last wave of one is a wave still
        (3, 10, 60.0, 60.0),  # fewer shards than workers: one wave
        (0, 10, 60.0, 0.0),
        (100, 10, 0.0, None),  # no shard committed yet
    ],
)
def test_the_time_a_group_needs_yet(
    remaining: int, max_workers: int, shard_s: float, expected: float | None
) -> None:
    assert expected_s(remaining=remaining, max_workers=max_workers, shard_s=shard_s) == expected


def test_each_mode_allows_and_prefers_its_pools() -> None:
    assert [allows("offline", p) for p in ("offline", "mixed", "online")] == [True, False, False]
    assert [allows("any", p) for p in ("offline", "mixed", "online")] == [True, True, False]
    assert [allows("mixed", p) for p in ("offline", "mixed", "online")] == [True, True, False]
    assert (preferred("offline"), preferred("any"), preferred("mixed")) == (
        "offline",
        "offline",
        "mixed",
    )


def demand(job: str, *, want: int, first: str, eligible: Any = None) -> Demand:
    return Demand(
        job=job,
        want=want,
        min_workers=0,
        priority=0,
        submitted_at=0.0,
        shape={"cpu": 2.0},
        eligible=eligible or (lambda _b: True),
        prefer=preference("mixed" if first == "mixed" else "any"),
    )


def test_each_job_fills_the_bins_of_its_own_preferred_pool_first() -> None:
    bins = [
        Bin("mixed-0", {"cpu": 4.0}, pool="mixed"),
        Bin("offline-0", {"cpu": 4.0}, pool="offline"),
    ]
    # Alone, each takes its own pool's room first, then the other's.
    assert allocate([demand("short", want=1, first="mixed")], bins) == {"short": 1}
    # Both: the short job's two workers go to the mixed node, the long job's to the
    # offline one; what one takes, the other does not find free.
    both = [demand("short", want=3, first="mixed"), demand("long", want=3, first="offline")]
    assert allocate(both, bins) == {"short": 2, "long": 2}
    # Without the mixed node the short job still runs, on the offline pool.
    offline_only = [b for b in bins if b.pool == "offline"]
    assert allocate([demand("short", want=3, first="mixed")], offline_only) == {"short": 2}


def test_a_job_kept_off_the_mixed_pool_takes_none_of_it() -> None:
    bins = [Bin("mixed-0", {"cpu": 8.0}, pool="mixed"), Bin("offline-0", {"cpu": 2.0}, "offline")]
    offline = demand("a", want=4, first="offline", eligible=lambda b: allows("offline", b.pool))
    assert allocate([offline], bins) == {"a": 1}


def node(
    name: str,
    pool: str = "offline",
    *,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    cpu: float = 8.0,
    gpu: float = 0.0,
) -> NodeFacts:
    return NodeFacts(
        name=name,
        pool=pool,
        labels={"ebb.io/pool": pool, **(labels or {})},
        taints=taints or [],
        allocatable={"cpu": cpu, "memory": 32.0 * 2**30, "nvidia.com/gpu": gpu},
    )


GPU_LABEL = "nvidia.com/gpu.product"
A100 = {GPU_LABEL: "NVIDIA-A100-SXM4-80GB"}
SHAPE = {"cpu": 2.0, "memory": 4.0 * 2**30}
GPU_SHAPE = {**SHAPE, "nvidia.com/gpu": 1.0}


def why(placement: Placement, nodes: list[NodeFacts], shape: dict[str, float] = SHAPE) -> str:
    return unplaceable(placement, shape, nodes, pool_label="ebb.io/pool", gpu_label=GPU_LABEL)


def test_a_group_placeable_on_some_node_has_no_reason_to_wait() -> None:
    assert why(Placement(pool="offline"), [node("off-0")]) == ""
    assert why(Placement(pool="mixed"), [node("mixed-0", "mixed")]) == ""
    gpu = Placement(node_selector=A100)
    assert why(gpu, [node("gpu-0", labels=A100, gpu=4)], GPU_SHAPE) == ""
    # Not ready, full, not lent by the tide now: all of that passes, so no reason.
    tainted = node(
        "off-0", taints=[{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]
    )
    assert why(Placement(pool="offline"), [tainted]) == ""


def test_why_a_group_could_never_be_placed() -> None:
    mixed = node("mixed-0", "mixed")
    reason = why(Placement(pool="offline"), [mixed, node("online-0", "online")])
    assert reason.startswith("pool offline: no node of the cluster is in the offline pool")
    assert "offline or mixed" in why(Placement(pool="any"), [node("online-0", "online")])
    # A GPU type no node has, named as such.
    other = node("gpu-0", labels={GPU_LABEL: "Tesla-T4"}, gpu=1)
    reason = why(Placement(node_selector=A100), [other], GPU_SHAPE)
    assert reason == (
        f"gpu_type NVIDIA-A100-SXM4-80GB: no node of its pools has that GPU (label {GPU_LABEL})"
    )
    # On a node of a pool it may not use, the GPU type does not count.
    a100_mixed = node("gpu-1", "mixed", labels=A100, gpu=1)
    assert why(Placement(node_selector=A100, pool="offline"), [a100_mixed], GPU_SHAPE).startswith(
        "pool offline"
    )
    assert why(Placement(node_selector={"zone": "b"}), [node("off-0", labels={"zone": "a"})]) == (
        "node_selector zone=b: no node of its pools has that label"
    )
    # Each label on some node, but not both on one.
    apart = [node("a", labels={"zone": "a"}), node("b", labels={"disk": "ssd"})]
    assert why(Placement(node_selector={"zone": "a", "disk": "ssd"}), apart) == (
        "node_selector: no node of its pools has all of zone=a, disk=ssd"
    )
    taint = {"key": "dedicated", "value": "search", "effect": "NoSchedule"}
    assert why(Placement(), [node("off-0", taints=[taint])]) == (
        "tolerations: every node it may use has a taint they do not tolerate "
        "(dedicated=search:NoSchedule)"
    )
    # More GPUs a worker than any node it may use has.
    big = {**SHAPE, "nvidia.com/gpu": 8.0}
    gpus = [node("gpu-0", labels=A100, gpu=4), node("gpu-1", "mixed", labels=A100, gpu=2)]
    assert why(Placement(node_selector=A100), gpus, big) == (
        "a worker asks for more than any node it may use has: 8 GPUs (the most a node it may "
        "use has: 4 GPUs)"
    )
    # Enough of each somewhere, but not all of it on one node.
    split = [node("cpu", cpu=16, gpu=0), node("gpu", cpu=1, gpu=1)]
    assert "no one node has all of 2 CPUs, 4 GiB memory, 1 GPUs" in why(
        Placement(), split, GPU_SHAPE
    )
