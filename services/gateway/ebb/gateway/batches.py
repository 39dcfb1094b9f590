"""The reconcile loop: which batch is stepped when (the steps themselves: ebb.gateway.steps).

Level-triggered over an index of the batches not ended (`live.<owner>.<id>` in KV, written
before a batch's record and dropped when it ends), as the controller is over its workers:
each full pass reads the index, not every batch ever made, and makes every live batch due;
between passes a batch is due when it is poked (created, cancelled, or its job said
something). Each due batch's step runs as a task of its own, at most `max_steps` at once
and one per batch: a 200 MB file being validated holds its own batch, never another
tenant's submit, cancel or end. Any replica may take any step; steps are written
compare-and-set (ebb.gateway.steps), so two replicas never undo each other.

At start, a full read of every record puts any batch not ended that the index lacks into it
(records written before there was an index, or by a replica that died between the two
writes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

import nats.errors

from ebb.common.aio import wait_any
from ebb.common.data.storage import StoreError
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects

from . import metrics
from .config import GatewayConfig
from .records import ENDED, Records, RecordsUnavailable
from .steps import BatchSteps
from .store import FileStore

log = logging.getLogger(__name__)


MIN_PASS_S = 0.05
"""Between two passes at least (a burst of job events wakes the loop once)."""

MAX_STEPS = 8
"""Batches stepped at once by one replica (the rest wait their turn, in id order)."""

TMP_AGE_S = 3600.0
"""A file being written whose bytes have not changed for this long was left by a writer that
died: the first sweep removes it."""

ORPHAN_S = 60.0
"""An index entry whose batch record never appeared is dropped after this long (the replica
that wrote it died before the record)."""


class BatchRunner:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        records: Records,
        store: FileStore,
        master: MasterClient,
        nc: Any,
        nats: NatsConfig,
        poll_s: float = 5.0,
        sweep_s: float = 60.0,
        max_steps: int = MAX_STEPS,
    ) -> None:
        self.records = records
        self.store = store
        self.nc = nc
        self.nats = nats
        self.poll_s = poll_s
        self.sweep_s = sweep_s
        """Between sweeps of the files past their `expires_at`."""
        self.max_steps = max_steps
        self.steps = BatchSteps(
            config=config,
            records=records,
            store=store,
            master=master,
            nc=nc,
            nats=nats,
            poke=self.poke,
        )
        self.wake = asyncio.Event()
        """Set when a batch is due a step (`poke`) or a step ended: the loop looks at once."""
        self.active: dict[str, tuple[str, float]] = {}
        """The batches not ended, by id: their owner and when they were indexed (as the last
        pass read the index, and as created since): whose jobs' events concern the loop."""
        self.due: set[str] = set()
        """Batches to step as soon as a place is free."""
        self.stepping: dict[str, asyncio.Task[None]] = {}
        """The steps running now, by batch."""
        self.swept_hour: int | None = None
        """The hour (since the epoch) of the last sweep; None: none yet."""
        self.statuses: dict[str, str] = {}
        """The status of each batch not ended, as its last step read it (the metrics')."""

    def poke(self, owner: str, batch_id: str) -> None:
        """The batch was created or cancelled, or its job said something: step it now."""
        if batch_id not in self.active:
            self.active[batch_id] = (owner, time.time())
        self.due.add(batch_id)
        self.wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set: a full pass each `poll_s` (the level-triggered truth:
        whatever was missed, a replica's work, windows that ran out), the batches poked
        between them, and now and then a sweep of expired files."""
        # Every job's events: batches' jobs are their owners' (those of batches from before
        # jobs had owners have none).
        subjects = Subjects(self.nats.prefix).every_event
        subscriptions = [await self.nc.subscribe(s, cb=self._heard) for s in subjects]
        try:
            await self._passes(stop)
        finally:
            for events in subscriptions:
                with contextlib.suppress(nats.errors.Error):
                    await events.unsubscribe()
            await self._stop_steps()

    async def _heard(self, msg: Any) -> None:
        job = Subjects.event_job(msg.subject)
        found = self.active.get(job)
        if found is not None:
            self.poke(found[0], job)

    async def _passes(self, stop: asyncio.Event) -> None:
        swept_at = passed_at = -math.inf
        indexed = False
        while not stop.is_set():
            self.wake.clear()
            try:
                if not indexed:
                    await self.index_all()
                    indexed = True
                if time.monotonic() - passed_at >= self.poll_s:
                    passed_at = time.monotonic()
                    await self.reconcile()
                self._start_due()
                if time.monotonic() - swept_at >= self.sweep_s:
                    swept_at = time.monotonic()
                    await self.sweep()
            except (RecordsUnavailable, StoreError) as e:
                log.warning("cannot read the batches or files: %s; trying again", e)
            except Exception:
                # A pass over everyone's batches is no one batch's: log, and pass again.
                log.exception("a pass over the batches failed; trying again")
            left = self.poll_s - (time.monotonic() - passed_at)
            await wait_any([stop, self.wake], timeout_s=max(left, 0.0))
            await asyncio.sleep(MIN_PASS_S)  # events in a burst: one step for all of them

    async def index_all(self) -> None:
        """Every batch record read once: those not ended that the index lacks are put in."""
        indexed = {(b.owner, b.id) for b in await self.records.live()}
        for record, _ in await self.records.batches():
            if record.status not in ENDED and (record.owner, record.id) not in indexed:
                await self.records.add_live(record.owner, record.id)
                log.info("batch %s of %s indexed as live", record.id, record.owner)

    async def reconcile(self) -> None:
        """The full pass: the index read, every batch in it due."""
        live = await self.records.live()
        self.active = {b.id: (b.owner, b.since) for b in live}
        self.statuses = {k: v for k, v in self.statuses.items() if k in self.active}
        metrics.observe_batches(self.statuses.values())
        self.due |= set(self.active)

    def _start_due(self) -> None:
        """A task for each due batch not stepping already, while places are free."""
        for batch_id in sorted(self.due):
            if len(self.stepping) >= self.max_steps:
                return
            if batch_id in self.stepping:
                continue  # stays due: stepped again once this step ends
            self.due.discard(batch_id)
            found = self.active.get(batch_id)
            if found is None:
                continue
            task = asyncio.create_task(self._step(found[0], batch_id, found[1]), name=batch_id)
            self.stepping[batch_id] = task
            task.add_done_callback(self._stepped)

    def _stepped(self, task: asyncio.Task[None]) -> None:
        self.stepping.pop(task.get_name(), None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s: its step raised", task.get_name(), exc_info=task.exception())
        self.wake.set()  # a place is free: due batches may start

    async def _step(self, owner: str, batch_id: str, since: float) -> None:
        try:
            found = await self.records.get_batch(owner, batch_id)
            if found is None or found[0].status in ENDED:
                self.statuses.pop(batch_id, None)
                if found is not None or time.time() - since > ORPHAN_S:
                    # Ended (the drop at its end was lost), or never written.
                    self.active.pop(batch_id, None)
                    await self.records.drop_live(owner, batch_id)
                return
            self.statuses[batch_id] = found[0].status
            await self.steps.take(*found)
        except (RecordsUnavailable, StoreError) as e:
            log.warning("batch %s: %s; trying again", batch_id, e)

    async def _stop_steps(self) -> None:
        """Steps in flight cancelled, and waited for: each is safe to take again."""
        tasks = list(self.stepping.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def sweep(self) -> None:
        """Remove the files whose `expires_at` has passed: their records, then their bytes
        (a sweep cut short between the two leaves bytes no record names, never a record
        whose bytes are gone). The first sweep reads every file once (a file the expiry
        index lacks is put in it) and the whole index, and removes what a writer killed
        mid-file left; later ones read only the index's hours since the last sweep."""
        now = time.time()
        hour = int(now // 3600)
        if self.swept_hour is None:
            for kept in await self.records.files("*"):
                if kept.expires_at is not None:
                    await self.records.index_expiry(kept)
            entries = await self.records.expiring()
            left = await asyncio.to_thread(self.store.remove_temporaries, older_than_s=TMP_AGE_S)
            for path in left:
                log.info("removed %s, left by a writer that did not finish", path)
        else:
            entries = []
            for h in range(self.swept_hour, hour + 1):
                entries += await self.records.expiring(h)
        for entry in entries:
            if entry.hour > hour:
                continue
            record = await self.records.get_file(entry.owner, entry.id)
            if record is None or record.expires_at is None:
                await self.records.forget_expiry(entry)  # deleted, or its record never came
            elif record.expires_at <= now:
                await self.records.delete_file(record)
                await asyncio.to_thread(self.store.delete, record.path)
                log.info("file %s of %s expired: removed", record.id, record.owner)
        self.swept_hour = hour
