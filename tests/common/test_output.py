"""The commit protocol: one winner per shard, complete files, a manifest of winners only."""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ebb.common.data.durable import waiting_for_room
from ebb.common.data.layout import ERROR_CHARS, OWNER, OutputFile, attempt_dir, most_common_errors
from ebb.common.data.output import OutputStore, new_commit


def _record(shard: int, attempt: int) -> object:
    files = [OutputFile(path=f"{attempt_dir(shard, attempt)}/part-00000.parquet", rows=5)]
    return new_commit(job="j", shard=shard, attempt=attempt, files=files, worker=f"w{attempt}")


@pytest.mark.parametrize("uri", ["local", "memory://ebb-test-commits"])
def test_exactly_one_attempt_wins_a_race(tmp_path: Path, uri: str) -> None:
    store = OutputStore(str(tmp_path / "out") if uri == "local" else uri)
    results: list[tuple[bool, int]] = []
    barrier = threading.Barrier(8)

    def attempt(n: int) -> None:
        barrier.wait()
        won, record = store.create_commit(_record(0, n))  # type: ignore[arg-type]
        results.append((won, record.attempt))

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [a for won, a in results if won]
    if uri == "local":  # link(2) is atomic; memory:// is a single-process stand-in
        assert len(winners) == 1
        assert {a for _, a in results} == set(winners)
    stored = store.read_commit(0)
    assert stored is not None and stored.rows == 5


def test_write_file_leaves_no_partial_or_temp_file(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path))
    store.write_file("data/shard=00000/attempt=1/part-00000.parquet", b"x" * 1000)
    files = sorted(p.name for p in (tmp_path / "data/shard=00000/attempt=1").iterdir())
    assert files == ["part-00000.parquet"]


def test_garbage_collection_keeps_only_winners(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path))
    for shard, attempt in [(0, 1), (0, 2), (1, 1), (2, 3)]:
        store.write_file(f"{attempt_dir(shard, attempt)}/part-00000.parquet", b"x")
    removed = store.remove_uncommitted({0: 2, 1: 1, 2: 3})
    assert removed == 1
    assert not (tmp_path / attempt_dir(0, 1)).exists()
    assert (tmp_path / attempt_dir(0, 2)).exists()


def test_a_write_that_finds_the_disk_full_waits_for_room_then_gives_up() -> None:
    attempts: list[int] = []
    slept: list[float] = []

    def write() -> None:
        attempts.append(1)
        if len(attempts) <= 3:
            raise OSError(errno.ENOSPC, "No space left on device")

    waiting_for_room("write x", write, wait_s=60, sleep=slept.append)
    assert len(attempts) == 4 and slept == [0.1, 0.2, 0.4]
    with pytest.raises(OSError) as full:  # full for good: fails with the system's words
        waiting_for_room(
            "write x",
            lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")),
            wait_s=0.0,
        )
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(PermissionError):  # any other error is not waited out
        waiting_for_room("write x", lambda: (_ for _ in ()).throw(PermissionError()), wait_s=60)


def test_a_shards_files_are_written_once_a_full_disk_has_room_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs of its own needs root: {mounted.stderr.decode().strip()}")
    try:
        ballast = disk / "ballast"
        with open(ballast, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        store = OutputStore(str(disk / "out"), full_disk_wait_s=60)
        data = b"x" * 200_000
        writing = threading.Thread(target=store.write_file, args=("data/part-0.bin", data))
        writing.start()
        deadline = time.monotonic() + 30
        while "waiting for room" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)  # until the write has found no room
        assert "No space left on device" in caplog.text
        assert writing.is_alive()  # waiting, not failed
        ballast.unlink()  # room again
        writing.join(timeout=30)
        assert not writing.is_alive()
        assert (disk / "out" / "data" / "part-0.bin").read_bytes() == data
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- who owns the root -------------------------------------------------------------------


def test_a_job_that_ended_with_nothing_committed_lets_go_of_its_root(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    assert store.claim("a", fields={"input.uri": "x"}) == (store.owner_record(), "")
    assert store.claim("b", fields={})[0].job == "a"  # a holds it while it runs
    ended = store.record_end("a", state="FAILED", shards_done=0, shards_total=3, rows_done=0)
    assert ended is not None and ended.released
    owner, taken_from = store.claim("b", fields={"input.uri": "y"})
    assert (owner.job, owner.generation, owner.took_over_from, taken_from) == ("b", 1, "a", "a")
    assert store.owner_record() == owner
    assert store.claim("c", fields={})[0].job == "b"  # b holds it now
    assert store.record_end("a", state="FAILED", shards_done=0, shards_total=3, rows_done=0) is None


def test_a_job_with_a_commit_record_keeps_its_root_whatever_it_counted(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    store.claim("a", fields={})
    store.create_commit(new_commit(job="a", shard=2, attempt=1, files=[], worker="w"))
    ended = store.record_end("a", state="CANCELLED", shards_done=0, shards_total=3, rows_done=0)
    assert ended is not None and not ended.released and ended.state == "CANCELLED"
    assert store.claim("b", fields={})[0].job == "a"
    # Carrying on there, it no longer says how it ended.
    again = store.reclaim("a")
    assert again is not None and (again.job, again.state) == ("a", "")


def test_a_commit_that_came_after_its_job_let_go_keeps_the_root_that_jobs(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    store.claim("a", fields={})
    store.record_end("a", state="FAILED", shards_done=0, shards_total=3, rows_done=0)
    # A worker that had not heard the job ended.
    store.create_commit(new_commit(job="a", shard=0, attempt=1, files=[], worker="w"))
    assert store.claim("b", fields={})[0].job == "a"
    assert store.owner() == "a"


def test_of_jobs_taking_a_root_over_at_once_exactly_one_does(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    store.claim("first", fields={})
    store.record_end("first", state="FAILED", shards_done=0, shards_total=1, rows_done=0)
    winners = _winners_at_once(
        8, lambda job: OutputStore(str(tmp_path / "out")).claim(job, fields={})[0].job
    )
    assert len(winners) == 1
    assert store.owner() == winners.pop()


def test_the_claim_file_decides_even_if_the_owner_record_was_not_rewritten(
    tmp_path: Path,
) -> None:
    """A master that died between creating its claim and rewriting `_job.json`: its job owns
    the root all the same, and a later job that finds the older record learns so."""
    store = OutputStore(str(tmp_path / "out"))
    store.claim("a", fields={})
    store.record_end("a", state="FAILED", shards_done=0, shards_total=1, rows_done=0)
    stale = (tmp_path / "out" / OWNER).read_bytes()
    store.claim("b", fields={})
    (tmp_path / "out" / OWNER).write_bytes(stale)
    assert store.owner() == "b"
    assert store.claim("c", fields={})[0].job == "b"


def test_an_owner_record_of_an_earlier_version_is_read(tmp_path: Path) -> None:
    (tmp_path / OWNER).write_text(json.dumps({"job": "a", "claimed_at": 1.0, "spec_digest": "d"}))
    owner = OutputStore(str(tmp_path)).owner_record()
    assert owner is not None
    assert (owner.job, owner.spec_digest, owner.output_fields, owner.released) == (
        "a",
        "d",
        None,
        False,
    )


def test_of_jobs_replacing_a_failed_output_at_once_exactly_one_does_and_it_is_gone(
    tmp_path: Path,
) -> None:
    store = OutputStore(str(tmp_path / "out"))
    store.claim("failed", fields={})
    store.write_file("data/shard=00000/attempt=1/part-00000.parquet", b"rows")
    store.create_commit(new_commit(job="failed", shard=0, attempt=1, files=[], worker="w"))
    ended = store.record_end("failed", state="FAILED", shards_done=1, shards_total=2, rows_done=1)
    assert ended is not None and not ended.released
    winners = _winners_at_once(
        6, lambda job: OutputStore(str(tmp_path / "out")).replace_output(ended, job, fields={}).job
    )
    assert len(winners) == 1
    owner = store.owner_record()
    assert owner is not None and owner.job == winners.pop() and not owner.removing
    assert store.first_commit() is None and not (tmp_path / "out" / "data").exists()


def test_the_most_common_errors_are_kept_cut_and_counted_together_once_cut() -> None:
    long = "x" * (ERROR_CHARS + 50)
    counts = {"b": 3, "a": 3, long + "1": 2, long + "2": 2, "rare": 1}
    kept = most_common_errors(counts, kept=3)
    assert list(kept.items()) == [("x" * (ERROR_CHARS - 1) + "…", 4), ("a", 3), ("b", 3)]


def _winners_at_once(count: int, take: Callable[[str], str]) -> set[str]:
    """Jobs j0..j<count-1> each `take` the root at once (threads released together); those
    that `take` says own it."""
    barrier = threading.Barrier(count)
    owners: dict[str, str] = {}

    def one(job: str) -> None:
        barrier.wait()
        owners[job] = take(job)

    threads = [threading.Thread(target=one, args=(f"j{n}",)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {job for job, owner in owners.items() if owner == job}
