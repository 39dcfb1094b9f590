"""A worker's CPU budget, and how its stage processes share it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ebb.client.stack import StackConfig
from ebb.common import envvars, host
from ebb.common.host import cgroup_quota
from ebb.common.job import StageSpec
from ebb.worker.modelets.runtimes import OnnxStage, TorchScriptStage
from ebb.worker.resources.cpus import (
    blas_environment,
    budget,
    detect,
    room_for_model_process,
    shares,
)

from ..helpers import FEATURES, write_model


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # v2, no quota
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "400000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 4),
        ({}, None),  # no cgroup file system to read
    ],
)
def test_the_cgroup_quota_in_cores(tmp_path: Path, files: dict[str, str], cores: float) -> None:
    assert cgroup_quota(_cgroup(tmp_path, files)) == cores


def test_the_budget_is_the_least_of_what_applies(tmp_path: Path) -> None:
    assert budget(told=None, quota=None, affinity=8) == 8
    assert budget(told=2.0, quota=None, affinity=8) == 2  # the local backend's share
    assert budget(told=4.0, quota=1.5, affinity=8) == 1.5  # a pod's quota
    assert budget(told=None, quota=16.0, affinity=1) == 1  # pinned to one core
    quota = _cgroup(tmp_path, {"cpu.max": "300000 100000"})
    assert detect({envvars.CPUS: "0.5"}, root=quota) == 0.5
    assert detect({envvars.CPUS: "not a number"}, root=quota) <= 3


def _stages(*, threads: int = 0, device: str = "cpu") -> list[StageSpec]:
    return [
        StageSpec(name="pre", modelet="m:Pre", batch_size=8),
        StageSpec(
            name="model",
            model="/models/m.onnx",
            batch_size=8,
            min_workers=1,
            max_workers=4,
            threads=threads,
            device=device,
        ),
        StageSpec(name="top", modelet="m:Top", batch_size=8),
    ]


@pytest.mark.parametrize(
    ("stages", "model_processes", "cores", "threads"),
    [
        (_stages(), 1, 1.0, 1),  # one core: the model one thread
        (_stages(), 1, 0.5, 1),  # half a core: never less than one
        (_stages(), 1, 8.0, 8),
        (_stages(), 2, 8.0, 4),  # two model processes share the cores
        (_stages(), 3, 2.0, 1),
        (_stages(threads=3), 2, 1.0, 3),  # an explicit count wins
        (_stages(device="cuda"), 2, 8.0, 1),  # a GPU model: its CPU side feeds the device
    ],
)
def test_model_processes_share_the_budget(
    stages: list[StageSpec], model_processes: int, cores: float, threads: int
) -> None:
    # Modelets: 0 (their BLAS is sized apart, below).
    assert shares(stages, [2, model_processes, 1], cores) == [0, threads, 0]


def test_another_model_process_only_while_each_gets_a_core() -> None:
    stages = _stages()
    assert room_for_model_process(stages, [3, 1, 1], 2.0)  # modelets do not count
    assert not room_for_model_process(stages, [1, 2, 1], 2.0)
    assert not room_for_model_process(stages, [1, 1, 1], 1.5)
    assert room_for_model_process(_stages(device="cuda"), [1, 4, 1], 2.0)


def test_modelet_processes_get_one_blas_thread_unless_told_otherwise() -> None:
    told = blas_environment({"MKL_NUM_THREADS": "4"})
    assert told["OMP_NUM_THREADS"] == "1" and told["OPENBLAS_NUM_THREADS"] == "1"
    assert "MKL_NUM_THREADS" not in told


def test_a_model_runs_the_threads_it_is_told_and_takes_a_new_count_between_batches(
    tmp_path: Path,
) -> None:
    onnx = OnnxStage(StageSpec(name="m", model=str(write_model(tmp_path / "m.onnx")), threads=2))
    onnx.setup()
    assert onnx.session.get_session_options().intra_op_num_threads == 2
    onnx.set_threads(1)
    options = onnx.session.get_session_options()
    assert options.intra_op_num_threads == 1
    # Between batches its threads sleep: a spin would take the other stages' cores.
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    features = np.ones((3, FEATURES), dtype=np.float32)
    assert onnx.infer({onnx.input_names[0]: features})  # still serves rows

    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(FEATURES, 2)), str(path))
    before = torch.get_num_threads()
    try:
        scripted = TorchScriptStage(StageSpec(name="t", model=str(path), threads=3))
        scripted.setup()
        assert torch.get_num_threads() == 3
        scripted.set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_every_part_counts_the_cores_it_may_use_alike(tmp_path: Path) -> None:
    """One answer (ebb.common.host) for the local backend, `ebb run` and the worker: the
    affinity mask within the cgroup's quota, never the machine's every core."""
    affinity = len(host.allowed_cores()) or 1
    quota = _cgroup(tmp_path, {"cpu.max": "150000 100000"})
    assert host.usable_cores(root=quota) == min(affinity, 1.5)
    assert host.core_count(root=quota) == 1
    unbounded = _cgroup(tmp_path / "none", {"cpu.max": "max 100000"})
    assert host.usable_cores(root=unbounded) == affinity
    assert host.core_count(root=unbounded) == affinity
    assert detect({}, root=quota) == host.usable_cores(root=quota)
    assert StackConfig(state_dir=tmp_path, data_roots=[]).max_workers == host.core_count()
