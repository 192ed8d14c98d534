"""What every generation route needs: the engine, the served name, the metrics, the config,
and the one way to submit a request."""

from __future__ import annotations

import dataclasses

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.server.errors import model_not_found
from kvserve.server.lifecycle import new_request_id
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import ServerMetrics
from kvserve.server.sampling import fit_max_tokens


@dataclasses.dataclass
class ServingContext:
    engine: AsyncLLMEngine
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    token_texts: TokenTexts

    @classmethod
    def create(cls, engine: AsyncLLMEngine, config: ServerConfig) -> "ServingContext":
        name = config.served_model_name or engine.engine.model_name
        return cls(engine, config, name, ServerMetrics(engine.engine, name), TokenTexts(engine.tokenizer))

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def engine_alive(self) -> bool:
        return self.engine.is_running

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise model_not_found(requested, self.model_name)

    def start(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        id_prefix: str,
        *,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        prompt_field: str = "prompt",
        max_tokens_field: str = "max_tokens",
    ) -> tuple[str, RequestStream]:
        """Validate and tokenize the prompt, settle max_tokens, submit: (request id, its stream).
        Raises the typed errors that become 4xx answers, before anything is sent."""
        if not self.engine_alive():
            raise EngineDeadError("the engine is not running")
        try:
            ids = self.engine.prepare_prompt(prompt, params)
        except InvalidRequestError as exc:
            if exc.param == "prompt":  # chat's prompt is its messages
                exc.param = prompt_field
            raise
        params = fit_max_tokens(params, len(ids), self.max_model_len, max_tokens_field, prompt_field)
        request_id = new_request_id(id_prefix)
        stream = self.engine.generate(ids, params, request_id, prompt_text=prompt_text, cache_salt=cache_salt)
        return request_id, stream
