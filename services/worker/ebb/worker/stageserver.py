"""Where stage processes come from: a fork server that has imported, once, what every stage
needs (numpy, pyarrow, the stage loop), and forks each stage process from that.

Spawning each stage from a bare interpreter made every stage import all of it again, each
process on its own, side by side: on a small machine most of a worker's start-up, and again
for every process the elastic scheduler or a memory recycle starts. Forking from a server that
has touched no GPU, opened no connection and started no thread is as safe as spawning (the
reason CUDA forbids plain fork does not arise), and the imported pages are shared.

Imports nothing heavy itself: the worker starts the server first thing, so that the server's
imports run while the worker imports its own, connects and reads the job.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
from multiprocessing.context import BaseContext

PRELOAD = ["ebb.worker.stage"]


def stage_context() -> BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_stage_server() -> None:
    """Start the fork server now (it loads PRELOAD in the background); stage processes
    started later fork from it at once. Harmless if it is running already."""
    stage_context()
    multiprocessing.forkserver.ensure_running()
