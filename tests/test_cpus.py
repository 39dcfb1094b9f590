"""A worker's CPU budget, and how its stage processes share it (pure: a table of cases)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ebb.common import envvars
from ebb.common.spec import StageSpec
from ebb.worker.cpus import blas_environment, budget, cgroup_quota, detect, with_threads


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


def _stages(
    *, model_workers: int = 1, model_max: int | None = None, threads: int = 0
) -> list[StageSpec]:
    return [
        StageSpec(name="pre", modelet="m:Pre", batch_size=8),
        StageSpec(
            name="model",
            model="/models/m.onnx",
            batch_size=8,
            workers=model_workers,
            min_workers=1 if model_max else None,
            max_workers=model_max,
            threads=threads,
        ),
        StageSpec(name="top", modelet="m:Top", batch_size=8),
    ]


@pytest.mark.parametrize(
    ("stages", "cores", "threads"),
    [
        (_stages(), 1.0, 1),  # one core: the model one thread
        (_stages(), 0.5, 1),  # half a core: never less than one
        (_stages(), 8.0, 8),
        (_stages(model_workers=2), 8.0, 4),  # two model processes share the cores
        (_stages(model_max=4), 2.0, 1),  # elastic: shared as if at its most processes
        (_stages(threads=3), 1.0, 3),  # an explicit count wins
    ],
)
def test_model_stages_share_the_budget(stages: list[StageSpec], cores: float, threads: int) -> None:
    shared = with_threads(stages, cores)
    assert [s.threads for s in shared] == [0, threads, 0]  # modelets: their BLAS, below


def test_modelet_processes_get_one_blas_thread_unless_told_otherwise() -> None:
    told = blas_environment({"MKL_NUM_THREADS": "4"})
    assert told["OMP_NUM_THREADS"] == "1" and told["OPENBLAS_NUM_THREADS"] == "1"
    assert "MKL_NUM_THREADS" not in told
