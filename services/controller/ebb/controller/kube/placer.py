"""Where each group's worker pods go on a Kubernetes cluster, pass by pass: its pool mode (its
spec's, or the WPAI policy's, from the time it needs yet and how often the mixed pool took its
workers back: ebb.controller.policy.pools), its node selector and tolerations
(podspec.pod_placement), the nodes capacity may count for it, and why none ever could
(placement.unplaceable).

The reclaims are counted here: a worker pod the scheduler preempted on a mixed node (for an
online pod), and one the tide drained (ebb.controller.kube.harvest counts those). A job's
count starts again when it no longer runs: a job resumed later is judged afresh.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable

from ebb.common.job.placement import PoolMode
from ebb.common.messaging.messages import JobStatus

from ..groups import groups_of, job_spec, tier_resources
from ..policy.capacity import Bin, Resources
from ..policy.failures import preempted
from ..policy.pools import MIXED, allows, decide, expected_s, preference
from .config import KubeConfig
from .placement import NodeFacts, Placement, unplaceable
from .podspec import JOB_LABEL, pod_placement
from .views import NodeView, PodView

Shape = Callable[[JobStatus, str], Resources]


class Placer:
    def __init__(self, config: KubeConfig, *, drained: Counter[str] | None = None) -> None:
        self.config = config
        self.drained: Counter[str] = drained if drained is not None else Counter()
        """Per job: its worker pods the tide drained (the harvester's count, read here)."""
        self.preempted: Counter[str] = Counter()
        """Per job: its worker pods the scheduler preempted on mixed nodes."""
        self._preempted_pods: set[str] = set()
        """Those pods, while they are still seen: each counts once."""

    def note_pods(self, pods: Iterable[PodView], nodes: Iterable[NodeView]) -> None:
        """Count the worker pods preempted on mixed nodes, each once. `pods`: every worker
        pod there is, ended and terminating ones included."""
        mixed = {n.name for n in nodes if n.meta.labels.get(self.config.pool_label) == MIXED}
        seen = set()
        for pod in pods:
            seen.add(pod.name)
            if pod.node in mixed and preempted(pod.obj) and pod.name not in self._preempted_pods:
                self._preempted_pods.add(pod.name)
                self.preempted[pod.meta.labels.get(JOB_LABEL, "")] += 1
        self._preempted_pods &= seen

    def forget_ended(self, running: Collection[str]) -> None:
        """Drop the counts of jobs that no longer run."""
        for counter in (self.preempted, self.drained):
            for job in [k for k in counter if k not in running]:
                del counter[job]

    def reclaims(self, job: str) -> int:
        """How often the mixed pool took back workers of `job`."""
        return self.drained[job] + self.preempted[job]

    def pool_mode(self, job: JobStatus, tier: str = "") -> PoolMode:
        """The pool mode of tier `tier` of `job` ("": a job without tiers): as its spec
        asks, or (`auto`) by the placement policy."""
        resources = tier_resources(job_spec(job), tier)
        group = next((g for g in groups_of(job) if g.tier == tier), None)
        if tier:
            shard_s = next((t.shard_s for t in job.tiers if t.name == tier), 0.0)
        else:
            shard_s = job.shard_s
        expected = None
        if group is not None:
            # A later tier's shards left include those the tiers before it have yet to
            # hand on: its `upstream`.
            expected = expected_s(
                remaining=group.upstream, max_workers=group.max_workers, shard_s=shard_s
            )
        return decide(
            resources.pool if resources is not None else "auto",
            expected=expected,
            reclaims=self.reclaims(job.id),
            policy=self.config.pools,
        )

    def placement(self, job: JobStatus, tier: str = "") -> Placement:
        """Where tier `tier`'s pods may run: their pool mode, and the node selector and
        tolerations of ours, the job's, the tier's and its GPU type's."""
        return pod_placement(self.config, job_spec(job), tier, pool=self.pool_mode(job, tier))

    def prefer(self, job: JobStatus, tier: str) -> Callable[[Bin], int]:
        """Capacity.prefer: its pool mode's preferred pool first."""
        return preference(self.pool_mode(job, tier))

    def eligible(
        self, nodes: Collection[NodeView]
    ) -> Callable[[JobStatus, str], Callable[[Bin], bool]]:
        """Capacity.eligible over `nodes`: those a group's pods may land on."""

        def eligible(job: JobStatus, tier: str) -> Callable[[Bin], bool]:
            placement = self.placement(job, tier)
            admitted = {n.name for n in nodes if placement.admits(n.meta.labels, n.taints())}
            return lambda b: b.name in admitted and allows(placement.pool, b.pool)

        return eligible

    def unplaceable(
        self, nodes: Collection[NodeView], shape: Shape
    ) -> Callable[[JobStatus, str], str]:
        """Capacity.unplaceable over `nodes`: every node of the cluster, ready or not."""
        facts = [
            NodeFacts(
                name=n.name,
                pool=n.meta.labels.get(self.config.pool_label, ""),
                labels=n.meta.labels,
                taints=n.taints(),
                allocatable=n.allocatable(),
            )
            for n in nodes
        ]

        def why(job: JobStatus, tier: str) -> str:
            return unplaceable(
                self.placement(job, tier),
                shape(job, tier),
                facts,
                pool_label=self.config.pool_label,
                gpu_label=self.config.gpu_type_label,
            )

        return why
