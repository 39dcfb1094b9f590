"""The KV cache of the sequences decoding together, left-padded: every sequence's keys and
values end at the same column, so one decoding step feeds every sequence one token.

A sequence that joins (prefilled on its own or with others) is padded on the left to the
batch's length, or the batch to its; one that finishes leaves its row; columns that only
padding fills any more (those before the longest sequence left) are cut. The attention mask
keeps padding out of every sequence's attention, and each sequence's positions are its own,
so a sequence's tokens are those it would get alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F


class BatchCache:
    def __init__(self, cache: Any, mask: torch.Tensor) -> None:
        self.cache = cache
        """A transformers `DynamicCache`: per layer, keys and values (batch, heads, seq, dim)."""
        self.mask = mask
        """(batch, seq): 1 where a sequence has a token, 0 where it is padding."""

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def _pad_left(self, n: int) -> None:
        if n <= 0:
            return
        for layer in self.cache.layers:
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))
        self.mask = F.pad(self.mask, (n, 0))

    def join(self, other: BatchCache) -> None:
        """`other`'s sequences join these, after them."""
        self._pad_left(other.length - self.length)
        other._pad_left(self.length - other.length)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([self.mask, other.mask])

    def keep(self, rows: list[int]) -> None:
        """Only these rows stay, in this order; columns left holding only padding go."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        filled = self.mask.any(dim=0).nonzero()
        lead = int(filled[0]) if len(filled) else self.length
        self.mask = self.mask[:, lead:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, lead:]
            layer.values = layer.values.index_select(0, index)[:, :, lead:]

    def step_mask(self) -> torch.Tensor:
        """The mask for one more token per sequence (the step's), kept as the new mask."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        return self.mask


def padded_peak(rows: Iterable[tuple[int, int]]) -> int:
    """The most token slots a left-padded cache of these sequences comes to, each given as
    (its length now, its prompt plus `max_tokens`), if each runs to its `max_tokens`.

    Every sequence in the cache is padded to the longest one's length, so at a step t from now
    the cache holds (sequences still running) x (the longest of their lengths now, plus t);
    each term is largest at the last step of the sequence that finishes next."""
    peak = longest = 0
    by_end = sorted(rows, key=lambda r: r[1] - r[0], reverse=True)
    for count, (length, need) in enumerate(by_end, start=1):
        longest = max(longest, length)
        peak = max(peak, count * (longest + need - length))
    return peak
