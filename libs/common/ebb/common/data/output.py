"""The output layout and its exactly-once commit protocol (DESIGN section 5).

    <out>/data/shard=S/attempt=A/part-00000.parquet   written by one attempt of shard S
    <out>/_commits/shard=S.json                       created EXCLUSIVELY by the attempt that wins
    <out>/_manifest.json                              written by the master when the job succeeds

A data file is complete before it is visible (local: temp file, fsync, rename; object stores:
one PUT, or a multipart upload that becomes visible only once completed), and its size is
checked in the store before any commit record names it. The commit record is created
exclusively (local: temp file, fsync, `os.link`, which fails if the name exists; object stores:
fsspec `pipe_file(mode="create")`, which s3fs sends as a conditional PUT, `If-None-Match: *`).
Whoever creates it decides which attempt's files are the shard's output; every other attempt's
folder is garbage. Readers read only what `_manifest.json` lists.

Every store operation is retried as `storage.retrying` classifies its errors; a retried
exclusive create that finds a record naming this very attempt (the first try went through, its
answer was lost) counts as created.

    <out>/_job.json                                   the job that owns the root (OutputOwner)
    <out>/_claims/generation=N.json                   created EXCLUSIVELY by its N-th new owner

A root belongs to the job that first created `_job.json`. A job that ends having committed
nothing lets go of it (`release`): the next job that names the root takes it over, and of
several trying at once only the one that creates `_claims/generation=N.json` does. What a job
in tiers committed in a tier before the last (`<out>/_tiers/<tier>/_commits/`) is committed
work of the root as much as its output is: the root is not let go while any is there.

Over 400 lines: one store's protocol (files, commit records, ownership, manifest) over one
fsspec filesystem; ownership is the part that would go, with `ebb.common`'s folders.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import secrets
import time
from dataclasses import replace
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .. import schema
from ..job import fields_digest
from .durable import FULL_DISK_WAIT_S, fsync_dir, unlink_quietly, write_new
from .layout import (
    COMMITS_DIR,
    DATA_DIR,
    MANIFEST,
    METRICS,
    OWNER,
    TIERS_DIR,
    CommitRecord,
    Manifest,
    OutputFile,
    OutputOwner,
    claim_path,
    commit_path,
)
from .storage import retrying

log = logging.getLogger(__name__)


def _json(value: Any) -> bytes:
    return json.dumps(schema.dump(value), indent=1, sort_keys=True).encode()


class OutputStore:
    """One job's output root, on the local disk or any fsspec filesystem."""

    def __init__(self, uri: str, *, full_disk_wait_s: float = FULL_DISK_WAIT_S) -> None:
        self.full_disk_wait_s = full_disk_wait_s
        """A local write that finds the disk full waits this long for room before it fails."""
        self.uri = uri.rstrip("/")
        fs, root = fsspec.core.url_to_fs(self.uri)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)

    def full(self, relpath: str) -> str:
        return posixpath.join(self.root, relpath)

    def url(self, relpath: str) -> str:
        """A URI for `relpath` that a user (or fsspec) can open."""
        return f"{self.uri}/{relpath}"

    # -- writing data ----------------------------------------------------------------------

    def write_file(self, relpath: str, data: bytes) -> None:
        """Write `data` so that the file is either absent or complete, never partial."""
        path = self.full(relpath)
        if not self.local:
            retrying(f"write {self.url(relpath)}", lambda: self.fs.pipe_file(path, data))
            # Complete before a commit record may name it: the store holds all of it.
            size = retrying(f"stat {self.url(relpath)}", lambda: self._size(path))
            if size != len(data):
                raise OSError(
                    f"{self.url(relpath)} holds {size} bytes, not the {len(data)} written"
                )
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        write_new(tmp, data, wait_s=self.full_disk_wait_s)
        try:
            os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        fsync_dir(os.path.dirname(path))

    # -- who owns the root -----------------------------------------------------------------

    def claim(self, job: str, *, fields: dict[str, Any]) -> tuple[OutputOwner, str]:
        """Make `job` the owner of this output root, unless another job holds it.

        Returns (the owner, the job it took the root over from): (`job`'s record, "") for a
        new root or `job`'s own; (`job`'s new record, the earlier owner) when that owner had
        let go; (the other job's record, "") when another job holds the root. `fields`
        (JobSpec.output_fields) are kept in a new record: a job that carries on in its own
        root is compared with them by the caller.
        """
        ours = OutputOwner(
            job=job,
            claimed_at=time.time(),
            output_fields=fields,
            output_digest=fields_digest(fields),
        )
        if self._create_exclusive(self.full(OWNER), _json(ours)):
            return ours, ""
        current = self.owner_record()
        if current is None:  # pragma: no cover - an owner record is never deleted
            raise OSError(f"{self.url(OWNER)} vanished after a conflicting create")
        if not current.released:
            return current, ""
        taken = self._take_over(current, ours)
        return taken, current.job if taken.job == job != current.job else ""

    def reclaim(self, job: str) -> OutputOwner | None:
        """`job` runs again in the root it owns, or owned (a resume): it holds it again if it
        had let go and nobody took it since, and its record no longer says how it ended.
        Returns the owner: `job`'s record, whoever's now, or None if the root has none."""
        current = self.owner_record()
        if current is None or current.job != job:
            return current
        if current.released:
            return self._take_over(current, replace(current, claimed_at=time.time()))
        return self._runs_again(current) if current.state else current

    def _runs_again(self, current: OutputOwner) -> OutputOwner:
        """The owner's record, no longer saying how it ended (it runs again)."""
        running = replace(current, state="", shards_done=0, shards_total=0, rows_done=0)
        self.write_file(OWNER, _json(running))
        return running

    def _take_over(self, released: OutputOwner, ours: OutputOwner) -> OutputOwner:
        """The root, from an owner that let go, for `ours` if nothing is committed in it and
        no one took it first. Returns whoever owns it then."""
        straggler = self.first_commit()
        if straggler is not None and straggler.job != ours.job:
            # Committed after its job let go (a worker that had not heard the job ended): the
            # root holds output after all, and it is that job's.
            return replace(released, released=False)
        new = replace(
            ours,
            generation=released.generation + 1,
            took_over_from=released.job if released.job != ours.job else ours.took_over_from,
            state="",
            released=False,
            shards_done=0,
            shards_total=0,
            rows_done=0,
        )
        if not self._create_exclusive(self.full(claim_path(new.generation)), _json(new)):
            return self.owner_record() or released  # another job took it over first
        # `_job.json` is only where readers look first: the claim is the file just created
        # (owner_record follows the generations), so a crash before this write loses nothing.
        self.write_file(OWNER, _json(new))
        return new

    def replace_output(
        self, owner: OutputOwner, job: str, *, fields: dict[str, Any]
    ) -> OutputOwner:
        """The root, for `job`, from `owner`, a job that ended (FAILED or CANCELLED: the caller
        knows) with output in it, which is removed. Returns whoever owns the root then: `job`,
        or another job that took it first (of several replacing at once, the one that creates
        the next generation's claim does).

        The claim comes first and says it is `removing`: from then on the root is `job`'s, and
        a crash before the removal ends leaves a record that has whoever claims it next (`job`
        again) finish it (`finish_removing`) before a shard of `job` runs."""
        new = OutputOwner(
            job=job,
            claimed_at=time.time(),
            output_fields=fields,
            output_digest=fields_digest(fields),
            generation=owner.generation + 1,
            took_over_from=owner.job,
            replaced=True,
            removing=True,
        )
        if not self._create_exclusive(self.full(claim_path(new.generation)), _json(new)):
            return self.owner_record() or owner
        return self.finish_removing(new)

    def finish_removing(self, owner: OutputOwner) -> OutputOwner:
        """Remove what the job `owner` replaced (commit records, data, the tiers' work, the
        manifest and metrics), then say in `_job.json` that it is gone. Only for a job none of
        whose shards ran yet: everything in those folders is the replaced job's."""
        for relpath in (MANIFEST, METRICS, COMMITS_DIR, TIERS_DIR, DATA_DIR):
            self.remove(relpath)
        done = replace(owner, removing=False)
        self.write_file(OWNER, _json(done))
        return done

    def record_end(
        self, job: str, *, state: str, shards_done: int, shards_total: int, rows_done: int
    ) -> OutputOwner | None:
        """Say in the owner record how `job` ended; a job that ended with nothing committed
        (no commit record in the root, whatever the job's own records say) lets go of the
        root. None if `job` does not own the root."""
        current = self.owner_record()
        if current is None or current.job != job or current.released:
            return None
        ended = replace(
            current,
            state=state,
            shards_done=shards_done,
            shards_total=shards_total,
            rows_done=rows_done,
            released=state != "SUCCEEDED" and self.first_commit() is None,
        )
        self.write_file(OWNER, _json(ended))
        return ended

    def owner(self) -> str:
        """The id of the job this output root belongs to; "" if none claimed it yet."""
        record = self.owner_record()
        return record.job if record is not None else ""

    def owner_record(self) -> OutputOwner | None:
        """The root's owner record; None if no job claimed the root yet."""
        record = self._read_owner(OWNER)
        while record is not None:
            newer = self._read_owner(claim_path(record.generation + 1))
            if newer is None:
                return record
            record = newer
        return None

    def _read_owner(self, relpath: str) -> OutputOwner | None:
        try:
            raw = json.loads(self._cat(self.full(relpath)))
        except FileNotFoundError:
            return None
        return schema.load(OutputOwner, raw, strict=False)

    def committed_shards(self) -> int:
        """How many commit records the root holds, its tiers' included (a listing: no
        record is read)."""
        count = 0
        for folder in self._commit_folders():
            try:
                names = self._ls(folder)
            except FileNotFoundError:
                continue
            count += sum(1 for name in names if name.endswith(".json"))
        return count

    def _commit_folders(self) -> list[str]:
        """Where commit records are: the root's `_commits`, then each tier's under `_tiers`."""
        folders = [self.full(COMMITS_DIR)]
        try:
            tiers = sorted(self._ls(self.full(TIERS_DIR)))
        except FileNotFoundError:
            return folders
        return folders + [posixpath.join(tier, COMMITS_DIR) for tier in tiers]

    def _size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.info(path)["size"])

    def _cat(self, path: str) -> bytes:
        data: bytes = retrying(
            f"read {self.fs.unstrip_protocol(path)}", lambda: self.fs.cat_file(path)
        )
        return data

    # -- commit records --------------------------------------------------------------------

    def create_commit(self, record: CommitRecord) -> tuple[bool, CommitRecord]:
        """Create the shard's commit record if none exists.

        Returns (True, record) if this call created it, else (False, the existing record):
        another attempt won and its files are the shard's output.
        """
        path = self.full(commit_path(record.shard))
        if self._create_exclusive(path, _json(record)):
            return True, record
        existing = self.read_commit(record.shard)
        if existing is None:  # pragma: no cover - a commit record is never deleted
            raise RuntimeError(f"commit record {path} vanished after a conflicting create")
        ours = (existing.job, existing.attempt, existing.worker) == (
            record.job,
            record.attempt,
            record.worker,
        )
        return ours, existing

    def _create_exclusive(self, path: str, data: bytes | str) -> bool:
        """Create a complete file at `path` unless one exists. True if this call created it."""
        raw = data.encode() if isinstance(data, str) else data
        if self.local:
            return self._link_exclusive(path, raw)
        try:
            retrying(
                f"create {self.fs.unstrip_protocol(path)}",
                lambda: self.fs.pipe_file(path, raw, mode="create"),
            )
        except FileExistsError:
            return False
        return True

    def _link_exclusive(self, path: str, data: bytes) -> bool:
        directory = os.path.dirname(path)
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        write_new(tmp, data, wait_s=self.full_disk_wait_s)
        try:
            try:
                # link(2) fails with EEXIST if the name exists: atomic, exclusive creation
                # of a file whose content was complete and durable before it got its name.
                os.link(tmp, path)
            except FileExistsError:
                return False
            fsync_dir(directory)
            return True
        finally:
            unlink_quietly(tmp)

    def read_commit(self, shard: int) -> CommitRecord | None:
        path = self.full(commit_path(shard))
        try:
            raw = self._cat(path)
        except FileNotFoundError:
            return None
        return schema.load(CommitRecord, json.loads(raw), strict=False)

    def commits(self) -> list[CommitRecord]:
        """The root's commit records (its tiers' not), by shard: the output's every file, each
        row in exactly one of them."""
        try:
            names = sorted(self._ls(self.full(COMMITS_DIR)))
        except FileNotFoundError:
            return []
        return [
            schema.load(CommitRecord, json.loads(self._cat(name)), strict=False)
            for name in names
            if name.endswith(".json")
        ]

    def first_commit(self) -> CommitRecord | None:
        """Any one commit record under this root, a tier's included (to tell whose work the
        root holds)."""
        for folder in self._commit_folders():
            try:
                names = sorted(self._ls(folder))
            except FileNotFoundError:
                continue
            for name in names:
                if name.endswith(".json"):
                    return schema.load(CommitRecord, json.loads(self._cat(name)), strict=False)
        return None

    def remove(self, relpath: str) -> bool:
        """Remove a file or a folder (with what it holds). False if there was none."""
        path = self.full(relpath)
        try:
            self._rm(path)
        except FileNotFoundError:
            return False
        return True

    def _rm(self, path: str) -> None:
        retrying(
            f"remove {self.fs.unstrip_protocol(path)}", lambda: self.fs.rm(path, recursive=True)
        )

    def _ls(self, path: str) -> list[str]:
        def listing() -> list[str]:
            self.fs.invalidate_cache(path)
            return list(self.fs.ls(path, detail=False))

        return retrying(f"list {self.fs.unstrip_protocol(path)}", listing)

    # -- the manifest and garbage ----------------------------------------------------------

    def write_metrics(self, job: str, values: dict[str, Any], specs: dict[str, Any]) -> None:
        """The job's metrics beside its manifest: their values and what each is."""
        body = {"job": job, "metrics": values, "specs": specs}
        self.write_file(METRICS, json.dumps(body, indent=1, sort_keys=True).encode())

    def write_manifest(self, manifest: Manifest) -> None:
        self.write_file(MANIFEST, _json(manifest))

    def read_manifest(self) -> Manifest | None:
        try:
            raw = self._cat(self.full(MANIFEST))
        except FileNotFoundError:
            return None
        return schema.load(Manifest, json.loads(raw), strict=False)

    def remove_uncommitted(self, winners: dict[int, int]) -> int:
        """Delete attempt folders that are not their shard's winner. Returns folders removed.

        Only call once no lease of the job can still be writing (the job has ended).
        """
        removed = 0
        base = self.full(DATA_DIR)
        try:
            shard_dirs = self._ls(base)
        except FileNotFoundError:
            return 0
        for sd in shard_dirs:
            name = posixpath.basename(sd.rstrip("/"))
            if not name.startswith("shard="):
                continue
            try:
                shard = int(name.removeprefix("shard="))
            except ValueError:
                continue
            for ad in self._ls(sd):
                attempt_name = posixpath.basename(ad.rstrip("/"))
                if not attempt_name.startswith("attempt="):
                    continue
                try:
                    attempt = int(attempt_name.removeprefix("attempt="))
                except ValueError:
                    continue
                if winners.get(shard) != attempt:
                    self._rm(ad)
                    removed += 1
        return removed


def new_commit(
    *,
    job: str,
    shard: int,
    attempt: int,
    files: list[OutputFile],
    worker: str,
    split_at: int = 0,
    metrics: dict[str, dict[str, Any]] | None = None,
    generation: dict[str, dict[str, Any]] | None = None,
    row_errors: dict[str, int] | None = None,
) -> CommitRecord:
    """A commit record of now. `split_at`: the rows of a part (0: the whole shard);
    `metrics`: the partials of the job's metrics over its rows; `generation`: what its `llm`
    stages generated with; `row_errors`: its most common row errors (`most_common_errors`)."""
    return CommitRecord(
        job=job,
        shard=shard,
        attempt=attempt,
        files=files,
        worker=worker,
        committed_at=time.time(),
        split_at=split_at,
        metrics=metrics or {},
        generation=generation or {},
        row_errors=row_errors or {},
    )
