"""Where `ebb run` keeps its stacks' state: one folder per run, the newest few failed ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ebb.client.runs import LOCK, RunFolder, prune, runs_home
from ebb.common import envvars


def test_runs_live_in_a_per_user_state_folder_that_the_environment_moves() -> None:
    home = Path.home()
    assert runs_home({}) == home / ".local" / "state" / "ebb" / "runs"
    assert runs_home({"XDG_STATE_HOME": "/xdg"}) == Path("/xdg/ebb/runs")
    assert runs_home({"XDG_STATE_HOME": "/xdg", envvars.RUNS_DIR: "/r"}) == Path("/r")


def _aged(folder: Path, seconds_ago: float) -> None:
    began = (folder / LOCK).stat().st_mtime - seconds_ago
    os.utime(folder / LOCK, (began, began))


def test_only_the_newest_runs_kept_stay_and_no_live_run_or_stranger_is_touched(
    tmp_path: Path,
) -> None:
    home = tmp_path / "runs"
    live = RunFolder.create(home, "live")
    _aged(live.path, 1_000)  # the oldest of all, but its run goes on
    stranger = home / "not-a-run"
    stranger.mkdir()
    kept: list[Path] = []
    for n in range(7):
        run = RunFolder.create(home, f"job-{n}")
        _aged(run.path, 100 - n)  # job-6 began last
        (run.path / "logs").mkdir()
        run.keep(kept=3)
        kept.append(run.path)
    assert sorted(p.name for p in home.iterdir() if p.is_dir()) == sorted(
        [live.path.name, stranger.name, *(p.name for p in kept[-3:])]
    )
    live.discard()
    assert not live.path.exists()
    assert sorted(prune(home, kept=0)) == sorted(kept[-3:])
    assert stranger.exists()


def test_a_run_killed_before_it_could_say_is_pruned_like_a_failed_one(tmp_path: Path) -> None:
    home = tmp_path / "runs"
    # A process that makes its run's folder and dies without a word: its lock goes with it.
    made = "import sys, pathlib; from ebb.client.runs import RunFolder; "
    made += "RunFolder.create(pathlib.Path(sys.argv[1]), sys.argv[2])"
    subprocess.run([sys.executable, "-c", made, str(home), "killed"], check=True, timeout=60)
    (killed,) = home.iterdir()
    _aged(killed, 10)
    newer = RunFolder.create(home, "newer")
    newer.keep(kept=1)
    assert not killed.exists() and newer.path.exists()
