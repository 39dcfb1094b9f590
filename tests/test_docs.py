"""The documentation: the job spec reference, generated from the spec's own field docstrings,
covers every field of every section; the site builds strictly (a broken link, a missing anchor
or a page left out of the nav fails it); the README's links lead to pages that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from ebb.common.job import accumulators, fields, llm, pipeline, reference, sections, spec

ROOT = Path(__file__).parent.parent


def _load_hook() -> ModuleType:
    name = "ebb_docs_gen_spec"
    location = importlib.util.spec_from_file_location(name, ROOT / "docs" / "gen_spec.py")
    assert location is not None and location.loader is not None
    module = importlib.util.module_from_spec(location)
    location.loader.exec_module(module)
    return module


GEN = reference
HOOK = _load_hook()
SPEC_MODULES = (spec, sections, pipeline, llm, fields, accumulators)
"""The modules whose dataclasses make up the job spec, in the generator's order."""


def spec_dataclasses() -> list[type]:
    """Every dataclass the spec's modules define (imported ones aside)."""
    return [
        value
        for module in SPEC_MODULES
        for value in vars(module).values()
        if isinstance(value, type)
        and dataclasses.is_dataclass(value)
        and value.__module__ == module.__name__
    ]


def test_the_generator_reads_what_python_sees() -> None:
    assert [Path(m.__file__ or "").resolve() for m in SPEC_MODULES] == GEN.SOURCES
    classes, _ = GEN.read_sources()
    assert set(classes) == {cls.__name__ for cls in spec_dataclasses()}
    for cls in spec_dataclasses():
        parsed = [f.name for f in classes[cls.__name__].fields]
        assert parsed == [f.name for f in dataclasses.fields(cls)], cls.__name__


def test_every_spec_field_has_a_docstring() -> None:
    classes, _ = GEN.read_sources()
    missing = [
        f"{name}.{f.name}" for name, parsed in classes.items() for f in parsed.fields if not f.doc
    ]
    assert missing == [], "fields of the job spec without a docstring"


def test_every_field_appears_in_the_reference() -> None:
    classes, _ = GEN.read_sources()
    sections = GEN.sections(classes)
    assert {s.cls.name for s in sections} == {cls.__name__ for cls in spec_dataclasses()}
    text = GEN.render()
    blocks = re.split(r"^### ", text, flags=re.MULTILINE)[1:]
    assert len(blocks) == len(sections)
    for section, block in zip(sections, blocks, strict=True):
        assert block.startswith(f"`{section.path}`" if section.path else "Top level")
        for f in section.cls.fields:
            row = next(
                (line for line in block.splitlines() if line.startswith(f"| `{f.name}` |")), None
            )
            assert row is not None, (
                f"{section.path or 'top level'}: {f.name} is not in the reference"
            )
            assert " ".join(f.doc.split()).replace("|", "\\|") in row


def test_the_job_spec_page_holds_the_reference_and_the_docs_hook_renders_it() -> None:
    page = (ROOT / "docs" / "job-spec.md").read_text()
    assert GEN.MARKER in page
    rendered = HOOK.on_page_markdown(page, None, None, None)
    assert GEN.MARKER not in rendered and GEN.render() in rendered


def test_ebb_spec_prints_the_reference_or_one_section_of_it() -> None:
    ebb = [sys.executable, "-m", "ebb.client.cli", "spec"]
    whole = subprocess.run([*ebb], capture_output=True, text=True, check=True, timeout=60)
    assert whole.stdout.strip() == GEN.render().strip()
    one = subprocess.run(
        [*ebb, "fault"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "### `fault`" in one and "max_error_fraction" in one and "### `input`" not in one
    bad = subprocess.run([*ebb, "nope"], check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no section of the job spec is nope" in bad.stderr
    assert "pipeline.stages[]" in bad.stderr


def test_the_readme_links_to_pages_of_the_site() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = {page for entry in config["nav"] for page in entry.values()}
    links = re.findall(r"\]\(docs/([^)#]+)", (ROOT / "README.md").read_text())
    assert links, "the README links into the documentation"
    for link in links:
        assert (ROOT / "docs" / link).is_file(), link
        assert link in pages, f"{link} is not in mkdocs.yml's nav"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (pip install -e '.[dev]')")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    page = (site / "job-spec" / "index.html").read_text()
    assert "spec-reference" not in page
    for cls in spec_dataclasses():
        for f in dataclasses.fields(cls):
            assert f"<code>{f.name}</code>" in page, f"{cls.__name__}.{f.name}"
