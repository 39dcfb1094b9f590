"""The commit protocol: one winner per shard, complete files, a manifest of winners only."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ebb.common.output import OutputFile, OutputStore, attempt_dir, new_commit


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
