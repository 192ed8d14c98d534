"""kvserve: an LLM inference engine, OpenAI-compatible server and inference planner."""

__version__ = "0.1.0"
