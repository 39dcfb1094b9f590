"""The job spec reference, generated from the spec's own code so that it cannot drift.

`ebb.common.job` declares the job spec as dataclasses, a docstring under each field
(`ebb.common.job.spec`, its sections in `ebb.common.job.sections` and
`ebb.common.job.pipeline`; a stage's metrics are `ebb.common.job.accumulators.MetricSpec`).
This module reads those files
with `ast` (nothing is imported: the docs build needs none of Ebb's dependencies), walks the
sections from `JobSpec` down (`input`, `pipeline`, `pipeline.stages[]`,
`pipeline.stages[].metrics.<name>`, ...) and renders each as a table: field, type, default,
what it does.

`ebb spec [SECTION]` prints it; MkDocs runs it through the hook `docs/gen_spec.py`: on a page,
the line `<!-- spec-reference -->` is replaced by the tables. It imports only the standard
library, so that the hook can load it by its path, without Ebb installed.
"""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB = Path(__file__).resolve().parent
SOURCES = [
    JOB / f"{module}.py"
    for module in ("spec", "sections", "pipeline", "llm", "fields", "accumulators")
]
"""The modules whose dataclasses make up the spec."""
MARKER = "<!-- spec-reference -->"
ROOT = "JobSpec"


@dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr
    default: str | None
    """The default, as the reference shows it (a value as YAML writes it); None: required."""
    doc: str


@dataclass(frozen=True)
class SpecClass:
    name: str
    doc: str
    fields: list[Field]


@dataclass(frozen=True)
class Section:
    path: str
    """Where the section sits in a job file: "" for the top level, `pipeline.stages[]`,
    `pipeline.stages[].metrics.<name>`."""
    cls: SpecClass


def read_classes(source: str) -> tuple[dict[str, SpecClass], dict[str, ast.expr]]:
    """The dataclasses of a module by name, and its type aliases (`Name = Literal[...]`)."""
    tree = ast.parse(source)
    classes: dict[str, SpecClass] = {}
    aliases: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Subscript):
                aliases[target.id] = node.value
        if isinstance(node, ast.ClassDef) and any(_is_dataclass(d) for d in node.decorator_list):
            classes[node.name] = SpecClass(
                name=node.name, doc=ast.get_docstring(node) or "", fields=_fields(node)
            )
    return classes, aliases


def read_sources() -> tuple[dict[str, SpecClass], dict[str, ast.expr]]:
    """`read_classes` of every module in SOURCES, together."""
    classes: dict[str, SpecClass] = {}
    aliases: dict[str, ast.expr] = {}
    for path in SOURCES:
        more_classes, more_aliases = read_classes(path.read_text())
        classes.update(more_classes)
        aliases.update(more_aliases)
    return classes, aliases


def _is_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id == "dataclass"


def _fields(node: ast.ClassDef) -> list[Field]:
    fields = []
    body = node.body
    for i, statement in enumerate(body):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        doc = ""
        following = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            doc = inspect.cleandoc(following.value.value)
        fields.append(
            Field(
                name=statement.target.id,
                annotation=statement.annotation,
                default=_default(statement.value),
                doc=doc,
            )
        )
    return fields


def _default(value: ast.expr | None) -> str | None:
    if value is None:
        return None
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "field"
    ):
        for keyword in value.keywords:
            if keyword.arg == "default":
                return _default(keyword.value)
            if keyword.arg == "default_factory":
                factory = keyword.value
                if isinstance(factory, ast.Name) and factory.id in ("dict", "list"):
                    return "`{}`" if factory.id == "dict" else "`[]`"
                if isinstance(factory, ast.Name):
                    return "its section's defaults"
                return f"`{ast.unparse(factory)}()`"
        return None
    try:
        return f"`{json.dumps(ast.literal_eval(value))}`"
    except ValueError:
        return f"`{ast.unparse(value)}`"


def sections(classes: dict[str, SpecClass], root: str = ROOT) -> list[Section]:
    """Every section reachable from `root`, depth first in field order, each at the first
    path it is found at (a tier's `resources` is the top level's section again)."""
    found: list[Section] = []

    def walk(name: str, path: str) -> None:
        if any(s.cls.name == name for s in found):
            return
        found.append(Section(path=path, cls=classes[name]))
        for f in classes[name].fields:
            child = _section_type(f.annotation, classes)
            if child is not None:
                name_in_path = f"{path}.{f.name}" if path else f.name
                walk(child[0], name_in_path + child[1])

    walk(root, "")
    return found


def _section_type(annotation: ast.expr, classes: dict[str, SpecClass]) -> tuple[str, str] | None:
    """(class name, what its path adds: "", "[]" for a list of them, ".<name>" for a map of
    them by name) when a field holds a section of its own, or may (`list[ModelSpec] | None`)."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = (annotation.left, annotation.right)
        found = [s for s in (_section_type(side, classes) for side in sides) if s is not None]
        return found[0] if found else None
    if isinstance(annotation, ast.Name) and annotation.id in classes:
        return annotation.id, ""
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "list"
        and isinstance(annotation.slice, ast.Name)
        and annotation.slice.id in classes
    ):
        return annotation.slice.id, "[]"
    value = _map_value(annotation)
    if value is not None and value in classes:
        return value, ".<name>"
    return None


def _map_value(annotation: ast.expr) -> str | None:
    """X of a `dict[str, X]` annotation."""
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "dict"
        and isinstance(annotation.slice, ast.Tuple)
        and len(annotation.slice.elts) == 2
        and isinstance(annotation.slice.elts[1], ast.Name)
    ):
        return annotation.slice.elts[1].id
    return None


def anchor(path: str) -> str:
    """The heading id of a section: `pipeline.stages[]` -> `spec-pipeline-stages`,
    `pipeline.stages[].metrics.<name>` -> `spec-pipeline-stages-metrics`; the top level's is
    `spec`. Links to a section from other pages use these."""
    path = path.replace("[]", "").replace(".<name>", "").replace("_", "-")
    return "-".join(["spec", *path.split(".")]).rstrip("-")


def _type(annotation: ast.expr, aliases: dict[str, ast.expr], paths: dict[str, str]) -> str:
    """A type as a reader of YAML wants it: `int or null`, one of `cpu`..., a link to a
    section."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        left = _type(annotation.left, aliases, paths)
        return f"{left} or {_type(annotation.right, aliases, paths)}"
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return "`null`"
    if isinstance(annotation, ast.Name):
        if annotation.id in aliases:
            return _type(aliases[annotation.id], aliases, paths)
        if annotation.id in paths:
            return f"[`{annotation.id}`](#{anchor(paths[annotation.id])})"
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "Literal"
    ):
        values = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else []
        names = [f"`{ast.literal_eval(v)}`" for v in values]
        return "one of " + ", ".join(names)
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "list"
        and isinstance(annotation.slice, ast.Name)
        and annotation.slice.id in paths
    ):
        return f"list of [`{annotation.slice.id}`](#{anchor(paths[annotation.slice.id])})"
    value = _map_value(annotation)
    if value is not None and value in paths:
        return f"map of names to [`{value}`](#{anchor(paths[value])})"
    return f"`{ast.unparse(annotation)}`"


def _cell(text: str) -> str:
    """Text for one table cell: one line, and a `|` that does not end the cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render(source: str | None = None, *, under: str = "") -> str:
    """The reference: one heading and table per section of the spec (those whose path
    begins with `under`, if given: `pipeline.stages[]`, say)."""
    classes, aliases = read_sources() if source is None else read_classes(source)
    found = sections(classes)
    paths = {s.cls.name: s.path for s in found}
    out: list[str] = []
    for section in found:
        if not section.path.startswith(under):
            continue
        title = f"`{section.path}`" if section.path else "Top level"
        out.append(f"### {title} {{#{anchor(section.path)}}}")
        out.append("")
        if section.cls.doc:
            out.append(" ".join(section.cls.doc.split()))
            out.append("")
        out.append("| field | type | default | what |")
        out.append("|---|---|---|---|")
        for f in section.cls.fields:
            default = "required" if f.default is None else f.default
            kind = _type(f.annotation, aliases, paths)
            out.append(f"| `{f.name}` | {_cell(kind)} | {_cell(default)} | {_cell(f.doc)} |")
        out.append("")
    return "\n".join(out)


def section_paths() -> list[str]:
    """Every section's path ("" for the top level), in the reference's order."""
    return [s.path for s in sections(read_sources()[0])]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: the marker, wherever a page has it, becomes the reference."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
