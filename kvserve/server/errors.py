"""Every error the server answers, as OpenAI's body: {"error": {message, type, param, code}}.

Typed engine errors (`KVServeError`) and request-parsing errors (pydantic) map to 4xx
statuses here, in one table, so no route builds an error body of its own and no user
mistake ever reaches the client as a traceback.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import EngineDeadError
from kvserve.errors import EngineOverloadedError, InvalidRequestError, KVServeError, PromptTooLongError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answer a route decides on itself (unknown model, unsupported field, …)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @property
    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def check_handoff(output) -> None:
    """A decode request whose KV handoff failed and was not recomputed (--kv-transfer-failure
    fail) is answered 502, before any byte of a stream: the failure is the first output."""
    t = getattr(output, "kv_transfer_params", None)
    if t and t.get("error") and not t.get("loaded") and not t.get("recomputed") and "do_remote_prefill" not in t:
        raise APIError(502, f"the KV handoff failed: {t['error']}", type="server_error", code="kv_transfer_failed")
    if t and t.get("error") and t.get("do_remote_prefill"):  # the prefill side could not send
        raise APIError(502, f"the KV handoff could not be sent: {t['error']}", type="server_error", code="kv_transfer_failed")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist; this server serves `{served}`.", param="model", code="model_not_found")


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def from_kvserve_error(exc: KVServeError) -> APIError:
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, f"Server overloaded: {exc}", type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable", code="service_unavailable")
    return APIError(500, str(exc), type="internal_error")


# Union members show up in pydantic's error locations ("prompt", "list[int]", 0); they
# are not fields the client wrote, so the `param` we report leaves them out.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\]\-A-Z]")


def from_validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        return APIError(400, f"The request body must be a JSON object: {first['msg']}")
    param = _param(first["loc"])
    # a union field reports one error per member; say them together, once
    messages = list(dict.fromkeys(e["msg"] for e in errors if _param(e["loc"]) == param))
    return APIError(400, f"{param}: {'; or '.join(messages)}", param=param)


def _param(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _TYPE_TAG.search(item):
            parts.append(("." if parts else "") + item)
    return "".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return exc.response(headers)

    @app.exception_handler(KVServeError)
    async def _kvserve_error(request: Request, exc: KVServeError) -> JSONResponse:
        return await _api_error(request, from_kvserve_error(exc))

    @app.exception_handler(ValidationError)
    async def _validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(error_body("internal server error", "internal_error"), status_code=500)


def sse_error(exc: BaseException) -> str:
    """An error that happens after a stream has started: one SSE event the openai client raises on."""
    api = from_kvserve_error(exc) if isinstance(exc, KVServeError) else APIError(500, "internal server error", "internal_error")
    return f"data: {json.dumps(api.body)}\n\n"
