"""The OpenAI wire format: request bodies in, response bodies and stream chunks out.

Field names are OpenAI's; the vLLM extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, cache_salt)
ride along. Requests are parsed strictly (a string is not a number), and unknown fields
are ignored so that a newer client still talks to this server. Turning a request into
`SamplingParams` is `server/sampling.py`'s job.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: str  # "text" | "json_object" | "json_schema"
    # {"name", "schema", "strict", "description"}; its shape is checked in server/structured.py
    json_schema: dict[str, Any] | None = None


class SamplingRequest(_Request):
    """Fields both generation endpoints share."""

    model: str | None = None  # optional, as in vLLM: absent means the served model
    max_tokens: int | None = None  # absent: whatever room the context leaves
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # prefill/decode disaggregation (vLLM's field): {"do_remote_decode" | "do_remote_prefill": true, "transfer_id": …}
    kv_transfer_params: dict[str, Any] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs extra
    # ({"json" | "regex" | "choice" | "grammar" | "json_object": …}) and its older guided_*
    # fields; server/structured.py turns them into the one constraint a request may carry
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    # one prompt (text or token ids), or several: a list of texts or of token-id lists
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = None  # unset: the server's default, else OpenAI's 16 (completions.py)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id… reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None
    # an assistant turn's calls ([{"id", "type": "function", "function": {"name", "arguments"}}])
    # and a tool turn's answer to one of them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Request):
    type: str  # only "function"; checked in server/tools.py for a clear error
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    # capped so one body cannot make the template render (and the server hold) a huge
    # conversation; 2048 is far past any real chat, the body limit bounds their sizes
    messages: list[ChatMessage] = Field(min_length=1, max_length=2048)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": …}}; checked in
    # server/tools.py, which names what is wrong better than a union's errors would
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class AbandonHandoffRequest(_Request):
    """POST /v1/kv_transfer/abandon: a router's word that a handoff will not come."""

    transfer_id: str
    reason: str = "the prefill instance failed"
    recompute: bool = False  # compute the prompt here whatever --kv-transfer-failure says (no prefill instance tried)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token that ended it


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a handoff's result (KVConnector.handoff_result)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_tool_calls(self, handler):
        # "content" is always there (null beside tool calls); "tool_calls" only when there are some
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a handoff's result (KVConnector.handoff_result)


def _drop_nulls(handler, model) -> dict:
    return {k: v for k, v in handler(model).items() if v is not None}


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return _drop_nulls(handler, self)


class DeltaToolCall(BaseModel):
    """A call's first delta has id, type and function.name (arguments ""); later ones only
    index and function.arguments, a fragment to append."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return _drop_nulls(handler, self)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        # a delta carries only what changed: {"role": …} first, then {"content": …}, then {}
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None
    # kvserve extra: what a request's unset sampling fields take (server/sampling_defaults.py)
    sampling_defaults: dict[str, float | int] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
