"""`SentenceEncoder`: texts to sentence embeddings, from a model folder in the
sentence-transformers layout, as `SentenceTransformer.encode` computes them.

The folder is what `SentenceTransformer.save` writes and what the Hub holds: `modules.json`
lists the modules in order, each in its own subfolder: the transformer itself (the folder's
root: `config.json`, the weights, the tokenizer; `sentence_bert_config.json` its
`max_seq_length`), `Pooling` (its `config.json`: CLS token, mean, max, mean over the square
root of the length, weighted mean or last token), then optionally `Dense` (a linear layer and
its activation) and `Normalize` (unit length). Any other module is refused at set-up, by name.

The transformer runs on torch (`transformers.AutoModel`) or, `backend: onnx`, on ONNX Runtime
from the folder's `onnx/model.onnx` (where sentence-transformers' own ONNX export puts it).
Rows are encoded longest first in sub-batches of at most `batch_tokens` tokens (rows times
the longest row: padding costs what it pads), so a batch of mixed lengths pads little. An
empty text is an error of its row; a text over `max_seq_length` tokens is cut, as
sentence-transformers cuts it.

    - name: embed
      modelet: ebb.worker.modelets:SentenceEncoder
      params: {model: s3://models/all-MiniLM-L6-v2, column: text, output: embedding}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..chunks.columns import ROW_ERROR, Columns, num_rows
from ..modelcache.client import local_model_folder
from .api import Modelet
from .sentence_layout import Layout, LayoutError, pool


class InputError(ValueError):
    """One row's input cannot be encoded: the error of that row alone."""


class SentenceEncoder(Modelet):
    """A column of texts -> a column of embeddings (float32, one vector per row).

    `inputs: many` (what the Batch API's `/v1/embeddings` asks): each row holds a list of
    inputs, texts in `column` or token ids (lists of the model's tokenizer's ids, without
    special tokens: they are added here) in `ids_column`, and its output is the list of their
    vectors, with `prompt_tokens` (the tokens encoded, special ones included) when
    `count_tokens`. `truncate: false`: an input over the model's `max_seq_length` is an error
    of its row, as the API refuses it, rather than cut. `dimensions_column`: a row's own
    `dimensions` (null: every one), the vector cut to its first ones and, for a model that
    normalizes, normalized again."""

    def __init__(
        self,
        model: str,
        *,
        column: str = "text",
        output: str = "embedding",
        backend: str = "torch",
        device: str = "cpu",
        batch_tokens: int = 16384,
        max_tokens: int | None = None,
        dimensions: int | None = None,
        inputs: str = "one",
        ids_column: str | None = None,
        dimensions_column: str | None = None,
        truncate: bool = True,
        count_tokens: bool = False,
    ) -> None:
        if backend not in ("torch", "onnx"):
            raise ValueError(f"backend must be torch or onnx, not {backend!r}")
        if inputs not in ("one", "many"):
            raise ValueError(f"inputs must be one or many, not {inputs!r}")
        if batch_tokens < 1:
            raise ValueError("batch_tokens must be positive")
        if dimensions is not None and dimensions < 1:
            raise ValueError("dimensions must be positive")
        self.model = model
        self.column = column
        self.output = output
        self.backend = backend
        self.device = device
        self.batch_tokens = batch_tokens
        self.max_tokens = max_tokens
        self.dimensions = dimensions
        self.many = inputs == "many"
        self.ids_column = ids_column
        self.dimensions_column = dimensions_column
        self.truncate = truncate
        self.count_tokens = count_tokens

    def setup(self) -> None:
        from transformers import AutoTokenizer

        self.layout = Layout.read(Path(local_model_folder(self.model)))
        root = self.layout.root
        self.tokenizer = AutoTokenizer.from_pretrained(str(root))
        model_limit = self.layout.max_tokens or int(self.tokenizer.model_max_length)
        self.limit = min(self.max_tokens or model_limit, model_limit)
        self.prefix, self.suffix = _special_tokens(self.tokenizer)
        self.vocabulary = len(self.tokenizer)
        if self.backend == "onnx":
            import onnxruntime as ort

            path = root / "onnx" / "model.onnx"
            if not path.is_file():
                raise LayoutError(f"backend onnx: {path} is missing")
            self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            self.onnx_inputs = {i.name for i in self.session.get_inputs()}
        else:
            import torch
            from transformers import AutoModel

            self.torch = torch
            self.encoder = AutoModel.from_pretrained(str(root)).to(self.device).eval()
        self.width = self._embed([self._text_ids("a")], [None]).shape[1]
        if self.dimensions is not None and self.dimensions > self.width:
            raise ValueError(f"dimensions {self.dimensions}: the model has {self.width}")

    def set_threads(self, threads: int) -> None:
        if self.backend == "torch":
            self.torch.set_num_threads(threads)

    def process_columns(self, batch: Columns) -> Columns:
        if self.column not in batch and self.ids_column not in batch:
            raise KeyError(
                f"no text column {self.column!r} among the rows' columns {sorted(batch)}"
            )
        n = num_rows(batch)
        errors: list[str | None] = [None] * n
        rows: list[list[list[int]]] = [[] for _ in range(n)]
        dims: list[int | None] = [self.dimensions] * n
        texts: list[tuple[int, int, str]] = []
        """(row, input, text) of every text input, tokenized together."""
        for i in range(n):
            try:
                dims[i] = self._row_dimensions(batch, i)
                given = self._row_ids(batch, i)
                if given is None:
                    texts += [(i, k, t) for k, t in enumerate(self._row_texts(batch, i))]
                else:
                    rows[i] = given
            except InputError as e:
                errors[i] = str(e)
        if texts:
            words = [t.lower() if self.layout.lowercase else t for _, _, t in texts]
            encoded = self.tokenizer(words, truncation=False)["input_ids"]
            for (i, k, _), ids in zip(texts, encoded, strict=True):
                if errors[i] is None:
                    try:
                        rows[i].append(self._bounded(list(ids), k))
                    except InputError as e:
                        errors[i] = str(e)
        good = [i for i in range(n) if errors[i] is None]
        vectors = self._embed(
            [ids for i in good for ids in rows[i]], [dims[i] for i in good for _ in rows[i]]
        )
        out: Columns = {}
        if self.many:
            column = np.full(n, None, dtype=object)
            start = 0
            for i in good:
                width = dims[i] or self.width
                column[i] = [vectors[start + k, :width] for k in range(len(rows[i]))]
                start += len(rows[i])
            out[self.output] = column
        else:
            width = self.dimensions or self.width
            matrix = np.zeros((n, width), dtype=np.float32)
            matrix[good] = vectors[:, :width]
            out[self.output] = matrix
        if self.count_tokens:
            out["prompt_tokens"] = np.array([sum(map(len, r)) for r in rows], dtype=np.int64)
        if any(e is not None for e in errors):
            out[ROW_ERROR] = np.array(errors, dtype=object)
        return out

    def _row_ids(self, batch: Columns, i: int) -> list[list[int]] | None:
        """Row `i`'s inputs given as token ids, special tokens added (None: given as text)."""
        if self.ids_column is None or self.ids_column not in batch:
            return None
        given = batch[self.ids_column][i]
        if given is None:
            return None
        items = [list(map(int, ids)) for ids in given] if self.many else [list(map(int, given))]
        if not items:
            raise InputError("the input is empty")
        for k, ids in enumerate(items):
            if not ids:
                raise InputError(f"input {k} is empty")
            if min(ids) < 0 or max(ids) >= self.vocabulary:
                raise InputError(
                    f"input {k} holds a token id outside the model's vocabulary of "
                    f"{self.vocabulary}"
                )
        return [self._bounded(self.prefix + ids + self.suffix, k) for k, ids in enumerate(items)]

    def _row_texts(self, batch: Columns, i: int) -> list[str]:
        value: Any = batch[self.column][i] if self.column in batch else None
        many = self.many and value is not None and not isinstance(value, str)
        given: list[Any] = list(value) if many else [value]
        if not given:
            raise InputError("the input is empty")
        texts: list[str] = []
        for text in given:
            if not isinstance(text, str):
                raise InputError(f"the text is not a string but {type(text).__name__}")
            if not text.strip():
                raise InputError("the text is empty")
            texts.append(text)
        return texts

    def _text_ids(self, text: str) -> list[int]:
        if self.layout.lowercase:
            text = text.lower()
        ids: list[int] = self.tokenizer(text, truncation=False)["input_ids"]
        return ids

    def _bounded(self, ids: list[int], k: int) -> list[int]:
        """`ids` within the model's limit: cut (keeping the closing special tokens, as the
        tokenizer cuts), or, not `truncate`, refused."""
        if len(ids) <= self.limit:
            return ids
        if not self.truncate:
            where = f"input {k} has" if self.many else "the text has"
            raise InputError(
                f"{where} {len(ids)} tokens: they exceed the model's context of {self.limit}"
            )
        keep = self.limit - len(self.suffix)
        return ids[:keep] + self.suffix

    def _row_dimensions(self, batch: Columns, i: int) -> int | None:
        if self.dimensions_column is None or self.dimensions_column not in batch:
            return self.dimensions
        value = batch[self.dimensions_column][i]
        if value is None or (isinstance(value, float) and np.isnan(value)):
            return self.dimensions
        wanted = int(value)
        if not 1 <= wanted <= self.width:
            raise InputError(f"dimensions {wanted}: the model has {self.width}")
        return wanted

    def _embed(self, ids: list[list[int]], dims: list[int | None]) -> np.ndarray:
        """Embeddings of token id lists, in their order; each cut to its `dims` (zeros past
        them) and normalized where the model normalizes."""
        result = np.empty((len(ids), getattr(self, "width", 0)), dtype=np.float32)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        start = 0
        while start < len(order):
            longest = len(ids[order[start]])
            rows = max(1, self.batch_tokens // max(longest, 1))
            chunk = order[start : start + rows]
            vectors = self._pooled([ids[i] for i in chunk])
            for dense in self.layout.dense:
                vectors = dense(vectors)
            if result.shape[1] != vectors.shape[1]:
                result = np.empty((len(ids), vectors.shape[1]), dtype=np.float32)
            result[chunk] = vectors
            start += rows
        for i, d in enumerate(dims):
            if d is not None:
                result[i, d:] = 0.0
        if self.layout.normalize:
            norms = np.linalg.norm(result, axis=1, keepdims=True)
            result = result / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(result, dtype=np.float32)

    def _pooled(self, rows: list[list[int]]) -> np.ndarray:
        """One sub-batch through the transformer and the pooling (before Dense and Normalize)."""
        length = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = np.full((len(rows), length), pad, dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=np.int64)
        for k, r in enumerate(rows):
            input_ids[k, : len(r)] = r
            mask[k, : len(r)] = 1
        if self.backend == "onnx":
            feeds = {"input_ids": input_ids, "attention_mask": mask}
            if "token_type_ids" in self.onnx_inputs:
                feeds["token_type_ids"] = np.zeros_like(input_ids)
            tokens = np.asarray(self.session.run(None, feeds)[0], dtype=np.float32)
        else:
            torch = self.torch
            with torch.inference_mode():
                hidden = self.encoder(
                    input_ids=torch.from_numpy(input_ids).to(self.device),
                    attention_mask=torch.from_numpy(mask).to(self.device),
                ).last_hidden_state
            tokens = hidden.float().cpu().numpy()
        return pool(tokens, mask, self.layout.pooling)


def _special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text's own ([CLS] and [SEP], <s> and
    </s>, a BOS alone...), found around a one-token text."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    return [], []
