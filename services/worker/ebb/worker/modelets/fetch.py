"""A reader stage for a column of URLs or paths (images, documents): `ebb.worker.modelets:Fetch`.

    - name: fetch
      modelet: ebb.worker.modelets:Fetch
      params: {column: url, output: content, concurrency: 32}

Each row's object is read through fsspec (s3://, gs://, https://, a local path), `concurrency`
at once per stage process, each read retried as `storage.retrying` classifies its errors. A
row whose object cannot be read (missing, access denied, retries exhausted) fails alone: the
batch raises, the pipeline's bisection isolates that row, and it becomes an error row with the
store's message while the others go on. The objects already read are kept (up to `cache_mb`)
so that the halves the bisection retries are not read again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np

from ebb.common.data.storage import RetryPolicy, retrying

from ..chunks.columns import Columns
from .api import Modelet


class FetchError(Exception):
    """An object of the batch cannot be read."""


class _Recent:
    """Objects read lately, by URL, up to a byte budget (least recently used first out)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        self.items: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, url: str) -> bytes | None:
        with self.lock:
            data = self.items.get(url)
            if data is not None:
                self.items.move_to_end(url)
            return data

    def put(self, url: str, data: bytes) -> None:
        if len(data) > self.budget:
            return
        with self.lock:
            if url in self.items:
                return
            self.items[url] = data
            self.size += len(data)
            while self.size > self.budget:
                _, old = self.items.popitem(last=False)
                self.size -= len(old)

    def pop(self, url: str) -> None:
        with self.lock:
            data = self.items.pop(url, None)
            if data is not None:
                self.size -= len(data)


class Fetch(Modelet):
    """Read the object each row of `column` names into `output` (bytes)."""

    def __init__(
        self,
        column: str = "url",
        output: str = "content",
        concurrency: int = 16,
        cache_mb: float = 256,
        attempts: int = 5,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.column = column
        self.output = output
        self.concurrency = concurrency
        self.policy = RetryPolicy(attempts=attempts)
        self.recent = _Recent(int(cache_mb * 2**20))
        self.pool: ThreadPoolExecutor | None = None

    def setup(self) -> None:
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="fetch")

    def _read(self, url: str) -> bytes | BaseException:
        cached = self.recent.get(url)
        if cached is not None:
            return cached

        def read() -> bytes:
            fs, path = fsspec.core.url_to_fs(url)  # one request: no HEAD before the GET
            return bytes(fs.cat_file(path))

        try:
            data = retrying(f"read {url}", read, policy=self.policy)
        except Exception as e:  # noqa: BLE001 - the row's failure, reported as its error
            return e
        self.recent.put(url, data)
        return data

    def process_columns(self, batch: Columns) -> Columns:
        if self.pool is None:
            self.setup()
        assert self.pool is not None
        urls = [str(u) for u in batch[self.column]]
        results = list(self.pool.map(self._read, urls))
        failed = [
            (url, r) for url, r in zip(urls, results, strict=True) if not isinstance(r, bytes)
        ]
        if failed:
            # What was read stays in `recent`: the bisection's halves find it there.
            url, error = failed[0]
            raise FetchError(f"cannot read {url}: {error}")
        for url in urls:  # handed on: no bisection will ask for these again
            self.recent.pop(url)
        contents = np.empty(len(urls), dtype=object)
        contents[:] = results
        out: dict[str, Any] = dict(batch)
        out[self.output] = contents
        return out
