"""One request's trip through the engine, seen from HTTP.

A request gets a server-made id (so no client can collide with another), is awaited
while the server listens for the client leaving, and is streamed by a response that
always closes its engine stream: a client that goes away aborts its request within a
step and frees its KV blocks, whether it was streaming or waiting for a whole answer.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import sse_error
from kvserve.server.protocol import PromptTokensDetails, Usage

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _disconnected(request: Request) -> None:
    # once the body is read, the next ASGI message for this request is its disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable`; if the client leaves first, cancel it and raise ClientDisconnected.
    Cancelling a wait on a RequestStream closes the stream, which aborts the request."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientDisconnected
    return work.result()


async def last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def outputs_from(first: RequestOutput, stream: RequestStream) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in stream:
            yield out


def fresh_outputs(out: RequestOutput, finished: set[int]) -> list[CompletionOutput]:
    """The samples of `out` that have something to stream: new text, new tokens with
    logprobs (text can lag behind tokens), or their end, which is sent once."""
    fresh = []
    for c in out.outputs:
        if c.index in finished:
            continue
        if c.finish_reason is not None:
            finished.add(c.index)
            fresh.append(c)
        elif c.delta_text or (c.delta_logprobs and c.delta_token_ids):
            fresh.append(c)
    return fresh


def usage_of(*outs: RequestOutput) -> Usage:
    """The usage of one request, or summed over several (completions with several prompts)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(o.num_generated_tokens for o in outs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outs)),
    )


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def ended_properly(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, always ending with `[DONE]`: an exception escaping them (an engine failure a
    route did not catch, a bug in building a chunk) becomes one error event and `[DONE]`,
    so the client sees an error rather than a cut connection. Cancellation (the client
    left) is not caught: nobody is there to read an event."""
    done = False
    try:
        async for event in events:
            done = done or event == SSE_DONE
            yield event
    except Exception as exc:
        if done:
            raise
        logger.exception("error inside an event stream; ending it with an error event")
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class SSEResponse(StreamingResponse):
    """Server-sent events that always end the engine request, however the response ends,
    and always end with `[DONE]` (`ended_properly`), however the events end.

    Starlette stops iterating when the client disconnects (cancelling the iterator, or
    an OSError from `send`); an iterator that never started runs no `finally`, so the
    close is done here, after the response, whatever happened."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            ended_properly(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            for iterator in (self.body_iterator, self._events):  # the inner one too, if never started
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
