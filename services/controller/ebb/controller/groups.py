"""Groups of workers: the workers of one tier of one job, each scaled on its own backlog.

A job without tiers is one group, keyed by the job's id, as it was before tiers. A job with
tiers (`JobSpec.tiers`: decoding on CPU pods, the model on GPU pods, say) is one group per
tier, keyed `job/tier`: each wants workers for its own backlog, within its own min and max,
and asks capacity for its own shape on the nodes it may use. A tier's backlog is its shards
TODO or DOING; a later tier gets its shards as the tier before commits its own, so it keeps
its min_workers, waiting for them, while any tier before it still has work. A tier the
master holds back (the hand-offs waiting for the next tier are at their bound) gets no more
workers than it has: more would only wait.

`plan` decides, per group, what a reconcile pass changes. Pure functions of plain values,
for the reconciler and the backends to share.
"""

from __future__ import annotations

import re
import secrets
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ebb.common.errors import SpecError
from ebb.common.job import JobSpec, ResourceSpec, TierSpec, parse_job
from ebb.common.messaging.messages import JobStatus, TierStatus

from .backend import Capacity, WorkerInfo
from .policy.capacity import Demand, allocate

UNTIERED = ""
"""The tier of a job without tiers."""


def group_key(job: str, tier: str) -> str:
    """What a group's entries in a plan are keyed by: the job's id for a job without tiers,
    `job/tier` for a tier (a job's id has no `/`)."""
    return f"{job}/{tier}" if tier else job


def job_of(key: str) -> str:
    """The job of the group `key` names."""
    return key.split("/", 1)[0]


def remaining(shards: dict[str, int]) -> int:
    """Shards not finished: TODO or DOING."""
    return shards.get("TODO", 0) + shards.get("DOING", 0)


def usable(status: JobStatus | TierStatus) -> int:
    """Workers a job's (or a tier's) shards left could keep busy: its shards not finished,
    or more where the master may cut a running shard's rest for idle workers
    (`JobStatus.workers_usable`)."""
    return max(remaining(status.shards), status.workers_usable)


def rows_done(job: JobStatus, tier: str) -> int:
    """Rows tier `tier` of `job` has committed (the job's, for a job without tiers)."""
    if not tier:
        return job.rows_done
    return next((t.rows_done for t in job.tiers if t.name == tier), 0)


@dataclass(frozen=True, kw_only=True)
class Group:
    """The workers of one tier of one job, as one thing to scale."""

    job: JobStatus
    tier: str = UNTIERED
    min_workers: int
    max_workers: int
    backlog: int
    """Its shards TODO or DOING, or the pieces the master may cut them into (`usable`)."""
    upstream: int
    """Shards TODO or DOING of this tier and of every tier before it: the work that is yet
    to reach it, its own included."""
    held_back: bool = False
    """The master leases none of its shards for now (see TierStatus.held_back)."""

    @property
    def key(self) -> str:
        return group_key(self.job.id, self.tier)


def job_spec(job: JobStatus) -> JobSpec | None:
    """The job's spec, parsed; None if the status carries none or it does not parse (the
    master checked it: a worker would find out, and say so)."""
    if not job.spec:
        return None
    try:
        return parse_job(job.spec)
    except SpecError:
        return None


def tier_spec(spec: JobSpec | None, tier: str) -> TierSpec | None:
    """Tier `tier` of the spec; None for a job without tiers, or a tier it does not name."""
    if spec is None or not tier:
        return None
    return next((t for t in spec.tiers if t.name == tier), None)


def tier_resources(spec: JobSpec | None, tier: str) -> ResourceSpec | None:
    """What a worker of tier `tier` asks for: its tier's resources, or the job's own for a
    job without tiers (or a tier the spec does not name); None without a spec."""
    if spec is None:
        return None
    found = tier_spec(spec, tier)
    return found.resources if found is not None else spec.resources


def groups_of(job: JobStatus) -> list[Group]:
    """The groups of `job`, in the order of its tiers."""
    if not job.tiers:
        left = usable(job)
        return [
            Group(
                job=job,
                min_workers=job.min_workers,
                max_workers=job.max_workers,
                backlog=left,
                upstream=left,
            )
        ]
    spec = job_spec(job)
    told = {t.name: t for t in job.tiers}
    # The spec's order is the rows' order; the master's status names the same tiers, but a
    # tier whose shards have not appeared yet may be missing from it.
    names = [t.name for t in spec.tiers] if spec is not None and spec.tiers else list(told)
    out = []
    upstream = 0
    for name in names:
        status = told.get(name, TierStatus(name=name))
        backlog = usable(status)
        upstream += backlog
        resources = tier_resources(spec, name)
        out.append(
            Group(
                job=job,
                tier=name,
                min_workers=resources.min_workers if resources else job.min_workers,
                max_workers=resources.max_workers if resources else job.max_workers,
                backlog=backlog,
                upstream=upstream,
                held_back=status.held_back,
            )
        )
    return out


def wanted(group: Group, *, have: int = 0) -> int:
    """Workers a group could use now, before capacity is considered; `have`: its live ones
    (what a group held back keeps)."""
    if group.job.state != "RUNNING" or group.upstream == 0:
        return 0
    want = min(group.max_workers, max(group.min_workers, group.backlog))
    return min(want, have) if group.held_back else want


def demand(group: Group, capacity: Capacity, *, have: int = 0) -> Demand:
    """What a group asks of capacity: the tiers of one job share its priority."""
    return Demand(
        job=group.key,
        want=wanted(group, have=have),
        min_workers=group.min_workers,
        priority=group.job.priority,
        submitted_at=group.job.submitted_at,
        shape=capacity.shape(group.job, group.tier),
        eligible=capacity.eligible(group.job, group.tier),
        owner=group.job.id,
        prefer=capacity.prefer(group.job, group.tier),
    )


def share(jobs: list[JobStatus], slots: int) -> dict[str, int]:
    """Split `slots` identical worker slots between the groups of jobs (see
    capacity.allocate), none of which has a worker yet."""
    capacity = Capacity.slots(slots)
    return allocate([demand(g, capacity) for j in jobs for g in groups_of(j)], capacity.bins)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Keyed by group (groups.group_key): a job's id, or `job/tier` for a tier."""

    desired: dict[str, int]
    launch: dict[str, int] = field(default_factory=dict)
    """Group -> workers to start."""
    terminate: list[str] = field(default_factory=list)
    """Worker ids to drain."""
    held_back: dict[str, float] = field(default_factory=dict)
    """Groups short of workers but in relaunch backoff: seconds left."""
    groups: dict[str, Group] = field(default_factory=dict)
    """The groups the keys name."""


def plan(
    *,
    jobs: list[JobStatus],
    workers: list[WorkerInfo],
    capacity: Capacity,
    now: float,
    not_before: dict[str, float],
) -> Plan:
    """What to change, given what is. Pure: no I/O, no clock, no memory.

    `capacity` counts the resources of the live workers of these jobs as free (they are
    placed again, from scratch, by `allocate`) and those of draining workers as taken.
    `not_before`: per group, when it may have workers launched again."""
    alive: dict[str, list[WorkerInfo]] = defaultdict(list)
    for w in workers:
        if w.alive:
            alive[group_key(w.job, w.tier)].append(w)
    groups = {g.key: g for j in jobs for g in groups_of(j)}
    desired = allocate(
        [demand(g, capacity, have=len(alive.get(k, []))) for k, g in groups.items()],
        capacity.bins,
    )
    launch: dict[str, int] = {}
    terminate: list[str] = []
    held_back: dict[str, float] = {}
    busy = {w for j in jobs for w in j.workers_busy}
    for key, target in desired.items():
        have = alive.get(key, [])
        if len(have) < target:
            wait = not_before.get(key, 0.0) - now
            if wait > 0:
                held_back[key] = wait
            else:
                launch[key] = target - len(have)
        elif len(have) > target:
            # Those holding no lease go first (at a job's end the idle, not the one whose
            # shard is nearly done); then the youngest, the oldest being the most likely to
            # be mid-shard when the master does not say.
            surplus = sorted(have, key=lambda w: (w.id in busy, -w.started_at))
            terminate += [w.id for w in surplus[: len(have) - target]]
    for key, have in alive.items():
        if key not in desired:  # the job ended, is unknown to the master, or has no such tier
            terminate += [w.id for w in have]
    return Plan(
        desired=desired, launch=launch, terminate=terminate, held_back=held_back, groups=groups
    )


def told_waiting(group: Group) -> str:
    """Why the master says the group's workers cannot be placed ("": it says nothing)."""
    if not group.tier:
        return group.job.waiting
    return next((t.waiting for t in group.job.tiers if t.name == group.tier), "")


def placement_news(
    decided: Plan, capacity: Capacity, refused: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Per group whose status is wrong about whether its workers can be placed: why no
    place could ever take them (or, `refused`, why the cluster refused to start them), or ""
    now that one could. A group with workers desired has a place, and one with no work left
    wants none (nothing to say of either)."""
    news: dict[str, str] = {}
    for key, group in decided.groups.items():
        reason = (refused or {}).get(key, "")
        if not reason and decided.desired.get(key, 0) == 0 and group.upstream > 0:
            reason = capacity.unplaceable(group.job, group.tier)
        if reason != told_waiting(group):
            news[key] = reason
    return news


_NOT_IN_AN_ID = re.compile(r"[^A-Za-z0-9_-]+")


def new_worker_id(job: str, tier: str) -> str:
    """A fresh id for a worker of the group: the job's id and its tier, cut so that the id
    makes a pod name (63 characters at most: podspec.pod_name) with its random suffix."""
    if not tier:
        return f"{job[:40]}-{secrets.token_hex(3)}"
    # A worker id is one NATS subject token: letters, digits, - and _.
    part = _NOT_IN_AN_ID.sub("-", tier).strip("-")[:15] or "tier"
    return f"{job[:40]}-{part}-{secrets.token_hex(3)}"
