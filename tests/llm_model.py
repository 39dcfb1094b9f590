"""The tiny generative model the tests and the benchmark build: examples/llm/tiny_model.py,
the example's own builder (one builder, used wherever a model is needed without a download)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

_BUILDER = Path(__file__).resolve().parent.parent / "examples" / "llm" / "tiny_model.py"
_spec = importlib.util.spec_from_file_location("ebb_example_tiny_model", _BUILDER)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

build_tiny_llm: Callable[..., Path] = _module.build_tiny_llm
corpus: Callable[..., list[str]] = _module.corpus


def build_sliding_llm(path: Path, architecture: str, *, window: int = 16) -> Path:
    """The tiny model's tokenizer beside a sliding-window model (`mistral`, `gemma2`,
    `gemma3`: each layer, or every other, attends to its last `window` tokens only), random
    weights, saved under `path`."""
    import shutil

    import torch
    from transformers import (
        AutoTokenizer,
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        MistralConfig,
        MistralForCausalLM,
    )

    llama = build_tiny_llm(path.parent / f"{path.name}-tokenizer")
    path.mkdir(parents=True, exist_ok=True)
    for file in llama.iterdir():  # the tokenizer and its chat template, not the model
        if file.name not in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(file, path / file.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "sliding_window": window,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    models = {
        "mistral": (MistralForCausalLM, MistralConfig),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig),
    }
    model, config = models[architecture]
    if architecture != "mistral":
        shape["head_dim"] = 16
    torch.manual_seed(0)
    model(config(**shape)).save_pretrained(path)
    return path
