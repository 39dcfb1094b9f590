"""Why a job may not write into an output root, in words a user can act on.

Pure functions of plain values: what the root's owner record says (`OutputOwner`), what this
master knows of that job, and the spec submitted. The intake reads those and raises
`OutputTaken` with the sentence one of these returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ebb.common.data.layout import OutputOwner
from ebb.common.job import JobSpec, differing_fields

FIELDS_NAMED = 6
"""Differing fields a refusal names at most (and how many more there are): a refusal's reason
is cut past REASON_CHARS."""
VALUE_CHARS = 40
"""A value shown in a refusal is cut to this."""
_ABSENT = object()
"""A path one spec has and the other lacks (a stage added, a parameter dropped)."""


@dataclass(frozen=True, kw_only=True)
class OwnerView:
    """What is known of the job that owns a root, from this master or from the root."""

    job: str
    state: str
    """SUCCEEDED, FAILED, CANCELLED, SUBMITTED or RUNNING; "" if nobody can tell (a master
    that stopped before it could record how the job ended, or one that still runs it)."""
    shards_done: int
    shards_total: int = 0
    """0: not known."""
    rows_done: int | None = None
    """None: not known (the commit records were counted, not read)."""
    here: bool = False
    """This master knows the job: `ebb resume` works on it here."""


def view_from_record(owner: OutputOwner, *, committed: int, complete: bool) -> OwnerView:
    """The owner as the root tells it: its record, the commit records counted (`committed`),
    and whether the root holds a manifest (`complete`: the job SUCCEEDED)."""
    if owner.state:
        return OwnerView(
            job=owner.job,
            state=owner.state,
            shards_done=owner.shards_done,
            shards_total=owner.shards_total,
            rows_done=owner.rows_done,
        )
    return OwnerView(job=owner.job, state="SUCCEEDED" if complete else "", shards_done=committed)


def _committed(view: OwnerView) -> str:
    shards = f"{view.shards_done} of {view.shards_total}" if view.shards_total else view.shards_done
    noun = "shard" if view.shards_done == 1 and not view.shards_total else "shards"
    rows = f", {view.rows_done:,} rows" if view.rows_done is not None else ""
    return f"{shards} {noun}{rows} committed"


def taken_reason(uri: str, view: OwnerView) -> str:
    """Why a job may not write into `uri`, which `view.job` owns, and what the user can do."""
    job = view.job
    if view.state == "SUCCEEDED":
        return (
            f"{uri} holds the complete output of job {job} (SUCCEEDED, {_committed(view)}): "
            "there is nothing to finish there. Choose another output.uri, or remove that "
            "output to compute it again"
        )
    if view.state in ("SUBMITTED", "RUNNING"):
        return (
            f"{uri} is being written by job {job} ({view.state}, {_committed(view)} so far): "
            f"wait for it, cancel it (`ebb cancel {job}`), or choose another output.uri"
        )
    if view.state:
        how = f"{view.state}, {_committed(view)}"
    else:
        how = (
            f"{_committed(view)}; it is still running elsewhere, or its stack stopped before "
            "it could record how it ended"
        )
    finish = (
        f"`ebb resume {job}` finishes it here"
        if view.here
        else "`ebb run JOB.yaml --resume` finishes it on this machine (or submit JOB.yaml "
        f"with `id: {job}` to a running stack)"
    )
    replace = (
        "; `--replace` (`ebb run` or `ebb submit`) removes it and computes this job anew"
        if view.state in REPLACEABLE
        else ""
    )
    return (
        f"{uri} holds the unfinished output of job {job} ({how}). {finish}, keeping what it "
        f"committed{replace}; or choose another output.uri"
    )


REPLACEABLE = ("FAILED", "CANCELLED")
"""How a job must have ended for `--replace` to remove its output."""


def replace_refusal(uri: str, view: OwnerView, named: str) -> str:
    """Why a job may not replace the output in `uri`, which `view.job` owns, asked to
    replace `named`'s ("" if it may): only the output of a job that ended FAILED or
    CANCELLED is removed, and only that of the job the user was told of."""
    job = view.job
    if named != job:
        return (
            f"{uri} belongs to job {job} now, not to job {named} whose output --replace was to "
            f"remove: look again ({taken_reason(uri, view)})"
        )
    if view.state in REPLACEABLE:
        return ""
    if view.state == "SUCCEEDED":
        return (
            f"{uri} holds the complete output of job {job} (SUCCEEDED, {_committed(view)}): "
            "--replace removes only the output of a job that FAILED or was CANCELLED, never "
            "a complete one. Choose another output.uri, or remove that output yourself"
        )
    if view.state in ("SUBMITTED", "RUNNING"):
        return (
            f"{uri} is being written by job {job} ({view.state}, {_committed(view)} so far): "
            f"cancel it first (`ebb cancel {job}`), then --replace removes its output"
        )
    return (
        f"{uri} holds the output of job {job} ({_committed(view)}), and how that job ended "
        "was never recorded: it may still be running elsewhere, or its stack stopped before "
        "it could say. --replace removes only the output of a job that FAILED or was "
        "CANCELLED: `ebb run JOB.yaml --resume` finishes it, or remove that output yourself"
    )


def spec_mismatch(uri: str, owner: OutputOwner, spec: JobSpec, fields: dict[str, Any]) -> str:
    """Why `spec` may not carry on in `uri` as the job that owns it ("" if it may): it would
    not compute the rows the job committed there. `fields`: spec.output_fields()."""
    if owner.output_fields is None:
        # Written before the fields were kept: only a digest of whole sections to go by.
        if not owner.spec_digest or owner.spec_digest == spec.whole_sections_digest():
            return ""
        return (
            f"{uri} holds the output of job {owner.job}, whose record (from an earlier "
            "version of Ebb) keeps only a digest of the input, pipeline and output sections "
            "it was submitted with: this spec differs from them somewhere, and which field "
            "cannot be told (a batching setting counts, there). Run it with the spec it was "
            "submitted with, or choose another output.uri"
        )
    differing = differing_fields(owner.output_fields, fields)
    if not differing:
        return ""
    if len(differing) == 1:
        (path,) = differing
        before, now = owner.output_fields.get(path, _ABSENT), fields.get(path, _ABSENT)
        named = f"{path} differs ({_shown(before)} then, {_shown(now)} now)"
    else:
        listed = differing[:FIELDS_NAMED]
        more = len(differing) - len(listed)
        tail = f" and {more} more" if more else f" and {listed.pop()}"
        named = f"{', '.join(listed)}{tail} differ"
    return (
        f"{uri} holds the output of job {owner.job}, computed with another spec: {named}. "
        "Its new shards would not be like the ones it committed: put that back, choose "
        "another output.uri, or compute the job anew there with `--replace` (`ebb run` or "
        "`ebb submit`: it removes that output, if its job FAILED or was CANCELLED)"
    )


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if value is None:
        return "none"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= VALUE_CHARS else "…" + text[-(VALUE_CHARS - 1) :]
