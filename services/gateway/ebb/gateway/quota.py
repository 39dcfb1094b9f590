"""A key's quotas held under concurrency and across replicas: reserve, then commit.

Each owner has one ledger record in KV (`ledger_<owner>`), changed only compare-and-set:
- `batches`: the ids of its batches taken against `max_active_batches`, each with when it
  was taken. A create takes a place before it writes its batch; a place whose batch has
  ended (or was never written, once `ORPHAN_S` has passed) is given back when the quota is
  full, so twenty creates at once against a quota of one make one batch, and a replica that
  died between the two writes holds a place only that long.
- `uploads`: bytes reserved by uploads streaming in, each until a deadline. An upload takes
  its room before the first byte is stored and gives it back once its file's record is
  written: N uploads at once share what is left, never each the whole of it.

Stored bytes are the owner's file records (uploads and results) plus its reservations, read
in that order against one ledger revision: whatever ends meanwhile (a file's record written,
then its reservation dropped) changes the ledger, and the reservation is tried again."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from .records import Conflict, Records

ORPHAN_S = 60.0
"""A place taken for a batch whose record never appeared is given back after this long (the
replica that took it died between the two writes)."""

RESERVATION_S = 3600.0
"""How long an upload's reservation holds at most (a replica that died mid-upload holds its
bytes this long)."""

ATTEMPTS = 20
"""Compare-and-set tries before the caller is told to ask again."""


class QuotaExceeded(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Busy(Exception):
    """The ledger kept changing under us: ask again."""


class Quotas:
    def __init__(self, records: Records) -> None:
        self.records = records

    async def take_batch_place(
        self,
        owner: str,
        batch_id: str,
        *,
        limit: int,
        still_active: Callable[[str], Awaitable[bool | None]],
    ) -> None:
        """Take a place for `batch_id`, or raise QuotaExceeded. `still_active(id)`: whether
        a batch holding a place has not ended (None: it has no record)."""
        for _ in range(ATTEMPTS):
            ledger, revision = await self.records.get_ledger(owner)
            places: dict[str, float] = dict(ledger.get("batches", {}))
            if len(places) >= limit:
                now = time.time()
                for held, taken_at in list(places.items()):
                    active = await still_active(held)
                    if active is False or (active is None and now - taken_at > ORPHAN_S):
                        del places[held]
            if len(places) >= limit:
                raise QuotaExceeded(
                    f"Key's quota of {limit} batches at once is reached: wait for one to end."
                )
            places[batch_id] = time.time()
            try:
                await self.records.put_ledger(owner, {**ledger, "batches": places}, last=revision)
            except Conflict:
                continue
            return
        raise Busy(f"{owner}'s quota ledger keeps changing")

    async def give_back_batch_place(self, owner: str, batch_id: str) -> None:
        await self._change(owner, lambda ledger: _without(ledger, "batches", batch_id))

    async def reserve_bytes(
        self, owner: str, token: str, *, limit: int, want: int, stored: Callable[[], Awaitable[int]]
    ) -> int:
        """Reserve up to `want` bytes of the owner's `limit` for upload `token`: how many were
        reserved (> 0), or QuotaExceeded. `stored()`: the bytes the owner's files hold."""
        for _ in range(ATTEMPTS):
            ledger, revision = await self.records.get_ledger(owner)
            now = time.time()
            uploads = {t: r for t, r in dict(ledger.get("uploads", {})).items() if r["until"] > now}
            room = limit - await stored() - sum(int(r["bytes"]) for r in uploads.values())
            if room <= 0:
                raise QuotaExceeded(
                    f"Key's quota of {limit} stored bytes is used up (uploads in flight "
                    "counted): delete files first."
                )
            granted = min(room, want)
            uploads[token] = {"bytes": granted, "until": now + RESERVATION_S}
            try:
                await self.records.put_ledger(owner, {**ledger, "uploads": uploads}, last=revision)
            except Conflict:
                continue
            return granted
        raise Busy(f"{owner}'s quota ledger keeps changing")

    async def release_bytes(self, owner: str, token: str) -> None:
        """The upload ended (its file's record written, or it failed): its room is free."""
        await self._change(owner, lambda ledger: _without(ledger, "uploads", token))

    async def _change(
        self, owner: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> None:
        for _ in range(ATTEMPTS):
            ledger, revision = await self.records.get_ledger(owner)
            changed = change(ledger)
            if changed is None:
                return
            try:
                await self.records.put_ledger(owner, changed, last=revision)
            except Conflict:
                continue
            return
        raise Busy(f"{owner}'s quota ledger keeps changing")


def _without(ledger: dict[str, Any], part: str, key: str) -> dict[str, Any] | None:
    held = dict(ledger.get(part, {}))
    if key not in held:
        return None
    del held[key]
    return {**ledger, part: held}
