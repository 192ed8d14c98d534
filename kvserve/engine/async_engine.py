"""AsyncLLMEngine: the engine in its own thread, requests as asyncio streams.

The engine thread alone touches the LLMEngine. Callers (the HTTP server's event loop)
validate and tokenize on their side, hand requests over through a command queue, and
read outputs from a per-request asyncio queue filled with `call_soon_threadsafe`, so a
forward pass never blocks the event loop and many streams progress together. A stream
that is closed early (a client that disconnected) aborts its request; the abort is
applied between steps, within one step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Sequence

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.errors import EngineOverloadedError, InvalidRequestError, KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(KVServeError):
    """The engine thread stopped; no request can be served."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> bool:
        """False when the consumer's event loop is gone (the request should be aborted)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:
            return False


class RequestStream:
    """Async iterator of one request's outputs. `close()` (or leaving `async with`) before
    the last output aborts the request and frees its blocks."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, stream: _Stream):
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # cancelled: the consumer went away
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.config = self.engine.config
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (event loop) ------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """Accepting requests, with the engine thread alive."""
        return self._accepting and self._thread.is_alive()

    def num_in_flight(self) -> int:
        return len(self._streams)

    def prepare_prompt(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Validate and tokenize on the caller's side; raises typed errors for 4xx answers."""
        params.check_vocab(self.engine.arch.vocab_size)
        ids = self.engine.tokenize_prompt(prompt)
        self.engine.check_prompt_length(len(ids))
        return ids

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
    ) -> "RequestStream":
        """Submit one request and return its output stream. Raises at once (before any
        output) when the server is shutting down or the waiting queue is full."""
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        limit = self.config.max_waiting_requests
        if limit and self.engine.num_waiting + len(self._commands) >= limit:
            raise EngineOverloadedError(f"the waiting queue is full ({limit} requests); retry later")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._streams[request_id] = stream
        self._submit(("add", request_id, prompt_token_ids, params, time.monotonic(), cache_salt, prompt_text))
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `drain_timeout_s`, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._submit(("stop",))
        self._thread.join(timeout=30)

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if self._stopped:
                break
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug, not a user error: fail what is in flight, keep serving
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            kind = command[0]
            if kind == "add":
                _, request_id, ids, params, arrival, salt, text = command
                try:
                    self.engine.add_request(request_id, ids, params, arrival_time=arrival, cache_salt=salt)
                    if text is not None:
                        self.engine.set_prompt_text(request_id, text)
                except Exception as exc:
                    self._deliver_error(request_id, exc)
            elif kind == "abort":
                out = self.engine.abort_request(command[1])
                if out is not None:
                    self._deliver(out)
            elif kind == "stop":
                self._stopped = True

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is not None and not stream.put(out) and not out.finished:
            self.engine.abort_request(out.request_id)  # nobody left to read it

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            self._deliver_error(request_id, EngineDeadError(f"engine step failed: {exc}"))
