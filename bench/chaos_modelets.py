"""Modelets of the chaos campaign (bench/chaos.py) that stage processes import through
code_paths: kept apart from the campaign itself, whose imports a stage process has no use for."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psutil

from ebb.worker.modelets import TopClass

FLAKY_MARKER = "fail-setup"
"""The file whose taking fails a stage's setup; it names the processes that may not take it."""
TAKEN_PREFIX = "failed-"
"""What the taker renames the marker to (then its pid): the campaign's evidence that it fired."""


def arm_flaky(folder: Path, *, spared: list[int]) -> None:
    """Arm the flaky node: the next stage process to set up that descends from none of the
    processes in `spared` (the workers running now) fails its setup, once."""
    staged = folder / f".{FLAKY_MARKER}.tmp"
    staged.write_text(json.dumps(spared))
    staged.rename(folder / FLAKY_MARKER)  # whole, or not there at all


def taken_by(folder: Path) -> int | None:
    """The pid of the stage process that took the marker, once one has."""
    for path in folder.glob(f"{TAKEN_PREFIX}*"):
        return int(path.name.removeprefix(TAKEN_PREFIX))
    return None


class FlakyTopClass(TopClass):
    """TopClass, whose setup fails once when the chaos campaign arms `flaky_dir` (a node whose
    pipeline cannot start: a driver that would not load, a device that would not open).

    The stage process of a newly started worker that takes the marker (a rename: exactly one
    does) raises in setup(); its worker then cannot start its pipeline. Stage processes of the
    workers that ran when the marker was armed (restarted or added later) leave it alone: the
    fault is a node's, met when a worker starts there."""

    def __init__(self, flaky_dir: str, **params: Any) -> None:
        super().__init__(**params)
        self.flaky_dir = Path(flaky_dir)

    def setup(self) -> None:
        marker = self.flaky_dir / FLAKY_MARKER
        try:
            spared = set(json.loads(marker.read_text()))
        except FileNotFoundError:
            return
        if any(p.pid in spared for p in psutil.Process().parents()):
            return
        try:
            marker.rename(self.flaky_dir / f"{TAKEN_PREFIX}{os.getpid()}")
        except FileNotFoundError:
            return  # another process took it first
        raise RuntimeError("this node's device would not open (a flaky node, the chaos campaign)")
