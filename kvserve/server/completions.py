"""POST /v1/completions: one prompt (text or token ids), n samples, streamed or whole."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.errors import KVServeError
from kvserve.outputs import CompletionOutput, RequestOutput
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
from kvserve.server.logprobs import completion_logprobs
from kvserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvserve.server.sampling import sampling_params


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(request.model)
    _reject_unsupported(request)
    prompt = _single_prompt(request.prompt)
    params = sampling_params(request, logprobs=request.logprobs, max_tokens=request.max_tokens)
    request_id, stream = ctx.start(
        prompt, params, "cmpl", prompt_text=prompt if isinstance(prompt, str) else None, cache_salt=request.cache_salt
    )
    created = int(time.time())
    try:
        if request.stream:
            first = await unless_disconnected(anext(stream), raw)
            return SSEResponse(_events(ctx, request, request_id, created, first, stream), on_close=stream.close)
        final = await unless_disconnected(last_output(stream), raw)
    except BaseException:
        stream.close()
        raise
    ctx.metrics.observe_finished(final)
    offsets = [0] * len(final.outputs)
    choices = [_choice(ctx, request, c, c.text, c.token_ids, c.logprobs, offsets) for c in final.outputs]
    body = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage_of(final))
    return JSONResponse(body.model_dump(mode="json"))


async def _events(ctx: ServingContext, request: CompletionRequest, request_id: str, created: int, first: RequestOutput, stream: RequestStream):
    offsets = [0] * request.n  # characters already sent per choice: logprobs' text_offset
    finished: set[int] = set()
    try:
        last = first
        async for out in outputs_from(first, stream):
            last = out
            for c in fresh_outputs(out, finished):
                choice = _choice(ctx, request, c, c.delta_text, c.delta_token_ids, c.delta_logprobs, offsets)
                yield sse(CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[choice]))
        ctx.metrics.observe_finished(last)
        if request.include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[], usage=usage_of(last)))
    except KVServeError as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _choice(ctx, request: CompletionRequest, c: CompletionOutput, text: str, token_ids, logprobs, offsets: list[int]) -> CompletionChoice:
    lp = None
    if request.logprobs is not None and logprobs is not None:
        lp, offsets[c.index] = completion_logprobs(token_ids, logprobs, request.logprobs, ctx.token_texts, offsets[c.index])
    return CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _reject_unsupported(request: CompletionRequest) -> None:
    if request.echo:
        raise unsupported("echo", "echo is not supported; the prompt is not repeated in the answer")
    if request.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    if request.best_of is not None and request.best_of != request.n:
        raise unsupported("best_of", f"best_of must equal n ({request.n}) when given; ranking samples is not supported")


def _single_prompt(prompt) -> str | list[int]:
    """Text, token ids, or a batch of exactly one of those."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return prompt
    if len(prompt) != 1:
        raise unsupported("prompt", f"a batch of {len(prompt)} prompts is not supported; send one prompt per request")
    return prompt[0]
