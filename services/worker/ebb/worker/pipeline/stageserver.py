"""Where stage processes come from: a fork server that has imported, once, what every stage
needs (numpy, pyarrow, the stage loop, and the model runtimes the job's stages use), and forks
each stage process from that.

Spawning each stage from a bare interpreter made every stage import all of it again, each
process on its own, side by side: on a small machine most of a worker's start-up, and again
for every process the elastic scheduler or a memory recycle starts. Forking from a server that
has touched no GPU, opened no connection and run no model is as safe as spawning (what makes
CUDA refuse a plain fork does not arise), and the imported pages are shared.

Imports nothing heavy itself: the worker starts the server first thing, so that the server's
imports run while the worker imports its own, connects and reads the job.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
from multiprocessing.context import ForkServerContext

from ebb.common import envvars

BASE = ["ebb.worker.stage.loop"]
RUNTIMES = {"onnxruntime", "torch"}
"""Modules the controller may ask for (`JobSpec.runtime_modules`): nothing else is imported,
whatever the environment says."""


def preload() -> list[str]:
    asked = os.environ.get(envvars.STAGE_PRELOAD, "")
    return BASE + sorted({m.strip() for m in asked.split(",")} & RUNTIMES)


def stage_context() -> ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload())
    return ctx


def start_stage_server() -> None:
    """Start the fork server now (it imports what `preload` names in the background); stage
    processes started later fork from it at once. Harmless if it is running already."""
    stage_context()
    multiprocessing.forkserver.ensure_running()
