"""The intake's memory of refused submissions: bounded in number and in size."""

from __future__ import annotations

from ebb.shard_master.table.intake import REASON_CHARS, REJECTIONS_KEPT, RejectionLog


def test_the_newest_refusals_are_kept_each_cut_in_the_middle() -> None:
    log = RejectionLog()
    for n in range(REJECTIONS_KEPT + 10):
        log.add(f"job-{n}", f"bad {n}")
    assert len(log) == REJECTIONS_KEPT
    assert next(iter(log)) == "job-10" and log[f"job-{REJECTIONS_KEPT + 9}"] == "bad 265"
    kept = log.add("long", "head " + "x" * 2 * REASON_CHARS + " tail")
    assert len(kept) == REASON_CHARS == len(log["long"])
    assert kept.startswith("head ") and kept.endswith(" tail") and "…" in kept
    assert "job-10" not in log  # the oldest made room


def test_a_job_refused_again_is_the_newest_again() -> None:
    log = RejectionLog()
    log.add("a", "first")
    log.add("b", "second")
    log.add("a", "again")
    assert list(log.items()) == [("b", "second"), ("a", "again")]
