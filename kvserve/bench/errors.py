"""Errors a benchmark run can meet that the user can act on (a peer that fails, a URL that does not answer)."""

from __future__ import annotations

from kvserve.errors import KVServeError


class BenchError(KVServeError):
    """A benchmark could not produce its figures; the message says why and what to try."""
