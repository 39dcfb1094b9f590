"""A real text corpus made on this machine, without downloads: the docstrings and the
documentation files of the installed Python packages.

Every module, class and function docstring of the `.py` files under the given folders (read
with `ast`, never imported), and every paragraph block of their `.md`, `.rst` and `.txt` files,
becomes a candidate row. Texts are whitespace-trimmed, cut to `max_chars`, deduplicated
exactly, ordered by a hash of their text (a stable shuffle: files of similar texts do not end
up in one shard) and given ids 0..n-1. Each row keeps where it came from (`source`).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DOC_SUFFIXES = (".md", ".rst", ".txt")


def installed() -> list[Path]:
    """The standard library and the folders this interpreter installs packages into."""
    paths = {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
    return sorted(Path(p) for p in paths if os.path.isdir(p))


def docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of the module and of every class and function in it."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return  # a file this Python cannot parse (a template, another version's syntax)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield getattr(node, "name", "<module>"), text


def paragraphs(path: Path, *, max_chars: int) -> Iterator[tuple[str, str]]:
    """A documentation file in blocks of whole paragraphs, cut once past `max_chars` / 8."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return
    block: list[str] = []
    size, number = 0, 0
    for paragraph in text.split("\n\n"):
        block.append(paragraph)
        size += len(paragraph)
        if size >= max_chars // 8:
            number += 1
            yield f"#{number}", "\n\n".join(block)
            block, size = [], 0
    if block:
        yield f"#{number + 1}", "\n\n".join(block)


def sources(roots: list[Path]) -> list[tuple[Path, Path]]:
    """(root, file) of every Python and documentation file under `roots`, in a stable order:
    listed first, so that the reading of them can tell how far it has got."""
    found: list[tuple[Path, Path]] = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = Path(folder) / name
                if "site-packages" in str(path.relative_to(root)).split(os.sep):
                    continue  # the standard library's folder holds a virtualenv's packages
                if name.endswith((".py", *DOC_SUFFIXES)):
                    found.append((root, path))
    return found


def texts(
    roots: list[Path], *, max_chars: int, read: Callable[[int, int], None] | None = None
) -> Iterator[tuple[str, str]]:
    """(source, text) of every docstring and documentation block under `roots`. `read` hears
    (files read, files in all) after each file."""
    files = sources(roots)
    for done, (root, path) in enumerate(files, 1):
        where = str(path.relative_to(root))
        if path.name.endswith(".py"):
            found = docstrings(path)
        else:
            found = paragraphs(path, max_chars=max_chars)
        for what, text in found:
            yield f"{where}:{what}", text
        if read is not None:
            read(done, len(files))


def build(
    out: Path,
    *,
    roots: list[Path] | None = None,
    rows: int | None = None,
    files: int = 8,
    max_chars: int = 2_000,
    min_chars: int = 16,
    progress: Callable[[int, int, int], None] | None = None,
) -> int:
    """Write the corpus as `files` Parquet files (id, text, source) under `out`; its rows.
    `progress` hears (files read, files in all, texts kept so far) after each file read."""
    seen: dict[str, str] = {}

    def read(done: int, total: int) -> None:
        if progress is not None:
            progress(done, total, len(seen))

    for source, raw in texts(roots or installed(), max_chars=max_chars, read=read):
        text = raw.strip()[:max_chars]
        if len(text) >= min_chars and text not in seen:
            seen[text] = source
    ordered = sorted(seen, key=lambda t: hashlib.blake2b(t.encode(), digest_size=8).digest())
    if rows is not None:
        ordered = ordered[:rows]
    out.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(ordered) // files)
    for f in range(files):
        part = ordered[f * per_file : (f + 1) * per_file]
        table = pa.table(
            {
                "id": pa.array(range(f * per_file, f * per_file + len(part)), pa.int64()),
                "text": pa.array(part, pa.string()),
                "source": pa.array([seen[t] for t in part], pa.string()),
            }
        )
        pq.write_table(table, out / f"part-{f:03d}.parquet")
    return len(ordered)
