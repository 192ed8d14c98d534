"""From an OpenAI request to `SamplingParams`, and the `max_tokens` that fits the context.

A field the request leaves unset takes the server's default (server/sampling_defaults.py:
a flag, the model's own generation config, or llama.cpp's defaults). Range checks stay in
`SamplingParams`, which names the field in its error; this module only adds what depends
on the prompt: the room left in `max_model_len`.
"""

from __future__ import annotations

import dataclasses

from kvserve.errors import InvalidRequestError, PromptTooLongError
from kvserve.sampling_params import SamplingParams
from kvserve.server.protocol import SamplingRequest
from kvserve.server.sampling_defaults import SamplingDefaults, resolve_sampling_defaults

_OPENAI = resolve_sampling_defaults("none", {}, {})


def sampling_params(
    request: SamplingRequest,
    logprobs: int | None,
    max_tokens: int | None,
    max_tokens_field: str = "max_tokens",
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    """`max_tokens` is range-checked here; `fit_max_tokens` settles it once the prompt is known."""
    d = defaults or _OPENAI
    try:
        return SamplingParams(
            n=request.n,
            temperature=d.get("temperature", request.temperature),
            top_p=d.get("top_p", request.top_p),
            top_k=d.get("top_k", request.top_k),
            min_p=d.get("min_p", request.min_p),
            seed=request.seed,
            presence_penalty=d.get("presence_penalty", request.presence_penalty),
            frequency_penalty=d.get("frequency_penalty", request.frequency_penalty),
            repetition_penalty=d.get("repetition_penalty", request.repetition_penalty),
            logit_bias=_logit_bias(request.logit_bias),
            logprobs=logprobs,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
        )
    except InvalidRequestError as exc:
        if exc.param == "max_tokens":  # chat may have called it max_completion_tokens
            exc.param = max_tokens_field
        raise


def fit_max_tokens(
    params: SamplingParams,
    num_prompt_tokens: int,
    max_model_len: int,
    max_tokens_field: str = "max_tokens",
    prompt_field: str = "prompt",
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """Prompt + max_tokens must fit `max_model_len`; an absent max_tokens takes all the room
    left, or the server's default (the model's max_new_tokens, a flag) where that is less."""
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is None:
        if default_max_tokens is not None and 1 <= room:
            return dataclasses.replace(params, max_tokens=min(room, default_max_tokens))
        if room < 1:
            raise PromptTooLongError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {prompt_field}.",
                prompt_field,
            )
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the {prompt_field}, "
            f"{params.max_tokens} in the completion). Please reduce the length of the {prompt_field} "
            f"or {max_tokens_field}.",
            max_tokens_field,
        )
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, hence strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out
