"""The modelet pipeline in real stage processes: results, batching, and every way a stage fails."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil
import pyarrow as pa
import pytest
import torch
from prometheus_client import REGISTRY

from ebb.common import envvars
from ebb.common.job import StageSpec
from ebb.worker.chunks import frames, shm
from ebb.worker.chunks.columns import VALUE
from ebb.worker.modelets.runtimes import WARM_UP_FILE, TorchScriptStage, warm_up_extra_files
from ebb.worker.pipeline import stageserver
from ebb.worker.pipeline.front import Pipeline, PipelineBroken, PipelineConfig, PipelineSetupError
from ebb.worker.pipeline.processes import ProcState, StageProcess
from ebb.worker.stage.board import BatchBoard
from ebb.worker.stage.loop import StageConfig, StageLoop

from ..helpers import ASSETS, FEATURES, wait_until, write_model


def rows(n: int, seed: int = 0, *, first_id: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {"id": first_id + i, "features": rng.normal(size=FEATURES).astype(np.float32)}
        for i in range(n)
    ]


def features_stage(**kw: Any) -> StageSpec:
    return StageSpec(
        name="features",
        modelet="ebb.worker.modelets:Features",
        params={"columns": ["features"]},
        **kw,
    )


async def run_pipeline(stages: list[StageSpec], items: list[Any], **config: Any) -> list[Any]:
    pipeline = Pipeline(PipelineConfig(stages=stages, code_paths=[str(ASSETS)], **config))
    try:
        await pipeline.start()
        return await pipeline.run(items)
    finally:
        await pipeline.stop()


async def test_onnx_stage_matches_onnxruntime_directly(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.onnx")
    items = rows(3_000)
    outcomes = await run_pipeline(
        [features_stage(batch_size=64), StageSpec(name="model", model=str(model), batch_size=128)],
        items,
    )
    assert all(ok for ok, _ in outcomes)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": np.stack([r["features"] for r in items])})[0]
    np.testing.assert_allclose(np.stack([v for _, v in outcomes]), expected, rtol=1e-5, atol=1e-6)


class _TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.layer(x), dim=1)


async def test_torchscript_stage_matches_torch_directly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = _TinyNet().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(net)
    scripted.save(str(tmp_path / "m.pt"))  # type: ignore[no-untyped-call]
    items = rows(500)
    outcomes = await run_pipeline(
        [features_stage(), StageSpec(name="model", model=str(tmp_path / "m.pt"), batch_size=50)],
        items,
    )
    with torch.inference_mode():
        expected = net(torch.from_numpy(np.stack([r["features"] for r in items]))).numpy()
    np.testing.assert_allclose(np.stack([v for _, v in outcomes]), expected, rtol=1e-5, atol=1e-6)


async def test_a_raising_row_fails_alone(tmp_path: Path) -> None:
    bad = {7, 500, 501, 1999}
    outcomes = await run_pipeline(
        [
            StageSpec(
                name="pick",
                modelet="ebbtest_modelets:FailOn",
                params={"ids": sorted(bad)},
                batch_size=64,
            )
        ],
        rows(2_000),
    )
    failed = {i for i, (ok, _) in enumerate(outcomes) if not ok}
    assert failed == bad
    assert "cannot score row 500" in outcomes[500][1]


async def test_a_modelet_that_takes_two_batches_at_once_gets_the_next_before_one_ends() -> None:
    # What an llm stage fed by a server declares: the server gets the next batch's rows
    # while the last of one finish. The first batch ends only once a second has begun.
    outcomes = await run_pipeline(
        [StageSpec(name="two", modelet="ebbtest_modelets:Overlapping", batch_size=8)],
        rows(64),
    )
    assert all(ok for ok, _ in outcomes)
    seen = [float(v[0]) for _, v in outcomes]
    # The first batch's rows saw a second begin (run one at a time, it would wait 60 s
    # and see none); none saw more than two.
    assert 2.0 in seen
    assert set(seen) <= {1.0, 2.0}


async def test_a_row_that_kills_a_process_running_two_batches_fails_alone() -> None:
    # The batch beside the killer's is blamed with it once; its rows, and the killer, are
    # then run alone (a suspect never beside another batch), and only the killer fails.
    outcomes = await run_pipeline(
        [
            StageSpec(
                name="crashy",
                modelet="ebbtest_modelets:OverlappingCrashOn",
                params={"ids": [123]},
                batch_size=16,
            )
        ],
        rows(400),
    )
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [123]
    assert "exited with code 17" in outcomes[123][1]


async def test_a_row_that_kills_its_process_fails_alone_and_the_stage_recovers() -> None:
    outcomes = await run_pipeline(
        [
            StageSpec(
                name="crashy",
                modelet="ebbtest_modelets:CrashOn",
                params={"ids": [123]},
                batch_size=32,
            ),
            StageSpec(name="pid", modelet="ebbtest_modelets:Pid"),
        ],
        rows(1_000),
    )
    failed = [i for i, (ok, _) in enumerate(outcomes) if not ok]
    assert failed == [123]
    assert "exited with code 17" in outcomes[123][1]


async def test_a_hung_batch_is_killed_and_only_its_culprit_fails() -> None:
    outcomes = await run_pipeline(
        [
            StageSpec(
                name="hangs", modelet="ebbtest_modelets:HangOn", params={"ids": [42]}, batch_size=16
            )
        ],
        rows(300),
        batch_timeout_s=1.0,
    )
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [42]
    assert "ran over 1s" in outcomes[42][1]


async def test_a_stage_over_its_memory_limit_is_recycled_without_losing_items() -> None:
    def recycled() -> float:
        sample = REGISTRY.get_sample_value(
            "ebb_stage_restarts_total", {"stage": "hog", "reason": "memory"}
        )
        return sample or 0.0

    before = recycled()
    stage = StageSpec(
        name="hog", modelet="ebbtest_modelets:Hog", params={"mb_per_batch": 20}, batch_size=50
    )
    items = rows(2_000)
    outcomes = await run_pipeline([stage], items, memory_limit_bytes=250 * 2**20)
    assert all(ok for ok, _ in outcomes)
    for item, (_, value) in zip(items, outcomes, strict=True):
        np.testing.assert_array_equal(value, item["features"])
    assert recycled() - before >= 2  # 40 batches x 20 MB against a 250 MB limit


async def test_several_workers_per_stage_share_the_items() -> None:
    outcomes = await run_pipeline(
        [StageSpec(name="pid", modelet="ebbtest_modelets:Pid", workers=2, batch_size=8)],
        rows(2_000),
    )
    pids = {pid for _, pid in outcomes}
    assert len(pids) == 2


async def test_a_stage_that_cannot_start_fails_the_pipeline_clearly() -> None:
    pipeline = Pipeline(
        PipelineConfig(
            stages=[StageSpec(name="broken", modelet="ebbtest_modelets:BrokenSetup")],
            code_paths=[str(ASSETS)],
        )
    )
    try:
        with pytest.raises(PipelineSetupError, match="weights not found"):
            await pipeline.start()
        with pytest.raises(PipelineSetupError):
            await pipeline.run(rows(3))
    finally:
        await pipeline.stop()


async def test_replacements_that_cannot_start_after_the_pipeline_was_ready_break_it(
    tmp_path: Path,
) -> None:
    """A process dies; those started in its place fail their set-up (its GPU memory not
    yet free, say). The pipeline did start here once: it is broken, not unable to start."""
    stage = StageSpec(
        name="once",
        modelet="ebbtest_modelets:StartsOnce",
        params={"marker": str(tmp_path / "started"), "crash_on": [5]},
        batch_size=4,
    )
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[str(ASSETS)]))
    try:
        await pipeline.start()
        with pytest.raises(PipelineBroken, match="died 3 times while starting") as failed:
            await pipeline.run(rows(20))
        assert not isinstance(failed.value, PipelineSetupError)
        with pytest.raises(PipelineBroken):
            await pipeline.run(rows(3))
    finally:
        await pipeline.stop()


class _NeverStarts:
    """A stage process whose fork server hangs up on the start request."""

    def start(self) -> None:
        raise EOFError("the stage server hung up")


async def test_a_router_that_gives_up_breaks_the_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server is lost at every start after the first: the router gives up on a
    replacement and fails. The pipeline had started: it is broken, not unable to start."""
    real: Any = stageserver.stage_context()

    class LosesItsServerAfterTheFirstStart:
        def __init__(self) -> None:
            self.starts = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def Process(self, *args: Any, **kwargs: Any) -> Any:
            self.starts += 1
            return real.Process(*args, **kwargs) if self.starts == 1 else _NeverStarts()

    monkeypatch.setattr(
        "ebb.worker.pipeline.router.stage_context", LosesItsServerAfterTheFirstStart
    )
    stage = StageSpec(
        name="crashy", modelet="ebbtest_modelets:CrashOn", params={"ids": [5]}, batch_size=4
    )
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[str(ASSETS)]))
    try:
        await pipeline.start()
        with pytest.raises(PipelineBroken, match="router failed: EOFError") as failed:
            await pipeline.run(rows(20))
        assert not isinstance(failed.value, PipelineSetupError)
    finally:
        await pipeline.stop()


def test_a_stopping_stage_over_its_memory_limit_does_not_ask_to_be_recycled() -> None:
    """Told to stop, a stage finishes what it holds and exits: over its memory limit or
    not, it asks for no replacement."""
    ctx = stageserver.stage_context()
    inbox_r, inbox_w = ctx.Pipe(duplex=False)
    outbox_r, outbox_w = ctx.Pipe(duplex=False)
    # A batch that is never full and waits a minute: only the stop lets it run.
    spec = StageSpec(
        name="s", modelet="ebb.worker.modelets:Identity", batch_size=8, batch_wait_s=60
    )
    config = StageConfig(spec=spec, code_paths=[], memory_limit_bytes=1)  # always over
    uids = np.arange(4, dtype=np.int64)
    inbox_w.send_bytes(frames.pack(frames.Kind.ITEMS, uids, {VALUE: uids}))
    inbox_w.send_bytes(frames.pack(frames.Kind.STOP))

    def identity(batch: Any) -> Any:
        return batch

    loop = StageLoop(config, identity, inbox_r, outbox_w, BatchBoard(ctx, 8))
    try:
        loop.run()
        kinds = []
        while True:
            try:
                kinds.append(frames.header(outbox_r.recv_bytes()).kind)
            except EOFError:
                break
    finally:
        for conn in (inbox_r, inbox_w, outbox_r, outbox_w):
            conn.close()
    assert frames.Kind.ITEMS in kinds  # it did run the batch it held
    assert frames.Kind.RECYCLE not in kinds


def stage_messages(spec: StageSpec, run: Any, deliveries: list[np.ndarray]) -> list[Any]:
    """Run a stage loop in this process on `deliveries` (each an ITEMS message of those uids),
    then a stop; the (kind, uids) of every message it sends back, in order."""
    ctx = stageserver.stage_context()
    inbox_r, inbox_w = ctx.Pipe(duplex=False)
    outbox_r, outbox_w = ctx.Pipe(duplex=False)
    for uids in deliveries:
        inbox_w.send_bytes(frames.pack(frames.Kind.ITEMS, uids, {VALUE: uids * 10}))
    inbox_w.send_bytes(frames.pack(frames.Kind.STOP))
    loop = StageLoop(
        StageConfig(spec=spec, code_paths=[]), run, inbox_r, outbox_w, BatchBoard(ctx, 8)
    )
    sent = []
    try:
        loop.run()
        while True:
            try:
                message = outbox_r.recv_bytes()
            except EOFError:
                break
            h = frames.header(message)
            values = frames.payload(message, copy=True) if h.kind == frames.Kind.ITEMS else None
            sent.append((h.kind, h.uids.tolist(), values))
    finally:
        for conn in (inbox_r, inbox_w, outbox_r, outbox_w):
            conn.close()
    return sent


def test_the_outputs_of_quick_batches_go_back_together_and_a_slow_batch_s_at_once() -> None:
    """The router's cost is per message: the outputs of a delivery's batches run back to back
    go back as one message, in order; a batch slow enough that the next would keep its output
    waiting (50 ms) sends it alone."""
    spec = StageSpec(name="s", modelet="ebb.worker.modelets:Identity", batch_size=32)
    uids = np.arange(256, dtype=np.int64)

    def quick(batch: Any) -> Any:
        return batch

    sent = stage_messages(spec, quick, [uids])
    items = [(u, v) for kind, u, v in sent if kind == frames.Kind.ITEMS]
    assert len(items) == 1
    assert items[0][0] == uids.tolist() and items[0][1][VALUE].tolist() == (uids * 10).tolist()

    def slow(batch: Any) -> Any:
        time.sleep(0.06)
        return batch

    sent = stage_messages(spec, slow, [uids[:96]])
    alone = [u for kind, u, _ in sent if kind == frames.Kind.ITEMS]
    assert alone == [list(range(0, 32)), list(range(32, 64)), list(range(64, 96))]


async def test_a_stage_over_its_memory_limit_while_the_pipeline_stops_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stage that finds itself over its limit after the batch it was running when the
    pipeline stopped asks to be recycled (the stop still waits in its inbox): the router,
    stopping, starts nothing in its place."""
    started: list[StageProcess] = []

    class Counted(StageProcess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr("ebb.worker.pipeline.stagepool.StageProcess", Counted)
    caplog.set_level(logging.DEBUG, logger="ebb.worker.pipeline.router")
    entered, gate, then = tmp_path / "entered", tmp_path / "gate", tmp_path / "then"
    stage = StageSpec(
        name="gated",
        modelet="ebbtest_modelets:Gated",
        params={"entered": str(entered), "gate": str(gate), "then": str(then)},
        batch_size=4,
    )
    pipeline = Pipeline(
        PipelineConfig(stages=[stage], code_paths=[str(ASSETS)], memory_limit_bytes=1)
    )
    running: asyncio.Task[Any] | None = None
    try:
        await pipeline.start()
        running = asyncio.create_task(pipeline.run(rows(8)))  # two batches
        await wait_until(entered.exists, timeout=30, what="the first batch to run")
        stopping = asyncio.create_task(pipeline.stop())
        (stage_process,) = started
        await wait_until(
            lambda: stage_process.state is ProcState.DRAINING,
            timeout=30,
            what="the stop to be sent",
        )
        gate.touch()
        # Its second batch holds it alive while the router reads its request.
        await wait_until(
            lambda: "over its memory limit, and stopping" in caplog.text,
            timeout=30,
            what="a recycle request",
        )
        then.touch()
        await stopping
    finally:
        gate.touch()
        then.touch()
        if running is not None:
            running.cancel()
            await asyncio.wait([running])
        await pipeline.stop()
        alive = [p for p in started if p.process.is_alive()]
        for p in alive:  # a process nothing stops would hold up this interpreter's exit
            p.process.kill()
            p.process.join()
    assert len(started) == 1
    assert not alive


async def test_a_cancelled_run_stops_taking_room_and_its_waiting_rows_are_not_computed(
    tmp_path: Path,
) -> None:
    """A run abandoned half way (its lease lost): rows of it that had not reached a process
    are dropped, and the next run does not wait behind them."""
    tally = tmp_path / "tally"
    stage = StageSpec(
        name="tally",
        modelet="ebbtest_modelets:Tally",
        params={"path": str(tally), "seconds_per_batch": 0.05},
        batch_size=16,
    )
    # Room for the whole first run at once: every one of its rows goes to the router.
    config = PipelineConfig(stages=[stage], code_paths=[str(ASSETS)], max_inflight=10_000)
    pipeline = Pipeline(config)
    try:
        await pipeline.start()
        first = asyncio.create_task(pipeline.run(rows(2_000)))
        await wait_until(lambda: tally.exists() and tally.read_text(), what="a first batch")
        first.cancel()
        await asyncio.wait([first])
        assert first.cancelled()
        second = await pipeline.run(rows(32, first_id=1_000))
        assert [v for _, v in second] == list(range(1_000, 1_032))
        computed = {int(line) for line in tally.read_text().split()}
        # The rows already inside the process finished; the rest of the run never ran.
        assert set(range(1_000, 1_032)) <= computed
        assert len(computed & set(range(2_000))) < 2_000
        await wait_until(lambda: pipeline.depths() == [0], timeout=10, what="an empty pipeline")
    finally:
        await pipeline.stop()


async def test_an_unknown_modelet_class_fails_the_pipeline_clearly() -> None:
    pipeline = Pipeline(PipelineConfig(stages=[StageSpec(modelet="no_such_module:Thing")]))
    try:
        with pytest.raises(PipelineSetupError, match="cannot import 'no_such_module'"):
            await pipeline.start()
    finally:
        await pipeline.stop()


async def test_a_stage_hung_in_native_code_holding_the_gil_is_still_killed() -> None:
    # Rows big enough that two batches fill the pipe: the router blocks writing to the hung
    # process, and only the watchdog thread can free it.
    items = [{"id": i, "blob": os.urandom(200_000)} for i in range(64)]
    stage = StageSpec(
        name="hang", modelet="ebbtest_modelets:GilHang", params={"ids": [0]}, batch_size=4
    )
    outcomes = await asyncio.wait_for(run_pipeline([stage], items, batch_timeout_s=1.0), 60)
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [0]
    assert outcomes[1] == (True, 200_000)


async def test_recycling_never_leaves_more_processes_than_configured() -> None:
    stage = StageSpec(
        name="crashy", modelet="ebbtest_modelets:CrashOn", params={"ids": [5, 6, 7]}, batch_size=4
    )
    pipeline = Pipeline(
        PipelineConfig(stages=[stage], code_paths=[str(ASSETS)], memory_limit_bytes=1)
    )
    try:
        await pipeline.start()
        outcomes = await pipeline.run(rows(40))
        assert sorted(i for i, (ok, _) in enumerate(outcomes) if not ok) == [5, 6, 7]
        router = pipeline._router
        assert router is not None
        await wait_until(lambda: len(router.pools[0]) == 1, timeout=20, what="one hog process")
    finally:
        await pipeline.stop()


async def test_an_output_that_cannot_be_sent_fails_only_its_row() -> None:
    stage = StageSpec(name="odd", modelet="ebbtest_modelets:Unsendable", params={"ids": [3]})
    outcomes = await run_pipeline([stage], rows(50))
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [3]
    assert "output cannot be sent" in outcomes[3][1]
    assert outcomes[4] == (True, 4)


def fan_stages(**label: Any) -> list[StageSpec]:
    return [
        StageSpec(name="split", modelet="ebbtest_modelets:Split", fanout=True, batch_size=16),
        StageSpec(name="label", modelet="ebbtest_modelets:Label", params=label, batch_size=64),
        StageSpec(name="join", modelet="ebbtest_modelets:Join", fanin=True, batch_size=16),
    ]


def joined(row_id: int) -> str:
    return "+".join(f"{row_id}.{k}" for k in range(row_id % 4))


async def test_fan_out_and_back_in_keeps_every_part_in_order() -> None:
    outcomes = await run_pipeline(fan_stages(), rows(1_000))
    assert [v for _, v in outcomes] == [joined(i) for i in range(1_000)]
    assert outcomes[4] == (True, "")  # no parts at all: the item still comes back


async def test_without_a_fan_in_the_parts_come_back_as_a_list() -> None:
    outcomes = await run_pipeline(fan_stages()[:2], rows(100))
    assert outcomes[7] == (True, ["7.0", "7.1", "7.2"])


async def test_a_failing_part_fails_its_item_only() -> None:
    outcomes = await run_pipeline(fan_stages(fail_on=11), rows(200))
    failed = [i for i, (ok, _) in enumerate(outcomes) if not ok]
    assert failed == [11]
    assert "part 2 of its fan-out" in outcomes[11][1] and "unreadable crop" in outcomes[11][1]


async def test_a_part_that_kills_its_process_fails_its_item_and_the_rest_recovers() -> None:
    outcomes = await run_pipeline(fan_stages(crash_on=15), rows(200))
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [15]
    assert all(v == joined(i) for i, (ok, v) in enumerate(outcomes) if ok)


async def test_a_fan_out_stage_must_return_lists() -> None:
    stages = [StageSpec(name="pid", modelet="ebbtest_modelets:Pid", fanout=True)]
    outcomes = await run_pipeline(stages, rows(3))
    assert all(not ok and "must return a list" in v for ok, v in outcomes)


def _segments() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}-")}


async def test_large_arrays_travel_in_shared_memory_and_leave_nothing_behind() -> None:
    before = _segments()
    items = [np.full(50_000, float(i), dtype=np.float32) for i in range(400)]  # 200 KB each
    stages = [
        StageSpec(
            name="a", modelet="ebbtest_modelets:Double", params={"crash_on": 123.0}, batch_size=16
        ),
        StageSpec(name="b", modelet="ebbtest_modelets:Double", batch_size=16),
    ]
    outcomes = await run_pipeline(stages, items)
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [123]
    for i, (ok, value) in enumerate(outcomes):
        if ok:
            assert value.shape == (50_000,) and value[0] == 4.0 * i
    assert _segments() == before


def test_segments_of_dead_processes_are_swept(tmp_path: Path) -> None:
    dead = subprocess.run(["true"], check=True)
    del dead
    orphan = f"{shm.PREFIX}-{2**22 - 3}-7"  # a pid beyond pid_max: nobody
    with open(os.path.join(shm.SHM_DIR, orphan), "wb") as f:
        f.write(b"x")
    mine = shm.Arena()
    name, _ = mine.store([memoryview(b"y" * 70_000)])
    assert shm.sweep_orphans() >= 1
    assert orphan not in _segments()
    assert name in _segments()  # ours: this process is alive
    shm.unlink(name)
    mine.close()


async def test_a_columnar_and_a_per_row_modelet_give_the_same_output() -> None:
    items = rows(1_000)
    columnar = await run_pipeline(
        [StageSpec(name="score", modelet="ebbtest_modelets:ScoreColumns", batch_size=128)], items
    )
    per_row = await run_pipeline(
        [StageSpec(name="score", modelet="ebbtest_modelets:ScoreRows", batch_size=128)], items
    )
    assert all(ok for ok, _ in columnar) and all(ok for ok, _ in per_row)
    assert [v["id"] for _, v in columnar] == list(range(1_000))
    np.testing.assert_allclose(
        [v["score"] for _, v in columnar], [v["score"] for _, v in per_row], rtol=1e-6
    )


async def test_a_chunk_with_one_poison_row_yields_exactly_one_error_row() -> None:
    table = pa.table(
        {
            "id": np.arange(2_000),
            "features": pa.FixedSizeListArray.from_arrays(
                pa.array(np.ones(2_000 * FEATURES, dtype=np.float32)), FEATURES
            ),
        }
    )
    pipeline = Pipeline(
        PipelineConfig(
            stages=[
                StageSpec(
                    name="score",
                    modelet="ebbtest_modelets:ScoreColumns",
                    params={"poison": [777]},
                    batch_size=256,
                )
            ],
            code_paths=[str(ASSETS)],
        )
    )
    try:
        await pipeline.start()
        result = await pipeline.run_columns(table)
    finally:
        await pipeline.stop()
    assert list(result.errors) == [777]
    assert "cannot score rows [777]" in result.errors[777]
    assert result.columns["id"].tolist()[:777] == list(range(777))
    ok = np.ones(2_000, dtype=bool)
    ok[777] = False
    np.testing.assert_array_equal(result.columns["id"][ok], np.arange(2_000)[ok])
    np.testing.assert_allclose(result.columns["score"][ok], 2.0 * FEATURES)


async def test_a_part_that_cannot_be_sent_fails_its_item_not_the_stage() -> None:
    stages = [
        StageSpec(
            name="split",
            modelet="ebbtest_modelets:SplitUnsendable",
            params={"ids": [5]},
            fanout=True,
        ),
        StageSpec(name="pid", modelet="ebbtest_modelets:Pid"),
    ]
    outcomes = await run_pipeline(stages, rows(20))
    assert [i for i, (ok, _) in enumerate(outcomes) if not ok] == [5]
    assert "cannot be sent" in outcomes[5][1]
    assert all(len(v) == 2 for ok, v in outcomes if ok)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_a_torchscript_stage_on_the_gpu_in_half_precision(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU()).eval()
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    items = rows(5_000)
    outcomes = await run_pipeline(
        [
            features_stage(batch_size=512),
            StageSpec(name="m", model=str(path), device="cuda", dtype="float16", batch_size=512),
        ],
        items,
    )
    assert all(ok for ok, _ in outcomes)
    with torch.inference_mode():
        expected = model(torch.from_numpy(np.stack([r["features"] for r in items]))).numpy()
    got = np.stack([v for _, v in outcomes])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)


async def test_uneven_sequences_are_padded_and_masked_within_a_token_budget(
    tmp_path: Path,
) -> None:
    class MeanEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            mask = attention_mask.unsqueeze(-1).float()
            out: torch.Tensor = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
            return out

    torch.manual_seed(0)
    model = MeanEmbedding().eval()
    path = tmp_path / "embed.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    items = rows(500)
    outcomes = await run_pipeline(
        [
            StageSpec(name="tokens", modelet="ebbtest_modelets:Tokens", batch_size=64),
            StageSpec(
                name="embed",
                model=str(path),
                batch_size=64,
                batch_tokens=200,
                length_column="input_ids",
            ),
        ],
        items,
    )
    assert all(ok for ok, _ in outcomes)
    with torch.inference_mode():
        for i in (0, 16, 17, 333, 499):  # each row alone: no padding at all
            ids = torch.full((1, 1 + i % 17), i % 50 + 1, dtype=torch.int64)
            expected = model(ids, torch.ones_like(ids))[0].numpy()
            np.testing.assert_allclose(outcomes[i][1], expected, rtol=1e-5, atol=1e-6)


def test_a_stage_whose_worker_died_exits_quietly() -> None:
    """A stage process whose pipes' other ends are gone (its worker was killed) exits 0
    without a traceback, instead of a BrokenPipeError per message."""
    code = """
import multiprocessing as mp
from ebb.common.job import StageSpec
from ebb.worker.stage.board import BatchBoard
from ebb.worker.stage.loop import StageConfig, stage_main

ctx = mp.get_context("spawn")
inbox_r, inbox_w = ctx.Pipe(duplex=False)
outbox_r, outbox_w = ctx.Pipe(duplex=False)
outbox_r.close()  # the worker's end: gone
spec = StageSpec(name="s", modelet="ebb.worker.modelets:Identity")
stage_main(StageConfig(spec=spec, code_paths=[]), inbox_r, outbox_w, BatchBoard(ctx, 4))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("stacked", [False, True])
def test_sequences_of_one_length_still_get_an_attention_mask(stacked: bool) -> None:
    """A batch cut from rows sorted by length often holds rows of one length (no padding):
    a model that takes an attention mask must get one all the same."""
    stage = TorchScriptStage(StageSpec(name="m", model="encoder.pt"))
    stage.input_names = ["input_ids", "attention_mask"]
    column = np.empty(2, dtype=object)
    column[0], column[1] = np.array([101, 7, 102]), np.array([101, 8, 102])
    feeds = stage._feeds({"input_ids": np.stack(list(column)) if stacked else column})
    assert feeds["input_ids"].tolist() == [[101, 7, 102], [101, 8, 102]]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]


def test_a_read_only_batch_reaches_the_model_without_a_warning() -> None:
    """A chunk's arrays are read-only views: torch's warning about them (in every worker's
    log) is not raised, and the tensor reads the batch's values, not a copy."""
    stage = TorchScriptStage(StageSpec(name="m", model="model.pt"))
    stage.dtype, stage.cuda = torch.float32, False
    batch = np.arange(6, dtype=np.float32).reshape(2, 3)
    batch.flags.writeable = False
    tensor = stage._to_device("x", batch)  # pytest makes any warning an error
    assert tensor.tolist() == batch.tolist()
    assert tensor.data_ptr() == batch.ctypes.data


def test_the_fork_server_imports_only_the_runtimes_it_knows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(envvars.STAGE_PRELOAD, "torch, os ,onnxruntime,evil_module")
    assert stageserver.preload() == [*stageserver.BASE, "onnxruntime", "torch"]
    monkeypatch.delenv(envvars.STAGE_PRELOAD)
    assert stageserver.preload() == stageserver.BASE


class _CountingNet(torch.nn.Module):
    """Counts its forward passes and the batch shapes it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.last_rows = 0
        self.last_width = 0

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last_rows, self.last_width = ids.shape[0], ids.shape[1]
        return (ids * attention_mask).float().sum(dim=1, keepdim=True)


@pytest.mark.parametrize("described", ["example", "none", "garbled"])
def test_a_torchscript_model_is_warmed_up_with_its_archives_example(
    tmp_path: Path, described: str
) -> None:
    path = tmp_path / "counting.pt"
    extra: dict[str, str] = {}
    if described == "example":
        extra = warm_up_extra_files(
            {"ids": torch.ones(8, 16, dtype=torch.int64), "attention_mask": np.ones((8, 16))}
        )
    elif described == "garbled":
        extra = {WARM_UP_FILE: "{not json"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_CountingNet()), str(path), _extra_files=extra)
    stage = TorchScriptStage(StageSpec(name="m", model=str(path)))
    stage.setup()
    # TorchScript profiles its first run and optimises the second: both happen at load time.
    expected_calls = 2 if described == "example" else 0
    assert stage.model.calls == expected_calls
    if described == "example":
        assert (stage.model.last_rows, stage.model.last_width) == (8, 16)
    # Whatever the archive said, the model serves rows.
    out = stage.process_columns({"ids": np.array([[1, 2, 3]], dtype=np.int64)})
    assert out[VALUE].tolist() == [[6.0]]


async def test_a_stage_sees_the_environment_of_now_not_of_its_fork_servers_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage processes fork from a server started long before (by an earlier test here, or
    first thing in a worker); what the worker's environment holds now is what they see."""
    monkeypatch.setenv("EBB_TEST_SET_LATER", "now")
    outcomes = await run_pipeline(
        [StageSpec(name="env", modelet="ebbtest_modelets:Getenv", batch_size=4)],
        [{"name": "EBB_TEST_SET_LATER"}],
    )
    assert outcomes == [(True, "now")]


async def test_a_fork_server_killed_while_a_stage_starts_is_replaced_not_fatal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fork server SIGKILLed while it is starting a stage (the OOM killer, a chaos run):
    the start fails with EOF, which is the machine's doing, not the job's; the router starts
    a new server and the stage, and the pipeline serves."""
    real: Any = stageserver.stage_context()

    class LosesItsServerOnce:
        def __init__(self) -> None:
            self.struck = False

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def Process(self, *args: Any, **kwargs: Any) -> Any:
            # The router starts the process it asks for here at once.
            if not self.struck:
                self.struck = True
                multiprocessing.forkserver.ensure_running()
                (server,) = [
                    p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())
                ]
                # Stopped, it takes the start request and never answers; killed, it hangs up.
                server.send_signal(signal.SIGSTOP)
                threading.Timer(0.5, server.send_signal, (signal.SIGKILL,)).start()
            return real.Process(*args, **kwargs)

    monkeypatch.setattr("ebb.worker.pipeline.router.stage_context", LosesItsServerOnce)
    caplog.set_level(logging.WARNING, logger="ebb.worker.pipeline.stagepool")
    outcomes = await run_pipeline([features_stage(batch_size=16)], rows(50))
    assert all(ok for ok, _ in outcomes) and len(outcomes) == 50
    assert "stage server lost (EOFError" in caplog.text
