"""POST /v1/completions: one prompt or several (text or token ids), n samples each, streamed
or whole, with `echo` repeating each prompt before its completion.

Several prompts are several engine requests, run together; choice `index` is
`prompt_index * n + sample_index`, as in OpenAI's and vLLM's answers, and usage is summed.
"""

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
from kvserve.server.context import ServingContext
from kvserve.server.errors import check_handoff, sse_error, unsupported
from kvserve.server.lifecycle import SSE_DONE, SSEResponse, fresh_outputs, last_output, sse, unless_disconnected, usage_of
from kvserve.server.logprobs import completion_logprobs
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.server.sampling import sampling_params
from kvserve.server.structured import structured_outputs_of

# OpenAI's legacy completions default, used when neither the request nor the server sets one
_DEFAULT_MAX_TOKENS = 16


class _Prompt:
    """One prompt of the request: its engine stream, and what echo repeats of it."""

    def __init__(self, index: int, request_id: str, stream: RequestStream, echo_text: str):
        self.index = index
        self.request_id = request_id
        self.stream = stream
        self.echo_text = echo_text

    def echo_logprobs(self, ctx: ServingContext, out: RequestOutput, num_top: int) -> tuple[CompletionLogprobs, int]:
        """The prompt's part of an echoed choice's logprobs (the first token has none, as in
        OpenAI's answers), and the text offset after it."""
        ids = out.prompt_token_ids
        scored = [None, *(out.prompt_logprobs or [])]
        result, offset = completion_logprobs(ids[1:], scored[1:], num_top, ctx.token_texts, len(ctx.token_texts(ids[0])))
        first = ctx.token_texts(ids[0])
        result.tokens.insert(0, first)
        result.token_logprobs.insert(0, None)
        result.top_logprobs.insert(0, None)
        result.text_offset.insert(0, 0)
        return result, offset


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(request.model)
    _reject_unsupported(request)
    prompts = _prompts(request.prompt)
    if request.kv_transfer_params is not None and len(prompts) > 1:
        raise InvalidRequestError("kv_transfer_params: a handoff carries one prompt, not a list of them", "kv_transfer_params")
    max_tokens = request.max_tokens
    if max_tokens is None and "max_tokens" not in ctx.sampling_defaults.values:
        max_tokens = _DEFAULT_MAX_TOKENS
    params = sampling_params(request, logprobs=request.logprobs, max_tokens=max_tokens, defaults=ctx.sampling_defaults)
    # echo with logprobs scores the prompt too (lm-eval's loglikelihood requests)
    prompt_logprobs = request.logprobs if request.echo else None
    params = dataclasses.replace(params, structured_outputs=structured_outputs_of(request), prompt_logprobs=prompt_logprobs)
    running = await _start_all(ctx, request, prompts, params)
    created = int(time.time())
    request_id = running[0].request_id
    close_all = lambda: [p.stream.close() for p in running]  # noqa: E731
    try:
        if request.stream:
            # the first output of each prompt is awaited here, so an error before any token
            # (engine dead, rejected at admission) is still an HTTP error, not an SSE event
            firsts = await unless_disconnected(asyncio.gather(*(anext(p.stream) for p in running)), raw)
            for first in firsts:
                check_handoff(first)
            return SSEResponse(_events(ctx, request, request_id, created, running, firsts), on_close=close_all)
        finals = await unless_disconnected(asyncio.gather(*(last_output(p.stream) for p in running)), raw)
        for final in finals:
            check_handoff(final)
    except BaseException:
        close_all()
        raise
    choices = []
    offsets = [0] * (request.n * len(running))
    for prompt, final in zip(running, finals):
        ctx.metrics.observe_finished(final)
        for c in final.outputs:
            text = prompt.echo_text + c.text
            echoed = _echoed_logprobs(ctx, request, prompt, final, offsets, c.index)
            choice = _choice(ctx, request, prompt, c, text, c.token_ids, c.logprobs, offsets)
            choices.append(_with_echoed(choice, echoed))
    body = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage_of(*finals),
                              kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None)  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


async def _start_all(ctx: ServingContext, request: CompletionRequest, prompts: list, params) -> list[_Prompt]:
    """Submit every prompt, or none: a prompt that fails validation closes those already started."""
    running: list[_Prompt] = []
    try:
        for i, prompt in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            request_id, stream = await ctx.start(
                prompt, params, "cmpl", prompt_text=prompt if isinstance(prompt, str) else None,
                cache_salt=request.cache_salt, prompt_field=field, kv_transfer=request.kv_transfer_params,
            )  # fmt: skip
            echo = ""
            if request.echo:
                echo = prompt if isinstance(prompt, str) else ctx.engine.tokenizer.decode(prompt, skip_special_tokens=False)
            running.append(_Prompt(i, request_id, stream, echo))
    except BaseException:
        for p in running:
            p.stream.close()
        raise
    return running


async def _events(
    ctx: ServingContext, request: CompletionRequest, request_id: str, created: int, running: list[_Prompt], firsts: list[RequestOutput]
):
    """Every prompt's chunks as they come, interleaved; one [DONE] after the last."""
    n = request.n
    offsets = [0] * (n * len(running))  # characters already sent per choice: logprobs' text_offset
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt: _Prompt, first: RequestOutput) -> None:
        try:
            await queue.put((prompt, first))
            if not first.finished:
                async for out in prompt.stream:
                    await queue.put((prompt, out))
        except BaseException as exc:  # delivered to the consumer, which ends the stream with it
            await queue.put((prompt, exc))

    def chunk(choices, usage=None) -> str:
        return sse(CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage))

    pumps = [asyncio.ensure_future(pump(p, f)) for p, f in zip(running, firsts)]
    try:
        if request.echo:  # each choice starts with its prompt (and its logprobs), as vLLM streams it
            yield chunk(
                [
                    CompletionChoice(index=p.index * n + j, text=p.echo_text, logprobs=_echoed_logprobs(ctx, request, p, f, offsets, j))
                    for p, f in zip(running, firsts)
                    for j in range(n)
                ]
            )
        finished: list[set[int]] = [set() for _ in running]
        lasts: list[RequestOutput | None] = [None] * len(running)
        while any(last is None or not last.finished for last in lasts):
            prompt, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            lasts[prompt.index] = out
            fresh = fresh_outputs(out, finished[prompt.index])
            if fresh:
                yield chunk([_choice(ctx, request, prompt, c, c.delta_text, c.delta_token_ids, c.delta_logprobs, offsets) for c in fresh])
            if out.finished:
                ctx.metrics.observe_finished(out)
        if request.include_usage:
            yield chunk([], usage=usage_of(*lasts))
    except KVServeError as exc:
        yield sse_error(exc)
    finally:
        for task in pumps:
            task.cancel()
    yield SSE_DONE


def _choice(
    ctx, request: CompletionRequest, prompt: _Prompt, c: CompletionOutput, text: str, token_ids, logprobs, offsets: list[int]
) -> CompletionChoice:
    index = prompt.index * request.n + c.index
    lp = None
    if request.logprobs is not None and logprobs is not None:
        lp, offsets[index] = completion_logprobs(token_ids, logprobs, request.logprobs, ctx.token_texts, offsets[index])
    return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _echoed_logprobs(ctx, request: CompletionRequest, prompt: _Prompt, out: RequestOutput, offsets: list[int], sample: int):
    """With echo and logprobs, the prompt's logprobs for one choice (and its text offset
    moved past the prompt); else None."""
    if not request.echo or request.logprobs is None:
        return None
    result, offsets[prompt.index * request.n + sample] = prompt.echo_logprobs(ctx, out, request.logprobs)
    return result


def _with_echoed(choice: CompletionChoice, echoed: CompletionLogprobs | None) -> CompletionChoice:
    """A whole answer's choice with the prompt's logprobs in front of the completion's."""
    if echoed is None:
        return choice
    if choice.logprobs is not None:
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(echoed, field).extend(getattr(choice.logprobs, field))
    choice.logprobs = echoed
    return choice


def _reject_unsupported(request: CompletionRequest) -> None:
    if request.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    if request.best_of is not None and request.best_of != request.n:
        raise unsupported("best_of", f"best_of must equal n ({request.n}) when given; ranking samples is not supported")


# one request's prompts at most: each is its own engine request, and admission counts them all
MAX_PROMPTS = 256


def _prompts(prompt) -> list[str | list[int]]:
    """Text, token ids, a list of texts, or a list of token-id lists."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
    return list(prompt)
