"""The Python SDK and the `ebb` command line."""

from .sdk import EbbClient, SubmitError

__all__ = ["EbbClient", "SubmitError"]
