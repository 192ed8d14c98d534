"""AsyncLLMEngine: the engine in its own thread, requests as asyncio streams.

The engine thread alone touches the LLMEngine. Callers (the HTTP server's event loop)
check and tokenize on their side (the engine's input processor: `prepare_prompt`, then
`generate`), hand requests over through a queue of typed commands, and read outputs from
a per-request hand-off filled with `call_soon_threadsafe`, so a forward pass never blocks
the event loop and many streams progress together. A stream
that is closed early (a client that disconnected) aborts its request; the abort is
applied between steps, within one step.

Delivery is bounded: a request has at most one pending output. When its consumer falls
behind, the engine merges the next output into the pending one (deltas appended), so a
client that stops reading costs no more than its request already holds, not one queued
output per step.

Engine death. A step that raises, or any exception escaping the thread's loop, kills the
engine: the thread stops, every open stream gets `EngineDeadError`, nothing more is
accepted (`is_running` is False, so /health answers 503) and `on_dead` is called, for the
server to exit (or restart). A failed step is not treated as one bad request: it may
have stopped half way through the scheduler's update (blocks allocated and not recorded,
a request's tokens appended and its KV not written, the KV pool partly overwritten), so
the engine's state is unknown, and a deterministic bug would fail every later step while
the server looked healthy. vLLM decides the same (its EngineDeadError): fail loudly, let
a supervisor start a clean process. Errors a request causes on purpose (`KVServeError`
from adding it) still fail only that request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Callable, Sequence

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.input_processor import NewRequest
from kvserve.errors import EngineOverloadedError, InvalidRequestError, KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# waiting prompt tokens, by default: this many KV pools' worth (see AsyncLLMEngine.__init__)
_WAITING_POOLS = 4


def _build_in_passing_thread(config: EngineConfig | None) -> LLMEngine:
    """Load the engine in a thread that then exits, not in the caller's.

    Loading runs torch's OpenMP parallel regions, and libgomp keeps a pool of worker threads for
    each thread that ever started one, for good. Built in the server's main thread, that pool
    outlived the load beside the engine thread's own: more OpenMP threads than cores, so libgomp
    stops spinning between parallel regions and every region waits for sleeping workers to wake.
    A batch-1 decode step of the default model took 14-16 ms in the engine thread against 5-6 ms
    when loaded this way (2 cores, Zen 5); a passing thread's pool goes with it."""
    box: dict = {}

    def build() -> None:
        try:
            box["engine"] = LLMEngine(config)
        except BaseException as exc:  # raised again in the caller's thread
            box["error"] = exc

    loader = threading.Thread(target=build, name="kvserve-load", daemon=True)
    loader.start()
    loader.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


class EngineDeadError(KVServeError):
    """The engine is not running (it failed, or the server is shutting down); no request can be served."""


# ---- what the engine thread applies between steps, in order ---------------------------------


@dataclasses.dataclass(frozen=True)
class AddRequest:
    request: NewRequest


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: str
    # the server is shutting down: a request that has produced nothing fails (a 503), not an abort
    shutting_down: bool = False


@dataclasses.dataclass(frozen=True)
class AbandonHandoff:
    """A decode request's handoff will not come (LLMEngine.abandon_handoff)."""

    transfer_id: str
    reason: str
    recompute: bool


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


Command = AddRequest | AbortRequest | AbandonHandoff | Stop


class _Stream:
    """One request's hand-off from the engine thread to its consumer: at most one pending
    output (later ones merged into it) and, at the end, perhaps an error."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int, num_prompt_tokens: int):
        self.loop = loop
        self.event = asyncio.Event()
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self._text_parts: dict[int, list[str]] = {}
        self._error: BaseException | None = None
        self.started = False  # an output was handed over (engine thread)
        # admission accounting, under AsyncLLMEngine._lock: what still counts as waiting
        self.unstarted = [True] * n
        self.waiting_samples = n
        self.waiting_tokens = num_prompt_tokens

    # engine thread
    def put(self, out: RequestOutput) -> bool:
        """False when the consumer's event loop is gone (the request should be aborted)."""
        if self.loop.is_closed():
            return False
        with self._lock:
            wake = self._pending is None and self._error is None
            if self._pending is None:
                self._pending = out
            else:
                self._pending.merge(out, self._text_parts)
        return self._wake() if wake else True

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            wake = self._pending is None and self._error is None
            self._error = exc
        if wake:
            self._wake()

    def _wake(self) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
            return True
        except RuntimeError:
            return False

    # consumer's event loop
    def take(self) -> RequestOutput | BaseException | None:
        """The pending output (merged), else the error, else None (and wait on `event`)."""
        with self._lock:
            out, self._pending = self._pending, None
            if out is not None:
                out.take_text_parts(self._text_parts)
                return out
            if self._error is not None:
                return self._error
            self.event.clear()
            return None


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
        while True:
            item = self._stream.take()
            if item is not None:
                break
            try:
                await self._stream.event.wait()
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
        self.engine = engine or _build_in_passing_thread(config)
        self.config = self.engine.config
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # guards _streams, _commands' adds, the waiting counts and the accepting/closed flags,
        # so an add either reaches the engine thread before it closes or is refused
        self._lock = threading.Lock()
        self._accepting = True
        self._closed = False  # the engine thread has stopped taking commands
        self._stopped = False
        self.dead_error: BaseException | None = None  # why the engine thread failed
        self.on_dead: Callable[[BaseException], None] | None = None  # called from the engine thread
        self._waiting_samples = 0
        self._waiting_tokens = 0
        # Admission counts what has not started (no token sampled yet: queued, or in prefill),
        # in samples (n = 4 is four sequences of work) and prompt tokens (the prefill still to
        # do, once per request: its samples share it). Preempted requests are not counted
        # again: they are work already admitted, which the scheduler resumes first.
        # The token bound defaults to a few KV pools' worth of prompt: past that, the last
        # admitted request waits for several full turnovers of the pool, and a 429 the client
        # can retry is better than a wait it cannot see; never below one longest prompt.
        cfg_tokens = self.config.max_waiting_tokens
        if cfg_tokens is None:
            cfg_tokens = max(self.engine.max_model_len, _WAITING_POOLS * self.engine.layout.num_tokens)
        self.max_waiting_tokens = cfg_tokens
        self.engine.inputs.longest_token_chars  # computed now, not on the first request's turn of the event loop
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (event loop) ------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """Accepting requests, with the engine thread alive."""
        return self._accepting and not self._closed and self._thread.is_alive()

    def num_in_flight(self) -> int:
        return len(self._streams)

    def prepare_prompt(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Check and tokenize on the caller's side (InputProcessor.tokenize); raises typed errors
        for 4xx answers. Blocking (tokenization): the server calls it in a worker thread."""
        return self.engine.inputs.tokenize(prompt, params)

    def check_prompt_length_before_tokenizing(self, prompt: str | Sequence[int]) -> None:
        """A prompt known to be too long, refused without tokenizing it (on the event loop)."""
        self.engine.inputs.check_prompt_length_before_tokenizing(prompt)

    def check_admission(self, n: int, num_prompt_tokens: int = 0) -> None:
        """Would a request of `n` samples and this many prompt tokens be admitted now? The cheap
        part of `generate`'s check, for callers to make before tokenizing."""
        with self._lock:
            self._admit(n, num_prompt_tokens)

    def _admit(self, n: int, num_prompt_tokens: int) -> None:  # under _lock
        if self._closed or not self._accepting:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine failed: {self.dead_error!r}")
            raise EngineDeadError("the server is shutting down")
        # an empty queue admits anything that fits the model, so every request can progress
        limit = self.config.max_waiting_requests
        if limit and self._waiting_samples and self._waiting_samples + n > limit:
            raise EngineOverloadedError(
                f"the waiting queue is full ({self._waiting_samples} of {limit} samples waiting); retry later"
            )
        limit = self.max_waiting_tokens
        if limit and self._waiting_tokens and self._waiting_tokens + num_prompt_tokens > limit:
            raise EngineOverloadedError(
                f"the waiting queue is full ({self._waiting_tokens} of {limit} prompt tokens waiting); retry later"
            )

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        kv_transfer: dict | None = None,
    ) -> "RequestStream":
        """Submit one request, its prompt checked and tokenized by `prepare_prompt`, and return its
        output stream. Raises at once (before any output) when its handoff part is not one this
        instance takes, the server is shutting down or the waiting queue is full."""
        stream = _Stream(asyncio.get_running_loop(), params.n, len(prompt_token_ids))
        with self._lock:  # checked and queued at once: the engine thread applies it or fails it
            self._admit(params.n, len(prompt_token_ids))
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            new = self.engine.inputs.process(request_id, prompt_token_ids, params, prompt_text=prompt_text, cache_salt=cache_salt,
                                             kv_transfer=kv_transfer)  # fmt: skip
            self._streams[request_id] = stream
            self._waiting_samples += stream.waiting_samples
            self._waiting_tokens += stream.waiting_tokens
            self._commands.append(AddRequest(new))
        self._wake.set()
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._submit(AbortRequest(request_id))

    def abandon_handoff(self, transfer_id: str, reason: str, recompute: bool) -> None:
        """A decode request's handoff will not come (LLMEngine.abandon_handoff), applied on the engine thread."""
        self._submit(AbandonHandoff(transfer_id, reason, recompute))

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `drain_timeout_s`, abort the rest.
        A request that has produced nothing yet fails with EngineDeadError (a 503), not an abort."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        for request_id in list(self._streams):
            self._submit(AbortRequest(request_id, shutting_down=True))
        self._submit(Stop())
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            try:
                self.engine.close()  # the other tensor-parallel ranks, if any, stop with it
            except Exception:  # a dead rank is already reported; the shutdown goes on
                logger.warning("stopping the tensor-parallel ranks failed", exc_info=True)

    def _submit(self, command: Command) -> None:
        if self._closed:  # nobody would apply it; the thread already ended every request
            return
        self._commands.append(command)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._loop()
        except BaseException as exc:  # the engine is dead; see the module docstring
            error = exc
            logger.critical("the engine thread failed; the engine is dead", exc_info=exc)
        finally:
            self._close(error)
        if error is not None and self.on_dead is not None:
            self.on_dead(error)

    def _loop(self) -> None:
        while True:
            self._apply_commands()
            if self._stopped:
                return
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            start = time.perf_counter()
            for out in self.engine.step():
                self._deliver(out)
            if self.engine.step_log is not None:  # requests handled by the event loop while the step ran
                arrivals = sum(1 for c in list(self._commands) if isinstance(c, AddRequest))
                self.engine.record_step(time.perf_counter() - start, arrivals)

    def _apply_commands(self) -> None:
        while self._commands:
            match self._commands.popleft():
                case AddRequest(new):
                    try:
                        self.engine.add(new)
                    except KVServeError as exc:  # this request's own fault; the engine is untouched
                        self._deliver_error(new.request_id, exc)
                case AbortRequest(request_id, shutting_down=True):
                    self._shutdown_abort(request_id)
                case AbortRequest(request_id):
                    out = self.engine.abort_request(request_id)
                    if out is not None:
                        self._deliver(out)
                case AbandonHandoff(transfer_id, reason, recompute):
                    self.engine.abandon_handoff(transfer_id, reason, recompute)
                case Stop():
                    self._stopped = True

    def _shutdown_abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.get(request_id)
        if stream is not None and not stream.started:  # never served: the server is unavailable
            self._deliver_error(request_id, EngineDeadError("the server is shutting down; the request was not started"))
        elif out is not None:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if stream is None:
                return
            if out.finished:
                self._forget(out.request_id)
            elif stream.waiting_samples:
                self._note_started(stream, out)
        stream.started = True
        if not stream.put(out) and not out.finished:  # nobody left to read it
            self.engine.abort_request(out.request_id)
            with self._lock:
                self._forget(out.request_id)

    def _note_started(self, stream: _Stream, out: RequestOutput) -> None:  # under _lock
        for c in out.outputs:
            if stream.unstarted[c.index] and (c.delta_token_ids or c.finished):
                stream.unstarted[c.index] = False
                stream.waiting_samples -= 1
                self._waiting_samples -= 1
                self._waiting_tokens -= stream.waiting_tokens  # the prefill is done
                stream.waiting_tokens = 0

    def _forget(self, request_id: str) -> _Stream | None:  # under _lock
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._waiting_samples -= stream.waiting_samples
            self._waiting_tokens -= stream.waiting_tokens
            stream.waiting_samples = stream.waiting_tokens = 0
        return stream

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._forget(request_id)
        if stream is not None:
            stream.fail(exc)

    def _close(self, error: BaseException | None) -> None:
        """The thread's last act: refuse further adds, then end every request still open,
        including adds queued that will never be applied, so no stream waits forever."""
        with self._lock:
            self._closed = True
            self._accepting = False
            self.dead_error = error
            leftover = list(self._commands)
            self._commands.clear()
            streams = list(self._streams.items())
            self._streams.clear()
            self._waiting_samples = self._waiting_tokens = 0
        if error is not None:
            reason = EngineDeadError(f"the engine failed: {error!r}")
            for _, stream in streams:
                stream.fail(reason)
            return
        # a clean stop: the engine is sound, so requests it holds are aborted and freed
        not_added = {c.request.request_id for c in leftover if isinstance(c, AddRequest)}
        for request_id, stream in streams:
            out = None if request_id in not_added else self.engine.abort_request(request_id)
            if out is not None and stream.started:
                stream.put(out)
            else:
                stream.fail(EngineDeadError("the server is shutting down; the request was not started"))

