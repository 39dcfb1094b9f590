"""Modelets used by the tests, loaded by stage processes through `code_paths`."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np


class FailOn:
    """Features, except that rows whose id is in `ids` raise (a row the model cannot take),
    each its own way, or all with `message`."""

    def __init__(self, ids: list[int], message: str = "") -> None:
        self.ids = set(ids)
        self.message = message

    def process(self, row: dict[str, Any]) -> Any:
        if row["id"] in self.ids:
            raise ValueError(self.message or f"cannot score row {row['id']}")
        return np.asarray(row["features"], dtype=np.float32)


class CrashOn:
    """Features, except that a row whose id is in `ids` kills the whole process."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = set(ids)

    def process(self, row: dict[str, Any]) -> Any:
        if row["id"] in self.ids:
            os._exit(17)
        return np.asarray(row["features"], dtype=np.float32)


class HangOn:
    """Features, except that a row whose id is in `ids` never returns."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = set(ids)

    def process(self, row: dict[str, Any]) -> Any:
        if row["id"] in self.ids:
            time.sleep(3600)
        return np.asarray(row["features"], dtype=np.float32)


class Slow:
    """Features (of a row, or a row's features as they are), sleeping `seconds_per_batch` per
    batch: keeps a shard in flight a while."""

    def __init__(self, seconds_per_batch: float) -> None:
        self.seconds = seconds_per_batch

    def process_batch(self, rows: list[Any]) -> list[Any]:
        time.sleep(self.seconds)
        return [
            np.asarray(r["features"] if isinstance(r, dict) else r, dtype=np.float32) for r in rows
        ]


class Straggler:
    """Slow, as `Slow`, and `factor` times slower again in the worker that claims `claim`
    first (a file: the first worker's pid is written in it): one straggler in a fleet."""

    def __init__(self, seconds_per_batch: float, factor: float, claim: str) -> None:
        self.seconds = seconds_per_batch * (factor if _claims(claim) else 1.0)

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        time.sleep(self.seconds)
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]


def _claims(claim: str) -> bool:
    """Whether this worker is the first to claim the file `claim` (its pid is written in it)."""
    worker = _worker_pid()
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(worker).encode())
        os.close(fd)
    except FileExistsError:
        pass
    with open(claim) as f:
        return f.read().strip() == str(worker)


def _worker_pid() -> int:
    """The worker process this stage process runs under."""
    import psutil

    for parent in psutil.Process().parents():
        if "ebb.worker" in " ".join(parent.cmdline()):
            return int(parent.pid)
    return os.getpid()


class Hog:
    """Features, holding on to `mb_per_batch` MB more with every batch (a leak)."""

    def __init__(self, mb_per_batch: int) -> None:
        self.mb = mb_per_batch
        self.hoard: list[bytes] = []

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        self.hoard.append(os.urandom(self.mb * 1024 * 1024))
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]


def _wait_for(path: str, *, timeout_s: float = 120.0) -> None:
    """Until the file at `path` exists (a test opens a gate), for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


class BrokenSetup:
    """Its set-up fails; given a `gate` (a file), only once that exists: a test holds it
    until the worker has leased its shards."""

    def __init__(self, gate: str = "") -> None:
        self.gate = gate

    def setup(self) -> None:
        if self.gate:
            _wait_for(self.gate)
        raise RuntimeError("weights not found")

    def process(self, row: Any) -> Any:
        return row


class GatedSetup:
    """Features, once its set-up has waited for the file `gate` (models that load slowly)."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def setup(self) -> None:
        _wait_for(self.gate)

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]


class Pid:
    """Each row -> the pid of the process that handled it."""

    def process(self, row: Any) -> Any:
        return os.getpid()


class Getenv:
    """Each row {"name": N} -> the value of environment variable N in the stage's process."""

    def process(self, row: Any) -> Any:
        return os.environ.get(row["name"])


class GilHang:
    """Never returns from native code that holds the GIL (a wedged C extension)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = set(ids)

    def process(self, row: Any) -> Any:
        if row["id"] in self.ids:
            import ctypes

            ctypes.PyDLL(None).sleep(3600)  # libc sleep, called without releasing the GIL
        return len(row["blob"])


class Unsendable:
    """Row ids in `ids` produce an output that cannot be pickled."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = set(ids)

    def process(self, row: Any) -> Any:
        return (lambda: None) if row["id"] in self.ids else row["id"]


class Split:
    """Row -> a list of `row["id"] % 4` parts (possibly none): a detector's crops."""

    def process(self, row: Any) -> Any:
        return [{"id": row["id"], "part": k} for k in range(row["id"] % 4)]


class Label:
    """Part -> "id.part"; fails on `fail_on` (an id), crashes its process on `crash_on`."""

    def __init__(self, fail_on: int = -1, crash_on: int = -1) -> None:
        self.fail_on = fail_on
        self.crash_on = crash_on

    def process(self, part: Any) -> Any:
        if part["id"] == self.crash_on and part["part"] == 1:
            os._exit(23)
        if part["id"] == self.fail_on and part["part"] == 2:
            raise ValueError("unreadable crop")
        return f"{part['id']}.{part['part']}"


class Join:
    """The parts' results of one row -> one string."""

    def process(self, parts: list[str]) -> Any:
        return "+".join(parts)


class Double:
    """Array -> the array times two (a new array, so the input view can be let go)."""

    def __init__(self, crash_on: float = -1.0) -> None:
        self.crash_on = crash_on

    def process_batch(self, items: list[Any]) -> list[Any]:
        for item in items:
            if item[0] == self.crash_on:
                os._exit(29)
        return [item * 2 for item in items]


class ScoreColumns:
    """The columnar form: {"id", "features"} -> {"id", "score"}, a batch at a time. Raises for
    a batch holding a row whose id is in `poison` (one bad row spoils a vectorised call)."""

    def __init__(self, poison: list[int] | None = None) -> None:
        self.poison = set(poison or [])

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        bad = self.poison.intersection(batch["id"].tolist())
        if bad:
            raise ValueError(f"cannot score rows {sorted(bad)}")
        return {"id": batch["id"], "score": batch["features"].sum(axis=1) * 2.0}


class ScoreRows:
    """The same as ScoreColumns, one row at a time (the per-row form)."""

    def process(self, row: dict[str, Any]) -> Any:
        return {"id": row["id"], "score": np.float32(row["features"].sum() * 2.0)}


class SplitUnsendable:
    """Row -> two parts; for ids in `ids` the second part cannot be pickled."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = set(ids)

    def process(self, row: Any) -> Any:
        second: Any = (lambda: None) if row["id"] in self.ids else row["id"]
        return [row["id"], second]


class Tokens:
    """Row -> {"input_ids": its id repeated to a length of 1 + id % 17}: sequences of uneven
    length, as a tokenizer makes them."""

    def process(self, row: dict[str, Any]) -> Any:
        return {"input_ids": np.full(1 + row["id"] % 17, row["id"] % 50 + 1, dtype=np.int64)}


class StartsOnce:
    """Features, except that a row whose id is in `crash_on` kills the process, and that no
    process started after the first can set up (the GPU still holds the dead one's memory).
    `marker`: a file the first process creates."""

    def __init__(self, marker: str, crash_on: list[int]) -> None:
        self.marker = marker
        self.crash_on = set(crash_on)

    def setup(self) -> None:
        try:
            with open(self.marker, "x"):
                pass
        except FileExistsError:
            raise RuntimeError("CUDA out of memory") from None

    def process(self, row: dict[str, Any]) -> Any:
        if row["id"] in self.crash_on:
            os._exit(17)
        return np.asarray(row["features"], dtype=np.float32)


class Tally:
    """Each row -> its id, appended to the file `path` as it is computed (a batch takes
    `seconds_per_batch`): a count of the rows the stage really computed."""

    def __init__(self, path: str, seconds_per_batch: float = 0.0) -> None:
        self.path = path
        self.seconds = seconds_per_batch

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        time.sleep(self.seconds)
        ids = [int(r["id"]) for r in rows]
        with open(self.path, "a") as f:
            f.write("".join(f"{i}\n" for i in ids))
        return ids


class Gated:
    """Features; the first batch is held until the file `gate` exists, every later one until
    the file `then` exists. The file `entered` tells a test that the first batch runs."""

    def __init__(self, entered: str, gate: str, then: str) -> None:
        self.entered = entered
        self.gate = gate
        self.then = then

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        with open(self.entered, "a"):
            pass
        _wait_for(self.gate)
        self.gate = self.then
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]


class FlakyNode:
    """Features; but the first `failures` processes to set it up (of any worker) fail, as on
    a node whose GPU has an ECC error: each takes one of the files `marker`.0, .1, ..."""

    def __init__(self, marker: str, failures: int = 1, seconds_per_batch: float = 0.0) -> None:
        self.marker = marker
        self.failures = failures
        self.seconds = seconds_per_batch

    def setup(self) -> None:
        for n in range(self.failures):
            try:
                with open(f"{self.marker}.{n}", "x"):
                    pass
            except FileExistsError:
                continue
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        time.sleep(self.seconds)
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]


class KillsItsWorker:
    """Features; but a row whose id is in `kill_on` takes its whole worker down with `signal`
    (as a reader running out of memory would), every time it is met."""

    def __init__(self, kill_on: list[int], signal: str = "SIGSEGV") -> None:
        self.kill_on = set(kill_on)
        self.signal = signal

    def process(self, row: dict[str, Any]) -> Any:
        if row["id"] in self.kill_on:
            import signal as signals

            import psutil

            # The worker: the eldest of the processes that run `ebb.worker` (its fork server
            # and stage processes run with its command line too).
            worker: psutil.Process | None = None
            process: psutil.Process | None = psutil.Process()
            while process is not None and "ebb.worker" in " ".join(process.cmdline()):
                worker, process = process, process.parent()
            if worker is not None:
                worker.send_signal(getattr(signals, self.signal))
            time.sleep(60)  # until the worker's death takes this process too
        return np.asarray(row["features"], dtype=np.float32)


class Placement:
    """Each row -> "pid GPU device": the process, the GPU its environment shows it, and the
    device Ebb told it (EBB_DEVICE). Given a `folder`, each process writes the same, once set
    up, into a file of its own there: which replica got which GPU, whichever computed rows."""

    def __init__(self, folder: str = "") -> None:
        self.folder = folder

    def _where(self) -> str:
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "-")
        return f"{os.getpid()} {gpu} {os.environ.get('EBB_DEVICE', '-')}"

    def setup(self) -> None:
        if self.folder:
            with open(os.path.join(self.folder, str(os.getpid())), "w") as f:
                f.write(self._where())

    def process(self, row: Any) -> Any:
        return self._where()


class Weighted:
    """{"id", "features"} -> {"id", <out>: features . weights}, columnar: a light model of its
    own per branch. Rows whose id is in `poison` fail (alone, after bisection); a row whose
    id is in `crash_on` kills the process (every time); `batch` records each row's batch
    size, to see that branches batch on their own."""

    def __init__(
        self,
        weight: float,
        out: str,
        poison: list[int] | None = None,
        crash_on: list[int] | None = None,
    ) -> None:
        self.weight = weight
        self.out = out
        self.poison = set(poison or [])
        self.crash_on = set(crash_on or [])

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = set(batch["id"].tolist())
        if self.crash_on & ids:
            os._exit(31)
        if self.poison & ids:
            raise ValueError(f"cannot score rows {sorted(self.poison & ids)}")
        n = len(batch["id"])
        return {
            "id": batch["id"],
            self.out: batch["features"].sum(axis=1) * self.weight,
            f"{self.out}_batch": np.full(n, n, dtype=np.int64),
        }


class Difference:
    """{"a", "b"} -> {"id", "diff": a - b}: a stage that reads two branches."""

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"id": batch["id"], "diff": batch["a"] - batch["b"]}


class Labelled:
    """{"id", "features"} -> the same with "label": 1 where the first feature is positive (the
    truth an evaluation scores its models against)."""

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**batch, "label": (batch["features"][:, 0] > 0).astype(np.int64)}


class Probability:
    """{"features", ...} -> the row's other columns and <out>: a probability from a linear
    score of the features (`weights`, one per feature), with noise fixed by the row's id: a
    light model that ranks the rows imperfectly. Optionally slow (`seconds_per_batch`)."""

    def __init__(
        self,
        weights: list[float],
        out: str,
        seconds_per_batch: float = 0.0,
        straggle: dict[str, Any] | None = None,
    ) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.out = out
        self.seconds = seconds_per_batch
        if straggle is not None and _claims(straggle["claim"]):
            self.seconds *= straggle["factor"]

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.seconds:
            time.sleep(self.seconds)
        noise = np.sin(batch["id"].astype(np.float64) * 12.9898) * 0.8
        logit = batch["features"].astype(np.float64) @ self.weights + noise
        rest = {k: v for k, v in batch.items() if k != "features"}
        return {**rest, self.out: 1.0 / (1.0 + np.exp(-logit))}


class Counted:
    """{"id", ...} -> {"id", "double": 2 * id}, and for its stage's metrics alone (not written
    out) each row's `work`: id % 3."""

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ebb.worker.modelets.api import hidden_column

        ids = batch["id"]
        return {"id": ids, "double": ids * 2, hidden_column("work"): ids % 3}


class Gate:
    """The batch as it came, with "tag" (the id), except: a batch holding an id of `fail`
    raises (bisected, those rows are error rows); one holding an id of `unstorable` tags its
    rows with what no column can store, which fails every attempt that writes them (their
    shard is quarantined once its attempts are spent)."""

    def __init__(self, fail: list[int] | None = None, unstorable: list[int] | None = None) -> None:
        self.fail = np.asarray(fail or [], dtype=np.int64)
        self.unstorable = np.asarray(unstorable or [], dtype=np.int64)

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["id"]
        failing = ids[np.isin(ids, self.fail)]
        if len(failing):
            raise ValueError(f"gate closed to rows {failing.tolist()}")
        tag: np.ndarray = ids.copy()
        if np.isin(ids, self.unstorable).any():
            tag = np.empty(len(ids), dtype=object)
            tag[:] = [{int(i)} for i in ids]
        return {**batch, "tag": tag}


class Hold:
    """Its items as they are, each batch held until the file `gate` exists (a tier that
    cannot commit until a test lets it)."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def process_batch(self, items: list[Any]) -> list[Any]:
        _wait_for(self.gate)
        return items


class WordLabelled:
    """{"id", "features"} -> the same with "label": "yes" where the first feature is positive,
    else "no" (a label column as a spreadsheet has it: words, not numbers)."""

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**batch, "label": np.where(batch["features"][:, 0] > 0, "yes", "no")}


class ZeroInPlace:
    """{"id", "features"} -> {"id", "zeroed": the sum it saw}, per row, then zeroing the row's
    features in place and its id: a modelet that writes into the rows it is given (to
    normalise them, say). Whatever it writes must stay its own."""

    def process(self, row: dict[str, Any]) -> Any:
        seen = float(row["features"].sum())
        row["features"] *= 0.0
        row["id"] = -1
        return {"id": row["id"], "zeroed": seen}


class ZeroColumnsInPlace:
    """ZeroInPlace on a batch's columns."""

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen = batch["features"].sum(axis=1)
        batch["features"] *= 0.0
        batch["id"] *= 0
        return {"id": batch["id"], "zeroed": seen}


class Renamed:
    """Row map -> {`to`: the row's `features`}: a column of this stage's making, which a later
    stage reads by its name."""

    def __init__(self, to: str) -> None:
        self.to = to

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.to: batch["features"]}


class Overlapping:
    """Declares that its loop may run two batches at once (`concurrent_batches`, as an llm
    stage fed by a server does). Each row's value: the most batches it saw running at once
    while its own ran. Its first batch waits (up to `wait_s`) until a second has begun."""

    concurrent_batches = 2

    def __init__(self, wait_s: float = 60.0) -> None:
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self.running = self.calls = 0
        self.two = threading.Event()

    def process_batch(self, rows: list[Any]) -> list[Any]:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
            self.running += 1
            most = self.running
            if self.running >= 2:
                self.two.set()
        try:
            if first and self.two.wait(self.wait_s):
                most = 2
        finally:
            with self.lock:
                self.running -= 1
        return [np.asarray([most], dtype=np.float32) for _ in rows]


class OverlappingCrashOn:
    """Two batches at once (`concurrent_batches`), each taking `seconds`; a row whose id is in
    `ids` kills the whole process, whichever batch runs beside its own."""

    concurrent_batches = 2

    def __init__(self, ids: list[int], seconds: float = 0.02) -> None:
        self.ids = set(ids)
        self.seconds = seconds

    def process_batch(self, rows: list[Any]) -> list[Any]:
        if any(r["id"] in self.ids for r in rows):
            os._exit(17)
        time.sleep(self.seconds)
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]
