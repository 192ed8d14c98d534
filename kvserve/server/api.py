"""The FastAPI app: routes, gatekeeping middleware and error handlers around one engine.

`build_app(engine, config)` is the whole server minus the process around it
(`server/cli.py` adds uvicorn, signals and the start-up report), so tests can also
drive it in-process.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from kvserve import __version__
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.config import ServerConfig
from kvserve.server.context import ServingContext
from kvserve.server.errors import APIError, error_body, install_error_handlers
from kvserve.server.lifecycle import ClientDisconnected
from kvserve.server.metrics import CONTENT_TYPE
from kvserve.server.middleware import APIKeyAuth, JSONBodiesOnly, MaxBodySize
from kvserve.server.playground import install_playground
from kvserve.disagg.transport import check_transfer_id
from kvserve.server.protocol import (
    AbandonHandoffRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from kvserve.server.tokens import detokenize, tokenize

Body = TypeVar("Body", bound=BaseModel)


async def _parse(raw: Request, model: type[Body]) -> Body:
    # parsed here rather than by FastAPI so JSON is read strictly (no "5" for 5) and
    # every malformed body takes the same path to a 400 with `param` named
    return model.model_validate_json(await raw.body())


def build_app(engine: AsyncLLMEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    ctx = ServingContext.create(engine, config)
    app = FastAPI(title="kvserve", version=__version__, summary="OpenAI-compatible LLM server")
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)  # left while still sending its body
    async def _gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"

    # the last added runs first: the key, then the size, then the type, before a byte of the body is read
    app.add_middleware(JSONBodiesOnly)
    app.add_middleware(MaxBodySize, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(APIKeyAuth, api_key=config.api_key)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, await _parse(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, await _parse(raw, ChatCompletionRequest), raw)

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[_model_card(ctx)]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        ctx.check_model(model)
        return _model_card(ctx).model_dump()

    @app.post("/tokenize")
    async def tokenize_route(raw: Request) -> dict:
        # tokenizing (or rendering a template) is CPU work: off the event loop, as generation's is
        return await asyncio.to_thread(tokenize, ctx, await _parse(raw, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(raw: Request) -> dict:
        return await asyncio.to_thread(detokenize, ctx, await _parse(raw, DetokenizeRequest))

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine_alive():
            return JSONResponse(error_body("the engine is not running", "service_unavailable"), status_code=503)
        body: dict = {"status": "ok"}
        engine = ctx.engine.engine
        if engine.connector is not None:  # what a router needs to pair prefill and decode instances
            transport = engine.connector.transport
            body["kv_transfer"] = {"role": engine.config.kv_role, "transport": transport.name, "address": transport.address}
        return JSONResponse(body)

    @app.post("/v1/kv_transfer/abandon")
    async def abandon_handoff(raw: Request) -> dict:
        """A router saw a handoff's prefill fail: the decode request waiting for it stops
        waiting now, not at --kv-transfer-timeout (disagg/connector.py `abandon`)."""
        body = await _parse(raw, AbandonHandoffRequest)
        engine = ctx.engine.engine
        if engine.connector is None or engine.config.kv_role == "prefill":
            raise APIError(400, "this instance receives no KV handoffs", param="transfer_id")
        check_transfer_id(body.transfer_id)
        ctx.engine.abandon_handoff(body.transfer_id, body.reason, body.recompute)
        return {"transfer_id": body.transfer_id, "abandoned": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0) -> JSONResponse:
        """vLLM's KV cache events from number `since` on (engine/kv_events.py)."""
        log = ctx.engine.engine.kv_events
        if log is None:
            raise APIError(404, "KV cache events are off: start the server with --enable-kv-cache-events", code="kv_events_off")
        if since < 0:
            raise APIError(400, f"since must be >= 0, got {since}", param="since")
        return JSONResponse(log.since(since))

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    install_playground(app, ctx)  # GET / and /playground/*: the web pages; their data routes under /v1
    return app


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(
        id=ctx.model_name, root=ctx.engine.engine.model_name, max_model_len=ctx.max_model_len, sampling_defaults=ctx.sampling_defaults.values
    )

