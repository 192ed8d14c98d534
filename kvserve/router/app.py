"""The router's HTTP front: the OpenAI routes passed through to a replica the policy picks.

The request body goes to the replica unchanged and its answer comes back unchanged (status,
body, the SSE stream chunk by chunk), so the OpenAI format of answers and errors is the
replica's own. The router adds only what belongs to it:
- a replica that cannot be reached, or answers 502/503/504, is marked down and the request
  is retried on another, as long as nothing has been streamed to the client. A stream is
  held until its first chunk arrives, so a replica that dies before that is retried too;
- a stream that breaks after that ends with an OpenAI error event (`data: {"error": …}`);
- no replica up: 503 with an OpenAI error body;
- a client that disconnects closes the upstream request, which aborts it on the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.router.first_token import FirstTokenSplice, early_eligible, first_chunks, first_text, first_text_is_whole, sse_event
from kvserve.router.policy import Choice, Policy
from kvserve.router.replicas import Replica, health_loop

# answers that mean the instance, not the request, failed: try another
_INSTANCE_FAILURES = (502, 503, 504)
_PASSED_HEADERS = ("content-type", "accept")


def error_body(message: str, type: str = "server_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def prompt_text(path: str, payload: dict) -> str:
    """What the policy matches prefixes on: the prompt's text (token ids as text), or the chat
    messages' roles and contents in order."""
    if path.endswith("/chat/completions"):
        parts = []
        for m in payload.get("messages") or []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\x1f{content or ''}\x1e")
        return "".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch goes to one replica: its first prompt decides
    if isinstance(prompt, list):
        return ",".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


class RouterMetrics:
    def __init__(self, replicas: list[Replica]):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_router:requests", "Requests sent to each replica, retries included.",
                                ["replica"], registry=self.registry)  # fmt: skip
        self.retries = Counter("kvserve_router:retries", "Requests retried on another replica after an instance failure.",
                               registry=self.registry)  # fmt: skip
        self.failed = Counter("kvserve_router:failed_requests", "Requests no replica could serve (answered 503).",
                              registry=self.registry)  # fmt: skip
        self.prompt_chars = Counter("kvserve_router:prompt_chars", "Prompt characters routed.", registry=self.registry)
        self.matched_chars = Counter("kvserve_router:prefix_matched_chars",
                                     "Prompt characters the chosen replica's prefix index matched (the router's estimate of its cache hits).",
                                     registry=self.registry)  # fmt: skip
        # prefill/decode handoffs: the prefill side's report, and the decode side's first bytes
        self.handoff_bytes = Histogram("kvserve_router:kv_handoff_bytes", "KV bytes a prefill instance handed over, per request.",
                                       buckets=[2**k for k in range(10, 34, 2)], registry=self.registry)  # fmt: skip
        self.handoff_seconds = Histogram("kvserve_router:kv_handoff_seconds", "Seconds the prefill instance took to send a request's KV.",
                                         buckets=[1e-4 * 2**k for k in range(18)], registry=self.registry)  # fmt: skip
        self.decode_first_byte_seconds = Histogram(
            "kvserve_router:first_to_second_token_seconds",
            "From the prefill instance's answer (the first token) to the decode instance's first bytes: the handoff's arrival "
            "and its first step, the gap between a handed-over request's first and second tokens.",
            buckets=[1e-3 * 2**k for k in range(14)], registry=self.registry,
        )  # fmt: skip
        labels = ["replica", "pool"]
        up = Gauge("kvserve_router:replica_up", "1 while the replica is up.", labels, registry=self.registry)
        in_flight = Gauge("kvserve_router:replica_in_flight", "Requests open on the replica.", labels, registry=self.registry)
        running = Gauge("kvserve_router:replica_running", "Requests running, as the replica last published.", labels, registry=self.registry)
        waiting = Gauge("kvserve_router:replica_waiting", "Requests waiting, as the replica last published.", labels, registry=self.registry)
        for r in replicas:
            up.labels(r.url, r.pool).set_function(lambda r=r: 1.0 if r.up else 0.0)
            in_flight.labels(r.url, r.pool).set_function(lambda r=r: r.in_flight)
            running.labels(r.url, r.pool).set_function(lambda r=r: r.running)
            waiting.labels(r.url, r.pool).set_function(lambda r=r: r.waiting)


def handoff_eligible(path: str, payload: dict) -> bool:
    """Whether a request can go prefill-then-decode: one prompt, and nothing that needs the
    prompt's logits on the decode side (prompt logprobs, echo with logprobs). With n > 1 the
    first sample takes the handoff and the others start from its prompt there."""
    if payload.get("prompt_logprobs") is not None:
        return False
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return False  # a batch of prompts
        if payload.get("echo") and payload.get("logprobs") is not None:
            return False
    return True


def create_router_app(
    urls: list[str], policy: Policy, api_key: str | None = None, replica_api_key: str | None = None,
    health_interval_s: float = 2.0, request_timeout_s: float = 600.0,
    prefill_urls: list[str] = (), decode_urls: list[str] = (),
) -> FastAPI:  # fmt: skip
    replicas = [Replica(url.rstrip("/"), i) for i, url in enumerate(urls)]
    n = len(replicas)
    prefills = [Replica(url.rstrip("/"), n + i, pool="prefill") for i, url in enumerate(prefill_urls)]
    decodes = [Replica(url.rstrip("/"), n + len(prefills) + i, pool="decode") for i, url in enumerate(decode_urls)]
    # plain requests go to the replicas; without any, to the decode pool (which computes prompts too)
    plain = replicas or decodes
    disaggregated = bool(prefills and decodes)
    replicas = replicas + prefills + decodes
    metrics = RouterMetrics(replicas)
    upstream_auth = {"authorization": f"Bearer {replica_api_key}"} if replica_api_key else {}
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["client"] = client
            checker = asyncio.create_task(health_loop(replicas, client, upstream_auth, health_interval_s))
            try:
                yield
            finally:
                checker.cancel()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.replicas = replicas
    app.state.policy = policy

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path not in ("/health",):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(error_body("Incorrect API key provided.", "invalid_request_error", "invalid_api_key"), 401)
        return await call_next(request)

    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return JSONResponse(error_body(f"the request body is not a JSON object: {exc}", "invalid_request_error"), 400)
        text = prompt_text(path, payload)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS} | upstream_auth
        if disaggregated and handoff_eligible(path, payload):
            return await _prefill_then_decode(path, payload, text, headers)
        return await _serve_from(plain, path, body, text, headers)

    async def _prefill_then_decode(path: str, payload: dict, text: str, headers: dict) -> Response:
        """The request on a decode instance and its prompt on a prefill instance at once: the
        decode instance allocates the prompt's blocks and waits, the prefill instance runs the
        prompt to its first token and hands the KV over into those blocks. A streaming client
        gets the first token from the prefill answer (router/first_token.py), the rest from the
        decode instance; otherwise the decode instance's answer is the client's."""
        transfer_id = uuid.uuid4().hex
        # the decode instance is picked first: a point-to-point transport needs its address
        target = policy.choose(decodes, text)
        if target is None:
            metrics.failed.inc()
            return JSONResponse(error_body("no decode instance could serve the request: every one is down", code="no_replica"), 503)
        params = {"do_remote_decode": True, "transfer_id": transfer_id}
        if target.replica.kv_address:
            params["remote_address"] = target.replica.kv_address
        first = dict(payload, stream=False, max_tokens=1, n=1, kv_transfer_params=params)
        first.pop("stream_options", None)
        first.pop("best_of", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        rest = dict(payload, kv_transfer_params={"do_remote_prefill": True, "transfer_id": transfer_id})
        sent = time.monotonic()
        # the chosen decode instance (the KV goes to it); if it fails, another computes the prompt itself
        pool = [target.replica] + [r for r in decodes if r is not target.replica]
        decoding = asyncio.create_task(_open_from(
            pool, path, json.dumps(rest).encode(), text, headers, prefer=target.replica, retry_body=json.dumps(payload).encode(),
            on_first_byte=lambda: metrics.decode_first_byte_seconds.observe(max(0.0, time.monotonic() - prefilled))))  # fmt: skip
        prefilled = sent
        tried_prefill = any(r.up for r in prefills)
        try:
            answer = await _answer_from(prefills, path, json.dumps(first).encode(), text, headers)
        except BaseException:  # the client went away: the decode instance's request goes too
            await _drop(decoding)
            raise
        prefilled = time.monotonic()
        if isinstance(answer, Response):
            if answer.status_code != 503 and b"kv_transfer_failed" not in answer.body:
                await _drop(decoding)  # the request's own error (a 4xx): the client gets it; closing aborts the decode side's copy
                return answer
            # no prefill instance was up (the decode instance computes the prompt), or the one
            # tried failed or could not send (the decode instance's --kv-transfer-failure
            # decides): said now, so the decode side does not wait out its timeout
            await _abandon(target.replica, transfer_id, answer, recompute=not tried_prefill)
            return await _respond(decoding)
        handoff = answer.get("kv_transfer_params") or {}
        metrics.handoff_bytes.observe(handoff.get("bytes") or 0)
        metrics.handoff_seconds.observe(handoff.get("seconds") or 0.0)
        if early_eligible(path, payload) and first_text_is_whole(first_text(path, answer)):
            return StreamingResponse(_spliced(path, answer, decoding), media_type="text/event-stream")
        return await _respond(decoding)

    async def _abandon(replica: Replica, transfer_id: str, answer: Response, recompute: bool) -> None:
        client: httpx.AsyncClient = state["client"]
        reason = f"the prefill side answered {answer.status_code}: {answer.body[:300].decode(errors='replace')}"
        try:
            await client.post(replica.url + "/v1/kv_transfer/abandon", headers=upstream_auth, timeout=10.0,
                              json={"transfer_id": transfer_id, "reason": reason, "recompute": recompute})  # fmt: skip
        except httpx.HTTPError:  # the decode request then times out into its failure policy
            pass

    async def _drop(decoding: asyncio.Task) -> None:
        """The decode side's request is not wanted: cancelled, or closed if already answering
        (either way the connection closes, which aborts it there)."""
        decoding.cancel()
        try:
            opened = await decoding
        except (asyncio.CancelledError, Exception):
            return
        if not isinstance(opened, Response):
            upstream, _, _, replica = opened
            replica.in_flight -= 1
            await upstream.aclose()

    async def _respond(decoding: asyncio.Task) -> Response:
        opened = await decoding
        if isinstance(opened, Response):
            return opened
        upstream, first_bytes, chunks, replica = opened
        return _relay(upstream, first_bytes, chunks, replica)

    async def _spliced(path: str, answer: dict, decoding: asyncio.Task):
        """The first token from the prefill answer, at once; then the decode instance's stream
        without it."""
        yield first_chunks(path, answer)
        try:
            opened = await decoding
        except BaseException:
            await _drop(decoding)
            raise
        if isinstance(opened, Response):  # no decode instance could go on: the stream ends with its error
            try:
                err = json.loads(opened.body)
            except ValueError:
                err = error_body(opened.body[:300].decode(errors="replace"), code="replica_failed")
            yield sse_event(err) + b"data: [DONE]\n\n"
            return
        upstream, first_bytes, chunks, replica = opened
        splice = FirstTokenSplice(path, answer)
        body = _relay_body(upstream, first_bytes, chunks, replica, streaming=True)
        try:
            async for data in body:
                out = splice.feed(data)
                if out:
                    yield out
            tail = splice.flush()
            if tail:
                yield tail
        finally:  # also when the client leaves mid-stream: the upstream closes, which aborts it there
            await body.aclose()

    def _next(pool: list[Replica], text: str, tried: set[str], errors: list[str], prefer: Replica | None = None) -> Choice | Response:
        """The replica to try next (`prefer` first, where a handoff went), counted as sent
        (a retry when one was tried before); or the 503 to answer when none is left."""
        if prefer is not None and prefer.up and prefer.url not in tried:
            choice = Choice(prefer, 0)
        else:
            choice = policy.choose(pool, text, tried)
        if choice is None:
            metrics.failed.inc()
            kind = "replica" if pool[0].pool == "replica" else f"{pool[0].pool} instance"
            why = "; ".join(errors) if errors else f"every {kind} is down"
            return JSONResponse(error_body(f"no {kind} could serve the request: {why}", code="no_replica"), 503)
        replica = choice.replica
        if tried:
            metrics.retries.inc()
        tried.add(replica.url)
        replica.in_flight += 1
        replica.requests += 1
        metrics.requests.labels(replica.url).inc()
        return choice

    async def _answer_from(pool: list[Replica], path: str, body: bytes, text: str, headers: dict) -> dict | Response:
        """A whole (non-streamed) answer from some replica of `pool`, retried past failed
        instances: its JSON on 200, else the Response to give the client."""
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        errors: list[str] = []
        while True:
            choice = _next(pool, text, tried, errors)
            if isinstance(choice, Response):
                return choice
            replica = choice.replica
            try:
                r = await client.post(replica.url + path, content=body, headers=headers)
            except httpx.HTTPError as exc:
                replica.mark_down(f"{type(exc).__name__}: {exc}")
                errors.append(f"{replica.url}: {type(exc).__name__}")
                continue
            finally:
                replica.in_flight -= 1
            if r.status_code in _INSTANCE_FAILURES and "kv_transfer_failed" not in r.text:
                replica.mark_down(f"answered {r.status_code}: {r.text[:300]}")
                errors.append(f"{replica.url}: {r.status_code}")
                continue
            if r.status_code != 200:
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            return r.json()

    async def _serve_from(pool: list[Replica], path: str, body: bytes, text: str, headers: dict) -> Response:
        opened = await _open_from(pool, path, body, text, headers)
        if isinstance(opened, Response):
            return opened
        return _relay(*opened)

    async def _open_from(pool: list[Replica], path: str, body: bytes, text: str, headers: dict, on_first_byte=None,
                         prefer: Replica | None = None, retry_body: bytes | None = None):  # fmt: skip
        """An answer under way from some replica of `pool` (`prefer` first, with `body`; any
        retry with `retry_body` when given): (upstream, its first bytes, the rest, the
        replica), once the first bytes are here; or the Response to give the client."""
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        errors: list[str] = []
        while True:
            choice = _next(pool, text, tried, errors, prefer)
            if isinstance(choice, Response):
                return choice
            replica = choice.replica
            if prefer is not None and replica is not prefer and retry_body is not None:
                body = retry_body  # not where the handoff went: this one computes the prompt
            try:
                upstream = await client.send(client.build_request("POST", replica.url + path, content=body, headers=headers), stream=True)
            except httpx.HTTPError as exc:
                replica.in_flight -= 1
                replica.mark_down(f"{type(exc).__name__}: {exc}")
                errors.append(f"{replica.url}: {type(exc).__name__}")
                continue
            if upstream.status_code in _INSTANCE_FAILURES:
                detail = (await upstream.aread())[:300].decode(errors="replace")
                await upstream.aclose()
                replica.in_flight -= 1
                if "kv_transfer_failed" in detail:  # the request's handoff failed, not the instance: say so
                    return Response(detail.encode(), status_code=upstream.status_code, media_type="application/json")
                replica.mark_down(f"answered {upstream.status_code}: {detail}")
                errors.append(f"{replica.url}: {upstream.status_code}")
                continue
            chunks = upstream.aiter_raw()
            try:  # nothing is committed to the client until the first bytes are here
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except httpx.HTTPError as exc:
                await upstream.aclose()
                replica.in_flight -= 1
                replica.mark_down(f"{type(exc).__name__} before the first byte: {exc}")
                errors.append(f"{replica.url}: {type(exc).__name__}")
                continue
            except BaseException:  # cancelled (the client left, or the request failed elsewhere): close, which aborts it there
                await upstream.aclose()
                replica.in_flight -= 1
                raise
            if on_first_byte is not None:
                on_first_byte()
            metrics.prompt_chars.inc(len(text))
            metrics.matched_chars.inc(choice.matched_chars)
            return upstream, first, chunks, replica

    async def _relay_body(upstream: httpx.Response, first: bytes, chunks, replica: Replica, streaming: bool):
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as exc:  # the replica went away mid-answer
            replica.mark_down(f"{type(exc).__name__} mid-answer: {exc}")
            if streaming:
                err = error_body(f"the replica serving this stream failed: {type(exc).__name__}", code="replica_failed")
                yield sse_event(err)
        finally:
            replica.in_flight -= 1
            await upstream.aclose()

    def _relay(upstream: httpx.Response, first: bytes, chunks, replica: Replica) -> Response:
        media = upstream.headers.get("content-type", "application/json")
        body = _relay_body(upstream, first, chunks, replica, streaming=media.startswith("text/event-stream"))
        return StreamingResponse(body, status_code=upstream.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        client: httpx.AsyncClient = state["client"]
        for replica in replicas:
            if not replica.up:
                continue
            try:
                r = await client.get(f"{replica.url}/v1/models", headers=upstream_auth, timeout=10.0)
            except httpx.HTTPError as exc:
                replica.mark_down(f"{type(exc).__name__}: {exc}")
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse(error_body("no replica is up", code="no_replica"), 503)

    @app.get("/health")
    async def health():
        serving = {r.pool for r in replicas if r.up}
        up = ("prefill" in serving and "decode" in serving) or any(r.up for r in plain)
        return JSONResponse({"status": "ok" if up else "unavailable", "policy": policy.name,
                             "replicas": [r.describe() for r in replicas]}, 200 if up else 503)  # fmt: skip

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
