"""Model stages: ONNX Runtime and TorchScript, each a columnar modelet.

A row is an array (one row of the model's input) or a map of arrays keyed by the model's
input names; with `input: field` in the stage spec, that field of a map row is the input.
The batch's column goes to the runtime as one array (no per-row stacking when it arrives as a
tensor column); one output comes back as the rows' value, several as a map per row.

Both runtimes in one module, past 400 lines: what differs between them (loading, threads,
devices, warm-up) is short beside what they share (feeds from columns, padding and masks,
the checks of inputs and outputs), and the shared part is read with either.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ebb.common.job import StageSpec

from ..chunks.columns import VALUE, Columns, from_rows, is_plain, num_rows, to_rows
from ..modelcache.client import local_model, worker_cache
from ..modelcache.store import ModelFetchError
from ..resources.devices import NO_GPU
from .api import Modelet, StageError

log = logging.getLogger(__name__)

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
    """A local path for the model file: itself, or its copy in the worker's model cache (from
    the node's cache when there is one, else from the store)."""
    if "://" not in uri or uri.startswith("file://"):
        return uri.removeprefix("file://")
    # Read here, in the stage process, as the worker's environment passes it down.
    cache_dir, cache_url = worker_cache()
    try:
        return local_model(uri, cache_dir, cache_url=cache_url).path
    except (ModelFetchError, OSError) as e:
        raise StageError(f"cannot fetch model {uri}: {e}") from e


_TORCH_DTYPES = ("float32", "float16", "bfloat16")

WARM_UP_FILE = "ebb-warm-up.json"
"""An extra file in a TorchScript archive: the shapes and dtypes of one example batch of the
model's inputs, by name (TorchScript keeps none), for a warm-up at load time."""


def warm_up_extra_files(example: Mapping[str, Any]) -> dict[str, str]:
    """For `torch.jit.save(model, path, _extra_files=...)`: the shapes of one example batch
    (arrays or tensors, by input name), so that a worker can warm the model up while it reads
    its first shard. The values themselves are not kept."""
    inputs = {
        name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        for name, value in example.items()
    }
    return {WARM_UP_FILE: json.dumps({"inputs": inputs})}


def _tensor(column: np.ndarray, dtype: Any = None) -> np.ndarray:
    """A column as one contiguous array (a column of per-row arrays is stacked)."""
    if column.dtype == object:
        column = np.stack([np.asarray(v) for v in column])
    return np.ascontiguousarray(column, dtype=dtype)


def _check_rows(outputs: dict[str, np.ndarray], n: int) -> None:
    for name, value in outputs.items():
        if value.shape[:1] != (n,):
            raise ValueError(f"model output {name!r} has shape {value.shape}, batch is {n}")


class NonFiniteInput(ValueError):
    """A row's model input holds NaN or inf."""


def _check_finite(feeds: dict[str, np.ndarray], n: int) -> None:
    """Raise NonFiniteInput if any row's floating-point input is NaN or inf. The batch fails
    before the model runs; the stage then splits it, so only the rows at fault fail (and
    each sub-batch without one runs once)."""
    for name, value in feeds.items():
        if value.dtype.kind != "f" or value.shape[:1] != (n,):
            continue
        finite = np.isfinite(value.reshape(n, -1)).all(axis=1)
        if not finite.all():
            bad = int(np.count_nonzero(~finite))
            which = "this row's" if n == 1 else f"{bad} of {n} rows'"
            raise NonFiniteInput(
                f"{which} model input {name!r} holds NaN or inf (finite_inputs: false lets "
                "a model that reads NaN as missing take it)"
            )


class ModelStage(Modelet):
    """A model file as a columnar modelet: the input columns go to the runtime as they are
    (one contiguous array each), its outputs come back as columns."""

    def __init__(self, spec: StageSpec) -> None:
        assert spec.model is not None
        self.spec = spec
        self.uri = spec.model
        self.input_names: list[str] = []

    def process_batch(self, items: list[Any]) -> list[Any]:
        return to_rows(self.process_columns(from_rows(items)))

    def process_columns(self, batch: Columns) -> Columns:
        n = num_rows(batch)
        feeds = self._feeds(batch)
        if self.spec.finite_inputs:
            _check_finite(feeds, n)
        outputs = self.infer(feeds)
        _check_rows(outputs, n)
        only = next(iter(outputs.values())) if len(outputs) == 1 else None
        key = self.spec.output
        if key is None:
            return {VALUE: only} if only is not None else outputs
        if is_plain(batch):
            raise TypeError(f"rows must be maps to take the model's output as {key!r}")
        out = {k: v for k, v in batch.items() if k != self.spec.input}
        if only is not None:
            out[key] = only
        else:  # several outputs under one key: a map per row
            names = list(outputs)
            per_row = np.empty(n, dtype=object)
            for i in range(n):
                per_row[i] = {name: outputs[name][i] for name in names}
            out[key] = per_row
        return out

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs, by name, for a batch of inputs, by name."""
        raise TypeError(f"{type(self).__name__} does not implement infer")

    def set_threads(self, threads: int) -> None:
        """Run with `threads` intra-op threads from the next batch on (its share of the
        worker's cores changed)."""

    def _feeds(self, batch: Columns) -> dict[str, np.ndarray]:
        """The model's inputs from the batch: the `input` column, the one column of plain
        rows, or the columns named like the model's inputs. Sequences of uneven length
        (token ids) are padded to the batch's longest, and a model that takes an attention
        mask the rows do not carry gets one (1 for a token, 0 for padding)."""
        wanted = [n for n in self.input_names if n not in MASK_NAMES] or self.input_names
        if self.spec.input is not None:
            if is_plain(batch) or self.spec.input not in batch:
                raise TypeError(f"rows have no field {self.spec.input!r}")
            column: np.ndarray | None = batch[self.spec.input]
        elif is_plain(batch) or (len(batch) == 1 and len(wanted) == 1):
            column = next(iter(batch.values()))  # the rows' one value feeds the one input
        else:
            column = None
        if column is not None:
            if column.dtype == object and len(column) and isinstance(column[0], dict):
                batch = from_rows(list(column))  # rows that are maps of the model's inputs
            elif len(wanted) == 1:
                batch = {wanted[0]: column}
            else:
                raise TypeError(
                    f"model takes inputs {self.input_names}: rows must be maps of those names"
                )
        feeds: dict[str, np.ndarray] = {}
        lengths: np.ndarray | None = None
        for name in self.input_names:
            if name in batch:
                feeds[name], found = _padded(batch[name])
                lengths = found if lengths is None else lengths
        missing = [n for n in self.input_names if n not in feeds]
        masks = [n for n in missing if n in MASK_NAMES]
        if masks and lengths is None:
            # Sequences that came as one 2-D array (rows stacked upstream) have no padding.
            widths = [f.shape for f in feeds.values() if f.ndim == 2]
            lengths = np.full(widths[0][0], widths[0][1], dtype=np.int64) if widths else None
        if masks and lengths is not None:
            longest = max(f.shape[1] for f in feeds.values() if f.ndim > 1)
            mask = (np.arange(longest)[None, :] < lengths[:, None]).astype(np.int64)
            feeds.update(dict.fromkeys(masks, mask))
            missing = [n for n in missing if n not in masks]
        if missing:
            raise TypeError(
                f"model takes inputs {self.input_names}: rows must be maps of those names "
                f"(they lack {missing})"
            )
        return feeds


MASK_NAMES = frozenset({"attention_mask", "mask"})
"""Model inputs that Ebb fills in from the padding of a batch of uneven sequences."""


def _padded(column: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A column of sequences (an object column of 1-D arrays), padded with zeros at the end
    into one array, and each row's length (None when the column holds no sequences). Rows of
    one length still give their lengths: a batch cut from rows sorted by length often has no
    padding, yet a model that takes an attention mask needs one all the same."""
    if column.dtype != object or not len(column):
        return column, None
    rows = [np.asarray(v) for v in column]
    if rows[0].ndim != 1:
        return column, None
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    out = np.zeros((len(rows), int(lengths.max())), dtype=np.result_type(*rows))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, lengths


class OnnxStage(ModelStage):
    def setup(self) -> None:
        import onnxruntime as ort

        self.providers: list[Any] = ["CPUExecutionProvider"]
        if self.spec.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise StageError(
                    f"stage {self.spec.name!r} runs on {self.spec.device}, and this onnxruntime "
                    f"has no CUDA support (install onnxruntime-gpu): {NO_GPU}"
                )
            device_id = int(self.spec.device.partition(":")[2] or 0)
            self.providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))
        self.path = _local_copy(self.uri)
        self.session = self._session(self.spec.threads)
        inputs = self.session.get_inputs()
        self.input_names = [i.name for i in inputs]
        self.dtypes = {i.name: _ONNX_DTYPES.get(i.type, np.float32) for i in inputs}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._warm_up(inputs)
        wanted = self.spec.dtype
        if wanted is not None:
            # ONNX Runtime runs the graph in the types it was exported with: a float16 model
            # is an export of its own, not a switch at load time.
            floats = {np.dtype(t).name for t in self.dtypes.values() if np.dtype(t).kind == "f"}
            if floats and floats != {wanted}:
                raise StageError(
                    f"{self.uri} takes {sorted(floats)} inputs, not {wanted}: export the model "
                    f"in {wanted} (onnxruntime cannot convert it at load time)"
                )

    def _session(self, threads: int) -> Any:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        # Its threads wait for the next batch asleep, not spinning: the stage shares the
        # worker's cores with the other stages and the router, whose time a spin would take.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            return ort.InferenceSession(self.path, sess_options=options, providers=self.providers)
        except Exception as e:
            raise StageError(f"cannot load ONNX model {self.uri}: {e}") from e

    def set_threads(self, threads: int) -> None:
        # ONNX Runtime sizes its pool when a session is made: a new session, which costs
        # what loading the model did (the elastic scheduler changes processes seldom).
        self.session = self._session(threads)
        self._warm_up(self.session.get_inputs())

    def _warm_up(self, inputs: list[Any]) -> None:
        """One batch of zeros through the model, while the worker reads its first shard: the
        runtime's first run (allocations, kernel choice; on a GPU, far slower than the next)
        is then not the first batch's. Only when every input's shape is known but the batch."""
        shapes = [[1, *i.shape[1:]] for i in inputs]
        if not all(isinstance(d, int) and d > 0 for shape in shapes for d in shape):
            return
        feed: dict[str, np.ndarray] = {
            i.name: np.zeros(shape, dtype=self.dtypes[i.name])
            for i, shape in zip(inputs, shapes, strict=True)
        }
        try:
            self.session.run(self.output_names, feed)
        except Exception as e:  # noqa: BLE001 - a model that rejects zeros still serves rows
            log.info("%s: no warm-up (%s)", self.uri, e)

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {name: _tensor(column, self.dtypes[name]) for name, column in feeds.items()}
        results = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, results, strict=True))


class TorchScriptStage(ModelStage):
    """A TorchScript model. On a GPU the batch goes through pinned host memory and a copy
    stream of its own, so that the copy to the device does not wait behind (or hold up) the
    kernels of the previous batch; `dtype` runs the model in half or bfloat16 precision."""

    def setup(self) -> None:
        import torch

        if self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        self.device = torch.device(self.spec.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise StageError(
                f"stage {self.spec.name!r} runs on {self.spec.device}, and no CUDA device is "
                f"visible to this worker: {NO_GPU}"
            )
        self.dtype = getattr(torch, self.spec.dtype or "float32")
        extra_files = {WARM_UP_FILE: ""}
        with warnings.catch_warnings():
            # TorchScript is deprecated upstream, yet it is what many model zoos ship.
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                self.model = torch.jit.load(  # type: ignore[no-untyped-call]
                    _local_copy(self.uri), map_location=self.device, _extra_files=extra_files
                )
            except Exception as e:
                raise StageError(f"cannot load TorchScript model {self.uri}: {e}") from e
        self.model.eval()
        if self.dtype != torch.float32:
            self.model.to(self.dtype)
        forward = self.model.forward
        try:
            arguments = forward.schema.arguments[1:]  # the first is `self`
            self.input_names = [a.name for a in arguments] or ["input"]
        except AttributeError:
            self.input_names = ["input"]
        self.pinned: dict[str, Any] = {}
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        if extra_files[WARM_UP_FILE]:
            self._warm_up(extra_files[WARM_UP_FILE])

    def set_threads(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)

    def _warm_up(self, described: str | bytes) -> None:
        """Two batches of ones, shaped like the archive's example, while the worker reads
        its first shard: TorchScript's executor profiles the first run and optimises the
        second; on a GPU the first also loads kernels and sets up cuBLAS. Neither then falls
        on the first batch of rows."""
        try:
            inputs = json.loads(described)["inputs"]
            feeds = {
                # Floating inputs go to the model in its dtype whatever they come in as.
                name: np.ones(d["shape"], dtype=np.float32 if "float" in d["dtype"] else d["dtype"])
                for name, d in inputs.items()
                if name in self.input_names
            }
            for _ in range(2):
                self.infer(feeds)
        except Exception as e:  # noqa: BLE001 - a model that rejects the example still serves rows
            log.info("%s: no warm-up (%s)", self.uri, e)

    def _to_device(self, name: str, array: np.ndarray) -> Any:
        import torch

        with warnings.catch_warnings():
            # A chunk's arrays are read-only views of the batch (shared memory, Arrow):
            # torch warns that writes through the tensor would be undefined. The model only
            # reads its inputs, and a copy to make them writable would cost a pass over the
            # batch, so the view is handed over as it is, without the warning in every log.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            host = torch.from_numpy(array)
        if host.is_floating_point():
            host = host.to(self.dtype)
        if not self.cuda:
            return host
        # Pinned (page-locked) staging memory, kept between batches: the copy to the GPU
        # then runs asynchronously, by DMA, instead of through a pageable bounce buffer.
        buffer = self.pinned.get(name)
        if buffer is None or buffer.dtype != host.dtype or buffer.numel() < host.numel():
            buffer = torch.empty(host.numel(), dtype=host.dtype).pin_memory()
            self.pinned[name] = buffer
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            on_device = staged.to(self.device, non_blocking=True)
        # The forward pass (on the default stream) starts once this copy is complete.
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        on_device.record_stream(torch.cuda.current_stream(self.device))
        return on_device

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        tensors = [
            self._to_device(name, _tensor(feeds[name]))
            for name in self.input_names
            if name in feeds
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
        return {k: _host(v) for k, v in outputs.items()}


def _host(tensor: Any) -> np.ndarray:
    import torch

    tensor = tensor.detach()
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()  # numpy has no bfloat16; output columns are float32
    array: np.ndarray = tensor.to("cpu").numpy()
    return array


def load_runtime(spec: StageSpec) -> ModelStage:
    if spec.runtime == "onnx":
        return OnnxStage(spec)
    if spec.runtime == "torchscript":
        return TorchScriptStage(spec)
    raise StageError(f"unknown runtime {spec.runtime!r}")
