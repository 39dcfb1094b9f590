"""Failpoints kill exactly the process that reaches an armed point, once, and say where."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ebb.common import envvars, failpoints

_REACH = (
    "import sys; from ebb.common import failpoints; "
    "failpoints.hit(failpoints.WORKER_AFTER_COMMIT_RECORD, detail='7'); sys.exit(3)"
)


def _reach(folder: Path | None) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    if folder is not None:
        env[envvars.FAILPOINT_DIR] = str(folder)
    return subprocess.run([sys.executable, "-c", _REACH], env=env, check=False)


def test_an_armed_point_kills_the_first_process_to_reach_it_and_only_that_one(
    tmp_path: Path,
) -> None:
    point = failpoints.WORKER_AFTER_COMMIT_RECORD
    assert _reach(tmp_path).returncode == 3  # not armed: passes through
    failpoints.arm(tmp_path, point)
    assert _reach(tmp_path).returncode == -signal.SIGKILL
    pid = failpoints.fired(tmp_path, point)
    assert pid is not None and failpoints.detail(tmp_path, point, pid) == "7"
    assert _reach(tmp_path).returncode == 3  # fired once: the next one passes


def test_points_are_inert_without_the_folder_and_unknown_ones_cannot_be_armed(
    tmp_path: Path,
) -> None:
    (tmp_path / failpoints.WORKER_AFTER_COMMIT_RECORD).write_text("")
    assert _reach(None).returncode == 3
    with pytest.raises(ValueError, match="no failpoint 'nowhere'"):
        failpoints.arm(tmp_path, "nowhere")
