"""The scheduler: one rule, one token budget (vLLM v1 style; the seed's §7).

There is no prefill phase and no decode phase. Each step, every request tries to bring
`num_computed_tokens` up to `num_tokens` within `max_num_batched_tokens` and
`max_num_seqs`: running requests first (a decode token or the next prefill chunk), then
waiting ones in arrival order. A prompt longer than the remaining budget is chunked, so
prefill chunks and decode tokens share one forward pass. When blocks run out, the most
recently admitted running request is preempted by recompute.

It is also the one bookkeeper of request state: `schedule` admits, preempts and hands the
runner each scheduled request's block table; `update_from_output` applies what the step
computed and sampled (tokens, timing, logprobs, stops); `finish` ends a request (a stop, a
length limit or an abort) and frees its blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, check_stop
from kvserve.request_state import RequestStatus
from kvserve.structured.advance import advance_structured

if TYPE_CHECKING:
    from kvserve.engine.sampler import SamplerOutput


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # m: positions computed this step, starting at num_computed_tokens
    # Does this step reach the last known token, so a new one is sampled? Fixed when the
    # step is scheduled (it stays true of the step after `update_from_output` moves the request on).
    samples: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # request id -> the ids of its KV blocks, taken after every allocation of the step
    block_tables: dict[str, list[int]]
    preempted: list[Request] = dataclasses.field(default_factory=list)  # this step, in eviction order
    # request id -> the rank whose pool holds its KV (the requests KV layout); None: one pool
    kv_ranks: dict[str, int] | None = None
    # decode requests whose first token arrived with their KV this step (disagg/connector.py),
    # and those whose handoff failed and ended them: outputs to emit though they ran nothing
    arrived: list[Request] = dataclasses.field(default_factory=list)
    # with KV groups (engine/kv_groups.py): request id -> its table in each group (block_tables
    # holds the first group's); None without groups
    group_block_tables: dict[str, list[list[int]]] | None = None

    @property
    def sampling(self) -> list[ScheduledRequest]:
        """The requests that sample a token this step, in scheduling order: the order of the
        runner's logits rows and so of the sampler output's rows."""
        return [s for s in self.scheduled if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass
class StepUpdate:
    """What `update_from_output` changed, for the engine to emit outputs and count metrics."""

    sampled: list[Request]  # got a token this step, in the order of the sampler output's rows
    finished: list[Request]  # finished this step (stop or length); `status` says which


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, connector=None, clock=time.monotonic):
        self.config = config
        self.kv_cache = kv_cache
        # what "now" is for request timing: the wall clock, or the simulator's modelled time (kvserve/sim)
        self.clock = clock
        # disagg/connector.py KVConnector: requests whose KV comes from another instance
        self.connector = connector
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
        now = self.clock()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, 0, budget)
            while not self.kv_cache.allocate_slots(request, n):
                # the tail of `running` is the most recently admitted and not yet scheduled;
                # with a pool per rank, the latest admitted whose blocks share request's pool
                j = len(self.running) - 1
                while j > i and not self.kv_cache.shares_pool(request, self.running[j]):
                    j -= 1
                victim = self.running.pop(j)
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

        arrived: list[Request] = []
        if not preempted:  # admitting new work while evicting running work would thrash
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if not request.is_ready():
                    skipped.append(self.waiting.popleft())
                    continue
                if self._receives_kv(request):
                    state = self._receive(request, now, arrived)
                    if state == "no room":
                        break
                    if state == "waits":
                        skipped.append(self.waiting.popleft())
                        continue
                    if state == "finished":  # its first token ended it, or its handoff failed: finish() dequeued it
                        continue
                    if state == "loaded":  # the prompt's KV is in its blocks: compute the first token's position
                        self._admit(request, now, request.num_prompt_tokens, 1, scheduled)
                        budget -= 1
                        continue
                    # "recompute": an ordinary request from here
                computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
                n = self._chunk(request, num_cached, budget)
                if not self.kv_cache.allocate_slots(request, n, computed_blocks):
                    break
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
                if request.timing.first_scheduled is None:
                    request.num_cached_tokens = num_cached
                self._admit(request, now, num_cached, n, scheduled)
                budget -= n
            self.waiting.extendleft(reversed(skipped))
        block_tables, group_tables = self.kv_cache.tables([s.request.request_id for s in scheduled])
        kv_ranks = self.kv_cache.ranks_of([s.request.request_id for s in scheduled])
        return SchedulerOutput(scheduled, block_tables, preempted, kv_ranks, arrived, group_tables)

    def _admit(self, request: Request, now: float, num_computed: int, n: int, scheduled: list[ScheduledRequest]) -> None:
        """The head of `waiting` runs from this step, computing n positions from num_computed."""
        self.waiting.popleft()
        self.running.append(request)
        if request.timing.first_scheduled is None:
            request.timing.first_scheduled = now
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        scheduled.append(ScheduledRequest(request, n))

    def _receives_kv(self, request: Request) -> bool:
        """A decode request of a disaggregated pair whose KV has not arrived (nor failed into
        computing the prompt here)."""
        t = request.kv_transfer
        return t is not None and t.do_remote_prefill and not (t.loaded or t.recomputed) and not request.output_token_ids

    def _receive(self, request: Request, now: float, arrived: list[Request]) -> str:
        """A decode request waiting for its KV. First its blocks are allocated, every prompt
        position's and the first token's, before anything arrives (a local prefix-cache hit is
        kept; the rest stays unfindable until loaded). Then each step polls: `waits` while the
        handoff is on its way; `loaded` once it is in the blocks and its first token taken;
        `finished` when that token ended it or the handoff failed under the `fail` policy;
        `recompute` when it failed and the prompt is computed here; `no room` when the blocks
        could not be had (it waits its turn like any request)."""
        t = request.kv_transfer
        if not t.allocated:
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            remote = self.connector.get_num_new_matched_tokens(request, num_cached)
            if not self.kv_cache.allocate_slots(request, remote + 1, computed_blocks, cache=False):
                return "no room"
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
            request.num_cached_tokens = num_cached
            self.connector.update_state_after_alloc(request, self.kv_cache.block_ids(request.request_id), num_cached)
        if self.connector.request_waits(request):
            return "waits"
        if t.error is not None:
            if self.connector.failure == "recompute" or t.must_recompute:
                self.kv_cache.free(request)  # what arrived, if anything, nobody could find: it goes
                t.recomputed = True
                return "recompute"
            for other in [r for r in self.waiting if r.leader is request]:  # its other samples (n > 1) end with it
                self.finish(other, RequestStatus.FINISHED_ABORTED)
                arrived.append(other)
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            arrived.append(request)
            return "finished"
        handoff, t.arrived = t.arrived, None  # the pool has its KV now
        self.kv_cache.cache_loaded(request, request.num_prompt_tokens)
        stop = self._take_token(request, handoff.first_token, handoff.first_logprobs, handoff.first_logprob, now)
        arrived.append(request)
        if stop is not None:
            status, request.stop_reason = stop
            self.finish(request, status)
            return "finished"
        return "loaded"

    def update_from_output(self, scheduler_output: SchedulerOutput, sampler_output: SamplerOutput | None) -> StepUpdate:
        """Apply what one step did to its requests: every scheduled request's positions are
        computed; each sampling request (`scheduler_output.sampling`, row i of
        `sampler_output`) gets its token, timing and logprobs, and the stop rule, which may
        finish it (and free its blocks). `sampler_output` is None when nothing sampled."""
        sampling = scheduler_output.sampling
        num_rows = 0 if sampler_output is None else len(sampler_output.token_ids)
        if num_rows != len(sampling):
            raise ValueError(f"{num_rows} sampled tokens for {len(sampling)} sampling requests")
        now = self.clock()
        for s in scheduler_output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        sampled: list[Request] = []
        finished: list[Request] = []
        for row, s in enumerate(sampling):
            request = s.request
            token = sampler_output.token_ids[row]
            stop = self._take_token(request, token, sampler_output.logprobs[row], sampler_output.sampled_logprobs[row], now)
            sampled.append(request)
            if stop is not None:
                status, request.stop_reason = stop
                self.finish(request, status)
                finished.append(request)
        return StepUpdate(sampled, finished)

    def _take_token(self, request: Request, token: int, logprobs: dict[int, float] | None, sampled_logprob: float,
                    now: float) -> tuple[RequestStatus, int | str | None] | None:  # fmt: skip
        """A new output token: appended with its timing and logprobs, through the
        detokenizer's stop strings, the stop rule and the request's grammar; whether it stops."""
        request.append_output_token(token)
        if request.timing.first_token is None:
            request.timing.first_token = now
        request.timing.token_times.append(now)
        if logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += sampled_logprob
        stop_string = None
        if request.detokenizer is not None:  # stop strings are searched once min_tokens are out
            past_min = request.num_output_tokens >= request.sampling_params.min_tokens
            stop_string = request.detokenizer.add_token(token, check_stop=past_min)
        stop = check_stop(request, token, stop_string)
        if request.structured is not None:  # its grammar takes the token, and may end it
            stop = advance_structured(request, token, stop)
        return stop

    def record_prompt_logprobs(self, scored: list[tuple[Request, list[dict[int, float]]]]) -> None:
        """The prompt logprobs a step computed (ModelRunner), in prompt order."""
        for request, entries in scored:
            request.prompt_logprobs.extend(entries)

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
        request.timing.finished = self.clock()
        if request.kv_transfer is not None and self.connector is not None:
            self.connector.request_released(request)  # before its blocks can go to anyone else
        self.kv_cache.free(request)
