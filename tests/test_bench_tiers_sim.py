"""The throughput model of the tiers simulation: how long a pod of each tier takes over a
shard, how many pods fit, and the steady state they make."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.tiers_sim import (
    ONE_TIER,
    TWO_TIERS,
    Costs,
    handoff_bound,
    pods_that_fit,
    shard_s,
    steady,
)


def test_a_gpu_node_paces_one_tier_by_its_cpus_and_two_tiers_by_the_gpu() -> None:
    costs = Costs()
    # 32 cores keep a GPU busy; a GPU node has 8: the preprocessing sets one tier's pace.
    assert costs.prep_cpu_s / costs.model_s == 32
    assert shard_s(costs, ONE_TIER, 0) == 240.0
    assert [pods_that_fit(t) for t in ONE_TIER] == [4]
    one = steady(costs, ONE_TIER)
    assert one.shards_per_s == pytest.approx(4 / 240)
    assert one.gpu_busy == pytest.approx(0.25)

    # Two tiers: 4 cores a pod and a hand-off written; the model and a hand-off read, each
    # half of 3.6 s (a shard of 301 MB at section 14's cost a byte).
    assert costs.handoff_write_s == costs.handoff_read_s == pytest.approx(1.797, abs=1e-3)
    cpu, gpu = 480.0 + costs.handoff_write_s, 60.0 + costs.handoff_read_s
    assert [shard_s(costs, TWO_TIERS, k) for k in (0, 1)] == [cpu, gpu]
    assert [pods_that_fit(t) for t in TWO_TIERS] == [32, 4]  # 8 nodes x 16 cores / 4
    two = steady(costs, TWO_TIERS)
    assert two.pods == {"cpu": 32, "gpu": 4}
    assert two.shards_per_s == pytest.approx(4 / gpu)  # the CPU tier makes 32/cpu, more
    assert two.gpu_busy == pytest.approx(60 / gpu)


def test_a_cpu_tier_short_of_cores_starves_the_gpus_in_proportion() -> None:
    costs = Costs()
    half = (replace(TWO_TIERS[0], max_workers=16), TWO_TIERS[1])
    model = steady(costs, half)
    cpu = 480.0 + costs.handoff_write_s
    assert model.shards_per_s == pytest.approx(16 / cpu)
    assert model.gpu_busy == pytest.approx(16 / cpu * 60 / 4)
    # Free hand-offs: the two tiers as one pipeline, the GPU paced by 64 cores.
    free = replace(costs, handoff_write_s=0.0, handoff_read_s=0.0)
    assert steady(free, half).gpu_busy == pytest.approx(0.5)


def test_the_master_holds_the_cpu_tier_back_at_what_lasts_the_gpus_one_of_its_shards() -> None:
    # 4 GPU workers get through 481.8 / 61.8 = 7.8 hand-offs each while a CPU shard computes.
    assert handoff_bound(Costs(), TWO_TIERS) == 4 + 32
    assert handoff_bound(Costs(), ONE_TIER) == 0
