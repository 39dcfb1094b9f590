"""The node cache's command line: `python -m ebb.worker.modelcache`, settings from flags or
the environment (EBB_MODEL_CACHE_*, EBB_MODEL_ROOTS)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from ebb.common import envvars
from ebb.common import log as logsetup
from ebb.common import metrics as metricsserver
from ebb.common.runner import EXIT_OK, run
from ebb.common.supervisor import install_stop_signals

from .server import CacheServerConfig, ModelCacheServer

log = logging.getLogger(__name__)

_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def byte_size(text: str) -> int:
    """`50Gi`, `512Mi`, `1073741824`: bytes (Kubernetes' binary suffixes)."""
    digits = text.rstrip("KMGTi")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or n Ki/Mi/Gi/Ti)")
    return int(digits) * _UNITS[unit]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m ebb.worker.modelcache", description=__doc__)
    p.add_argument(
        "--cache-dir",
        default=env(envvars.MODEL_CACHE_DIR),
        required=env(envvars.MODEL_CACHE_DIR) is None,
    )
    p.add_argument(
        "--max-bytes",
        type=byte_size,
        default=env(envvars.MODEL_CACHE_MAX_BYTES),
        required=env(envvars.MODEL_CACHE_MAX_BYTES) is None,
        help="the cache's bound (50Gi, say): least recently used models go beyond it",
    )
    roots = [r for r in env(envvars.MODEL_ROOTS, "").split(",") if r]
    p.add_argument(
        "--model-root",
        action="append",
        default=roots,
        required=not roots,
        help="a store URI under which models lie, the only objects served (repeatable; "
        "default: EBB_MODEL_ROOTS)",
    )
    p.add_argument(
        "--port", type=int, default=int(env(envvars.MODEL_CACHE_PORT, str(CacheServerConfig.port)))
    )
    p.add_argument("--grace", type=float, default=float(env(envvars.SHUTDOWN_GRACE_S, "10")))
    metricsserver.add_metrics_argument(p)
    p.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    server = ModelCacheServer(
        CacheServerConfig(
            cache_dir=args.cache_dir,
            max_bytes=args.max_bytes,
            model_roots=args.model_root,
            port=args.port,
        )
    )
    await server.start()
    stop = asyncio.Event()
    install_stop_signals(stop.set)
    metricsserver.set_readiness(lambda: (True, "serving"))
    await stop.wait()
    log.info("stopping: %d connections open", server.connections)
    await server.close(grace_s=args.grace)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.setup(args.log_level, service="model-cache")
    metricsserver.serve(args.metrics_port)
    return run(amain(args))
