"""The name job specs wrote before the layout (`modelet: ebb.worker.fetch:Fetch`): kept so
those specs run. `ebb.worker.modelets:Fetch` is the same class."""

from .modelets.fetch import Fetch, FetchError

__all__ = ["Fetch", "FetchError"]
