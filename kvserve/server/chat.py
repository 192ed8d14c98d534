"""POST /v1/chat/completions: messages through the model's chat template, n samples,
streamed (a role chunk first, then content or tool-call deltas) or whole.

Structured outputs (`response_format`, vLLM's `structured_outputs`) come from
server/structured.py, tools from server/tools.py; at most one of them constrains decoding.
The template is rendered and the prompt tokenized in a worker thread, off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import MAX_LOGPROBS
from kvserve.server.context import ServingContext
from kvserve.server.errors import check_handoff, sse_error, unsupported
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
from kvserve.server.structured import structured_outputs_of
from kvserve.server.tools import ChoiceParser, ToolSetup, merge, render_history, template_reads_tools, tool_setup, with_tools_offered

# arguments of apply_chat_template itself; a client's chat_template_kwargs may not override them
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "return_dict"}


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(request.model)
    num_top = _num_top_logprobs(request)
    tools, constraint = _tools_and_constraint(request)
    template_kwargs = _template_kwargs(request)
    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    params = sampling_params(
        request, logprobs=num_top, max_tokens=max_tokens, max_tokens_field=max_tokens_field, defaults=ctx.sampling_defaults
    )
    if constraint is not None:
        params = dataclasses.replace(params, structured_outputs=constraint)
    # admission before the template's work: a full queue answers 429 without rendering anything
    ctx.engine.check_admission(params.n)
    text, ids = await asyncio.to_thread(_render_prompt, ctx.engine.tokenizer, request, tools, template_kwargs)
    request_id, stream = await ctx.start(
        ids, params, "chatcmpl", prompt_text=text, cache_salt=request.cache_salt, prompt_field="messages",
        max_tokens_field=max_tokens_field, kv_transfer=request.kv_transfer_params,
    )  # fmt: skip
    created = int(time.time())
    try:
        if request.stream:
            first = await unless_disconnected(anext(stream), raw)
            check_handoff(first)
            return SSEResponse(_events(ctx, request, num_top, tools, request_id, created, first, stream), on_close=stream.close)
        final = await unless_disconnected(last_output(stream), raw)
        check_handoff(final)
    except BaseException:
        stream.close()
        raise
    ctx.metrics.observe_finished(final)
    choices = [_choice(ctx, num_top, tools, c) for c in final.outputs]
    body = ChatCompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage_of(final),
                                  kv_transfer_params=final.kv_transfer_params)  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


def _choice(ctx: ServingContext, num_top: int | None, tools: ToolSetup, c: CompletionOutput) -> ChatChoice:
    parser = tools.parser()
    content, tool_calls, finish_reason = c.text, None, c.finish_reason
    if parser is not None:  # the same parse as streaming's, fed the whole text at once
        content, tool_calls = merge(parser.feed(c.text) + parser.finish())
        finish_reason = parser.finish_reason(c.finish_reason)
    return ChatChoice(
        index=c.index,
        message=AssistantMessage(content=content, tool_calls=tool_calls),
        logprobs=_logprobs(ctx, num_top, c.token_ids, c.logprobs),
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
    )


async def _events(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    num_top: int | None,
    tools: ToolSetup,
    request_id: str,
    created: int,
    first: RequestOutput,
    stream: RequestStream,
):
    def chunk(choices, usage=None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage))

    finished: set[int] = set()
    parsers = {i: tools.parser() for i in range(request.n)}
    try:
        for i in range(request.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        last = first
        async for out in outputs_from(first, stream):
            last = out
            for c in fresh_outputs(out, finished):
                parser = parsers[c.index]
                if parser is None:
                    yield chunk([_chunk_choice(ctx, num_top, c)])
                else:
                    for choice in _tool_chunk_choices(ctx, num_top, c, parser):
                        yield chunk([choice])
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


def _tool_chunk_choices(ctx: ServingContext, num_top: int | None, c: CompletionOutput, parser: ChoiceParser) -> list[ChatChunkChoice]:
    """This step's deltas of a sample whose output is parsed for tool calls: none while text
    is held back (a `<tool_call>` may be starting), a call's start and its arguments once
    recognised; the step's logprobs ride on the first, the finish on the last."""
    deltas = parser.feed(c.delta_text)
    if c.finished:
        deltas += parser.finish()
    logprobs = _logprobs(ctx, num_top, c.delta_token_ids, c.delta_logprobs)
    if not deltas:
        if not c.finished and logprobs is None:
            return []
        deltas = [DeltaMessage()]
    last = len(deltas) - 1
    return [
        ChatChunkChoice(
            index=c.index,
            delta=delta,
            logprobs=logprobs if k == 0 else None,
            finish_reason=parser.finish_reason(c.finish_reason) if k == last else None,
            stop_reason=c.stop_reason if k == last else None,
        )
        for k, delta in enumerate(deltas)
    ]


def _logprobs(ctx: ServingContext, num_top: int | None, token_ids, logprobs):
    if num_top is None or logprobs is None:
        return None
    return chat_logprobs(token_ids, logprobs, num_top, ctx.token_texts)


def conversation(messages: list[ChatMessage], native_tools: bool = False) -> list[dict]:
    """Messages as the chat template reads them; text parts of a content list are joined.
    Tool calls and tool results are rendered for a template without a tool format of its own
    unless `native_tools` (server/tools.py `render_history`)."""
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
    return render_history(out, native_tools)


def _render_prompt(tokenizer, request: ChatCompletionRequest, tools: ToolSetup, template_kwargs: dict) -> tuple[str, list[int]]:
    """The prompt text and its token ids (run in a worker thread: jinja and the tokenizer are
    CPU work). Tools are offered in the template's own format where it has one (it gets
    `tools=`), else as a system-prompt section."""
    native = template_reads_tools(tokenizer.chat_template)
    messages = conversation(request.messages, native_tools=native)
    if tools.offered:
        if native:
            template_kwargs = {**template_kwargs, "tools": tools.tool_dicts()}
        else:
            messages = with_tools_offered(messages, tools)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt, **template_kwargs)
    # the template wrote any BOS it wants; don't add another
    return text, tokenizer.encode(text, add_special_tokens=False)


def _tools_and_constraint(request: ChatCompletionRequest):
    """The request's tools and the one constraint on its output, if any. A tool_choice that
    constrains (required, a named function) cannot be combined with a structured output;
    under one, tool_choice auto offers no tools: the output follows the format instead."""
    tools = tool_setup(request)
    structured = structured_outputs_of(request)
    tool_constraint = tools.constraint()
    if structured is None:
        return tools, tool_constraint
    field = structured.field.split(".")[0]
    if tool_constraint is not None:
        choice = tools.named if tools.choice == "named" else tools.choice
        raise InvalidRequestError(
            f"tool_choice {choice!r} constrains the output to a tool call; it cannot be combined with {field}", field
        )
    return dataclasses.replace(tools, choice="none"), structured


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

