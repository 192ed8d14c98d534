"""A minimal OpenAI-compatible completions server for testing the load client.

A stand-in peer, not a mock of kvserve's engine: it streams `max_tokens` text chunks
`token_delay_s` apart in the SSE format vLLM, llama.cpp and kvserve use, then a usage
chunk and `[DONE]`. It records how many requests were in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"


class FakeServer:
    def __init__(self, token_delay_s: float = 0.002, accept_token_ids: bool = True, token_text: str = " t{i}"):
        self.token_delay_s = token_delay_s
        self.token_text = token_text  # each chunk's text, formatted with its index i
        self.accept_token_ids = accept_token_ids
        self.in_flight = 0
        self.max_in_flight = 0
        self.payloads: list[dict] = []
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.payloads.append(body)
            prompt = body["prompt"]
            if isinstance(prompt, list) and not self.accept_token_ids:
                return JSONResponse({"error": {"message": "prompt must be a string"}}, status_code=400)
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            return StreamingResponse(self._stream(prompt_tokens, int(body["max_tokens"])), media_type="text/event-stream")

        return app

    async def _stream(self, prompt_tokens: int, max_tokens: int):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.token_delay_s)
                last = i == max_tokens - 1
                choice = {"index": 0, "text": self.token_text.format(i=i), "finish_reason": "length" if last else None}
                # unescaped non-ASCII, as pydantic's JSON (kvserve's, vLLM's) writes it
                chunk = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]}, ensure_ascii=False)
                yield f"data: {chunk}\n\n"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens}
            yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """Serve an ASGI app on a free local port in a thread; `url` is its base."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
