"""The scheduler: one rule, one token budget (vLLM v1 style; the seed's §7).

There is no prefill phase and no decode phase. Each step, every request tries to bring
`num_computed_tokens` up to `num_tokens` within `max_num_batched_tokens` and
`max_num_seqs`: running requests first (a decode token or the next prefill chunk), then
waiting ones in arrival order. A prompt longer than the remaining budget is chunked, so
prefill chunks and decode tokens share one forward pass. When blocks run out, the most
recently admitted running request is preempted by recompute.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from kvserve.config import EngineConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # m: positions computed this step, starting at num_computed_tokens

    @property
    def samples(self) -> bool:
        """Does this step reach the last known token, so a new one is sampled?"""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, num_cached: int, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens - num_cached
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, 0, budget)
            while not self.kv_cache.allocate_slots(request, n):
                # the tail of `running` is the most recently admitted and not yet scheduled
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, n))
                budget -= n
                i += 1
                continue
            break

        if not preempted:  # admitting new work while evicting running work would thrash
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if not request.is_ready():
                    skipped.append(self.waiting.popleft())
                    continue
                computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
                n = self._chunk(request, num_cached, budget)
                if not self.kv_cache.allocate_slots(request, n, computed_blocks):
                    break
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
                self.waiting.popleft()
                self.running.append(request)
                if request.timing.first_scheduled is None:
                    request.timing.first_scheduled = now
                    request.num_cached_tokens = num_cached
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_cached
                scheduled.append(ScheduledRequest(request, n))
                budget -= n
            self.waiting.extendleft(reversed(skipped))
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its KV, keep its tokens, resume it first."""
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state; frees everything it holds. Idempotent."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        request.timing.finished = time.monotonic()
        self.kv_cache.free(request)
