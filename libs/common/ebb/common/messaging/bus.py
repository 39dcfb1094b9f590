"""NATS: connection with reconnect and backoff, subject names, JetStream set-up, typed requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.client import RawCredentials

from .. import schema
from ..aio import until
from ..errors import BusError, ErrorCode, RemoteError, SchemaError
from ..schema import Message
from .auth import inbox_for_user, team_inbox
from .identity import credentials_name, credentials_team
from .messages import ErrorReply
from .natsconfig import NatsConfig

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """A retry schedule: capped exponential delays with full jitter."""

    first_s: float = 0.1
    """Delay before the second try."""
    max_s: float = 5.0
    """Longest delay between two tries."""
    factor: float = 2.0
    attempts: int = 0
    """Tries in all; 0: unbounded."""

    def delays(self) -> list[float] | None:
        return None if self.attempts == 0 else [self.delay(i) for i in range(self.attempts - 1)]

    def delay(self, attempt: int) -> float:
        """Delay after the `attempt`-th failure (0-based), with jitter in [50%, 100%]."""
        ceiling = min(self.max_s, self.first_s * self.factor ** min(attempt, 32))
        return ceiling * (0.5 + random.random() / 2)  # noqa: S311 - jitter, not crypto


_FIRST_CONNECT_WARN_EVERY_S = 5.0


class ConnectAborted(BusError):
    """Asked to stop while still waiting for the first connection to NATS."""


async def connect(config: NatsConfig, *, name: str, stop: asyncio.Event | None = None) -> NATS:
    """Connect; until the first connection, retry (nats-py does, every half second) for up to
    `first_connect_timeout_s`, saying why at WARNING every few seconds; later drops reconnect
    forever. Credentials the server refuses fail at once: waiting will not change a wrong
    password. `stop` set before the first connection ends the wait (ConnectAborted): a
    service told to stop while NATS is away stops, rather than wait for NATS first."""

    connected: list[NATS] = []
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[Exception] = loop.create_future()
    warned_at = [-math.inf]

    def closing() -> bool:
        return bool(connected) and (connected[0].is_closed or connected[0].is_draining)

    async def on_error(e: Exception) -> None:
        if not connected and _refused(e):
            if not refused.done():
                refused.set_result(e)
            return
        if not connected and isinstance(e, OSError | TimeoutError):
            # The first connection, still failing: say so, with where and why, now and then.
            if loop.time() - warned_at[0] >= _FIRST_CONNECT_WARN_EVERY_S:
                warned_at[0] = loop.time()
                log.warning("%s cannot reach NATS at %s (%s); retrying", name, config.url, e)
            return
        log.log(logging.DEBUG if closing() else logging.WARNING, "nats error (%s): %s", name, e)

    async def on_disconnect() -> None:
        quiet = closing() or not connected  # not yet connected: a failed first attempt
        log.log(logging.DEBUG if quiet else logging.WARNING, "nats disconnected (%s)", name)

    async def on_reconnect() -> None:
        log.info("nats reconnected (%s)", name)

    options: dict[str, Any] = {
        "servers": config.servers,
        "name": name,
        "connect_timeout": config.connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
    if config.user is not None:
        options["user"] = config.user
        options["password"] = config.password
    # Ebb's roles and teams may subscribe only to their own inboxes (ebb.common.messaging.auth).
    team = connection_owner(config)
    user = config.user or _credentials_user(config)
    inbox = inbox_for_user(config.prefix, user) if user else None
    if team:
        inbox = team_inbox(config.prefix, team)
    if inbox is not None:
        options["inbox_prefix"] = inbox
    if config.inbox_prefix is not None:
        options["inbox_prefix"] = config.inbox_prefix
    if config.token is not None:
        options["token"] = config.token
    if config.creds_file is not None:
        options["user_credentials"] = config.creds_file
    if config.creds is not None:
        options["user_credentials"] = RawCredentials(config.creds)
    if config.tls_ca or config.tls_cert:
        import ssl

        context = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert:
            context.load_cert_chain(config.tls_cert, config.tls_key)
        options["tls"] = context

    nc = NATS()
    connecting = asyncio.ensure_future(nc.connect(**options))
    log.debug("connecting to NATS at %s as %s", config.url, name)
    try:
        # Connected, refused, or no answer in time; or a stop (a `stop` of None never comes).
        answers: list[asyncio.Future[Any]] = [connecting, refused]
        answered = asyncio.wait(
            answers,
            timeout=config.first_connect_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        await until(answered, stop if stop is not None else asyncio.Event())
    finally:
        if not connecting.done():
            connecting.cancel()
            await asyncio.wait([connecting])
            with contextlib.suppress(Exception):
                await nc.close()
    if stop is not None and stop.is_set() and not connected:
        with contextlib.suppress(Exception):
            await nc.close()
        raise ConnectAborted(f"{name}: asked to stop before NATS at {config.url} answered")
    if refused.done():
        who = f"user {config.user!r}" if config.user else "these credentials"
        raise BusError(f"NATS at {config.url} refused {who}: {refused.result()}")
    if not connecting.done() or connecting.cancelled():
        raise BusError(
            f"cannot connect to NATS at {config.url} "
            f"(no answer in {config.first_connect_timeout_s:g}s)"
        )
    try:
        connecting.result()
    except (OSError, nats.errors.Error, TimeoutError) as e:
        raise BusError(f"cannot connect to NATS at {config.url}: {e}") from e
    connected.append(nc)
    return nc


def _credentials_text(config: NatsConfig) -> str | None:
    """This connection's .creds text, if it has one that can be read."""
    if config.creds is not None or config.creds_file is None:
        return config.creds
    try:
        return Path(config.creds_file).read_text()
    except OSError:
        return None  # nats-py says why, when it reads the file to connect


def _credentials_user(config: NatsConfig) -> str | None:
    """The user name the JWT of this connection's credentials gives, if it has one."""
    creds = _credentials_text(config)
    return credentials_name(creds) if creds else None


def connection_owner(config: NatsConfig) -> str:
    """The team a connection with `config` is (its credential a team's, `TeamSigner`), whose
    subjects its submissions and requests must use; "" for any other identity (the admin's
    client role, a service, no credential at all)."""
    creds = _credentials_text(config)
    return (credentials_team(creds) or "") if creds else ""


def _refused(e: BaseException) -> bool:
    if isinstance(e, nats.errors.AuthorizationError):
        return True
    # At the first connect nats-py raises the server's -ERR as a plain Error.
    return isinstance(e, nats.errors.Error) and "authorization violation" in str(e).lower()


_RETRYABLE = (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError)


async def request(
    nc: NATS,
    subject: str,
    message: Message,
    reply_type: type[M],
    *,
    timeout_s: float,
    backoff: Backoff | None = None,
) -> M:
    """Send a request and validate its reply as `reply_type`.

    Timeouts and "no responders" (the master restarting, say) are retried on `backoff`;
    without one, the first failure raises BusError. An error reply raises RemoteError.
    """
    payload = schema.encode(message)
    attempt = 0
    while True:
        try:
            reply = await nc.request(subject, payload, timeout=timeout_s)
            break
        except _RETRYABLE as e:
            if backoff is None or (backoff.attempts and attempt + 1 >= backoff.attempts):
                raise BusError(f"no reply on {subject}: {type(e).__name__}") from e
            await asyncio.sleep(backoff.delay(attempt))
            attempt += 1
    return parse_reply(reply.data, reply_type)


def parse_reply(data: bytes, reply_type: type[M]) -> M:
    try:
        body = schema.unpack(data)
        schema.check_version(body)
        if body.get("ok") is False:
            err = schema.load(ErrorReply, body, strict=False)
            raise RemoteError(err.code, err.message)
        return schema.load(reply_type, body, strict=False)
    except SchemaError as e:
        raise RemoteError(ErrorCode.BAD_REPLY, f"malformed reply: {e}") from e


def error_reply(code: ErrorCode, message: str) -> bytes:
    return schema.encode(ErrorReply(code=code, message=message))


Handler = Callable[[bytes, str], Awaitable[bytes]]
"""Answers a request: (payload, the subject it came on) -> reply payload."""


class RequestServer:
    """Serves request/reply subjects (wildcards too): one handler per subject, up to
    `concurrency` at a time.

    A handler that raises gets an `internal` error reply: a bug in one request never takes the
    service down, and the requester learns why it failed. Handlers run as tasks this object
    owns; `close` unsubscribes, lets running handlers finish for `grace_s`, then cancels them.
    """

    def __init__(self, nc: NATS, *, queue: str, concurrency: int = 64) -> None:
        self._nc = nc
        self._queue = queue
        self._slots = asyncio.Semaphore(concurrency)
        self._subscriptions: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def add(self, subject: str, handler: Handler) -> None:
        async def on_message(msg: Any) -> None:
            # Waiting for a slot here holds this subscription's delivery loop, which is the
            # back-pressure we want: NATS buffers (and eventually drops) rather than us.
            await self._slots.acquire()
            task = asyncio.create_task(self._answer(subject, handler, msg))
            self._tasks.add(task)
            task.add_done_callback(self._done)

        self._subscriptions.append(
            await self._nc.subscribe(subject, queue=self._queue, cb=on_message)
        )

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _answer(self, subject: str, handler: Handler, msg: Any) -> None:
        try:
            answer = await handler(msg.data, msg.subject)
        except Exception as e:
            log.exception("handler for %s failed", subject)
            answer = error_reply(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        limit = self._nc.max_payload
        if len(answer) > limit:
            # NATS would refuse to carry it and the requester would only see a timeout, and
            # retry, forever: tell it instead, so that it can ask for less.
            reason = f"reply of {len(answer)} bytes exceeds the server's max payload of {limit}"
            log.error("cannot answer on %s: %s", subject, reason)
            answer = error_reply(ErrorCode.TOO_LARGE, reason)
        if msg.reply:
            try:
                await msg.respond(answer)
            except nats.errors.Error as e:
                log.warning("could not reply on %s: %s", subject, e)

    async def close(self, *, grace_s: float = 5.0) -> None:
        for sub in self._subscriptions:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as e:
                log.debug("unsubscribe failed: %s", e)
        self._subscriptions.clear()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
