"""kvserve: an LLM inference engine, OpenAI-compatible server and inference planner."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Imported on first use, so `kvserve plan` and `--help` start without loading torch.
_EXPORTS = {
    "LLM": "kvserve.engine.llm",
    "EngineConfig": "kvserve.config",
    "SamplingParams": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
}

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.llm import LLM
    from kvserve.outputs import CompletionOutput, RequestOutput
    from kvserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
