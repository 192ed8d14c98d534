"""The offline API: `LLM(model=...).generate(prompts, SamplingParams)` and `.chat(messages)`."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **config))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order.

        `on_output` sees every intermediate output, e.g. to stream text as it comes: read its
        `delta_*` fields (new since the previous one) and `text`; the whole `token_ids` and
        `logprobs` come on the final output only (kvserve/outputs.py).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(None, p, sp or SamplingParams()) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                start = time.perf_counter()
                for out in self.engine.step():
                    if on_output:
                        on_output(out)
                    if out.finished:
                        final[out.request_id] = out
                self.engine.record_step(time.perf_counter() - start)
        except BaseException:
            for request_id in ids:
                if request_id not in final:
                    self.engine.abort_request(request_id)
            raise
        return [final[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode_chat(conv, **template_kwargs) for conv in conversations]
        return self.generate(prompts, sampling_params, on_output)
