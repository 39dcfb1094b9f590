"""Which GPUs a worker has, and which of them each replica of a GPU stage is handed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ebb.common.job import StageSpec
from ebb.worker.modelets.api import StageError
from ebb.worker.modelets.runtimes import TorchScriptStage
from ebb.worker.pipeline.front import Pipeline, PipelineConfig
from ebb.worker.resources.devices import DEVICE_ENV, least_used_slot, placement, spread, visible

from ..helpers import ASSETS


@pytest.mark.parametrize(
    ("environ", "gpus"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, ("2", "3")),
        ({"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "0"}, ()),  # hidden on purpose
        ({"CUDA_VISIBLE_DEVICES": "-1"}, ()),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}, ("GPU-a1", "GPU-b2")),  # a pod's
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, ()),
    ],
)
def test_the_gpus_a_worker_was_given(environ: dict[str, str], gpus: tuple[str, ...]) -> None:
    assert visible(environ) == gpus


def _gpu_stage(device: str = "cuda", **kw: int) -> StageSpec:
    return StageSpec(name="embed", model="/m.pt", device=device, **kw)  # type: ignore[arg-type]


def test_workers_of_a_cuda_stage_are_per_gpu() -> None:
    pre = StageSpec(name="pre", modelet="m:Pre", workers=3)
    stages = spread([pre, _gpu_stage(workers=2, min_workers=1, max_workers=3)], ("0", "1"))
    assert stages[0] == pre
    assert (stages[1].workers, stages[1].min_workers, stages[1].max_workers) == (4, 2, 6)
    # One named GPU: as asked.
    assert spread([_gpu_stage("cuda:1")], ("0", "1"))[0].workers == 1


def test_a_gpu_stage_without_the_gpu_it_asks_for_says_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"no CUDA device is visible.*set `device: cpu`"):
        spread([_gpu_stage()], ())
    with pytest.raises(ValueError, match=r"has 2 GPU\(s\) \(0, 1\)"):
        spread([_gpu_stage("cuda:2")], ("0", "1"))
    # Nothing says which GPUs there are: the stage finds out where it starts.
    assert spread([_gpu_stage()], None)[0].workers == 1


def test_each_replica_is_handed_one_gpu() -> None:
    gpus = ("4", "6")
    assert placement("cuda", 0, gpus) == (
        "cuda:0",
        {"CUDA_VISIBLE_DEVICES": "4", DEVICE_ENV: "cuda:0"},
    )
    assert placement("cuda", 3, gpus)[1]["CUDA_VISIBLE_DEVICES"] == "6"
    assert placement("cuda:1", 0, gpus)[1]["CUDA_VISIBLE_DEVICES"] == "6"
    assert placement("cpu", 5, gpus) == ("cpu", {DEVICE_ENV: "cpu"})
    assert placement("cuda:1", 0, None) == ("cuda:1", {DEVICE_ENV: "cuda:1"})
    # Replicas added after some went away fill the gaps, so the GPUs stay evenly used.
    assert least_used_slot([0, 2, 3]) == 1
    assert least_used_slot([]) == 0


@pytest.mark.parametrize("gpus", [("0", "1"), ("GPU-8f0e", "GPU-77aa")])
async def test_replicas_of_a_cuda_stage_on_a_worker_with_two_gpus_get_one_each(
    gpus: tuple[str, str], tmp_path: Path
) -> None:
    stage = StageSpec(
        name="place",
        modelet="ebbtest_modelets:Placement",
        device="cuda",
        batch_size=4,
        params={"folder": str(tmp_path)},
    )
    pipeline = Pipeline(
        PipelineConfig(stages=spread([stage], gpus), code_paths=[str(ASSETS)], cpus=2.0, gpus=gpus)
    )
    try:
        await pipeline.start()
        outcomes = await pipeline.run([{"i": i} for i in range(400)])
    finally:
        await pipeline.stop()
    assert all(ok for ok, _ in outcomes)
    # What each replica was handed, as it set up: the router may give one replica every
    # batch while the other starts, so the rows alone need not show both.
    placed = [tuple(f.read_text().split()) for f in tmp_path.iterdir()]
    by_process = {pid: (gpu, device) for pid, gpu, device in placed}
    assert len(placed) == len(by_process) == 2, placed  # two processes, each with one GPU
    assert sorted(gpu for gpu, _ in by_process.values()) == sorted(gpus)
    assert {device for _, device in by_process.values()} == {"cuda:0"}
    assert {tuple(str(v).split()) for _, v in outcomes} <= set(placed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_torch_stage_on_cuda_without_one_says_what_to_change(tmp_path: object) -> None:
    stage = TorchScriptStage(StageSpec(name="embed", model="/nowhere/m.pt", device="cuda"))
    with pytest.raises(
        StageError, match=r"no CUDA device is visible to this worker: set `device: cpu`"
    ):
        stage.setup()
