"""The embedded stack on one machine: nats-server, shard master and controller as processes.

Each service runs as its own process (`python -m ebb.shard_master`, `python -m ebb.controller`),
exactly as it is deployed, only with loopback networking and local workers. Logs go to files
under the state folder; `ebb run` prints where when a job fails. A reaper (ebb.common.reaper)
watches every process the stack starts and ends them if the process that started the stack dies
without stopping them (SIGKILLed, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ebb.common import envvars, host
from ebb.common.errors import BusError, EbbError, RemoteError
from ebb.common.messaging import auth, identity
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff, connect
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.natsconfig import NatsConfig, nats_environment
from ebb.common.runner import GRACE_S

log = logging.getLogger(__name__)


class StackError(EbbError):
    """A service of the embedded stack did not start."""


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    state_dir: Path
    """JetStream store and logs live here; reusing it resumes unfinished jobs."""
    data_roots: list[str]
    port: int = 0
    """NATS port on 127.0.0.1 (0: any free port)."""
    max_workers: int = field(default_factory=host.core_count)
    pin_cpus: bool = False
    """Pin each local worker to cores of its own (the controller's --pin-cpus)."""
    prefix: str = "ebb"
    auth: bool = True
    """Each service and client connects with a NATS identity of its own, with only the
    permissions its role needs (ebb.common.messaging.auth), and each worker with one minted for it
    alone (ebb.common.messaging.identity); keys are new at every start."""
    log_level: str = "INFO"
    worker_grace_s: float = GRACE_S
    start_timeout_s: float = 60.0
    controller: bool = True
    """Start a controller (with local workers). Without one, workers are someone else's."""
    standby_masters: int = 0
    """More shard masters (`master-2`, ...) beside the first, standing by to take over."""
    gateway: Path | None = None
    """Serve the OpenAI Batch API (ebb.gateway) with this configuration (catalogue, keys)."""
    gateway_port: int = 0
    """The gateway's port on 127.0.0.1 (0: any free port)."""
    gateway_replicas: int = 1
    """Gateways serving the same records (`gateway`, `gateway-2`, ...), each on a port of
    its own (`gateway_ports`), as Kubernetes runs two behind one Service."""


class LocalStack:
    """nats-server, master and controller. `supervise()` restarts a service that dies, with
    backoff, as Kubernetes would restart its pod: state lives in JetStream, so a restarted
    master resumes every job where it was."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.logs = config.state_dir / "logs"
        self.trust = identity.Trust.new(config.prefix) if config.auth else None
        self._credentials = (
            {r: self.trust.role_credentials(r) for r in auth.ROLES if r != "worker"}
            if self.trust
            else {}
        )
        self.nats = EmbeddedNats(
            state_dir=config.state_dir / "nats",
            port=config.port,
            authorization=self.trust.server_config() if self.trust else None,
        )
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.restarts: dict[str, int] = {}
        self.held: set[str] = set()
        """Services (or "nats") that `supervise()` leaves down for now: a drill's lost node."""
        self._log_files: list[IO[bytes]] = []
        self._stopping = False
        self._reaper: asyncio.subprocess.Process | None = None
        self.gateway_port = (config.gateway_port or _free_port()) if config.gateway else None
        """Where the Batch API is served (`http://127.0.0.1:<port>/v1`), if it is."""
        self.gateway_ports: dict[str, int] = {}
        """Each gateway replica's port, by its name."""
        if self.gateway_port is not None:
            self.gateway_ports["gateway"] = self.gateway_port
            for k in range(2, config.gateway_replicas + 1):
                self.gateway_ports[f"gateway-{k}"] = _free_port()

    @property
    def nats_config(self) -> NatsConfig:
        """How a client (the SDK, the CLI) connects."""
        return self.nats_config_for("client")

    def nats_config_for(self, role: auth.Role) -> NatsConfig:
        """How one of the roles connects (a worker: `worker_nats_config`)."""
        if self.trust is None:
            return NatsConfig(url=self.nats.url, prefix=self.config.prefix)
        if role == "worker":
            raise ValueError("each worker has a credential of its own: worker_nats_config(id)")
        return NatsConfig(
            url=self.nats.url, prefix=self.config.prefix, creds=self._credentials[role]
        )

    def worker_nats_config(self, worker: str) -> NatsConfig:
        """How the worker `worker` connects: as itself, and no other worker."""
        return NatsConfig(
            url=self.nats.url,
            prefix=self.config.prefix,
            creds=self.trust.worker_signer().credentials(worker) if self.trust else None,
            inbox_prefix=auth.worker_inbox(self.config.prefix, worker),
        )

    def team_nats_config(self, team: str) -> NatsConfig:
        """How the team `team` connects: with a credential of its own (minted now, with the
        stack's tenants' key), which submits, reads and acts on its own jobs alone. A stack
        without auth has no teams."""
        if self.trust is None:
            raise StackError("a stack without NATS auth has no teams' identities")
        return NatsConfig(
            url=self.nats.url,
            prefix=self.config.prefix,
            creds=self.trust.team_signer().credentials(team),
        )

    def client_environment(self, team: str = "") -> dict[str, str]:
        """EBB_* variables with which `ebb submit/status/cancel` reach this stack: as its
        admin (sees every job), or as `team` (its own jobs alone)."""
        return nats_environment(self.team_nats_config(team) if team else self.nats_config)

    @property
    def masters(self) -> list[str]:
        """The names of the master processes: `master`, then each standby's."""
        return ["master", *(f"master-{i + 2}" for i in range(self.config.standby_masters))]

    @property
    def gateway_url(self) -> str | None:
        """The Batch API's base URL (an OpenAI client's `base_url`), if the stack serves it."""
        return None if self.gateway_port is None else f"http://127.0.0.1:{self.gateway_port}/v1"

    def _command(self, name: str) -> list[str]:
        common = ["--log-level", self.config.log_level]
        if name in self.gateway_ports:
            assert self.config.gateway is not None
            return [
                "-m",
                "ebb.gateway",
                *common,
                "--config",
                str(self.config.gateway),
                "--port",
                str(self.gateway_ports[name]),
                "--poll",
                "2",
            ]
        if name in self.masters:
            roots: list[str] = []
            for root in self.config.data_roots:
                roots += ["--data-root", root]
            master_id = "embedded" if name == "master" else f"embedded-{name}"
            return ["-m", "ebb.shard_master", *common, "--id", master_id, *roots]
        return [
            "-m",
            "ebb.controller",
            *common,
            "--max-workers",
            str(self.config.max_workers),
            "--log-dir",
            str(self.logs / "workers"),
            "--worker-grace",
            str(self.config.worker_grace_s),
            *(["--pin-cpus"] if self.config.pin_cpus else []),
        ]

    async def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        await self._start_reaper()
        await self._start_nats()
        for name in [*self.masters, *(["controller"] if self.config.controller else [])]:
            await self._spawn(name)
        await self._wait_for_master()
        for name in self.gateway_ports:
            await self._spawn(name)
            await self.wait_for_gateway(name)

    async def _start_reaper(self) -> None:
        """The process that ends the stack if this one dies without stopping it. Its own
        session: a signal to this process's group (a terminal's, a CI runner's) misses it."""
        self._reaper = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ebb.common.reaper",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self._log("reaper"),
            start_new_session=True,
        )

    async def _tell_reaper(self, line: str) -> None:
        reaper = self._reaper
        if reaper is None or reaper.stdin is None or reaper.returncode is not None:
            return
        with contextlib.suppress(ConnectionError):
            reaper.stdin.write(f"{line}\n".encode())
            await reaper.stdin.drain()

    async def _start_nats(self) -> None:
        await asyncio.to_thread(self.nats.start)
        if self.nats.pid is not None:
            await self._tell_reaper(f"watch {self.nats.pid}")

    def _log(self, name: str) -> IO[bytes]:
        log_file = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._log_files.append(log_file)
        return log_file

    async def _spawn(self, name: str) -> None:
        self.processes[name] = process = await asyncio.create_subprocess_exec(
            sys.executable,
            *self._command(name),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log(name),
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=self._environment(name),
        )
        await self._tell_reaper(f"watch {process.pid}")

    def _environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)}
        if name in self.masters:
            return {**env, **nats_environment(self.nats_config_for("master"))}
        if name in self.gateway_ports:
            return {**env, **nats_environment(self.nats_config_for("gateway"))}
        env.update(nats_environment(self.nats_config_for("controller")))
        if self.trust is not None:
            # For the workers the controller launches: a credential for each, minted with a
            # key that can sign nothing but one worker's own permissions.
            env[envvars.WORKER_NATS_SIGNING_KEY] = self.trust.worker_signing_key.seed
            env[envvars.WORKER_NATS_ACCOUNT] = self.trust.account.public
        return env

    async def kill(self, name: str) -> None:
        """SIGKILL a service, as a node failure would (tests, chaos drills)."""
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

    async def restart(self, name: str) -> None:
        """Start a service that is not running (after `kill`)."""
        if self.processes[name].returncode is None:
            raise StackError(f"{name} is still running")
        await self._spawn(name)

    @contextlib.asynccontextmanager
    async def running(
        self, *, status: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None
    ) -> AsyncIterator[LocalStack]:
        """Started; each service restarted if it dies (`supervise`); stopped, in order, after.
        `status` shows what is going on meanwhile (a terminal's spinner)."""
        say = status or (lambda _: contextlib.nullcontext())
        supervisor: asyncio.Task[None] | None = None
        try:
            with say("starting the embedded stack"):
                await self.start()
            supervisor = asyncio.create_task(self.supervise(), name="stack-supervisor")
            yield self
        finally:
            if supervisor is not None:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor
            with say("stopping the embedded stack"):
                await self.stop()

    async def supervise(self) -> None:
        """Restart a service that exits, for as long as the stack runs. Runs until cancelled."""
        while not self._stopping:
            for name, process in list(self.processes.items()):
                if process.returncode is None or self._stopping or name in self.held:
                    continue
                count = self.restarts.get(name, 0)
                self.restarts[name] = count + 1
                delay = min(30.0, 0.5 * 2**count)
                log.warning(
                    "%s exited with code %s; restarting in %.1fs (see %s)",
                    name,
                    process.returncode,
                    delay,
                    self.logs / f"{name}.log",
                )
                await asyncio.sleep(delay)
                if not self._stopping:
                    await self._spawn(name)
            if not self.nats.running() and not self._stopping and "nats" not in self.held:
                log.warning("nats-server exited; restarting it")
                await self._start_nats()
            await asyncio.sleep(0.5)

    async def _wait_for_master(self) -> None:
        nc = await connect(self.nats_config, name="ebb-stack-probe")
        try:
            client = MasterClient(nc, self.nats_config, backoff=Backoff(first_s=0.05, max_s=0.5))
            await asyncio.wait_for(client.status(), self.config.start_timeout_s)
        except (TimeoutError, BusError, RemoteError) as e:
            raise StackError(
                f"the shard master did not start; see {self.logs / 'master.log'}"
            ) from e
        finally:
            with contextlib.suppress(Exception):
                await nc.drain()

    async def wait_for_gateway(self, name: str = "gateway") -> None:
        """Until the Batch API answers (after `start`, or a `restart("gateway")`)."""
        url = f"http://127.0.0.1:{self.gateway_ports[name]}/healthz"
        deadline = asyncio.get_running_loop().time() + self.config.start_timeout_s
        while not await asyncio.to_thread(_answers, url):
            process = self.processes[name]
            if process.returncode is not None or asyncio.get_running_loop().time() > deadline:
                raise StackError(
                    f"the Batch API gateway did not start; see {self.logs / f'{name}.log'}"
                )
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """In order: the gateway, the controller (it drains the workers), master, then NATS."""
        self._stopping = True
        for name in self.gateway_ports:
            await _terminate(self.processes.get(name), 15)
        await _terminate(self.processes.get("controller"), self.config.worker_grace_s + 15)
        for name in self.masters:
            await _terminate(self.processes.get(name), 15)
        await asyncio.to_thread(self.nats.stop)
        await self._stop_reaper()
        for f in self._log_files:
            f.close()
        self._log_files.clear()

    async def _stop_reaper(self) -> None:
        """Every process is stopped: the reaper has nothing left to do."""
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        if reaper.stdin is not None and reaper.returncode is None:
            with contextlib.suppress(ConnectionError):
                reaper.stdin.write(b"done\n")
                await reaper.stdin.drain()
            reaper.stdin.close()
        try:
            await asyncio.wait_for(reaper.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                reaper.kill()
            await reaper.wait()


_NOT_INHERITED = (envvars.NATS_NAME_PREFIX, envvars.WORKER_NATS_NAME_PREFIX, envvars.METRICS_PORT)
"""Credentials of whoever started the stack are never handed down to its services (nor one
metrics port to several processes)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own loopback URL
            return bool(response.status == 200)
    except OSError:
        return False


async def _terminate(process: asyncio.subprocess.Process | None, grace_s: float) -> None:
    if process is None or process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
