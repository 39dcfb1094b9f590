"""Each row's next token from its logits, by its own sampling: greedy at temperature 0, else
sampled (top-k, then top-p) with the row's own generator, so that a row's text depends on its
seed and its prompt alone, never on the rows it happened to decode beside."""

from __future__ import annotations

import torch

from .engine import Sampling


class RowSampler:
    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self.generator: torch.Generator | None = None
        if sampling.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token, from this row's logits (vocabulary,)."""
        s = self.sampling
        if self.generator is None:
            return int(torch.argmax(logits))
        scores = logits.float() / s.temperature
        if s.top_k:
            kth = torch.topk(scores, min(s.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if s.top_p < 1:
            ordered, order = torch.sort(probs, descending=True)
            before = ordered.cumsum(-1) - ordered
            ordered = ordered.masked_fill(before >= s.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        return int(torch.multinomial(probs, 1, generator=self.generator))
