"""One streamed completion against any OpenAI-compatible server, timed from the client.

POST /v1/completions with `stream: true` and `stream_options.include_usage`, reading the
server-sent events as they arrive. TTFT is from sending the request to the first chunk
that carries text; ITL is each gap between text-carrying chunks; token counts come from
the final usage chunk where the server sends one (vLLM, llama.cpp and kvserve do), else
from the number of text chunks. `ignore_eos` is an extension vLLM and llama.cpp accept,
so the output runs to `max_tokens` exactly.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

import httpx


@dataclasses.dataclass
class RequestRecord:
    ok: bool
    prompt_tokens: int
    output_tokens: int
    sent_at_s: float  # perf_counter when sent
    ttft_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def completion_payload(model: str, prompt: list[int] | str, max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }


def _error_text(body: bytes) -> str:
    try:
        data = json.loads(body)
        err = data.get("error", data)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    except ValueError:
        return body.decode(errors="replace")[:200]


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response):
    """The event stream's lines, ended by CR, LF or CRLF only, as the SSE format defines them.
    Not httpx's `aiter_lines`: it splits like `str.splitlines`, also at U+2028, U+2029 and
    U+0085, which JSON leaves unescaped, so a token whose text holds one would cut its chunk
    in two (pydantic's JSON, which kvserve and vLLM send, writes them raw)."""
    pending = ""
    async for text in response.aiter_text():
        buffer = pending + text
        held = buffer.endswith("\r")  # a CR at the end may be half of a CRLF: wait for the next chunk
        lines = _SSE_LINE_END.split(buffer[:-1] if held else buffer)
        pending = lines.pop() + ("\r" if held else "")
        for line in lines:
            yield line
    if pending:
        yield pending.removesuffix("\r")


async def send_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_tokens: int) -> RequestRecord:
    record = RequestRecord(ok=False, prompt_tokens=prompt_tokens, output_tokens=0, sent_at_s=time.perf_counter())
    last_chunk_s = None
    text_chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {_error_text(await response.aread())}"
                return record
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict) else chunk["error"])[:200]
                    return record
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if last_chunk_s is None:
                        record.ttft_s = now - record.sent_at_s
                    else:
                        record.itl_s.append(now - last_chunk_s)
                    last_chunk_s = now
                    text_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    record.usage_reported = True
                    record.output_tokens = int(usage.get("completion_tokens", 0))
                    record.prompt_tokens = int(usage.get("prompt_tokens", prompt_tokens))
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    record.e2e_s = time.perf_counter() - record.sent_at_s
    if not record.usage_reported:
        record.output_tokens = text_chunks
    record.ok = record.ttft_s is not None
    if not record.ok:
        record.error = "the stream carried no text"
    return record
