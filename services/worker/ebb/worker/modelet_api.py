"""The import path of the modelet API before it moved to `ebb.worker.modelets` (user code
imports `ebb.worker.modelet_api.Modelet` and `hidden_column`): kept so that code runs."""

from .modelets.api import BatchModelet, ColumnsModelet, Modelet, StageError, hidden_column

__all__ = ["BatchModelet", "ColumnsModelet", "Modelet", "StageError", "hidden_column"]
