"""Model stages: ONNX Runtime and TorchScript, each a modelet that batches numpy inputs.

An item is an array (one row of the model's input) or a map of arrays keyed by the model's
input names; with `input: field` in the stage spec, that field of a map item is the input.
Outputs are split back per item: one output gives an array per item, several give a map.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import numpy as np

from ebb.common.spec import StageSpec

from .modelet import Modelet, StageError

_ONNX_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _local_copy(uri: str) -> str:
    """A local path for the model file: itself, or a download of a remote URI."""
    if "://" not in uri or uri.startswith("file://"):
        return uri.removeprefix("file://")
    import fsspec

    suffix = os.path.splitext(uri)[1]
    fd, path = tempfile.mkstemp(prefix="ebb-model-", suffix=suffix)
    os.close(fd)
    with fsspec.open(uri, "rb") as src, open(path, "wb") as dst:
        while chunk := src.read(8 * 1024 * 1024):
            dst.write(chunk)
    return path


def _split(outputs: dict[str, np.ndarray], n: int) -> list[Any]:
    names = list(outputs)
    for name in names:
        if outputs[name].shape[:1] != (n,):
            raise ValueError(f"model output {name!r} has shape {outputs[name].shape}, batch is {n}")
    if len(names) == 1:
        only = outputs[names[0]]
        return [only[i] for i in range(n)]
    return [{name: outputs[name][i] for name in names} for i in range(n)]


class _ModelStage(Modelet):
    def __init__(self, spec: StageSpec) -> None:
        assert spec.model is not None
        self.spec = spec
        self.uri = spec.model
        self.input_names: list[str] = []

    def process_batch(self, items: list[Any]) -> list[Any]:
        outputs = self.infer(items)
        key = self.spec.output
        if key is None:
            return outputs
        consumed = self.spec.input
        return [
            {**{k: v for k, v in item.items() if k != consumed}, key: out}
            for item, out in zip(items, outputs, strict=True)
        ]

    def infer(self, items: list[Any]) -> list[Any]:
        """One output per item."""
        raise TypeError(f"{type(self).__name__} does not implement infer")

    def _inputs(self, items: list[Any]) -> dict[str, list[Any]]:
        if self.spec.input is not None:
            items = [item[self.spec.input] for item in items]
        if len(self.input_names) == 1 and not isinstance(items[0], dict):
            return {self.input_names[0]: items}
        if not isinstance(items[0], dict):
            raise TypeError(
                f"model takes inputs {self.input_names}: items must be maps of those names"
            )
        return {name: [item[name] for item in items] for name in self.input_names}


class OnnxStage(_ModelStage):
    def setup(self) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if self.spec.threads:
            options.intra_op_num_threads = self.spec.threads
            options.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if self.spec.device.startswith("cuda"):
            device_id = int(self.spec.device.partition(":")[2] or 0)
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))  # type: ignore[arg-type]
        try:
            self.session = ort.InferenceSession(
                _local_copy(self.uri), sess_options=options, providers=providers
            )
        except Exception as e:
            raise StageError(f"cannot load ONNX model {self.uri}: {e}") from e
        inputs = self.session.get_inputs()
        self.input_names = [i.name for i in inputs]
        self.dtypes = {i.name: _ONNX_DTYPES.get(i.type, np.float32) for i in inputs}

    def infer(self, items: list[Any]) -> list[Any]:
        feed: dict[str, np.ndarray] = {
            name: np.stack([np.asarray(v) for v in values]).astype(self.dtypes[name], copy=False)
            for name, values in self._inputs(items).items()
        }
        names = [o.name for o in self.session.get_outputs()]
        results = self.session.run(names, feed)
        return _split(dict(zip(names, results, strict=True)), len(items))


class TorchScriptStage(_ModelStage):
    def setup(self) -> None:
        import torch

        if self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        self.device = torch.device(self.spec.device)
        with warnings.catch_warnings():
            # TorchScript is deprecated upstream, yet it is what many model zoos ship.
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                self.model = torch.jit.load(  # type: ignore[no-untyped-call]
                    _local_copy(self.uri), map_location=self.device
                )
            except Exception as e:
                raise StageError(f"cannot load TorchScript model {self.uri}: {e}") from e
        self.model.eval()
        forward = self.model.forward
        try:
            arguments = forward.schema.arguments[1:]  # the first is `self`
            self.input_names = [a.name for a in arguments] or ["input"]
        except AttributeError:
            self.input_names = ["input"]

    def infer(self, items: list[Any]) -> list[Any]:
        import torch

        inputs = self._inputs(items)
        tensors = [
            torch.from_numpy(np.stack([np.asarray(v) for v in inputs[name]])).to(self.device)
            for name in self.input_names
            if name in inputs
        ]
        with torch.inference_mode():
            out = self.model(*tensors)
        if isinstance(out, torch.Tensor):
            outputs = {"output": out}
        elif isinstance(out, dict):
            outputs = dict(out)
        elif isinstance(out, list | tuple):
            outputs = {f"output{i}": t for i, t in enumerate(out)}
        else:
            raise TypeError(f"TorchScript model returned {type(out).__name__}, not tensors")
        arrays = {k: v.detach().to("cpu").numpy() for k, v in outputs.items()}
        return _split(arrays, len(items))


def load_runtime(spec: StageSpec) -> Modelet:
    if spec.runtime == "onnx":
        return OnnxStage(spec)
    if spec.runtime == "torchscript":
        return TorchScriptStage(spec)
    raise StageError(f"unknown runtime {spec.runtime!r}")
