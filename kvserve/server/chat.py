"""POST /v1/chat/completions: messages through the model's chat template, n samples,
streamed (a role chunk first, then content deltas) or whole."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import MAX_LOGPROBS
from kvserve.server.context import ServingContext
from kvserve.server.errors import sse_error, unsupported
from kvserve.server.lifecycle import (
    SSE_DONE,
    SSEResponse,
    fresh_outputs,
    last_output,
    outputs_from,
    sse,
    unless_disconnected,
    usage_of,
)
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
)
from kvserve.server.sampling import sampling_params

# arguments of apply_chat_template itself; a client's chat_template_kwargs may not override them
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "return_dict"}


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(request.model)
    _reject_unsupported(request)
    num_top = _num_top_logprobs(request)
    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    params = sampling_params(request, logprobs=num_top, max_tokens=max_tokens, max_tokens_field=max_tokens_field)
    tokenizer = ctx.engine.tokenizer
    text = tokenizer.apply_chat_template(
        conversation(request.messages), add_generation_prompt=request.add_generation_prompt, **_template_kwargs(request)
    )
    # the template wrote any BOS it wants; don't add another
    ids = tokenizer.encode(text, add_special_tokens=False)
    request_id, stream = ctx.start(
        ids, params, "chatcmpl", prompt_text=text, cache_salt=request.cache_salt, prompt_field="messages", max_tokens_field=max_tokens_field
    )
    created = int(time.time())
    try:
        if request.stream:
            first = await unless_disconnected(anext(stream), raw)
            return SSEResponse(_events(ctx, request, num_top, request_id, created, first, stream), on_close=stream.close)
        final = await unless_disconnected(last_output(stream), raw)
    except BaseException:
        stream.close()
        raise
    ctx.metrics.observe_finished(final)
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=_logprobs(ctx, num_top, c.token_ids, c.logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    body = ChatCompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage_of(final))
    return JSONResponse(body.model_dump(mode="json"))


async def _events(
    ctx: ServingContext, request: ChatCompletionRequest, num_top: int | None, request_id: str, created: int, first: RequestOutput, stream: RequestStream
):
    def chunk(choices, usage=None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage))

    finished: set[int] = set()
    try:
        for i in range(request.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        last = first
        async for out in outputs_from(first, stream):
            last = out
            for c in fresh_outputs(out, finished):
                yield chunk([_chunk_choice(ctx, num_top, c)])
        ctx.metrics.observe_finished(last)
        if request.include_usage:
            yield chunk([], usage=usage_of(last))
    except KVServeError as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _chunk_choice(ctx: ServingContext, num_top: int | None, c: CompletionOutput) -> ChatChunkChoice:
    return ChatChunkChoice(
        index=c.index,
        delta=DeltaMessage(content=c.delta_text or None),
        logprobs=_logprobs(ctx, num_top, c.delta_token_ids, c.delta_logprobs),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def _logprobs(ctx: ServingContext, num_top: int | None, token_ids, logprobs):
    if num_top is None or logprobs is None:
        return None
    return chat_logprobs(token_ids, logprobs, num_top, ctx.token_texts)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template reads them; text parts of a content list are joined."""
    out = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise unsupported(f"messages[{i}].content", f"only text content parts are supported, got type {part.get('type')!r}")
                texts.append(part["text"])
            entry["content"] = "\n".join(texts)
        elif content is None:
            entry["content"] = ""
        out.append(entry)
    return out


def _num_top_logprobs(request: ChatCompletionRequest) -> int | None:
    """None: no logprobs; k: the sampled token's plus k alternatives."""
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}", "top_logprobs")
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


def _template_kwargs(request: ChatCompletionRequest) -> dict:
    kwargs = dict(request.chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    return kwargs


def _reject_unsupported(request: ChatCompletionRequest) -> None:
    if request.tools:
        raise unsupported("tools", "tool calling is not supported")
    if request.response_format is not None and request.response_format.type != "text":
        raise unsupported("response_format", f"response_format {request.response_format.type!r} is not supported; only 'text'")
