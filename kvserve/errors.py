"""Typed errors a user can cause. Each maps to a clear message (CLI) or a 4xx body (server)."""

from __future__ import annotations


class KVServeError(Exception):
    """Base of every error kvserve raises on purpose."""


class ConfigError(KVServeError, ValueError):
    """A configuration value is out of its allowed range; the message names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class InvalidRequestError(KVServeError, ValueError):
    """A request (prompt or sampling parameter) is invalid; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        self.param = param
        super().__init__(message)


class PromptTooLongError(InvalidRequestError):
    """A prompt does not fit `max_model_len` or the KV cache; it is rejected, not truncated."""


class ModelLoadError(KVServeError):
    """A model source is missing, malformed or of an unsupported kind."""


class UnsupportedModelError(ModelLoadError):
    """The architecture or a tensor type is one kvserve does not implement."""


class EngineOverloadedError(KVServeError):
    """The waiting queue is full; the caller should retry later."""
