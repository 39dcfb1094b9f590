"""The benchmark report: rerunning some benchmarks replaces their sections and nothing else."""

from __future__ import annotations

from pathlib import Path

from bench import report
from bench.common import Section
from bench.docblock import DocBlock, keep

BEFORE = """# Benchmarks

- measured: earlier

## 5. Start-up: `ebb run` on a tiny job

five's text

| a | b |
|---|---|

## 6. Tidal harvesting of the mixed pool over a day

the old six

## 7. A million rows

seven's text
"""


def test_update_replaces_only_the_sections_rerun(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.md"
    path.write_text(BEFORE)
    six = Section(
        title="6. Tidal harvesting of the mixed pool",
        intro="6. Tidal harvesting\n\nthe new six",
        tables=["| x |\n|---|"],
        notes=["a note"],
    )
    report.update(path, [six])
    after = path.read_text()
    assert after == BEFORE.replace(
        "## 6. Tidal harvesting of the mixed pool over a day\n\nthe old six\n",
        "## 6. Tidal harvesting of the mixed pool\n\nthe new six\n\n| x |\n|---|\n\na note\n",
    )
    # A section the report did not have yet goes at the end.
    report.update(path, [Section(title="8. Something new", intro="8.\n\neight")])
    assert path.read_text() == after + "\n## 8. Something new\n\neight\n"


def test_a_rewritten_report_keeps_the_sections_other_benchmarks_wrote() -> None:
    soak, lost = DocBlock("soak", "## Soak"), DocBlock("lost", "## Lost")
    old = "# Old\n"
    old = soak.put(old, soak.wrap("soak figures"))
    old = lost.put(old, lost.wrap("lost figures v1"))
    assert old.index("## Soak") < old.index("## Lost")
    new = keep([soak, lost], old, "# Reliability\n\nthe campaign\n")
    assert new.startswith("# Reliability\n\nthe campaign\n")
    assert soak.find(new) == soak.wrap("soak figures")
    assert lost.find(new) == lost.wrap("lost figures v1")
    # Rewritten in place, the others untouched.
    again = lost.put(new, lost.wrap("lost figures v2"))
    assert lost.find(again) == lost.wrap("lost figures v2") and again.count("## Lost") == 1
    assert soak.find(again) == soak.wrap("soak figures")
