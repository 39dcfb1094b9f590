"""Sections of a report that another benchmark rewrites around: each between two markers,
kept in place when the report is written anew (the chaos campaign rewrites
docs/reliability.md; the soak's and the lost-worker timing's sections stay)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DocBlock:
    name: str
    heading: str
    """The section's heading, written above the block when it is first appended."""

    @property
    def start(self) -> str:
        return f"<!-- {self.name}:start -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def wrap(self, body: str) -> str:
        """`body` between this block's markers."""
        return f"{self.start}\n{body.strip(chr(10))}\n{self.end}"

    def find(self, text: str) -> str | None:
        """The block in `text`, markers included, if it has one."""
        if self.start not in text or self.end not in text:
            return None
        return self.start + text.partition(self.start)[2].partition(self.end)[0] + self.end

    def put(self, text: str, block: str) -> str:
        """`text` with `block` (markers included) in its place, or appended under the heading."""
        if self.start in text and self.end in text:
            head, _, rest = text.partition(self.start)
            _, _, tail = rest.partition(self.end)
            return head + block + tail
        return text.rstrip("\n") + f"\n\n{self.heading}\n\n{block}\n"

    def write(self, doc: Path, block: str, *, title: str) -> None:
        """Put `block` into the report at `doc` (a new one, titled `title`, if none is there)."""
        doc.write_text(self.put(doc.read_text() if doc.exists() else f"{title}\n", block))


def keep(blocks: list[DocBlock], old: str, new: str) -> str:
    """`new` (a report written anew) with every one of `blocks` that `old` had."""
    for block in blocks:
        found = block.find(old)
        if found is not None:
            new = block.put(new, found)
    return new
