"""`python -m ebb.controller`: reconcile workers against running jobs until SIGTERM.

--backend local        workers are child processes (the embedded stack)
--backend kubernetes   workers are pods; settings from --config (YAML, the fields of
                       KubeConfig: namespace, image, tidal thresholds...)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import Any

import yaml

from ebb.common import envvars, schema
from ebb.common import log as logsetup
from ebb.common import metrics as metricsserver
from ebb.common.messaging.identity import Key, WorkerSigner
from ebb.common.messaging.natsconfig import add_nats_arguments, nats_config_from_args
from ebb.common.runner import EXIT_FAILED, EXIT_OK, GRACE_S, run
from ebb.common.supervisor import AgentExited, install_stop_signals

from .backend import ClusterBackend
from .election import LeaderElector, LostLeadership
from .local.backend import LocalBackend, LocalConfig
from .reconcile import ReconcilerConfig
from .service import Controller, ControllerConfig

log = logging.getLogger("ebb.controller")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m ebb.controller",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend", choices=["local", "kubernetes"], default=env(envvars.BACKEND, "local")
    )
    add_nats_arguments(p)
    p.add_argument("--max-workers", type=int, default=int(env(envvars.MAX_WORKERS, "0")) or None)
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        default=env(envvars.PIN_CPUS, "") not in ("", "0", "false"),
        help="local backend: pin each worker to cores of its own",
    )
    p.add_argument("--log-dir", default=env(envvars.WORKER_LOG_DIR))
    p.add_argument("--config", default=env(envvars.CONTROLLER_CONFIG), help="KubeConfig YAML")
    p.add_argument("--id", default=env(envvars.CONTROLLER_ID, socket.gethostname()))
    p.add_argument("--kubeconfig", default=env("KUBECONFIG"), help="outside a cluster")
    p.add_argument("--worker-grace", type=float, default=GRACE_S)
    p.add_argument("--resync", type=float, default=ControllerConfig.resync_s)
    metricsserver.add_metrics_argument(p)
    p.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    return p.parse_args(argv)


def read_settings(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a map of KubeConfig fields")
    return data


async def kubernetes_backend(args: argparse.Namespace) -> tuple[ClusterBackend, LeaderElector, Any]:
    from kubernetes_asyncio import config as kube_config
    from kubernetes_asyncio.client import ApiClient

    from .kube.backend import KubeConfig, KubernetesBackend, from_cluster

    if args.kubeconfig:
        await kube_config.load_kube_config(config_file=args.kubeconfig)
    else:
        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
    settings = read_settings(args.config)
    nats = nats_config_from_args(args)
    settings.setdefault("nats", {"url": nats.url, "prefix": nats.prefix})
    # In a pod, the downward API tells us where we are and who we are.
    if os.environ.get(envvars.NAMESPACE):
        settings.setdefault("namespace", os.environ[envvars.NAMESPACE])
    api = ApiClient()
    config = await from_cluster(
        schema.load(KubeConfig, settings), api, pod_name=os.environ.get(envvars.POD_NAME)
    )
    elector = LeaderElector(
        api, namespace=config.namespace, name="ebb-controller", identity=args.id
    )
    return KubernetesBackend(config, api, signer=worker_signer()), elector, api


def worker_signer() -> WorkerSigner | None:
    """The key that mints each worker a NATS credential of its own (ebb.common.messaging.identity),
    if this controller was given one."""
    seed = os.environ.get(envvars.WORKER_NATS_SIGNING_KEY)
    if not seed:
        return None
    account = os.environ.get(envvars.WORKER_NATS_ACCOUNT, "")
    if not account:
        raise SystemExit(
            f"{envvars.WORKER_NATS_SIGNING_KEY} is set without {envvars.WORKER_NATS_ACCOUNT}"
        )
    try:
        return WorkerSigner(account=account, signing_key=Key.from_seed(seed))
    except ValueError as e:
        raise SystemExit(f"{envvars.WORKER_NATS_SIGNING_KEY}: {e}") from None


async def amain(args: argparse.Namespace) -> int:
    nats = nats_config_from_args(args)
    backend: ClusterBackend
    elector: LeaderElector | None = None
    api: Any = None
    if args.backend == "kubernetes":
        backend, elector, api = await kubernetes_backend(args)
    else:
        worker_nats = None
        if os.environ.get(envvars.WORKER_NATS_USER):
            # Workers run user code: they connect as the worker role, not as us.
            worker_nats = dataclasses.replace(
                nats,
                user=os.environ[envvars.WORKER_NATS_USER],
                password=os.environ.get(envvars.WORKER_NATS_PASSWORD),
                token=None,
            )
        signer = worker_signer()
        if signer is not None:
            # Better still: a credential of its own for each worker (ebb.common.messaging.identity).
            worker_nats = dataclasses.replace(
                nats, user=None, password=None, token=None, creds=None, creds_file=None
            )
        local = LocalConfig(
            nats=nats,
            log_dir=args.log_dir,
            worker_nats=worker_nats,
            worker_signer=signer,
            worker_grace_s=args.worker_grace,
        )
        if args.max_workers:
            local = dataclasses.replace(local, max_workers=args.max_workers)
        local = dataclasses.replace(local, pin_cpus=args.pin_cpus)
        backend = LocalBackend(local)
    controller = Controller(
        ControllerConfig(
            nats=nats,
            resync_s=args.resync,
            reconciler=ReconcilerConfig(worker_grace_s=args.worker_grace),
            shutdown_grace_s=args.worker_grace,
        ),
        backend,
        elector=elector,
    )
    install_stop_signals(controller.request_stop)
    try:
        await controller.run()
    except (AgentExited, LostLeadership) as e:
        log.error("%s", e)
        return EXIT_FAILED
    finally:
        if api is not None:
            await api.close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.setup(args.log_level, service="controller")
    metricsserver.serve(args.metrics_port)
    return run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
