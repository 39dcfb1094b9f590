"""Shared by every part of Ebb: config, message schemas, NATS helpers, the embedded server."""

__version__ = "0.1.0"
