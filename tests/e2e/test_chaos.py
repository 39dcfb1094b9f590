"""The chaos campaign, short: seeded runs of a real job on the embedded stack, each hurt by
faults at random moments (bench/chaos.py), and each checked to end with every input id exactly
once, counters that agree with the files, and no failure but the one its own fault (a vanished
input) causes. No timing is asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import chaos
from bench.chaos_modelets import FLAKY_MARKER, FlakyTopClass, arm_flaky, taken_by


def _check(results: list[chaos.RunResult], lines: list[str]) -> None:
    log = "\n".join(lines)
    for r in results:
        assert r.final_state == "SUCCEEDED", log
        assert not r.failed_by_another, f"seed {r.seed}: {r.foreign_failure}\n{log}"
        outcome = (r.lost, r.duplicated, r.counters_agree, r.metrics_agree, r.left_behind)
        assert (outcome, r.problems) == ((0, 0, True, True, 0), []), log
        assert r.injections, f"seed {r.seed}: no fault was injected\n{log}"


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_two_seeded_chaos_runs_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    results = await chaos.campaign(
        [1, 2], tmp_path, rows=8_000, rows_per_shard=500, faults=3, log=lines.append
    )
    _check(results, lines)
    report = chaos.report(results, command="test", machine="test")
    assert "| worker_kill |" in report and "| nats_restart |" in report
    assert "| failed by a fault not its own |" in report


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_workers_and_stages_killed_mid_generation_lose_and_double_no_row(
    tmp_path: Path,
) -> None:
    """The job with an llm stage beside the model (bench/chaos.py --llm), its workers and
    stage processes SIGKILLed: every id once, and the tokens metric equal to the output's."""
    lines: list[str] = []
    results = await chaos.campaign(
        [4, 5],
        tmp_path,
        rows=6_000,
        rows_per_shard=500,
        faults=3,
        log=lines.append,
        kinds=("worker_kill", "stage_kill"),
        generating=True,
    )
    _check(results, lines)
    # Each kill came while the llm stage's processes were generating: it runs on a branch
    # from the input, beside the others, from the first row to the last.
    assert {i.kind for r in results for i in r.injections} <= {"worker_kill", "stage_kill"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["churn", "flaky_node", "worker_storm"])
async def test_faults_of_the_cluster_do_not_fail_the_job(tmp_path: Path, kind: str) -> None:
    """Workers lost one after another, a node pool lost, a node whose pipeline cannot start:
    the cluster's faults, none the job's own, at the default lease and max_attempts. One kind
    a run: the first fault aimed at workers waits for their shards, which went to the tail of
    the queue, so a short job seldom lives to see a second."""
    lines: list[str] = []
    results = await chaos.campaign(
        [1], tmp_path, rows=8_000, rows_per_shard=500, faults=2, log=lines.append, kinds=(kind,)
    )
    _check(results, lines)
    assert results[0].injections[0].kind == kind
    assert (results[0].lease_s, results[0].max_attempts) == (60.0, 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_faults_at_the_seams_lose_and_count_nothing_twice(tmp_path: Path) -> None:
    """A job in two tiers (seed 3's shape) with metrics, hurt where a DONE names a new shard (a
    hand-off, a split's rest) and where a DONE's answer is lost: every row once, every metric
    as the output says, nothing left running."""
    lines: list[str] = []
    kinds = ("split_kill", "successor_kill", "kv_answer_lost")
    results = await chaos.campaign(
        [3], tmp_path, rows=8_000, rows_per_shard=500, faults=3, log=lines.append, kinds=kinds
    )
    _check(results, lines)
    assert results[0].tiered
    assert {i.kind for i in results[0].injections} <= set(kinds)


def test_the_report_counts_runs_failed_by_a_fault_not_their_own() -> None:
    own = chaos.RunResult(
        seed=1, rows=10, first_state="FAILED", first_reason="part-1.parquet vanished"
    )
    own.final_state = "SUCCEEDED"
    other = chaos.RunResult(seed=2, rows=10, first_state="FAILED", final_state="SUCCEEDED")
    other.foreign_failure = "a worker could not start its pipeline"
    other.injections.append(chaos.Injection("flaky_node", 1.0, None))
    report = chaos.report([own, other], command="test", machine="test")
    totals = report.split("## Totals")[1].splitlines()
    assert "| failed by a fault not its own |" in totals[2]
    assert totals[4].startswith("| 2 | 0 | 2 | 0 | 1 |")
    assert "| 1 | 1 | FAILED: part-1.parquet vanished | SUCCEEDED | no |" in report
    assert "| 2 | 1 | FAILED | SUCCEEDED | yes |" in report
    for kind in ("churn", "flaky_node", "worker_storm", "split_kill", "kv_answer_lost"):
        assert f"| {kind} |" in report
    assert "default fault settings (lease_s 60, max_attempts 3)" in report


def test_the_new_fault_kinds_are_accepted_on_the_command_line() -> None:
    unknown = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--kinds", "churn,no_such_fault"],
        capture_output=True,
        text=True,
        cwd=chaos.REPO,
        check=False,
        timeout=60,
    )
    assert unknown.returncode == 2
    assert "unknown faults ['no_such_fault']" in unknown.stderr


def test_a_flaky_node_fails_one_setup_of_a_worker_started_after_it_was_armed(
    tmp_path: Path,
) -> None:
    # A stage process of a worker that ran when the marker was armed (its parent spared).
    arm_flaky(tmp_path, spared=[os.getppid()])
    FlakyTopClass(str(tmp_path)).setup()
    assert (tmp_path / FLAKY_MARKER).exists() and taken_by(tmp_path) is None
    assert json.loads((tmp_path / FLAKY_MARKER).read_text()) == [os.getppid()]

    arm_flaky(tmp_path, spared=[])
    with pytest.raises(RuntimeError, match="flaky node"):
        FlakyTopClass(str(tmp_path)).setup()
    assert taken_by(tmp_path) == os.getpid()
    FlakyTopClass(str(tmp_path)).setup()  # once only
