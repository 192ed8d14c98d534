"""Gatekeeping before any route runs: the API key on /v1 routes and the request-size cap.

Both are plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would
wrap `receive` and hide the client's disconnect from the routes that listen for it.
"""

from __future__ import annotations

import hmac
import json

from kvserve.server.errors import error_body


async def _send_error(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class APIKeyAuth:
    """Every /v1 route needs `Authorization: Bearer <key>`; /health, /metrics and the
    tokenizer routes stay open, as in vLLM, so probes and scrapers need no secret."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                message = "Missing API key" if not given else "Incorrect API key provided"
                body = error_body(f"{message}; send it as `Authorization: Bearer <key>`.", "invalid_request_error", code="invalid_api_key")
                await _send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class MaxBodySize:
    """Requests over `max_bytes` get 413, whether they declare a Content-Length or stream chunks."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return

        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send) -> None:
        body = error_body(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes (--max-request-bytes).",
            "invalid_request_error",
            code="request_too_large",
        )
        await _send_error(send, 413, body, [(b"connection", b"close")])
