"""A sentence-transformers folder read: what its `modules.json` and its modules' configurations
say (ebb.worker.modelets.sentence runs it), the pooling and the Dense layer as
sentence-transformers computes them. Both layouts: the one before sentence-transformers 6
(`sentence_transformers.models.Pooling`, `pooling_mode_<name>: true`, `max_seq_length` in
sentence_bert_config.json) and the one 6 writes (each module's own type path, `pooling_mode`,
the length in the tokenizer's config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
"""The modules run here, by the last part of their type in `modules.json`: sentence-transformers
before 6 names them `sentence_transformers.models.Pooling`, 6 and later by their own module
(`sentence_transformers.sentence_transformer.modules.pooling.Pooling`)."""
POOLING_NAMES = {
    "cls": "cls_token",
    "mean": "mean_tokens",
    "max": "max_tokens",
    "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "weightedmean": "weightedmean_tokens",
    "lasttoken": "lasttoken",
}
"""Pooling's `pooling_mode` (sentence-transformers 6 and later) -> the name of its older
`pooling_mode_<name>: true` key."""

POOLING_MODES = (
    "cls_token",
    "mean_tokens",
    "max_tokens",
    "mean_sqrt_len_tokens",
    "weightedmean_tokens",
    "lasttoken",
)
ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, 0.0),
    "torch.nn.modules.activation.Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


class LayoutError(ValueError):
    """The folder is not a sentence-transformers model this encoder can run."""


@dataclass(frozen=True)
class Dense:
    weight: np.ndarray
    """[out, in]"""
    bias: np.ndarray | None
    activation: Any

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return np.asarray(self.activation(y), dtype=np.float32)


@dataclass(frozen=True)
class Layout:
    """What `modules.json` and the modules' configurations say."""

    root: Path
    max_tokens: int | None
    """`max_seq_length` as sentence_bert_config.json says it (None: the tokenizer's
    `model_max_length`, where sentence-transformers 6 keeps it)."""
    lowercase: bool
    pooling: str
    """One of POOLING_MODES."""
    dense: list[Dense]
    normalize: bool

    @classmethod
    def read(cls, root: Path) -> Layout:
        modules_file = root / "modules.json"
        if not modules_file.is_file():
            raise LayoutError(f"{root} has no modules.json: not a sentence-transformers folder")
        modules = sorted(json.loads(modules_file.read_text()), key=lambda m: int(m["idx"]))
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        for module, kind in zip(modules, kinds, strict=True):
            if kind not in MODULES:
                raise LayoutError(f"{root}: module {module.get('type')!r} is not supported here")
        if not kinds or kinds[0] != "Transformer" or (modules[0].get("path") or "") != "":
            raise LayoutError(f"{root}: the first module must be the Transformer at the root")
        if len(kinds) < 2 or kinds[1] != "Pooling" or {"Transformer", "Pooling"} & set(kinds[2:]):
            raise LayoutError(f"{root}: the Transformer, then Pooling, then Dense or Normalize")
        settings: dict[str, Any] = {}
        bert_config = root / "sentence_bert_config.json"
        if bert_config.is_file():
            settings = json.loads(bert_config.read_text())
        pooling = _pooling_mode(json.loads((root / modules[1]["path"] / "config.json").read_text()))
        dense = [
            _dense(root / m["path"]) for m, k in zip(modules, kinds, strict=True) if k == "Dense"
        ]
        limit = settings.get("max_seq_length")
        return cls(
            root=root,
            max_tokens=int(limit) if limit else None,
            lowercase=bool(settings.get("do_lower_case", False)),
            pooling=pooling,
            dense=dense,
            normalize="Normalize" in kinds,
        )


def _pooling_mode(config: dict[str, Any]) -> str:
    if "pooling_mode" in config:  # sentence-transformers 6 and later
        mode = config["pooling_mode"]
        if not isinstance(mode, str) or mode not in POOLING_NAMES:
            raise LayoutError(f"pooling: mode {mode!r} is not supported here")
        return POOLING_NAMES[mode]
    chosen = [m for m in POOLING_MODES if config.get(f"pooling_mode_{m}")]
    if len(chosen) != 1:
        raise LayoutError(f"pooling: exactly one mode must be on, not {chosen or 'none'}")
    return chosen[0]


def _dense(folder: Path) -> Dense:
    config = json.loads((folder / "config.json").read_text())
    activation_name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation_name not in ACTIVATIONS:
        raise LayoutError(f"Dense: activation {activation_name!r} is not supported here")
    weights: dict[str, np.ndarray]
    if (folder / "model.safetensors").is_file():
        from safetensors.numpy import load_file

        weights = load_file(str(folder / "model.safetensors"))
    else:
        import torch

        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        weights = {k: v.float().numpy() for k, v in state.items()}
    bias = weights.get("linear.bias") if config.get("bias", True) else None
    return Dense(
        weight=weights["linear.weight"].astype(np.float32),
        bias=None if bias is None else bias.astype(np.float32),
        activation=ACTIVATIONS[activation_name],
    )


def pool(tokens: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """Token embeddings [rows, length, width] and the attention mask [rows, length] (right
    padded) -> one vector per row, as sentence-transformers' Pooling computes it."""
    pooled: np.ndarray = _pool(tokens, mask, mode)
    return pooled


def _pool(tokens: np.ndarray, mask: np.ndarray, mode: str) -> Any:
    mask_f = mask[..., None].astype(np.float32)
    lengths = np.maximum(mask.sum(axis=1, keepdims=True).astype(np.float32), 1e-9)
    if mode == "cls_token":
        return tokens[:, 0]
    if mode == "lasttoken":
        last = mask.sum(axis=1).astype(np.int64) - 1
        return tokens[np.arange(len(tokens)), np.maximum(last, 0)]
    if mode == "max_tokens":
        return np.where(mask_f > 0, tokens, -1e9).max(axis=1)
    if mode == "weightedmean_tokens":
        weights = mask_f * np.arange(1, tokens.shape[1] + 1, dtype=np.float32)[None, :, None]
        return (tokens * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    summed = (tokens * mask_f).sum(axis=1)
    if mode == "mean_sqrt_len_tokens":
        return summed / np.sqrt(lengths)
    return summed / lengths
