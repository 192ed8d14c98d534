"""Constrained decoding: a request's output held to a JSON schema, a regex, a choice or a grammar."""

from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
