"""Modelets of the benchmark workloads (stage processes import them through code_paths)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from bench.workloads import CELLS, CHANNELS, CROP, PATCH, decode, normalise, pixels
from ebb.worker.chunks.columns import VALUE


class Decode:
    """Row -> the tagger's input tensor (decompress, crop, normalise)."""

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        return [decode(r["image"]) for r in rows]

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Each image decodes into its row of one batch tensor: no per-row arrays to stack.
        images = batch["image"]
        out = np.empty((len(images), CHANNELS, CROP, CROP), dtype=np.float32)
        for i, blob in enumerate(images):
            out[i] = decode(blob)
        return {VALUE: out}


class DecodeFull:
    """Row -> {"image": the detector's input tensor, "pixels": the image itself}.

    The detector consumes "image"; the cropper reads "pixels" (a quarter of the bytes)."""

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        out = []
        for r in rows:
            image = pixels(r["image"])
            out.append({"image": normalise(image), "pixels": image})
        return out


def crops_of(image: np.ndarray, scores: np.ndarray, threshold: float) -> list[np.ndarray]:
    """The normalised crops of the grid cells scoring above `threshold` (image: uint8 HWC)."""
    out = []
    for cell in np.flatnonzero(scores > threshold).tolist():
        y, x = divmod(cell, CELLS)
        out.append(normalise(image[y * PATCH : (y + 1) * PATCH, x * PATCH : (x + 1) * PATCH]))
    return out


class Crops:
    """{"pixels", "scores"} -> the crops of the cells scoring above `threshold` (a fan-out)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def process(self, item: dict[str, Any]) -> list[np.ndarray]:
        return crops_of(item["pixels"], item["scores"], self.threshold)


def summarise(logits: list[np.ndarray]) -> dict[str, Any]:
    labels = [int(np.argmax(v)) for v in logits]
    return {"objects": len(labels), "labels": labels}


class Summarise:
    """The classifier's logits for one image's crops -> {"objects", "labels"} (a fan-in)."""

    def process(self, logits: list[np.ndarray]) -> dict[str, Any]:
        return summarise(logits)


class DetectAndClassify:
    """Both models in one stage: decode, detect, crop and classify each batch in turn."""

    def __init__(
        self,
        detector: str,
        classifier: str,
        threshold: float,
        threads: int = 1,
        device: str = "cpu",
    ) -> None:
        self.paths = (detector, classifier)
        self.threshold = threshold
        self.threads = threads
        self.providers = ["CPUExecutionProvider"]
        if device == "cuda":
            self.providers.insert(0, "CUDAExecutionProvider")

    def setup(self) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        self.detector, self.classifier = (
            ort.InferenceSession(p, sess_options=options, providers=self.providers)
            for p in self.paths
        )

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        images = [pixels(r["image"]) for r in rows]
        scores = self.detector.run(None, {"x": np.stack([normalise(i) for i in images])})[0]
        crops = [crops_of(img, s, self.threshold) for img, s in zip(images, scores, strict=True)]
        flat = [c for cs in crops for c in cs]
        logits = self.classifier.run(None, {"x": np.stack(flat)})[0] if flat else []
        out, at = [], 0
        for cs in crops:
            out.append(summarise(list(logits[at : at + len(cs)])))
            at += len(cs)
        return out


class Work:
    """Simulated compute: `ms_per_row` of waiting per row, times EBB_BENCH_SLOWDOWN (a slow
    machine). Waiting, not spinning, so that four workers on two cores do not compete."""

    def __init__(self, ms_per_row: float) -> None:
        self.seconds = ms_per_row / 1000 * float(os.environ.get("EBB_BENCH_SLOWDOWN", "1"))

    def process_batch(self, rows: list[Any]) -> list[Any]:
        time.sleep(self.seconds * len(rows))
        return [r["id"] for r in rows]


class Standardize:
    """Row -> its `column` vector, standardised: the MLP benchmarks' preprocessing."""

    def __init__(self, mean: float, std: float, column: str = "features") -> None:
        self.mean = np.float32(mean)
        self.std = np.float32(std)
        self.column = column

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        x = np.asarray([r[self.column] for r in rows], dtype=np.float32)
        return list((x - self.mean) / self.std)

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {VALUE: (batch[self.column] - self.mean) / self.std}


class StandardizeRow:
    """The same, written per row, as most modelets are."""

    def __init__(self, mean: float, std: float, column: str = "features") -> None:
        self.mean = np.float32(mean)
        self.std = np.float32(std)
        self.column = column

    def process(self, row: dict[str, Any]) -> Any:
        return (np.asarray(row[self.column], dtype=np.float32) - self.mean) / self.std


class PassRows:
    """Rows through unchanged, one Python object per row: the per-row form's own cost."""

    def process_batch(self, rows: list[Any]) -> list[Any]:
        return rows


class HashTokenize:
    """Text -> token ids of its words (a hashing tokenizer: deterministic, no vocabulary file),
    with [CLS] first and at most `max_tokens` ids: the embedding benchmark's CPU stage."""

    def __init__(self, vocab: int = 30_522, max_tokens: int = 128) -> None:
        self.vocab = vocab
        self.max_tokens = max_tokens

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = np.empty(len(batch["text"]), dtype=object)
        for i, text in enumerate(batch["text"]):
            words = text.split()[: self.max_tokens - 1]
            ids[i] = np.fromiter(
                (101, *(1000 + (hash_word(w) % (self.vocab - 1000)) for w in words)),
                dtype=np.int64,
            )
        return {"input_ids": ids}


def hash_word(word: str) -> int:
    """A stable hash of a word (Python's own is salted per process)."""
    h = 2166136261
    for byte in word.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


SLOW_MARKER = "slow"
"""While a file of this name is in a ChaosFeatures' `hang_dir`, each of its batches takes
SLOW_BATCH_S more (below the chaos job's batch timeout)."""
SLOW_BATCH_S = 1.0


class ChaosFeatures:
    """The `features` vector, `seconds_per_batch` slower per batch (so that a small job is in
    flight long enough to be hurt), and hanging once whenever the chaos campaign drops a file
    named `hang` into `hang_dir`: the process that takes the file (a rename, so exactly one
    does) sleeps until the pipeline's batch timeout kills it. Slower still while the campaign
    leaves SLOW_MARKER there (a drain whose shards must not finish within its wait)."""

    def __init__(self, seconds_per_batch: float, hang_dir: str) -> None:
        self.seconds = seconds_per_batch
        self.hang_dir = hang_dir

    def process_batch(self, rows: list[dict[str, Any]]) -> list[Any]:
        trigger = os.path.join(self.hang_dir, "hang")
        try:
            os.rename(trigger, os.path.join(self.hang_dir, f"hung-{os.getpid()}"))
        except FileNotFoundError:
            pass
        else:
            time.sleep(3600)
        slowed = os.path.exists(os.path.join(self.hang_dir, SLOW_MARKER))
        time.sleep(self.seconds + (SLOW_BATCH_S if slowed else 0.0))
        return [np.asarray(r["features"], dtype=np.float32) for r in rows]
