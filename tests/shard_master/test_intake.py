"""The intake's memory of refused submissions: bounded in number and in size, and each
owner's seen by that owner alone."""

from __future__ import annotations

from ebb.shard_master.table.intake import REASON_CHARS, REJECTIONS_KEPT, RejectionLog


def test_the_newest_refusals_are_kept_each_cut_in_the_middle() -> None:
    log = RejectionLog()
    for n in range(REJECTIONS_KEPT + 10):
        log.add(f"job-{n}", f"bad {n}")
    assert len(log) == REJECTIONS_KEPT
    seen = log.seen_by(None)
    assert next(iter(seen)) == "job-10" and seen[f"job-{REJECTIONS_KEPT + 9}"] == "bad 265"
    kept = log.add("long", "head " + "x" * 2 * REASON_CHARS + " tail")
    assert len(kept) == REASON_CHARS == len(log.seen_by(None)["long"])
    assert kept.startswith("head ") and kept.endswith(" tail") and "…" in kept
    assert "job-10" not in log.seen_by(None)  # the oldest made room


def test_a_job_refused_again_is_the_newest_again() -> None:
    log = RejectionLog()
    log.add("a", "first")
    log.add("b", "second")
    log.add("a", "again")
    assert list(log.seen_by(None).items()) == [("b", "second"), ("a", "again")]


def test_an_owner_sees_its_own_refusals_and_the_admin_everyone_s() -> None:
    log = RejectionLog()
    log.add("a", "team-a's reason", owner="team-a")
    log.add("b", "team-b's reason", owner="team-b")
    log.add("c", "no owner's reason")
    log.add("a", "team-b's own a", owner="team-b")  # one id, two owners: two refusals
    assert log.seen_by("team-a") == {"a": "team-a's reason"}
    assert log.seen_by("team-b") == {"b": "team-b's reason", "a": "team-b's own a"}
    assert log.seen_by("") == {"c": "no owner's reason"}
    assert log.seen_by(None) == {
        "b": "team-b's reason",
        "c": "no owner's reason",
        "a": "team-b's own a",
    }
    assert len(log) == 4
