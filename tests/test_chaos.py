"""The chaos campaign, short: two seeded runs of a real job on the embedded stack, each hurt
by faults at random moments (bench/chaos.py), and each checked to end with every input id
exactly once and counters that agree with the files. No timing is asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import chaos

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


async def test_two_seeded_chaos_runs_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    results = await chaos.campaign(
        [1, 2], tmp_path, rows=8_000, rows_per_shard=500, faults=3, log=lines.append
    )
    log = "\n".join(lines)
    for r in results:
        assert r.final_state == "SUCCEEDED", log
        assert (r.lost, r.duplicated, r.counters_agree, r.problems) == (0, 0, True, []), log
        assert r.injections, f"seed {r.seed}: no fault was injected\n{log}"
    report = chaos.report(results, command="test", machine="test")
    assert "| worker_kill |" in report and "| nats_restart |" in report
