"""What users import and name in a job spec (`modelet: ebb.worker.modelets:<Name>`).

`api` (the modelet protocols, `Modelet`, `hidden_column`, `StageError`), `builtins`
(`Features`, `TopClass`, `Identity`, `Metrics`), `sentence` (`SentenceEncoder`: sentence
embeddings from a sentence-transformers folder, read by `sentence_layout`), `fetch` (`Fetch`,
a reader stage for a column of URLs), `runtimes` (ONNX Runtime and TorchScript models),
`multimodel` (several models in one stage). May use `modelcache`, `resources`, `chunks`."""

from .api import BatchModelet, ColumnsModelet, Modelet, StageError, hidden_column
from .builtins import Features, Identity, Metrics, TopClass
from .fetch import Fetch, FetchError
from .sentence import SentenceEncoder

__all__ = [
    "BatchModelet",
    "ColumnsModelet",
    "Features",
    "Fetch",
    "FetchError",
    "Identity",
    "Metrics",
    "Modelet",
    "SentenceEncoder",
    "StageError",
    "TopClass",
    "hidden_column",
]
