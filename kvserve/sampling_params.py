"""SamplingParams: how to pick tokens and when to stop, validated once at creation."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128
# Caps on what is checked per generated token, each a 400 beyond. OpenAI allows 4 stop
# strings; vLLM no limit, and 200,000 were once accepted and slowed every step. 32 strings
# of <= 256 characters keep the stop search (each string searched in the new tail, which
# is as long as the longest one) to a few microseconds a token, and cover generous
# agent-framework lists; the longest also sets how much text streaming holds back.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# stop_token_ids are looked up in a set, so their cost is per request, not per token;
# 256 is far beyond any real use (a model's end tokens are a handful).
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's own limit on logit_bias entries


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-n alternatives per sampled token (plus the sampled one)
    # the same for each prompt token after the first (vLLM's prompt_logprobs): what the model
    # gave it, from the positions before it; such a request skips the prefix cache
    prompt_logprobs: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (kvserve/structured)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        # looked up per generated token (request.check_stop): a set, built once
        self.stop_token_id_set = frozenset(t for t in self.stop_token_ids if isinstance(t, int))
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _validate(self) -> None:
        _int_in("n", self.n, 1, MAX_N)
        _float_in("temperature", self.temperature, 0.0, 100.0)
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _int_in("top_k", self.top_k, 0, 2**31 - 1, note=" (0 or -1 disables it)")
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty"
            )
        if self.seed is not None:
            _int_in("seed", self.seed, -(2**63), 2**63 - 1)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _int_in("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop must hold non-empty strings", "stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}", "stop"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}", "stop_token_ids"
            )
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}", "logit_bias"
            )
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must hold token ids >= 0, got {t!r}", "stop_token_ids")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise InvalidRequestError(f"logit_bias token ids must be >= 0, got {token}", "logit_bias")
            _float_in("logit_bias", bias, -100.0, 100.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for field, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {}))):
            for t in ids:
                if t >= vocab_size:
                    raise InvalidRequestError(f"{field}: token id {t} is outside the vocabulary (size {vocab_size})", field)


_EPS = 1e-5


def _int_in(field: str, value, lo: int, hi: int, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{field} must be an integer, got {value!r}", field)
    if not lo <= value <= hi:
        raise InvalidRequestError(f"{field} must be in [{lo}, {hi}]{note}, got {value}", field)


def _float_in(field: str, value, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{field} must be a finite number, got {value!r}", field)
    if not lo <= value <= hi:
        raise InvalidRequestError(f"{field} must be in [{lo}, {hi}], got {value}", field)
