"""kvserve: an LLM inference engine, OpenAI-compatible server and inference planner."""

__version__ = "0.1.0"

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.llm import LLM  # noqa: E402
from kvserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
