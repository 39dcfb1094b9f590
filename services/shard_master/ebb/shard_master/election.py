"""Leader election through a JetStream KV key with a bucket TTL.

The leader holds key `master` and refreshes it (compare-and-set) every third of the TTL. When a
leader dies its key ages out and a standby's `create` succeeds. A master that restarts under
the same id takes its own key back at once. The revision at which leadership was won is the
master's epoch: it is stamped into every lease token, and it only ever grows.

The key's value is the holder's id and a nonce of this process. A refresh whose reply was
lost (a NATS server killed under it, a stream moving its leader) may still have been written:
the retry then meets a revision it does not know, and the nonce tells our own write from a
rival's, or from a restarted process under our id, which must depose us.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from .errors import Deposed

log = logging.getLogger(__name__)

KEY = "master"


class Leadership:
    def __init__(self, kv: KeyValue, *, holder: str, ttl_s: float) -> None:
        self._kv = kv
        self.holder = holder
        self.ttl_s = ttl_s
        self.revision = 0
        self.value = f"{holder} {secrets.token_hex(8)}".encode()

    async def acquire(self) -> int:
        """Wait until we lead; returns the epoch."""
        value = self.value
        waiting_logged = False
        while True:
            try:
                self.revision = await self._kv.create(KEY, value)
                log.info("leading as %s (epoch %d)", self.holder, self.revision)
                return self.revision
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            try:
                entry = await self._kv.get(KEY)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue  # it just expired: try to create it again
            if _holder(entry.value) == self.holder and entry.revision is not None:
                try:
                    self.revision = await self._kv.update(KEY, value, last=entry.revision)
                    log.info("resumed leadership as %s (epoch %d)", self.holder, self.revision)
                    return self.revision
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
            if not waiting_logged:
                log.info("standing by: %s leads", _holder(entry.value) or "?")
                waiting_logged = True
            await asyncio.sleep(self.ttl_s / 3)

    async def keepalive(self) -> None:
        """Refresh the key for as long as we lead. Raises Deposed when we no longer do."""
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                self.revision = await self._kv.update(KEY, self.value, last=self.revision)
                last_ok = loop.time()
            except nats.js.errors.KeyWrongLastSequenceError as e:
                if not await self._wrote_it_ourselves():
                    raise Deposed("another master took the leader key") from e
                last_ok = loop.time()
            except (nats.errors.Error, TimeoutError) as e:
                # Past a full TTL without a refresh, a standby may lead already.
                if loop.time() - last_ok > self.ttl_s:
                    raise Deposed(f"could not refresh leadership for {self.ttl_s}s: {e}") from e
                log.warning("leader refresh failed (%s); retrying", e)

    async def _wrote_it_ourselves(self) -> bool:
        """Whether the key's current value is this process's own (a refresh that went through
        though its reply was lost); if so, carry on from its revision."""
        try:
            entry = await self._kv.get(KEY)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return False
        if entry.value != self.value or entry.revision is None:
            return False
        log.info("leader key at revision %d is our own refresh; carrying on", entry.revision)
        self.revision = entry.revision
        return True

    async def resign(self) -> None:
        """Hand over at once on a clean stop, instead of making a standby wait out the TTL."""
        try:
            await self._kv.delete(KEY, last=self.revision)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as e:
            log.debug("could not resign leadership: %s", e)


def _holder(value: bytes | None) -> str:
    """The holder's id in the key's value (`id nonce`; plain `id` as older masters wrote)."""
    return value.decode(errors="replace").split(" ", 1)[0] if value else ""
