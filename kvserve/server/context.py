"""What every generation route needs: the engine, the served name, the metrics, the config,
and the one way to submit a request."""

from __future__ import annotations

import asyncio
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
from kvserve.server.sampling_defaults import SamplingDefaults, resolve_sampling_defaults


@dataclasses.dataclass
class ServingContext:
    engine: AsyncLLMEngine
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    token_texts: TokenTexts
    sampling_defaults: SamplingDefaults  # what a request's unset sampling fields take

    @classmethod
    def create(cls, engine: AsyncLLMEngine, config: ServerConfig) -> "ServingContext":
        name = config.served_model_name or engine.engine.model_name
        defaults = resolve_sampling_defaults(config.generation_config, engine.engine.generation_config, config.sampling_overrides)
        return cls(engine, config, name, ServerMetrics(engine.engine, name), TokenTexts(engine.tokenizer), defaults)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def engine_alive(self) -> bool:
        return self.engine.is_running

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise model_not_found(requested, self.model_name)

    async def start(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        id_prefix: str,
        *,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        prompt_field: str = "prompt",
        max_tokens_field: str = "max_tokens",
        kv_transfer: dict | None = None,
    ) -> tuple[str, RequestStream]:
        """Validate and tokenize the prompt, settle max_tokens, submit: (request id, its stream).
        Raises the typed errors that become 4xx answers, before anything is sent.

        The cheap checks come first, on the event loop: the engine is alive, the waiting queue
        has room for n samples (and for a token-id prompt's tokens), a prompt is not known to
        be too long (a token-id prompt's length; for text, a lower bound on its token count).
        Tokenizing, which can take milliseconds per long prompt, runs in a worker thread so
        the loop keeps streaming other requests; `generate` then admits on the exact count."""
        if not self.engine_alive():
            raise EngineDeadError("the engine is not running")
        try:
            self.engine.check_admission(params.n, 0 if isinstance(prompt, str) else len(prompt))
            self.engine.check_prompt_length_before_tokenizing(prompt)
            ids = await asyncio.to_thread(self.engine.prepare_prompt, prompt, params)
        except InvalidRequestError as exc:
            if exc.param == "prompt":  # chat's prompt is its messages
                exc.param = prompt_field
            raise
        default_max = self.sampling_defaults.values.get("max_tokens")
        params = fit_max_tokens(params, len(ids), self.max_model_len, max_tokens_field, prompt_field, default_max)
        request_id = new_request_id(id_prefix)
        stream = self.engine.generate(ids, params, request_id, prompt_text=prompt_text, cache_salt=cache_salt,
                                      kv_transfer=kv_transfer)  # fmt: skip
        return request_id, stream
