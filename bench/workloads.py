"""Datasets and models the benchmarks generate for themselves (nothing is downloaded).

An image-tagging workload: `images` holds zlib-compressed 64x64 RGB images (about 4-6 KB
each once compressed: enough to make decoding cost something, as it does for JPEG). Models
are small convolutional networks built with onnx.helper from seeded random weights: what
they predict is meaningless, what they cost is real.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
from onnx import TensorProto, helper, numpy_helper

SIDE = 64
CHANNELS = 3
CROP = 56
CELLS = 4
"""The detector scores a CELLS x CELLS grid; each cell above threshold is one crop."""
PATCH = SIDE // CELLS
CLASSES = 100


def write_images(folder: Path, *, rows: int, files: int = 4, seed: int = 0) -> Path:
    """Parquet files of `id` and `image` (zlib-compressed uint8 HWC)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = -(-rows // files)
    for f in range(files):
        start = f * per_file
        n = min(per_file, rows - start)
        if n <= 0:
            break
        # Smooth noise compresses like a photo, not like white noise.
        base = rng.integers(0, 255, size=(n, SIDE // 8, SIDE // 8, CHANNELS), dtype=np.uint8)
        images = np.repeat(np.repeat(base, 8, axis=1), 8, axis=2)
        images = images + rng.integers(0, 4, size=images.shape, dtype=np.uint8)
        encoded = [zlib.compress(img.tobytes(), 6) for img in images]
        table = pa.table(
            {
                "id": np.arange(start, start + n, dtype=np.int64),
                "image": pa.array(encoded, type=pa.binary()),
            }
        )
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=2_000)
    return folder


def decode(blob: Any) -> np.ndarray:
    """Compressed bytes -> normalised float32 CHW center crop: the preprocessing stage."""
    image = np.frombuffer(zlib.decompress(blob), dtype=np.uint8).reshape(SIDE, SIDE, CHANNELS)
    offset = (SIDE - CROP) // 2
    crop = image[offset : offset + CROP, offset : offset + CROP].astype(np.float32)
    crop = (crop / 255.0 - 0.45) / 0.225
    return np.ascontiguousarray(crop.transpose(2, 0, 1))


def pixels(blob: Any) -> np.ndarray:
    """Compressed bytes -> uint8 HWC pixels."""
    return np.frombuffer(zlib.decompress(blob), dtype=np.uint8).reshape(SIDE, SIDE, CHANNELS)


def normalise(image: np.ndarray) -> np.ndarray:
    """uint8 HWC -> normalised float32 CHW (the models' input)."""
    scaled = (image.astype(np.float32) / 255.0 - 0.45) / 0.225
    return np.ascontiguousarray(scaled.transpose(2, 0, 1))


def decode_full(blob: Any) -> np.ndarray:
    """Compressed bytes -> normalised float32 CHW, whole image (for the detector)."""
    return normalise(pixels(blob))


def _conv(name: str, cin: int, cout: int, rng: np.random.Generator) -> list[onnx.TensorProto]:
    w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
    b = np.zeros(cout, dtype=np.float32)
    return [numpy_helper.from_array(w, f"{name}_w"), numpy_helper.from_array(b, f"{name}_b")]


def _cnn(
    path: Path,
    *,
    side: int,
    widths: list[int],
    outputs: int,
    seed: int,
    head: str = "classify",
) -> Path:
    """Conv(3x3, stride 2)+ReLU layers, then a head: `classify` (global pool + Gemm -> logits
    [N, outputs]) or `grid` (1x1 conv -> sigmoid scores [N, CELLS*CELLS])."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    current, cin = "x", CHANNELS
    for i, cout in enumerate(widths):
        inits += _conv(f"c{i}", cin, cout, rng)
        nodes.append(
            helper.make_node(
                "Conv",
                [current, f"c{i}_w", f"c{i}_b"],
                [f"c{i}"],
                kernel_shape=[3, 3],
                strides=[2, 2] if i < 3 else [1, 1],
                pads=[1, 1, 1, 1],
            )
        )
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        current, cin = f"r{i}", cout
    if head == "classify":
        w = (rng.standard_normal((cin, outputs)) / np.sqrt(cin)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, "fc_w"),
            numpy_helper.from_array(np.zeros(outputs, np.float32), "fc_b"),
        ]
        nodes += [
            helper.make_node("GlobalAveragePool", [current], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["out"]),
        ]
        out_shape: list[int | str] = ["N", outputs]
    else:
        w = (rng.standard_normal((1, cin, 1, 1)) / np.sqrt(cin)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, "score_w"),
            numpy_helper.from_array(np.zeros(1, np.float32), "score_b"),
        ]
        # Pool to the grid, one score per cell.
        nodes += [
            helper.make_node("Conv", [current, "score_w", "score_b"], ["s"], kernel_shape=[1, 1]),
            helper.make_node("AveragePool", ["s"], ["g"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Sigmoid", ["g"], ["p"]),
            helper.make_node("Flatten", ["p"], ["out"]),
        ]
        out_shape = ["N", CELLS * CELLS]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", CHANNELS, side, side])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def tagger(path: Path, *, seed: int = 0) -> Path:
    """The single-model benchmark's classifier: 56x56 image -> 100 logits."""
    return _cnn(path, side=CROP, widths=[32, 64, 96, 128], outputs=CLASSES, seed=seed)


def detector(path: Path, *, seed: int = 1) -> Path:
    """64x64 image -> CELLS*CELLS objectness scores in (0, 1)."""
    return _cnn(path, side=SIDE, widths=[16, 32, 48], outputs=0, seed=seed, head="grid")


def crop_classifier(path: Path, *, seed: int = 2) -> Path:
    """16x16 crop -> 100 logits."""
    return _cnn(path, side=PATCH, widths=[32, 64, 96, 128], outputs=CLASSES, seed=seed)
