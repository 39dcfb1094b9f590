"""What a worker tells the master when a shard's attempt ends: its commit, or its release.

Both are bounded by what must not be lost: a commit is reported until the master takes it
(its record already decides the shard's output), a release is tried once within a timeout and
shielded from the cancellation that may have caused it (an unconfirmed one lets the lease run
out, which costs the shard nothing more).
"""

from __future__ import annotations

import asyncio
import logging

from ebb.common.data.layout import CommitRecord
from ebb.common.errors import BusError, RemoteError
from ebb.common.messaging.api import MasterClient

from .leases import ActiveLease

log = logging.getLogger(__name__)


class Reports:
    def __init__(self, *, worker: str, timeout_s: float) -> None:
        self.worker = worker
        self.timeout_s = timeout_s
        """How long a release waits for the master's answer."""

    async def commit(self, master: MasterClient, active: ActiveLease, record: CommitRecord) -> None:
        """Report the commit record to the master, retrying through master restarts and
        store hiccups. The record already decides the shard's output; this only tells."""
        active.mark_committed()
        attempt = 0
        while True:
            try:
                reply = await master.commit(
                    active.token,
                    worker=self.worker,
                    rows=record.rows,
                    error_rows=record.error_rows,
                )
                break
            except RemoteError as e:
                if e.lease_lost:
                    # The record stands: whoever holds the shard now will find and report it.
                    log.info("shard %d: commit refused (%s)", active.shard.index, e)
                    return
                if not e.retryable:
                    raise
                delay = master.backoff.delay(attempt)
                log.warning(
                    "shard %d: commit not taken (%s); retrying in %.1fs",
                    active.shard.index,
                    e,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)
        log.info(
            "shard %d attempt %d %s: %d rows, %d errors",
            active.shard.index,
            active.attempt,
            reply.status,
            record.rows,
            record.error_rows,
        )

    async def release(
        self,
        master: MasterClient,
        active: ActiveLease,
        reason: str,
        *,
        retryable: bool,
        mistake: bool = False,
    ) -> None:
        """Hand the lease's shard back (`retryable`: at no cost to it; `mistake`: and the job
        fails, for a mistake every row repeats)."""
        active.release()
        await self.release_token(
            master,
            active.token,
            active.shard.index,
            reason=reason,
            retryable=retryable,
            mistake=mistake,
        )

    async def release_token(
        self,
        master: MasterClient,
        token: str,
        shard: int,
        *,
        reason: str,
        retryable: bool,
        mistake: bool = False,
    ) -> None:
        """Hand a shard back. Shielded and bounded: it must happen even while we are being
        cancelled, and must not hold up a shutdown if the master is unreachable."""

        async def release() -> None:
            try:
                await asyncio.wait_for(
                    master.release(
                        token, reason, worker=self.worker, retryable=retryable, mistake=mistake
                    ),
                    self.timeout_s,
                )
            except (RemoteError, BusError, TimeoutError) as e:
                log.info("release of shard %d not confirmed (%s); its lease will expire", shard, e)

        await asyncio.shield(release())
