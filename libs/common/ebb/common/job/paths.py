"""A job file's paths: read from disk relative to the file, made absolute, and checked
against the data roots a master allows (no `..` nor symlink escapes a root)."""

from __future__ import annotations

import os
import posixpath
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from ..errors import SpecError
from .spec import JobSpec, parse_job


def load_job_file(path: str | os.PathLike[str]) -> JobSpec:
    """Read a YAML or JSON job file; relative paths in it are taken relative to the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError("", f"cannot read job file {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError("", f"{p} is not valid YAML or JSON: {e}") from None
    spec = parse_job(data)
    return resolve_paths(spec, p.resolve().parent)


def is_url(uri: str) -> bool:
    scheme = urlsplit(uri).scheme
    return len(scheme) > 1  # a single letter is a Windows drive, not a scheme


def _resolve(uri: str, base: Path) -> str:
    if is_url(uri):
        return uri
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    p = Path(uri).expanduser()
    return str(p if p.is_absolute() else (base / p))


def _tracking_path(uri: str) -> str | None:
    """The local path an MLflow tracking URI writes to: a folder (a path, or a file: URI) or a
    sqlite: database (`sqlite:////abs/path.db`). None for a server's (http:, databricks)."""
    if uri.startswith("sqlite:"):
        return uri.removeprefix("sqlite:///")
    if uri.startswith("file:"):
        return urlsplit(uri).path
    return None if is_url(uri) else uri


def resolve_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Make every local path in the spec absolute, relative to `base` (the job file's folder)."""
    tracking = spec.tracking
    uri = tracking.mlflow_uri
    if uri is not None and not uri.startswith("sqlite:") and _tracking_path(uri) is not None:
        # A folder; a sqlite: URI is left as written (SQLAlchemy's own syntax).
        tracking = replace(tracking, mlflow_uri=_resolve(uri, base))
    stages = [
        replace(s, model=_resolve(s.model, base)) if s.model is not None else s
        for s in spec.pipeline.stages
    ]
    stages = [
        replace(s, models=[replace(m, model=_resolve(m.model, base)) for m in s.models])
        if s.models is not None
        else s
        for s in stages
    ]
    stages = [
        replace(s, llm=replace(s.llm, model=_resolve(s.llm.model, base)))
        if s.llm is not None
        else s
        for s in stages
    ]
    return replace(
        spec,
        input=replace(spec.input, uri=_resolve(spec.input.uri, base)),
        pipeline=replace(
            spec.pipeline,
            stages=stages,
            code_paths=[_resolve(c, base) for c in spec.pipeline.code_paths],
        ),
        output=replace(spec.output, uri=_resolve(spec.output.uri, base)),
        tracking=tracking,
    )


def _normalise(uri: str) -> str:
    """Collapse `.` and `..` and duplicate slashes; local paths are made absolute."""
    if is_url(uri):
        parts = urlsplit(uri)
        return f"{parts.scheme}://{parts.netloc}{posixpath.normpath('/' + parts.path)}"
    return os.path.normpath(os.path.abspath(uri))


def _under(uri: str, root: str) -> bool:
    root = _normalise(root).rstrip("/")
    return uri == root or uri.startswith(root + "/")


def check_roots(spec: JobSpec, roots: list[str]) -> None:
    """Refuse a spec whose input, output, model or code paths lie outside the allowed roots.

    Local paths are resolved through symlinks, so neither `..` nor a link can escape a root.
    """
    named = [("input.uri", spec.input.uri), ("output.uri", spec.output.uri)]
    named += [
        (f"pipeline.stages[{i}].model", s.model)
        for i, s in enumerate(spec.pipeline.stages)
        if s.model is not None
    ]
    named += [
        (f"pipeline.stages[{i}].models[{j}].model", m.model)
        for i, s in enumerate(spec.pipeline.stages)
        for j, m in enumerate(s.models or [])
    ]
    named += [
        (f"pipeline.stages[{i}].llm.model", s.llm.model)
        for i, s in enumerate(spec.pipeline.stages)
        if s.llm is not None
    ]
    named += [(f"pipeline.code_paths[{i}]", c) for i, c in enumerate(spec.pipeline.code_paths)]
    if spec.tracking.mlflow_uri is not None:
        local = _tracking_path(spec.tracking.mlflow_uri)
        if local is not None:
            named.append(("tracking.mlflow_uri", local))
    for where, uri in named:
        if not is_url(uri) and not os.path.isabs(uri):
            raise SpecError(where, f"{uri!r} must be absolute when submitted")
        resolved = _normalise(uri) if is_url(uri) else os.path.realpath(uri)
        resolved_roots = [r if is_url(r) else os.path.realpath(r) for r in roots]
        if not any(_under(resolved, r) for r in resolved_roots):
            allowed = ", ".join(dict.fromkeys(roots)) or "(none configured)"
            raise SpecError(where, f"{uri!r} lies outside the allowed data roots: {allowed}")
