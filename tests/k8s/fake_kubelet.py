"""The fake scheduler and kubelet: what moves pods through their lives in the fake cluster.

One asyncio task reconciles every pod whenever a pod or node changes, or when a timer it set
falls due (a container start, a scripted exit, the end of a grace period). It writes through the
store, so every step it takes is a MODIFIED/DELETED event that watches see, as with a real
kubelet, with the same status fields.

What a pod's containers do is a `Policy`, chosen when the kubelet first sees the pod: the newest
rule whose predicate matches (`FakeKubelet.add_policy`), else the default. A policy describes the
*container*; the pod's restartPolicy decides the rest, as on a real node: a container that exits
1 fails a `Never` pod but puts an `Always` pod into CrashLoopBackOff.

The scheduler places pods by priority (spec.priority, which admission resolved from the pod's
PriorityClass), honours node selectors, required and preferred node affinity, taints and
capacity, and, when a pod fits nowhere, preempts as kube-scheduler's default PostFilter does:
on the node where the fewest and least important lower-priority pods must go, it marks them
(DisruptionTarget) and deletes them gracefully, and nominates the node to the pod
(status.nominatedNodeName), whose room no pod of lower priority may take meanwhile. A pod
whose preemptionPolicy is Never waits instead.

A container starts only once every Secret its pod mounts (a `secret` volume, not optional)
exists: until then it waits in ContainerCreating, and the kubelet looks again whenever a
Secret is made, as a real one retries the mount.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from tests.k8s.fake_store import (
    NODES,
    PODS,
    SECRETS,
    TERMINAL_PHASES,
    Change,
    Obj,
    Store,
    now_rfc3339,
    parse_quantity,
)

# --------------------------------------------------------------------------------------------
# Policies: what a pod's containers do once started
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Policy:
    start_after: float | None = None  # scheduled -> Running; None: the kubelet's start_delay
    sigterm_exit_code: int = 143  # the exit code when the pod is deleted while running


@dataclass(frozen=True, kw_only=True)
class RunForever(_Policy):
    """Containers run until the pod is deleted."""


@dataclass(frozen=True, kw_only=True)
class Exit(_Policy):
    """Containers exit with `code` after running `after` seconds. Restart policy Never (or
    OnFailure with code 0) ends the pod Succeeded/Failed; otherwise the container is restarted
    after a back-off and exits again: CrashLoopBackOff with a growing restartCount."""

    code: int = 0
    after: float = 0.1
    reason: str | None = None  # containerStatuses[].state.terminated.reason; default by code
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class OOMKilled(Exit):
    code: int = 137
    reason: str | None = "OOMKilled"


@dataclass(frozen=True, kw_only=True)
class CrashLoop(Exit):
    """Exit 1 shortly after every start; in a restartPolicy Always/OnFailure pod (the default
    is Always) that is CrashLoopBackOff."""

    code: int = 1
    after: float = 0.02


@dataclass(frozen=True, kw_only=True)
class Evicted(_Policy):
    """The kubelet evicts the pod `after` seconds into its run (node pressure)."""

    after: float = 0.1
    message: str = (
        "The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki. "
    )


@dataclass(frozen=True, kw_only=True)
class Preempted(_Policy):
    """Preempted `after` seconds into its run. By the scheduler: a DisruptionTarget condition
    (PreemptionByScheduler), then a graceful delete. By the kubelet (critical pod admission):
    phase Failed with reason Preempting."""

    after: float = 0.1
    by: Literal["scheduler", "kubelet"] = "scheduler"


@dataclass(frozen=True, kw_only=True)
class ImagePullError(_Policy):
    """The image never pulls: Pending, waiting ErrImagePull then ImagePullBackOff, in turn."""

    message: str = "failed to pull and unpack image: failed to resolve reference: not found"


Policy = RunForever | Exit | Evicted | Preempted | ImagePullError


@dataclass
class PolicyRule:
    policy: Policy
    match: Callable[[Obj], bool]
    remaining: int | None  # how many more pods take it; None: every matching pod
    pods: list[str] = field(default_factory=list)  # the pods it was given to, by name


# --------------------------------------------------------------------------------------------
# Scheduling: which node a pod fits on, and why not
# --------------------------------------------------------------------------------------------


def pod_requests(pod: Obj) -> dict[str, Fraction]:
    """What the scheduler reserves: the sum over containers, or the largest init container."""
    spec = pod.get("spec") or {}

    def requests(container: Obj) -> dict[str, Fraction]:
        raw = (container.get("resources") or {}).get("requests") or {}
        return {name: parse_quantity(value) for name, value in raw.items()}

    total: dict[str, Fraction] = {}
    for container in spec.get("containers") or []:
        for name, amount in requests(container).items():
            total[name] = total.get(name, Fraction(0)) + amount
    for container in spec.get("initContainers") or []:
        for name, amount in requests(container).items():
            total[name] = max(total.get(name, Fraction(0)), amount)
    return total


def _node_taints(node: Obj) -> list[Obj]:
    """The node's taints, plus those the node lifecycle controller would add for its state."""
    taints = list((node.get("spec") or {}).get("taints") or [])
    ready = _condition(node, "Ready")
    if ready is None or ready.get("status") == "False":
        taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
    elif ready.get("status") != "True":
        taints.append({"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"})
    return taints


def _tolerates(tolerations: list[Obj], taint: Obj) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expression_matches(expr: Obj, values_of: Callable[[str], str | None]) -> bool:
    actual = values_of(expr["key"])
    op, values = expr.get("operator"), expr.get("values") or []
    if op == "In":
        return actual is not None and actual in values
    if op == "NotIn":
        return actual is None or actual not in values
    if op == "Exists":
        return actual is not None
    if op == "DoesNotExist":
        return actual is None
    if op in ("Gt", "Lt") and actual is not None:
        try:
            a, bound = int(actual), int(values[0])
        except (ValueError, IndexError):
            return False
        return a > bound if op == "Gt" else a < bound
    return False


def node_matches(pod: Obj, node: Obj) -> bool:
    """spec.nodeSelector and required node affinity (terms ORed, expressions ANDed)."""
    spec = pod.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not affinity:
        return True
    fields = {"metadata.name": node["metadata"]["name"]}
    for term in affinity.get("nodeSelectorTerms") or []:
        expressions = term.get("matchExpressions") or []
        field_exprs = term.get("matchFields") or []
        if not expressions and not field_exprs:
            continue  # an empty term selects nothing
        if all(_expression_matches(e, labels.get) for e in expressions) and all(
            _expression_matches(e, fields.get) for e in field_exprs
        ):
            return True
    return False


def preferred_weight(pod: Obj, node: Obj) -> int:
    """The summed weights of the pod's preferred node affinity terms that `node` matches."""
    preferred = (((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}).get(
        "preferredDuringSchedulingIgnoredDuringExecution"
    ) or []
    labels = node["metadata"].get("labels") or {}
    return sum(
        int(term.get("weight", 0))
        for term in preferred
        if all(
            _expression_matches(e, labels.get)
            for e in (term.get("preference") or {}).get("matchExpressions") or []
        )
    )


def _condition(obj: Obj, kind: str) -> Obj | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return None


def _condition_is(pod: Obj, kind: str, reason: str) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("reason") == reason for c in conditions)


def set_condition(
    pod: Obj, kind: str, value: str, reason: str | None = None, message: str | None = None
) -> None:
    conditions: list[Obj] = pod.setdefault("status", {}).setdefault("conditions", [])
    current = next((c for c in conditions if c.get("type") == kind), None)
    if current is None:
        current = {"type": kind, "status": value, "lastProbeTime": None}
        current["lastTransitionTime"] = now_rfc3339()
        conditions.append(current)
    elif current["status"] != value:
        current["status"] = value
        current["lastTransitionTime"] = now_rfc3339()
    for key, text in (("reason", reason), ("message", message)):
        if text is None:
            current.pop(key, None)
        else:
            current[key] = text


def _set_unready(pod: Obj) -> None:
    names = " ".join(c["name"] for c in pod["spec"]["containers"])
    unready = f"containers with unready status: [{names}]"
    set_condition(pod, "ContainersReady", "False", "ContainersNotReady", unready)
    set_condition(pod, "Ready", "False", "ContainersNotReady", unready)


_MIN_PRIORITY = -(2**31)


def _priority(pod: Obj) -> int:
    return int(pod["spec"].get("priority") or 0)


# --------------------------------------------------------------------------------------------
# The kubelet
# --------------------------------------------------------------------------------------------


@dataclass
class _PodRun:
    """What the kubelet remembers of a pod it has seen (keyed by uid)."""

    policy: Policy
    seq: int  # first-seen order: pods of equal priority are scheduled first come, first served
    stage: str = "waiting"  # waiting -> running <-> backoff | pulling; done
    start_at: float | None = None
    next_at: float | None = None  # when the current stage ends
    kill_at: float | None = None  # when a graceful deletion completes
    started_at: str = ""
    container_id: str = ""
    pull_attempts: int = 0


class FakeKubelet:
    def __init__(
        self,
        store: Store,
        *,
        start_delay: float,
        terminate_delay: float,
        backoff_delay: float,
        default_policy: Policy,
    ) -> None:
        self._store = store
        self.start_delay = start_delay
        self.terminate_delay = terminate_delay
        self.backoff_delay = backoff_delay
        self.default_policy = default_policy
        self._rules: list[PolicyRule] = []
        self._runs: dict[str, _PodRun] = {}
        self._seq = itertools.count()
        self._pod_ips = itertools.count(2)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._unsubscribe = self._store.subscribe(self._on_change)
        self._task = asyncio.create_task(self._run(), name="fake-kubelet")

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif (exc := task.exception()) is not None:
            raise exc

    def check(self) -> None:
        """Raise the error the kubelet died of, if it died: a test must not wait on a corpse."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            exc = self._task.exception()
            if exc is not None:
                raise RuntimeError("the fake kubelet crashed") from exc

    def _on_change(self, change: Change) -> None:
        if change.rt is PODS and change.type == "ADDED":
            self._run_of(change.obj)  # the policy goes to pods in the order they are created
        if change.rt is PODS or change.rt is NODES or change.rt is SECRETS:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            wake_at = self._reconcile_all(loop.time())
            timeout = None if wake_at is None else max(0.0, wake_at - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    # ---- test controls ---------------------------------------------------------------------

    def add_policy(
        self, policy: Policy, match: Callable[[Obj], bool], count: int | None
    ) -> PolicyRule:
        rule = PolicyRule(policy, match, count)
        self._rules.append(rule)
        return rule

    def evict(self, namespace: str, name: str, reason: str, message: str) -> Obj:
        pod = self._bound_pod(namespace, name)
        self._run_of(pod).stage = "done"
        return self._write(pod, lambda p: self._evicted(p, reason, message))

    def exit(self, namespace: str, name: str, code: int) -> Obj:
        """The pod's containers exit now with `code`, as an `Exit` policy's do when their
        time comes: a program that ends of itself (its work done, its drain over). Nothing
        happens to a pod whose containers do not run."""
        pod = self._bound_pod(namespace, name)
        run = self._run_of(pod)
        if run.stage != "running":
            return pod
        self._exit(pod, run, Exit(code=code), asyncio.get_running_loop().time())
        return self._store.get(PODS, namespace, name) or pod

    def preempt(self, namespace: str, name: str, by: Literal["scheduler", "kubelet"]) -> Obj:
        pod = self._bound_pod(namespace, name)
        return self._preempt(pod, self._run_of(pod), by)

    def node_lost(self, node: str, pods: Literal["fail", "delete", "keep"]) -> None:
        """What the pod garbage collector does to the pods of a node that is gone."""
        if pods == "keep":
            return
        for pod in self._store.objects(PODS):
            spec, status = pod["spec"], pod.get("status") or {}
            if spec.get("nodeName") != node or status.get("phase") in TERMINAL_PHASES:
                continue
            self._run_of(pod).stage = "done"
            name = pod["metadata"]["name"]

            def lost(p: Obj, name: str = name) -> None:
                st = p["status"]
                st["phase"] = "Failed"
                st["reason"] = "NodeLost"
                st["message"] = f"Node {node} which was running pod {name} is unresponsive"
                set_condition(
                    p, "DisruptionTarget", "True", "DeletionByPodGC", "PodGC: node no longer exists"
                )
                set_condition(p, "Ready", "False", "PodFailed")

            self._write(pod, lost)
            if pods == "delete":
                self._store.delete(PODS, pod["metadata"]["namespace"], name, grace_period=0)

    # ---- the reconcile pass ----------------------------------------------------------------

    def _reconcile_all(self, now: float) -> float | None:
        pods = self._store.view(PODS)
        for pod in pods:
            self._run_of(pod)
        live = {p["metadata"]["uid"] for p in pods}
        for uid in [uid for uid in self._runs if uid not in live]:
            del self._runs[uid]
        pods.sort(key=lambda p: (-_priority(p), self._run_of(p).seq))
        wake_at: float | None = None
        for pod in pods:
            at = self._reconcile(pod, self._run_of(pod), now)
            if at is not None and (wake_at is None or at < wake_at):
                wake_at = at
        return wake_at

    def _run_of(self, pod: Obj) -> _PodRun:
        uid = pod["metadata"]["uid"]
        run = self._runs.get(uid)
        if run is None:
            run = self._runs[uid] = _PodRun(self._choose_policy(pod), next(self._seq))
        return run

    def _choose_policy(self, pod: Obj) -> Policy:
        for rule in reversed(self._rules):
            if rule.remaining != 0 and rule.match(pod):
                if rule.remaining is not None:
                    rule.remaining -= 1
                rule.pods.append(pod["metadata"]["name"])
                return rule.policy
        return self.default_policy

    def _reconcile(self, pod: Obj, run: _PodRun, now: float) -> float | None:
        spec, status = pod["spec"], pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            return self._terminate(pod, run, now)
        if status.get("phase") in TERMINAL_PHASES or run.stage == "done":
            run.stage = "done"
            return None
        if not spec.get("nodeName") and spec.get("schedulingGates"):
            # The scheduler leaves a gated pod alone until every gate is removed.
            if not _condition_is(pod, "PodScheduled", "SchedulingGated"):
                self._write(
                    pod,
                    lambda p: set_condition(
                        p, "PodScheduled", "False", "SchedulingGated", "Scheduling is blocked"
                    ),
                )
            return None
        if not spec.get("nodeName"):
            self._schedule(pod)
            return None
        if run.start_at is None:
            delay = run.policy.start_after
            run.start_at = now + (self.start_delay if delay is None else delay)
        if now < run.start_at:
            return run.start_at
        return self._advance(pod, run, now)

    def _advance(self, pod: Obj, run: _PodRun, now: float) -> float | None:
        policy = run.policy
        if run.stage == "waiting":
            missing = self._missing_secrets(pod)
            if missing:
                message = f'MountVolume.SetUp failed: secret "{missing[0]}" not found'
                if not _waiting_for(pod, "ContainerCreating"):
                    self._write(pod, lambda p: self._waiting(p, "ContainerCreating", message))
                return None  # a Secret made wakes the kubelet
            if isinstance(policy, ImagePullError):
                run.stage, run.next_at = "pulling", now + self.backoff_delay
                self._write(pod, lambda p: self._waiting(p, "ErrImagePull", policy.message))
                return run.next_at
            self._start(pod, run)
            run.stage = "running"
            after = getattr(policy, "after", None)
            run.next_at = None if after is None else now + after
            return run.next_at
        if run.next_at is None or now < run.next_at:
            return run.next_at
        if run.stage == "pulling" and isinstance(policy, ImagePullError):
            # Each failed pull is followed by a back-off, and so on for ever.
            run.pull_attempts += 1
            if run.pull_attempts % 2:
                image = pod["spec"]["containers"][0]["image"]
                reason, message = "ImagePullBackOff", f'Back-off pulling image "{image}"'
            else:
                reason, message = "ErrImagePull", policy.message
            self._write(pod, lambda p: self._waiting(p, reason, message))
            run.next_at = now + self.backoff_delay
        elif run.stage == "backoff":
            self._start(pod, run)
            run.stage = "running"
            run.next_at = now + policy.after if isinstance(policy, Exit) else None
        elif isinstance(policy, Exit):
            self._exit(pod, run, policy, now)
        elif isinstance(policy, Evicted):
            run.stage, run.next_at = "done", None
            self._write(pod, lambda p: self._evicted(p, "Evicted", policy.message))
        elif isinstance(policy, Preempted):
            self._preempt(pod, run, policy.by)
        return run.next_at

    def _schedule(self, pod: Obj) -> None:
        nodes = self._store.view(NODES)
        pods = self._store.view(PODS)
        wanted = pod_requests(pod)
        reasons: Counter[str] = Counter()
        fits: list[tuple[Fraction, str]] = []
        for node in nodes:
            misfits, free = self._misfits(pod, wanted, node, pods)
            if misfits:
                reasons.update(misfits)
            else:
                fits.append((free, node["metadata"]["name"]))
        if fits:
            # Preferred node affinity outweighs spreading (its plugin weighs twice the
            # resource scores); among equals the least allocated node wins.
            preference = {n["metadata"]["name"]: preferred_weight(pod, n) for n in nodes}
            best = min(fits, key=lambda f: (-preference[f[1]], -f[0], f[1]))[1]

            def bind(p: Obj) -> None:
                p["spec"]["nodeName"] = best
                p["status"].pop("nominatedNodeName", None)
                set_condition(p, "PodScheduled", "True")

            self._write(pod, bind)
            return
        if nodes:
            summary = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
            message = f"0/{len(nodes)} nodes are available: {summary}."
        else:
            message = "no nodes available to schedule pods"
        nominated = self._preempt_for(pod, wanted, nodes, pods)

        def unschedulable(p: Obj) -> None:
            set_condition(p, "PodScheduled", "False", "Unschedulable", message)
            if nominated:
                p["status"]["nominatedNodeName"] = nominated

        self._write(pod, unschedulable)

    # ---- preemption, as kube-scheduler's default PostFilter does it ------------------------

    def _preempt_for(
        self, pod: Obj, wanted: dict[str, Fraction], nodes: list[Obj], pods: list[Obj]
    ) -> str | None:
        """Make room for `pod` by preempting lower-priority pods on one node; returns the node
        it is nominated to (its victims terminate gracefully first), or None."""
        spec = pod["spec"]
        if spec.get("preemptionPolicy") == "Never":
            return None
        priority = _priority(pod)
        nominated = (pod.get("status") or {}).get("nominatedNodeName")
        if nominated and any(
            other["spec"].get("nodeName") == nominated
            and other["metadata"].get("deletionTimestamp")
            and _priority(other) < priority
            for other in pods
        ):
            return str(nominated)  # its victims are still going: no second round of victims
        candidates: list[tuple[tuple[int, int, int, float, str], str, list[Obj]]] = []
        for node in nodes:
            victims = self._victims(pod, wanted, node, pods)
            if victims is None:
                continue
            if not victims:
                continue  # it fits without preemption: not this pass's business
            top = max(_priority(v) for v in victims)
            latest_top = max(self._run_of(v).seq for v in victims if _priority(v) == top)
            rank = (
                top,  # the lowest highest-priority victim
                sum(_priority(v) - _MIN_PRIORITY for v in victims),
                len(victims),
                -latest_top,  # the most recently started of the most important victims
                node["metadata"]["name"],
            )
            candidates.append((rank, node["metadata"]["name"], victims))
        if not candidates:
            return None
        _, name, victims = min(candidates, key=lambda c: c[0])
        for victim in victims:
            self._preempt(victim, self._run_of(victim), "scheduler")
        return name

    def _victims(
        self, pod: Obj, wanted: dict[str, Fraction], node: Obj, pods: list[Obj]
    ) -> list[Obj] | None:
        """The fewest lower-priority pods of `node` whose going makes room for `pod`: remove
        them all, then give back the most important first while the pod still fits. None:
        no preemption on this node helps."""
        name = node["metadata"]["name"]
        priority = _priority(pod)
        lower = [
            p
            for p in pods
            if p["spec"].get("nodeName") == name
            and (p.get("status") or {}).get("phase") not in TERMINAL_PHASES
            and not p["metadata"].get("deletionTimestamp")
            and _priority(p) < priority
        ]
        if not lower:
            return None
        removed = {p["metadata"]["uid"] for p in lower}
        misfits, _ = self._misfits(pod, wanted, node, pods, without=removed)
        if misfits:
            return None
        victims = []
        for candidate in sorted(lower, key=lambda p: (-_priority(p), self._run_of(p).seq)):
            removed.discard(candidate["metadata"]["uid"])
            if self._misfits(pod, wanted, node, pods, without=removed)[0]:
                removed.add(candidate["metadata"]["uid"])
                victims.append(candidate)
        return victims

    def _misfits(
        self,
        pod: Obj,
        wanted: dict[str, Fraction],
        node: Obj,
        pods: list[Obj],
        *,
        without: set[str] | None = None,
    ) -> tuple[list[str], Fraction]:
        """Why `pod` cannot go on `node` (as the scheduler words it), and how free the node
        would be after taking it. Pods in `without` (uids) are counted as gone; pods nominated
        to the node at the pod's priority or above are counted as there."""
        spec = pod.get("spec") or {}
        name = node["metadata"]["name"]
        if (node.get("spec") or {}).get("unschedulable") and not _tolerates(
            spec.get("tolerations") or [],
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
        ):
            return ["node(s) were unschedulable"], Fraction(0)
        for taint in _node_taints(node):
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(
                spec.get("tolerations") or [], taint
            ):
                return [
                    f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
                ], Fraction(0)
        if not node_matches(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"], Fraction(0)
        allocatable = {
            k: parse_quantity(v)
            for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()
        }
        used: dict[str, Fraction] = {}
        count = 0
        priority = _priority(pod)
        for other in pods:
            if other["metadata"]["uid"] in (without or ()):
                continue
            if other["spec"].get("nodeName") != name:
                nominated = (other.get("status") or {}).get("nominatedNodeName") == name
                if not (
                    nominated
                    and not other["spec"].get("nodeName")
                    and other["metadata"]["uid"] != pod["metadata"]["uid"]
                    and _priority(other) >= priority
                ):
                    continue
            elif (other.get("status") or {}).get("phase") in TERMINAL_PHASES:
                continue
            count += 1
            for resource, amount in pod_requests(other).items():
                used[resource] = used.get(resource, Fraction(0)) + amount
        misfits = [
            f"Insufficient {resource}"
            for resource, amount in sorted(wanted.items())
            if amount > 0
            and used.get(resource, Fraction(0)) + amount > allocatable.get(resource, 0)
        ]
        if count + 1 > allocatable.get("pods", Fraction(110)):
            misfits.append("Too many pods")
        shares = [
            (allocatable[r] - used.get(r, Fraction(0)) - wanted.get(r, Fraction(0)))
            / allocatable[r]
            for r in ("cpu", "memory")
            if allocatable.get(r)
        ]
        return misfits, (sum(shares, Fraction(0)) / len(shares) if shares else Fraction(0))

    def _missing_secrets(self, pod: Obj) -> list[str]:
        namespace = pod["metadata"]["namespace"]
        missing = []
        for volume in pod["spec"].get("volumes") or []:
            secret = volume.get("secret")
            if not isinstance(secret, dict) or secret.get("optional"):
                continue
            name = str(secret.get("secretName", ""))
            if self._store.get(SECRETS, namespace, name) is None:
                missing.append(name)
        return missing

    # ---- status writes ---------------------------------------------------------------------

    def _write(self, pod: Obj, change: Callable[[Obj], None]) -> Obj:
        meta = pod["metadata"]
        updated = self._store.mutate(PODS, meta["namespace"], meta["name"], change)
        return updated if updated is not None else pod

    def _start(self, pod: Obj, run: _PodRun) -> None:
        run.started_at = now_rfc3339()
        run.container_id = "containerd://" + secrets.token_hex(32)
        node = self._store.get(NODES, "", pod["spec"]["nodeName"]) or {}
        host_ip = next(
            (
                a["address"]
                for a in (node.get("status") or {}).get("addresses") or []
                if a.get("type") == "InternalIP"
            ),
            "10.0.0.1",
        )

        def start(p: Obj) -> None:
            st = p["status"]
            st["phase"] = "Running"
            st.setdefault("startTime", run.started_at)
            st["hostIP"], st["hostIPs"] = host_ip, [{"ip": host_ip}]
            if "podIP" not in st:
                n = next(self._pod_ips)
                ip = f"10.244.{n // 250}.{n % 250 + 1}"
                st["podIP"], st["podIPs"] = ip, [{"ip": ip}]
            self._set_containers(p, run, {"running": {"startedAt": run.started_at}}, ready=True)
            done = {
                "terminated": {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": run.started_at,
                    "finishedAt": run.started_at,
                }
            }
            init = p["spec"].get("initContainers") or []
            if init:
                st["initContainerStatuses"] = [
                    self._container_status(c, run, done, ready=True) for c in init
                ]
            for kind in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready"):
                set_condition(p, kind, "True")

        self._write(pod, start)

    def _exit(self, pod: Obj, run: _PodRun, policy: Exit, now: float) -> None:
        terminated: Obj = {
            "exitCode": policy.code,
            "reason": policy.reason or ("Completed" if policy.code == 0 else "Error"),
            "startedAt": run.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": run.container_id,
        }
        if policy.message is not None:
            terminated["message"] = policy.message
        restart_policy = pod["spec"].get("restartPolicy", "Always")
        restart = restart_policy == "Always" or (restart_policy == "OnFailure" and policy.code != 0)
        meta = pod["metadata"]
        names = [c["name"] for c in pod["spec"]["containers"]]

        def exited(p: Obj) -> None:
            st = p["status"]
            if restart:
                waiting = {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {self.backoff_delay:g}s restarting failed container="
                    f"{names[0]} pod={meta['name']}_{meta['namespace']}({meta['uid']})",
                }
                self._set_containers(
                    p,
                    run,
                    {"waiting": waiting},
                    ready=False,
                    last_state={"terminated": terminated},
                    restarted=True,
                )
                _set_unready(p)
                return
            st["phase"] = "Succeeded" if policy.code == 0 else "Failed"
            self._set_containers(p, run, {"terminated": terminated}, ready=False)
            why = "PodCompleted" if policy.code == 0 else "PodFailed"
            set_condition(p, "PodReadyToStartContainers", "False")
            set_condition(p, "ContainersReady", "False", why)
            set_condition(p, "Ready", "False", why)

        if restart:
            run.stage, run.next_at = "backoff", now + self.backoff_delay
        else:
            run.stage, run.next_at = "done", None
        self._write(pod, exited)

    def _evicted(self, p: Obj, reason: str, message: str) -> None:
        st = p["status"]
        st["phase"], st["reason"], st["message"] = "Failed", reason, message
        set_condition(p, "DisruptionTarget", "True", "TerminationByKubelet", message)
        self._kill_containers(p, exit_code=137)

    def _preempt(self, pod: Obj, run: _PodRun, by: Literal["scheduler", "kubelet"]) -> Obj:
        run.next_at = None
        meta = pod["metadata"]
        if by == "kubelet":
            run.stage = "done"

            def preempted(p: Obj) -> None:
                st = p["status"]
                st["phase"], st["reason"] = "Failed", "Preempting"
                st["message"] = "Preempted in order to admit critical pod"
                set_condition(
                    p,
                    "DisruptionTarget",
                    "True",
                    "TerminationByKubelet",
                    "Preempted in order to admit critical pod",
                )
                self._kill_containers(p, exit_code=137)

            return self._write(pod, preempted)
        pod = self._write(
            pod,
            lambda p: set_condition(
                p,
                "DisruptionTarget",
                "True",
                "PreemptionByScheduler",
                f"{p['spec'].get('schedulerName', 'default-scheduler')}: preempting to "
                "accommodate a higher priority pod",
            ),
        )
        # The scheduler deletes the victim with its own grace period; the kubelet's
        # termination path then finishes it.
        obj, _ = self._store.delete(PODS, meta["namespace"], meta["name"])
        return obj

    def _terminate(self, pod: Obj, run: _PodRun, now: float) -> float | None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
        if run.stage == "done" and grace == 0:
            return None  # finished; only a finalizer still holds the pod
        kill_at = now + min(grace, self.terminate_delay)
        run.kill_at = kill_at if run.kill_at is None else min(run.kill_at, kill_at)
        if now < run.kill_at:
            return run.kill_at
        if run.stage in ("running", "backoff"):
            # The real kubelet reports the pod terminal before it goes: a watcher sees the
            # deleted pod turn Failed (or Succeeded) first.
            code = 137 if grace == 0 else run.policy.sigterm_exit_code

            def killed(p: Obj) -> None:
                p["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
                self._kill_containers(p, exit_code=code)

            self._write(pod, killed)
        run.stage, run.next_at = "done", None
        if grace > 0:
            # The kubelet's final delete with grace 0: gone now, unless finalizers hold it.
            self._write(pod, lambda p: p["metadata"].__setitem__("deletionGracePeriodSeconds", 0))
        return None

    def _kill_containers(self, p: Obj, *, exit_code: int) -> None:
        run = self._run_of(p)
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": run.started_at or now_rfc3339(),
            "finishedAt": now_rfc3339(),
        }
        if run.container_id:
            terminated["containerID"] = run.container_id
        self._set_containers(p, run, {"terminated": terminated}, ready=False)
        for kind in ("ContainersReady", "Ready"):
            set_condition(p, kind, "False", "PodFailed" if exit_code else "PodCompleted")

    def _waiting(self, p: Obj, reason: str, message: str) -> None:
        self._set_containers(
            p, self._run_of(p), {"waiting": {"reason": reason, "message": message}}, ready=False
        )
        _set_unready(p)

    def _set_containers(
        self,
        p: Obj,
        run: _PodRun,
        state: Obj,
        *,
        ready: bool,
        last_state: Obj | None = None,
        restarted: bool = False,
    ) -> None:
        previous = {c["name"]: c for c in p["status"].get("containerStatuses") or []}
        statuses = []
        for container in p["spec"]["containers"]:
            old = previous.get(container["name"], {})
            status = self._container_status(container, run, state, ready=ready)
            status["restartCount"] = old.get("restartCount", 0) + (1 if restarted else 0)
            status["lastState"] = last_state if last_state is not None else old.get("lastState", {})
            statuses.append(status)
        p["status"]["containerStatuses"] = statuses

    @staticmethod
    def _container_status(container: Obj, run: _PodRun, state: Obj, *, ready: bool) -> Obj:
        ran = "waiting" not in state or run.container_id != ""
        status: Obj = {
            "name": container["name"],
            "image": container["image"],
            "imageID": _image_id(container["image"]) if ran else "",
            "ready": ready,
            "started": "running" in state,
            "restartCount": 0,
            "state": state,
            "lastState": {},
        }
        if run.container_id and "waiting" not in state:
            status["containerID"] = run.container_id
        return status

    def _bound_pod(self, namespace: str, name: str) -> Obj:
        pod = self._store.get(PODS, namespace, name)
        if pod is None:
            raise KeyError(f"no pod {namespace}/{name}")
        if not pod["spec"].get("nodeName"):
            raise ValueError(f"pod {namespace}/{name} is not on a node: no kubelet runs it")
        return pod


def _waiting_for(pod: Obj, reason: str) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all(
        ((c.get("state") or {}).get("waiting") or {}).get("reason") == reason for c in statuses
    )


def _image_id(image: str) -> str:
    """What a kubelet reports as the image a container runs: the repository and the digest of
    what the tag resolved to when it was pulled (here: a digest made from the reference)."""
    repository = image.split("@", 1)[0]
    last = repository.rsplit("/", 1)[-1]
    if ":" in last:
        repository = repository[: len(repository) - len(last)] + last.split(":", 1)[0]
    if "@sha256:" in image:
        return f"{repository}@{image.split('@', 1)[1]}"
    return f"{repository}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"
