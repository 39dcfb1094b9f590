"""Benchmark 15: tiers in the cluster simulation: one tier against two.

A job whose preprocessing needs 4x the CPUs a GPU node has, run in one tier and in two, on a
cluster of 4 GPU nodes (8 cores and one `nvidia.com/gpu` each, tainted for GPU pods) and 8 CPU
nodes (16 cores each): the fake Kubernetes API server of the tests, a real shard master on a
real nats-server, the real controller (Kubernetes backend, reconciler: each tier of a job a
group of workers scaled on its own backlog, placed by its tier's node selector and
tolerations). Time is compressed: a simulated second lasts a few milliseconds.

What is simulated is the workers' computing (bench/sim_workers.py). Each pod the fake kubelet
runs gets a simulated worker that speaks the real lease protocol to the master
(`MasterClient`: lease with its tier, renew at a third of the lease telling its rows done,
commit), waits out the simulated time of its shard, writes a placeholder file and a real commit
record (`OutputStore.create_commit`) in its tier's root (a tier before the last under the
output root's `_tiers/<tier>`: the hand-off the master makes a shard of the next tier), and
commits. So the master's per-tier queues, hand-offs and backpressure, and the controller's
per-tier scaling, are what is measured. A worker whose pod is deleted drains as a real one
does: it leases nothing more, carries on with its shard for its grace, then commits the rows
done as a part of it (`split_at`); a renewal that asks for a split does the same at once. A
worker that is done ends its pod (Succeeded).

The job: one pipeline of two stages, `prep` (decoding, tokenizing: CPU work) and `model`
(GPU work), over N shards of 1,000 rows. A shard's `prep` costs P = 1,920 CPU-seconds and its
`model` G = 60 GPU-seconds: keeping one GPU busy takes P/G = 32 cores, 4x the 8 a GPU node
has. The two variants:

- one tier: both stages in pods of 1 GPU and 8 cores (a GPU node each), at most 4; a pod's
  shard takes max(G, P/8) = 240 s, `prep` and `model` pipelined (the model's batches overlap
  the next ones' preprocessing, pipeline fill ignored): the GPU busy G/240 of the time;
- two tiers: `prep` in a tier `cpu` of pods of 4 cores on the CPU nodes (min 1, max 64: the
  CPU nodes hold 32), `model` in a tier `gpu` of pods of 1 GPU and 2 cores on the GPU nodes
  (min 1, max 4). A `cpu` pod's shard takes P/4 plus the writing of its hand-off, a `gpu`
  pod's G plus the reading of one; the `gpu` tier is fed once the `cpu` tier has about 32
  cores per GPU, which the CPU nodes have, just.

Assumptions, each a parameter of this module or of bench/sim_workers.py:

- The hand-off's cost, from section 14's measure on this machine (3.2 µs a row of 268 bytes,
  written and read, start-up and fill included), scaled by bytes to what preprocessing would
  hand a vision model: 224 x 224 pixels, 3 channels of float16, 301,056 bytes a row. A
  shard's hand-off (301 MB) then costs 3.6 s: half to write, in the `cpu` pod (0.4% of its
  480 s), half to read, in the `gpu` pod, counted as time its GPU is idle (3% of its 60 s;
  a real worker reads ahead while its model runs: an upper bound). Section 14 wrote to a
  local disk; a cluster's store is slower or faster by its bandwidth per pod.
- Every shard of a tier costs the same. A pod starts its worker 60 s after the scheduler
  places it (image, model loaded). A worker computes one shard at a time; its lease of the
  next and its commit of the last overlap its computing, as a real worker's read-ahead has
  them do. The job's lease is 600 s (a `cpu` shard's time and a margin), renewed every 200 s.
- Pods are deleted with Ebb's default grace (60 s): the worker drains for 50 s, keeping 5 s
  (the split reserve) for the part, as the real worker does; the fake kubelet ends a pod still
  there 60 s and half a second of the machine's time after its deletion (the part's requests
  take the machine's milliseconds, simulated seconds on the compressed clock).
- The controller passes every 10 s (the real one passes on every event of the master's, at
  most 5 a second, and every 2 s at least); the master's waits are its defaults, in simulated
  seconds (a worker with nothing to do asks again after 1 s; the tail's wait is a tenth of the
  lease), and so are its speculation's.

Reported per variant: the job's time (submission to the last shard's commit), the GPU-busy
share (GPU-seconds of model work over the GPU-seconds the GPU pods held, from being placed to
their end, and over the GPU nodes' time for the whole job), the steady rate the throughput
model predicts, the pods of each tier at their peak, the hand-offs waiting for the `gpu` tier
at most (sampled at each pass) against the master's bound, and whether every row is in the
output once (the manifest's rows, each shard in it once, none quarantined; each tier's
commit records holding every row once; a shard done for each record).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.common.data.output import OutputStore
from ebb.common.job import parse_job
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, JobStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import KubeConfig, KubernetesBackend
from ebb.controller.reconcile import Reconciler, ReconcilerConfig
from ebb.shard_master.service import MasterConfig, ShardMaster
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.manifests import find

from .common import Context, Section, table
from .sim_workers import POD_GRACE_S, Counts, Fleet, SimClock, TierPace

# --------------------------------------------------------------------------------------------
# The cluster, the job and its costs
# --------------------------------------------------------------------------------------------

GPU_NODES = 4
GPU_NODE_CPUS = 8
CPU_NODES = 8
CPU_NODE_CPUS = 16
NODE_MEMORY_GB = 64
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ROWS_PER_SHARD = 1_000
NAMESPACE = "ebb"
BATCH_CLASS = find("PriorityClass", "ebb-batch")

POD_START_S = 60.0
"""From a pod bound to a node to its worker's first lease (image, model loaded)."""
END_MARGIN_S = 0.5
"""Of the machine's time, added to a deleted pod's grace before the fake kubelet ends it: a
draining worker commits its part in the machine's milliseconds, which the compressed clock
makes simulated seconds (a busy master's 60 ms, 15 s); a worker ends its pod itself once it
has, so that the margin is only an upper bound."""
LEASE_S = 600.0
"""The job's lease: a `cpu` pod's shard (495 s) and a margin."""
RECONCILE_S = 10.0
"""Between two passes of the controller."""


HANDOFF_S_PER_BYTE = 3.2e-6 / 268
"""Section 14, measured on this machine: a hand-off cost 3.2 µs a row of 268 bytes, written
once and read once (a second worker's start and the pipeline's fill and drain included: more
than the bytes' own cost)."""
HANDOFF_BYTES_PER_ROW = 3 * 224 * 224 * 2
"""What preprocessing hands the model, a row: an image of 224 x 224 pixels, 3 channels of
float16 (301,056 bytes)."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What a shard of ROWS_PER_SHARD rows costs, in simulated seconds."""

    model_s: float = 60.0
    """G: GPU-seconds of the model."""
    prep_cpu_s: float = 60.0 * 4 * GPU_NODE_CPUS
    """P: CPU-seconds of the preprocessing; P/G cores keep a GPU busy, 4x a GPU node's."""
    handoff_write_s: float = ROWS_PER_SHARD * HANDOFF_BYTES_PER_ROW * HANDOFF_S_PER_BYTE / 2
    """A pod of a tier before the last writing a shard's hand-off: half of what section 14
    measured, scaled to the hand-off's bytes."""
    handoff_read_s: float = ROWS_PER_SHARD * HANDOFF_BYTES_PER_ROW * HANDOFF_S_PER_BYTE / 2
    """A pod of a later tier reading it, its GPU idle meanwhile: the other half."""


@dataclass(frozen=True, kw_only=True)
class TierShape:
    """One tier of a variant: the stages it runs and the pods it runs them in."""

    name: str
    prep: bool
    model: bool
    cpu: float
    gpu: int
    memory_gb: float
    max_workers: int
    on_gpu_nodes: bool

    def resources(self) -> dict[str, Any]:
        return {
            "min_workers": 1,
            "max_workers": self.max_workers,
            "cpu": self.cpu,
            "memory_gb": self.memory_gb,
            "gpu": self.gpu,
        }


ONE_TIER = (
    TierShape(
        name="gpu",
        prep=True,
        model=True,
        cpu=GPU_NODE_CPUS,
        gpu=1,
        memory_gb=32,
        max_workers=GPU_NODES,
        on_gpu_nodes=True,
    ),
)
TWO_TIERS = (
    TierShape(
        name="cpu",
        prep=True,
        model=False,
        cpu=4,
        gpu=0,
        memory_gb=8,
        max_workers=64,
        on_gpu_nodes=False,
    ),
    TierShape(
        name="gpu",
        prep=False,
        model=True,
        cpu=2,
        gpu=1,
        memory_gb=16,
        max_workers=GPU_NODES,
        on_gpu_nodes=True,
    ),
)
VARIANTS: dict[str, tuple[TierShape, ...]] = {"one tier": ONE_TIER, "two tiers": TWO_TIERS}

# --------------------------------------------------------------------------------------------
# The throughput model: what the steady state should be
# --------------------------------------------------------------------------------------------


def shard_s(costs: Costs, tiers: tuple[TierShape, ...], k: int) -> float:
    """How long a pod of tier `k` takes over a whole shard: its stages pipelined (the
    slower sets the pace), plus the writing of a hand-off (a tier before the last) and the
    reading of one (a tier after the first)."""
    tier = tiers[k]
    prep = costs.prep_cpu_s / tier.cpu if tier.prep else 0.0
    model = costs.model_s if tier.model else 0.0
    write = costs.handoff_write_s if k < len(tiers) - 1 else 0.0
    read = costs.handoff_read_s if k > 0 else 0.0
    return max(prep, model) + write + read


def pods_that_fit(tier: TierShape) -> int:
    """The tier's pods the cluster holds at once: its nodes, and its max_workers."""
    if tier.on_gpu_nodes:
        nodes, cpus, gpus = GPU_NODES, GPU_NODE_CPUS, 1
    else:
        nodes, cpus, gpus = CPU_NODES, CPU_NODE_CPUS, 0
    per_node = math.floor(cpus / tier.cpu)
    if tier.gpu:
        per_node = min(per_node, gpus // tier.gpu)
    return min(tier.max_workers, per_node * nodes)


@dataclass(frozen=True, kw_only=True)
class Steady:
    """The steady state of a variant: every tier at its pods, the slowest setting the pace."""

    pods: dict[str, int]
    shards_per_s: float
    gpu_busy: float
    """The GPUs' share of their pods' time spent on the model."""


def steady(costs: Costs, tiers: tuple[TierShape, ...]) -> Steady:
    pods = {t.name: pods_that_fit(t) for t in tiers}
    rate = min(pods[t.name] / shard_s(costs, tiers, k) for k, t in enumerate(tiers))
    gpus = sum(pods[t.name] * t.gpu for t in tiers)
    return Steady(pods=pods, shards_per_s=rate, gpu_busy=rate * costs.model_s / gpus)


def handoff_bound(costs: Costs, tiers: tuple[TierShape, ...]) -> int:
    """The hand-offs waiting for the last tier at which the one before is held back, as the
    master reckons it (`Job.handoff_bound`) from shards that took the model's times."""
    if len(tiers) < 2:
        return 0
    most = tiers[-1].max_workers
    ratio = shard_s(costs, tiers, len(tiers) - 2) / shard_s(costs, tiers, len(tiers) - 1)
    return max(2, 2 * most, most + math.ceil(most * ratio))


def paces(costs: Costs, tiers: tuple[TierShape, ...]) -> dict[str, TierPace]:
    """How the simulated workers of each tier spend their time."""
    return {
        t.name: TierPace(
            name=t.name,
            shard_s=shard_s(costs, tiers, k),
            model_s=costs.model_s if t.model else 0.0,
            last=k == len(tiers) - 1,
            rows_per_shard=ROWS_PER_SHARD,
        )
        for k, t in enumerate(tiers)
    }


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    variant: str
    shards: int
    second_s: float
    """A simulated second, in the machine's seconds."""
    job_s: float
    gpu_model_s: float
    gpu_held_s: float
    gpu_held_fed_s: float
    """Of it, from the first hand-off on (two tiers), when the model first had work."""
    gpu_node_s: float
    peak_pods: dict[str, int]
    waiting_max: int
    """Hand-offs waiting for the last tier (its TODO shards), the most seen at a pass."""
    waiting_bound: int
    """The master's: the tier before is held back while this many wait (once both tiers have
    shards done; before, twice the last tier's workers)."""
    held_back_share: float
    """Of the controller's passes, those that found the first tier held back."""
    rows: int
    rows_out: int
    exactly_once: bool
    counts: Counts
    series: dict[str, list[float]]

    @property
    def busy_of_pods(self) -> float:
        return self.gpu_model_s / self.gpu_held_s if self.gpu_held_s else 0.0

    @property
    def busy_once_fed(self) -> float:
        return self.gpu_model_s / self.gpu_held_fed_s if self.gpu_held_fed_s else 0.0

    @property
    def busy_of_nodes(self) -> float:
        return self.gpu_model_s / self.gpu_node_s if self.gpu_node_s else 0.0


def job_body(
    tiers: tuple[TierShape, ...], data: Path, out: Path, *, second_s: float
) -> dict[str, Any]:
    """The job: `prep` and `model`, placed in `tiers`. Its lease is LEASE_S in the machine's
    seconds (the master keeps leases on its own clock)."""
    stages = [
        {"name": "prep", "modelet": "ebb.worker.modelets:Identity"},
        {"name": "model", "modelet": "ebb.worker.modelets:Identity"},
    ]
    return {
        "name": f"tiers-sim-{len(tiers)}",
        "input": {"uri": str(data), "rows_per_shard": ROWS_PER_SHARD},
        "pipeline": {"stages": stages},
        "output": {"uri": str(out)},
        "fault": {"lease_s": LEASE_S * second_s},
        "tiers": [
            {
                "name": t.name,
                "stages": [s for s, runs in (("prep", t.prep), ("model", t.model)) if runs],
                "resources": t.resources(),
                "node_selector": {"pool": "gpu" if t.on_gpu_nodes else "cpu"},
                **({"tolerations": [GPU_TOLERATION]} if t.on_gpu_nodes else {}),
            }
            for t in tiers
        ],
    }


def _cluster(kube: FakeKubeAPI) -> None:
    kube.add_namespace(NAMESPACE)
    kube.add("priorityclasses", BATCH_CLASS)
    memory = f"{NODE_MEMORY_GB}Gi"
    for n in range(GPU_NODES):
        kube.add_node(
            f"gpu-{n}",
            labels={"ebb.io/pool": "offline", "pool": "gpu"},
            allocatable={
                "cpu": str(GPU_NODE_CPUS),
                "memory": memory,
                "nvidia.com/gpu": "1",
                "pods": "110",
            },
            taints=[GPU_TAINT],
        )
    for n in range(CPU_NODES):
        kube.add_node(
            f"cpu-{n}",
            labels={"ebb.io/pool": "offline", "pool": "cpu"},
            allocatable={"cpu": str(CPU_NODE_CPUS), "memory": memory, "pods": "110"},
        )


async def _run(
    ctx: Context, variant: str, *, shards: int, costs: Costs, second_s: float
) -> RunResult:
    tiers = VARIANTS[variant]
    root = ctx.dir(f"tierssim-{time.monotonic_ns()}")
    data = root / "rows.parquet"
    rows = shards * ROWS_PER_SHARD
    pq.write_table(pa.table({"id": np.arange(rows)}), data, row_group_size=ROWS_PER_SHARD)
    nats = EmbeddedNats(state_dir=root / "nats")
    await asyncio.to_thread(nats.start)
    try:
        config = NatsConfig(url=nats.url)
        master = ShardMaster(
            MasterConfig(
                nats=config,
                id="sim",
                data_roots=[str(root)],
                # Its waits in simulated seconds: the compressed clock's, as the workers'.
                wait_retry_s=MasterConfig.wait_retry_s * second_s,
                speculate_after_s=MasterConfig.speculate_after_s * second_s,
            )
        )
        master_task = asyncio.create_task(master.run(), name="master")
        await master.ready.wait()
        try:
            async with FakeKubeAPI(
                start_delay=POD_START_S * second_s,
                terminate_delay=POD_GRACE_S * second_s + END_MARGIN_S,
            ) as kube:
                _cluster(kube)
                client = await EbbClient.connect(config)
                try:
                    body = job_body(tiers, data, root / "out", second_s=second_s)
                    return await _drive(
                        ctx, kube, client, config, body, variant, costs, shards, second_s
                    )
                finally:
                    await client.close()
        finally:
            master.request_stop()
            await master_task
    finally:
        await asyncio.to_thread(nats.stop)


async def _drive(
    ctx: Context,
    kube: FakeKubeAPI,
    client: EbbClient,
    config: NatsConfig,
    body: dict[str, Any],
    variant: str,
    costs: Costs,
    shards: int,
    second_s: float,
) -> RunResult:
    tiers = VARIANTS[variant]
    api = kube.api_client()
    backend = KubernetesBackend(
        KubeConfig(
            namespace=NAMESPACE,
            nats=config,
            tidal=None,
            grace_s=1,
            priority_class=BATCH_CLASS["metadata"]["name"],
        ),
        api,
    )
    master = MasterClient(client.nc, config)
    reconciler = Reconciler(
        master=MasterClient(client.nc, config, backoff=Backoff(attempts=1)),
        backend=backend,
        config=ReconcilerConfig(
            # Longer than the kubelet's end of a deleted pod (POD_GRACE_S): that is the grace.
            worker_grace_s=1.0,
            relaunch_backoff=Backoff(first_s=second_s, max_s=60 * second_s),
        ),
    )
    agents = [asyncio.create_task(a, name=n) for n, a in backend.agents().items()]
    loop = asyncio.get_running_loop()
    clock = SimClock(second_s, loop.time())
    spec = parse_job(body).with_id()
    job_id = await client.submit(spec)
    fleet = Fleet(
        kube,
        namespace=NAMESPACE,
        job=spec,
        paces=paces(costs, tiers),
        master=master,
        clock=clock,
    )
    names = [t.name for t in tiers]
    series: dict[str, list[float]] = {"hours": [], "waiting": []}
    series.update({f"{n} pods": [] for n in names})
    peak = dict.fromkeys(names, 0)
    waiting_max = held = passes = 0
    # A job far slower than the model's one-tier pace is a broken run, not a figure.
    cap = 3 * shards * shard_s(costs, ONE_TIER, 0) / GPU_NODES + 3600
    status: JobStatus | None = None
    try:
        while True:
            fleet.check()
            try:
                await reconciler.reconcile_once()
            except Exception as e:  # the next pass retries, as the controller's loop does
                ctx.log(f"  reconcile failed: {e!r}")
            status = await master.job(job_id)
            passes += 1
            now = clock.now()
            series["hours"].append(now / 3600)
            for n in names:
                peak[n] = max(peak[n], fleet.live(n))
                series[f"{n} pods"].append(fleet.live(n))
            waiting = status.tiers[-1].shards.get("TODO", 0) if len(status.tiers) > 1 else 0
            series["waiting"].append(waiting)
            waiting_max = max(waiting_max, waiting)
            held += any(t.held_back for t in status.tiers)
            if status.state in TERMINAL_JOB_STATES:
                break
            if now > cap:
                raise RuntimeError(f"{variant}: the job ran past {cap / 3600:.1f} simulated hours")
            delay = clock.origin + clock.wall(passes * RECONCILE_S) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
    finally:
        await fleet.close()
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        await api.close()
    if status is None or status.state != "SUCCEEDED":
        ended = "did not start" if status is None else f"ended {status.state}: {status.reason}"
        raise RuntimeError(f"{variant}: the job {ended}")
    end = fleet.counts.last_commit
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    rows = shards * ROWS_PER_SHARD
    counts = fleet.counts
    placed = [f.shard for f in manifest.files]
    # The output holds every row once; each tier's commit records (those that won) hold every
    # row once; and the master counts a shard done for each of them.
    exactly_once = (
        manifest.rows == rows
        and sum(f.rows for f in manifest.files) == rows
        and len(placed) == len(set(placed))
        and not manifest.quarantined_shards
        and all(counts.rows.get(t.name) == rows for t in tiers)
        and status.shards.get("DONE") == sum(counts.commits.values())
    )
    if not exactly_once:
        ctx.log(
            f"  {variant}: NOT exactly once: the output {manifest.rows:,} rows in "
            f"{len(placed)} files of {len(set(placed))} shards, quarantined "
            f"{manifest.quarantined_shards}; rows committed per tier {counts.rows}; "
            f"{status.shards.get('DONE')} shards done for {sum(counts.commits.values())} "
            "commit records"
        )
    return RunResult(
        variant=variant,
        shards=shards,
        second_s=second_s,
        job_s=end,
        gpu_model_s=fleet.counts.model_s,
        gpu_held_s=fleet.gpu_held_s(end),
        # Two tiers: no model work before the first hand-off; one tier: from the start.
        gpu_held_fed_s=fleet.gpu_held_s(end, since=counts.first_handoff or 0.0),
        gpu_node_s=GPU_NODES * end,
        peak_pods=peak,
        waiting_max=waiting_max,
        waiting_bound=handoff_bound(costs, tiers),
        held_back_share=held / passes,
        rows=rows,
        rows_out=manifest.rows,
        exactly_once=exactly_once,
        counts=counts,
        series=series,
    )


# --------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------


CLOCKS = {"one tier": 0.0015, "two tiers": 0.005}
"""A simulated second, in the machine's seconds, per variant: four workers keep up with a
faster clock than 36; each as slow as the run's length allows, so that the machine's own
delays (a busy master's request, a late timer) are few simulated seconds."""


def _spread(values: list[float], fmt: str) -> str:
    """`median (min-max)`, or the one value."""
    mid = format(statistics.median(values), fmt)
    if len(values) < 2:
        return mid
    return f"{mid} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def run(ctx: Context) -> Section:
    costs = Costs()
    # Enough shards that the two-tier job's fill (a first `cpu` shard before any `gpu` work)
    # is a small part of it.
    shards = 16 if ctx.smoke else 96 if ctx.quick else 320
    runs: dict[str, list[RunResult]] = {v: [] for v in VARIANTS}
    started = time.perf_counter()
    for repeat in range(ctx.repeats):
        for variant in VARIANTS:  # interleaved: a busy neighbour hurts both alike
            t0 = time.perf_counter()
            second_s = 0.002 if ctx.smoke else CLOCKS[variant]
            r = asyncio.run(_run(ctx, variant, shards=shards, costs=costs, second_s=second_s))
            runs[variant].append(r)
            ctx.log(
                f"  {variant} run {repeat + 1}/{ctx.repeats}: job {r.job_s / 3600:.2f} h, GPU "
                f"busy {r.busy_of_pods:.0%} of its pods' time, {r.busy_of_nodes:.0%} of the "
                f"nodes', pods at peak {r.peak_pods}, hand-offs waiting at most "
                f"{r.waiting_max}, rows {r.rows_out:,} of {r.rows:,} "
                f"({'exactly once' if r.exactly_once else 'NOT exactly once'}); "
                f"{time.perf_counter() - t0:.0f} s"
            )
    seconds = time.perf_counter() - started
    base = statistics.median(r.job_s for r in runs["one tier"])
    rows_out: list[list[Any]] = []
    for variant, rs in runs.items():
        tiers = VARIANTS[variant]
        model = steady(costs, tiers)
        once = all(r.exactly_once for r in rs)
        rows_out.append(
            [
                variant,
                _spread([r.job_s / 3600 for r in rs], ".2f"),
                f"{shards / model.shards_per_s / 3600:.2f}",
                f"{statistics.median(r.job_s for r in rs) / base:.2f}x",
                _spread([r.busy_of_pods for r in rs], ".0%"),
                f"{model.gpu_busy:.0%}",
                _spread([r.busy_of_nodes for r in rs], ".0%"),
                ", ".join(f"{t.name} {max(r.peak_pods[t.name] for r in rs)}" for t in tiers),
                f"{max(r.waiting_max for r in rs)} (bound {handoff_bound(costs, tiers)})"
                if len(tiers) > 1
                else "-",
                _spread([r.held_back_share for r in rs], ".0%") if len(tiers) > 1 else "-",
                f"{rs[0].rows:,} each run, " + ("once each" if once else "NOT once"),
            ]
        )
    detail: list[list[Any]] = []
    for variant, rs in runs.items():
        tiers = VARIANTS[variant]
        for k, t in enumerate(tiers):
            pod = f"{t.cpu:g} cores" + (f", {t.gpu} GPU" if t.gpu else "")
            detail.append(
                [
                    f"{variant}: {t.name}",
                    pod,
                    f"{shard_s(costs, tiers, k):.0f}",
                    steady(costs, tiers).pods[t.name],
                    max(r.peak_pods[t.name] for r in rs),
                    _spread([r.counts.commits.get(t.name, 0) for r in rs], ".0f"),
                    "every run" if all(r.counts.rows.get(t.name) == r.rows for r in rs) else "NO",
                ]
            )
    every = [r for rs in runs.values() for r in rs]
    protocol = [s for r in every for s in r.counts.protocol_s]
    protocol_ms = statistics.median(protocol) * 1000 if protocol else 0.0
    protocol_sim = [s / r.second_s for r in every for s in r.counts.protocol_s]
    protocol_sim_s = statistics.median(protocol_sim) if protocol_sim else 0.0
    one, two = runs["one tier"], runs["two tiers"]

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    return Section(
        title="15. Tiers in the cluster simulation",
        intro=__doc__ or "",
        tables=[
            table(
                [
                    "variant",
                    "job time, simulated h",
                    "at the model's steady rate, h",
                    "vs one tier",
                    "GPU busy, of GPU pods' time",
                    "model's steady state",
                    "GPU busy, of GPU nodes' time",
                    "pods at peak",
                    "hand-offs waiting, most",
                    "passes with a tier held back",
                    "rows in the output",
                ],
                rows_out,
            ),
            table(
                [
                    "tier",
                    "pod",
                    "a shard takes, s",
                    "pods that fit",
                    "pods at peak",
                    "commit records",
                    "every row once",
                ],
                detail,
            ),
        ],
        slug="tierssim",
        plot={
            "kind": "lines",
            "runs": {v: rs[0].series for v, rs in runs.items()},
            "x": "hours",
            "xlabel": "simulated hours since submission (the first run of each)",
        },
        summary={
            "shards": shards,
            "one_tier_job_s": median([r.job_s for r in one]),
            "two_tiers_job_s": median([r.job_s for r in two]),
            "one_tier_gpu_busy": median([r.busy_of_pods for r in one]),
            "two_tiers_gpu_busy": median([r.busy_of_pods for r in two]),
            "one_tier_gpu_busy_of_nodes": median([r.busy_of_nodes for r in one]),
            "two_tiers_gpu_busy_of_nodes": median([r.busy_of_nodes for r in two]),
            "two_tiers_gpu_busy_once_fed": median([r.busy_once_fed for r in two]),
            "two_tiers_waiting_max": max(r.waiting_max for r in two),
            "exactly_once": all(r.exactly_once for r in every),
            "protocol_ms": protocol_ms,
        },
        notes=[
            f"{shards} shards of {ROWS_PER_SHARD:,} rows; {ctx.repeats} run(s) of each variant, "
            "interleaved, medians (min-max). A simulated second lasted "
            + ", ".join(
                f"{1000 * (0.002 if ctx.smoke else CLOCKS[v]):g} ms ({v})" for v in VARIANTS
            )
            + f"; {seconds:.0f} s in all. The model's steady rate: each tier with the pods that "
            "fit, the slowest tier setting the pace; the job's time adds the fill (pods "
            "starting, a first shard through every tier before the last) and the tail. From "
            "the first hand-off on, the two tiers' GPUs were busy "
            f"{median([r.busy_once_fed for r in two]):.0%} of their pods' time (before it, the "
            "GPU tier's first pod waits for work, and the others start as hand-offs come). "
            "The master's bound on hand-offs waiting is twice the GPU tier's workers until "
            "both tiers have shards done, then what the GPU tier gets through in a CPU "
            "shard's time, and one more a worker; the most waiting adds the shards the CPU "
            "tier held when it was held back.",
            f"A lease and a commit took {protocol_ms:.1f} ms of the machine's time per attempt "
            f"(median), {protocol_sim_s:.1f} simulated s, overlapped with the computing as a real "
            "worker's read-ahead overlaps them. Over every run: parts committed (drains, "
            f"splits) {sum(r.counts.parts for r in every)}, commits that lost a race "
            f"{sum(r.counts.lost_races for r in every)}, shards handed back with nothing done "
            f"{sum(r.counts.released for r in every)}, workers whose pod ended before they did "
            f"{sum(r.counts.killed for r in every)}.",
        ],
    )
