"""Why a worker pod failed, read from its status, and what to do about it.

- capacity: evicted, preempted, its node lost or reclaimed. Not the worker's fault: relaunch
  (elsewhere), no penalty.
- oom: killed for memory. Relaunch with more memory, up to a cap.
- crash: exited non-zero, or keeps restarting. Relaunch after a backoff; too many in a row and
  the job is failed; pods failing on the same node make it one to avoid.
- setup: the worker could not start its pipeline there (a model that would not load, a GPU
  that would not open). The node's fault, until workers fail so on several nodes with none of
  the job's ever ready: then the job's (see reconcile.SetupFailures).
- fatal: the image cannot be pulled, the pod cannot be created, or the worker says its
  configuration is wrong: relaunching cannot help; the job fails with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ebb.common.runner import EXIT_CONFIG, EXIT_SETUP

Kind = Literal["capacity", "oom", "crash", "setup", "fatal"]

_FATAL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImageNeverPull",
    }
)
_CAPACITY_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "Terminated"})
_PREEMPTIONS = frozenset({"Preempting", "PreemptionByScheduler"})
"""The reasons of a pod the scheduler preempted for a pod of higher priority."""
_DISRUPTIONS = frozenset(
    {
        "PreemptionByScheduler",
        "TerminationByKubelet",
        "DeletionByTaintManager",
        "EvictionByEvictionAPI",
    }
)


@dataclass(frozen=True)
class Failure:
    kind: Kind
    reason: str


def preempted(pod: dict[str, Any]) -> bool:
    """The pod was preempted for a pod of higher priority (an online one, on a mixed node).
    The scheduler says so in the pod's DisruptionTarget condition before it deletes it, so it
    shows while the pod drains, however the worker then ends (a drained worker exits 0); a
    kubelet that preempts it leaves it Failed, `Preempting`."""
    status = pod.get("status") or {}
    if status.get("reason") in _PREEMPTIONS:
        return True
    return any(
        c.get("type") == "DisruptionTarget"
        and c.get("status") == "True"
        and c.get("reason") in _PREEMPTIONS
        for c in status.get("conditions") or []
    )


def disruption(pod: dict[str, Any]) -> Failure | None:
    """The cluster's taking of the pod, as its DisruptionTarget condition says (preempted,
    evicted, its node's taint or shutdown), if it says so: capacity, nobody's fault."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        disrupted = (
            condition.get("type") == "DisruptionTarget" and condition.get("status") == "True"
        )
        if disrupted and condition.get("reason") in _DISRUPTIONS:
            return Failure("capacity", f"{condition['reason']}: {condition.get('message', '')}")
    return None


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return list(status.get("containerStatuses") or [])


def classify(pod: dict[str, Any], *, crashloop_restarts: int = 3) -> Failure | None:
    """The failure a pod (as a JSON map) shows, or None while it has none."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    reason = status.get("reason") or ""
    message = status.get("message") or ""
    for container in _containers(pod):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _FATAL_WAITING:
            return Failure("fatal", f"{waiting['reason']}: {waiting.get('message', '')}".strip())
        restarts = int(container.get("restartCount") or 0)
        if waiting.get("reason") == "CrashLoopBackOff" and restarts >= crashloop_restarts:
            last = (container.get("lastState") or {}).get("terminated") or {}
            if last.get("reason") == "OOMKilled":
                return Failure("oom", "OOMKilled, again and again")
            return Failure("crash", f"keeps crashing ({_exit(last)})")
    if phase != "Failed":
        return None
    if reason in _CAPACITY_REASONS:
        return Failure("capacity", f"{reason}: {message}".strip(": "))
    disrupted = disruption(pod)
    if disrupted is not None:
        return disrupted
    for container in _containers(pod):
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated.get("reason") == "OOMKilled":
            return Failure("oom", "OOMKilled")
        if terminated and int(terminated.get("exitCode") or 0) == EXIT_CONFIG:
            return Failure("fatal", f"the worker's configuration is wrong ({_exit(terminated)})")
        if terminated and int(terminated.get("exitCode") or 0) == EXIT_SETUP:
            return Failure("setup", f"its pipeline could not start ({_exit(terminated)})")
        if terminated and int(terminated.get("exitCode") or 0) != 0:
            return Failure("crash", _exit(terminated))
    return Failure("crash", reason or message or "failed")


def _exit(terminated: dict[str, Any]) -> str:
    code = terminated.get("exitCode")
    why = terminated.get("reason") or ""
    detail = terminated.get("message") or ""
    return f"exit code {code}" + (f", {why}" if why else "") + (f": {detail}" if detail else "")
