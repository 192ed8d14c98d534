"""Gatekeeping before any route runs: the API key, the request-size cap and JSON-only bodies.

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


# Open without the key: liveness probes (/health, /version), FastAPI's API docs (the schema,
# no data) and the web playground's static pages (code, no data; every piece of data they
# show comes from a JSON route under /v1, which needs the key like any other).
OPEN_PATHS = frozenset({"/health", "/version", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_PREFIXES = ("/playground/",)


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path == "/playground" or path.startswith(OPEN_PREFIXES)


class APIKeyAuth:
    """With an API key set, every route needs `Authorization: Bearer <key>` (the scheme in any
    case, as RFC 7235 has it) except the open ones above: /v1/*, and also /tokenize,
    /detokenize (they run the tokenizer on the caller's text) and /metrics (it tells
    the traffic and the model), unlike vLLM, where those stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not is_open_path(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)
            if not ok:
                message = "Missing API key" if not given else "Incorrect API key provided"
                body = error_body(f"{message}; send it as `Authorization: Bearer <key>`.", "invalid_request_error", code="invalid_api_key")
                await _send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class JSONBodiesOnly:
    """A POST (PUT, PATCH) must declare `Content-Type: application/json` (parameters such as
    charset allowed), else 415 before its body is read. Every body this server takes is JSON;
    requiring the type blocks cross-site "simple" requests (a web page can post text/plain,
    a form or a typeless body to any address without a CORS preflight, but not JSON)."""

    _METHODS = frozenset({"POST", "PUT", "PATCH"})

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] in self._METHODS:
            given = dict(scope["headers"]).get(b"content-type", b"")
            media_type = given.split(b";", 1)[0].strip().lower()
            if media_type != b"application/json":
                shown = given.decode("latin-1") if given else "none"
                body = error_body(
                    f"The request body must be JSON, sent with `Content-Type: application/json` (got {shown}).",
                    "invalid_request_error",
                    code="unsupported_media_type",
                )
                await _send_error(send, 415, body)
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
