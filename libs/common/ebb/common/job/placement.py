"""Where a job asks its workers to run: the pools a spec may name, and the checks of a job's
GPU type, node selector and tolerations (of the job, or of one of its tiers), made when the
job is submitted rather than when its first pod is made. The job spec (ebb.common.job.spec) calls
these; its fields' docstrings are the reference. Imports nothing of ebb.common.job.spec (it imports
this)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..errors import SpecError
from .tiers import check_toleration, label_key_problem, label_value_problem

PoolMode = Literal["offline", "any", "mixed"]
"""Where workers go, once `auto` is decided: the offline pool only; either pool, the offline
one preferred; either pool, lent mixed nodes preferred."""

POOLS = ("auto", "offline", "any", "mixed", "online")
"""What `resources.pool` may say. `online` is read as `any`: specs stored before the pool
was read say it, and it never placed anything on online nodes."""


def as_meant_before_pools(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A job spec (as a map) stored before `resources.pool` placed workers, with what its pool
    meant then. Every spec stored then says `pool: offline`, the default of that version, and
    every worker went to the offline pool first and to lent mixed nodes after: `any` now. Read
    as `offline`, a job running across the upgrade would lose its mixed nodes, or wait for
    ever on a cluster without an offline pool."""
    out = copy.deepcopy(dict(spec))
    tiers = out.get("tiers")
    for holder in [out, *(tiers if isinstance(tiers, list) else [])]:
        resources = holder.get("resources") if isinstance(holder, dict) else None
        if isinstance(resources, dict) and resources.get("pool") == "offline":
            resources["pool"] = "any"
    return out


def asked_pool(pool: str) -> PoolMode | None:
    """The pool mode a spec's `resources.pool` asks for; None: `auto`, the controller's
    placement policy decides."""
    if pool == "auto":
        return None
    if pool in ("any", "online"):
        return "any"
    if pool == "offline":
        return "offline"
    if pool == "mixed":
        return "mixed"
    raise ValueError(f"not a pool: {pool!r}")


def check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise SpecError("pool", f"expected one of {', '.join(POOLS[:-1])}, got {pool!r}")


def check_gpu_type(gpu_type: str | None, *, gpu: int) -> None:
    """A GPU type is a node label's value, and asks nothing of a worker without a GPU."""
    if gpu_type is None:
        return
    if not gpu_type:
        raise SpecError("gpu_type", "must not be empty (leave it out: any GPU type)")
    problem = label_value_problem(gpu_type)
    if problem:
        raise SpecError("gpu_type", f"{problem}: a GPU type is matched as a node label's value")
    if gpu <= 0:
        raise SpecError(
            "gpu_type",
            f"{gpu_type!r} names a GPU type for workers that ask for no GPU: set `gpu` "
            "(GPUs per worker) too",
        )


def check_node_placement(
    node_selector: Mapping[str, str], tolerations: Sequence[dict[str, Any]]
) -> None:
    """Refuse a node selector or tolerations the Kubernetes API server would refuse."""
    for key, value in node_selector.items():
        problem = label_key_problem(key) or label_value_problem(value)
        if problem:
            raise SpecError(f"node_selector.{key}", problem)
    for i, toleration in enumerate(tolerations):
        check_toleration(f"tolerations[{i}]", toleration)
