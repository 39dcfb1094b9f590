"""The elastic scheduler: its decisions, and a pipeline that scales a slow stage out and back."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from pathlib import Path

import pytest
import torch

from ebb.common.job import StageSpec
from ebb.worker.pipeline.elastic import ElasticScheduler, ElasticSettings, StageLoad
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from ..helpers import ASSETS, FEATURES, wait_until
from .test_pipeline import features_stage, rows


def load(
    stage: int,
    *,
    util: float,
    waiting: int,
    workers: int = 1,
    lo: int = 1,
    hi: int = 4,
    device: float = 0.5,
) -> StageLoad:
    return StageLoad(
        stage=stage,
        workers=workers,
        min_workers=lo,
        max_workers=hi,
        utilization=util,
        waiting=waiting,
        device_busy=device,
    )


def test_the_busiest_stage_with_work_waiting_gets_a_process() -> None:
    s = ElasticScheduler(ElasticSettings(confirm=1, cooldown_s=0))
    loads = [
        load(0, util=0.9, waiting=10),
        load(1, util=0.95, waiting=50),
        load(2, util=0.1, waiting=0),
    ]
    assert s.decide(0.0, loads) == ("add", 1)


def test_a_full_device_takes_from_an_idle_stage_instead() -> None:
    s = ElasticScheduler(ElasticSettings(confirm=1, cooldown_s=0))
    loads = [
        load(0, util=0.95, waiting=80, device=0.97),
        load(1, util=0.1, waiting=0, workers=3, device=0.97),
    ]
    assert s.decide(0.0, loads) == ("remove", 1)
    # ...but never below a stage's minimum.
    loads[1] = load(1, util=0.1, waiting=0, workers=1, device=0.97)
    assert s.decide(1.0, loads) is None


def test_decisions_need_confirming_and_respect_the_cooldown() -> None:
    s = ElasticScheduler(ElasticSettings(confirm=2, cooldown_s=10))
    busy = [load(0, util=0.9, waiting=10)]
    assert s.decide(0.0, busy) is None  # seen once
    assert s.decide(1.0, busy) == ("add", 0)  # confirmed
    assert s.decide(2.0, busy) is None
    assert s.decide(3.0, busy) is None  # confirmed again, but cooling down
    assert s.decide(11.0, busy) == ("add", 0)


def test_idle_processes_are_given_back_down_to_the_minimum() -> None:
    s = ElasticScheduler(ElasticSettings(confirm=1, cooldown_s=0))
    assert s.decide(0.0, [load(0, util=0.0, waiting=0, workers=3)]) == ("remove", 0)
    assert s.decide(1.0, [load(0, util=0.0, waiting=0, workers=1)]) is None


async def test_a_slow_stage_scales_out_under_load_and_back_in_when_idle() -> None:
    stage = StageSpec(
        name="slow",
        modelet="ebbtest_modelets:Slow",
        params={"seconds_per_batch": 0.05},
        batch_size=8,
        workers=1,
        min_workers=1,
        max_workers=3,
    )
    pipeline = Pipeline(
        PipelineConfig(
            stages=[stage],
            code_paths=[str(ASSETS)],
            # The machine's CPU may be busy with other work (a CI neighbour): that veto of
            # the device is tested on its own; here the stage's own load decides.
            elastic=ElasticSettings(tick_s=0.2, cooldown_s=0.3, confirm=1, device_full=1.01),
        )
    )
    try:
        await pipeline.start()
        router = pipeline._router
        assert router is not None
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(router.pools[0].live()))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        items = rows(1_500)
        outcomes = await pipeline.run(items)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        assert all(ok for ok, _ in outcomes)
        assert peak == 3
        await wait_until(
            lambda: len(router.pools[0].live()) == 1,
            timeout=30,
            what="the stage to shrink back to one process",
        )
    finally:
        await pipeline.stop()


class _Wide(torch.nn.Module):
    """Slow enough on a CPU that its stage is the bottleneck for a few ticks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out[:, :4]


@pytest.mark.parametrize(("cores", "most"), [(4.0, 2), (1.0, 1)])
async def test_a_model_stage_grows_only_within_the_cpu_budget_and_its_threads_are_divided_again(
    tmp_path: Path, cores: float, most: int
) -> None:
    path = tmp_path / "wide.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_Wide().eval()), str(path))
    model = StageSpec(
        name="model", model=str(path), batch_size=32, workers=1, min_workers=1, max_workers=2
    )
    pipeline = Pipeline(
        PipelineConfig(
            stages=[features_stage(), model],
            # The budget is what the test sets, whatever this machine has; the measured
            # load's veto is tested apart (the machine may be busy with other work).
            cpus=cores,
            elastic=ElasticSettings(tick_s=0.2, cooldown_s=0.3, confirm=1, device_full=1.01),
        )
    )
    seen: set[tuple[int, ...]] = set()
    try:
        await pipeline.start()
        router = pipeline._router
        assert router is not None

        async def watch() -> None:
            while True:
                live = router.pools[1].live()
                seen.add(tuple(sorted(p.threads for p in live)))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        outcomes = await pipeline.run(rows(20_000))
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    finally:
        await pipeline.stop()
    assert all(ok for ok, _ in outcomes)
    assert max(len(s) for s in seen) == most, seen
    # Each model process gets its share of the budget: all of it alone, half of it with two.
    assert (int(cores),) in seen
    if most == 2:
        assert (2, 2) in seen, seen
