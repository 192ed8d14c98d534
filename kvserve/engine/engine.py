"""LLMEngine: add requests, step, get outputs. A step reads aloud as schedule, execute, update.

Each part of a step is a call into the room that owns it: the scheduler plans the step and
is the one bookkeeper of request state (engine/scheduler.py); the model runner runs the
forward pass and draws the tokens (engine/model_runner.py); the KV connector sends and
receives the handoffs of disaggregated serving (disagg/connector.py). Requests come in
through the input processor (checked once, tokenized, fanned out into their n samples:
engine/input_processor.py) and leave through the output processor (one output per user
request: engine/output_processor.py). The engine keeps the counters and the step log.

Built from this rank's share of the model (engine/model_share.py); under tensor parallelism
the other ranks are workers that follow its steps (engine/tp_worker.py, distributed/launch.py).
Synchronous by design; the server drives it from its own thread (engine/async_engine.py),
the offline `LLM` calls `step()` until everything is done.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Sequence

from kvserve.config import EngineConfig
from kvserve.disagg.connector import KVConnector, KVTransferParams, open_transport
from kvserve.disagg.transport import KVTransport
from kvserve.distributed.launch import join_group, stop_ranks
from kvserve.engine.describe import step_log_header
from kvserve.engine.input_processor import InputProcessor, NewRequest
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.kv_events import KVEventLog
from kvserve.engine.kv_placement import RequestShardedKVCache
from kvserve.engine.model_share import build_model_share, use_process_settings
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.sampler import skip_draw
from kvserve.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
from kvserve.engine.step_log import StepLog
from kvserve.engine.step_shape import shape_of
from kvserve.engine.tp_worker import run_worker
from kvserve.errors import InvalidRequestError
from kvserve.model.loader import LoadedModel
from kvserve.outputs import RequestOutput
from kvserve.request_state import RequestStatus
from kvserve.sampling_params import SamplingParams


@dataclasses.dataclass
class EngineCounters:
    """Monotonic totals, for metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    computed_tokens: int = 0  # positions run through the model (prefix-cache hits are not)
    # KV bytes the attention read (positions x c_kv, all layers' K and V): as the step ran,
    # and as a per-request scan of every history would have (equal where no shared prefix
    # was read once: --shared-prefix-attention off, no group, or a path that ignores the plan)
    attention_kv_bytes_read: int = 0
    attention_kv_bytes_read_without_sharing: int = 0
    shared_prefix_steps: int = 0  # steps whose decode attention read shared prefixes once per group


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 kv_transport: KVTransport | None = None):  # fmt: skip
        """`loaded`: weights already loaded (else config.model is); `kv_transport`: how handoffs
        travel (else as config.kv_transport says: disagg/connector.py `open_transport`)."""
        self.config = config = config or EngineConfig()
        use_process_settings(config)
        # tensor parallelism (distributed/): this process is rank 0, the others follow its steps
        self.tp, self._rank_procs, tp_notes, self._finalizer = None, [], [], None
        if config.tensor_parallel_size > 1:
            self.tp, self._rank_procs, tp_notes = join_group(config, run_worker)
            self._finalizer = weakref.finalize(self, stop_ranks, self.tp, self._rank_procs, True)
        try:
            self._build(config, loaded, tp_notes, kv_transport)
        except BaseException:
            self._abandon_ranks()  # nothing left waiting on a group that will never step
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None, tp_notes: list[str], kv_transport) -> None:
        share = build_model_share(config, self.tp, loaded, tp_notes)
        loaded = share.loaded
        self.model_name, self.arch, self.tokenizer, self.format_notes = loaded.name, loaded.arch, loaded.tokenizer, loaded.notes
        self.generation_config = loaded.generation_config  # the server's sampling defaults start here
        self.load_seconds, self.model_source, self.loaded_from_cache = loaded.load_seconds, loaded.source, loaded.from_cache
        self.shard, self.requests_layout, self.kernels = share.shard, share.requests_layout, share.kernels
        self.layout, self.context_len, self.max_model_len = share.layout, share.context_len, share.max_model_len
        self.model, self.runner = share.model, share.runner
        self.kv_events = KVEventLog() if config.enable_kv_cache_events else None
        if self.requests_layout:  # rank 0 places each request on a rank's pool; each pool has its own prefix cache
            self.kv_cache = RequestShardedKVCache(
                self.tp.world, self.layout.num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events
            )
        else:
            self.kv_cache = KVCacheManager(self.layout.num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events,
                                           self.layout.groups)  # fmt: skip
        # a handoff moves one process's pools (not yet a tensor-parallel group's), whole blocks
        # of every layer (not yet a pool held to its windows)
        self.connector = None
        if self.tp is None and self.layout.groups is None:
            self.connector = KVConnector(
                kv_transport or open_transport(config), self.runner.kv_pool, self.runner.kv_scales, config.block_size,
                functools.partial(skip_draw, vocab_size=self.arch.vocab_size), config.kv_transfer_failure,
                config.kv_transfer_timeout_s,
            )  # fmt: skip
        self.scheduler = Scheduler(config, self.kv_cache, self.connector)
        refusal = None if self.connector is not None else (
            "handoffs under tensor parallelism are not supported yet" if self.tp is not None else
            "this instance holds sliding-window layers to their window, and a handoff moves every layer's positions; "
            "start both instances of the pair with --kv-role prefill / decode, which keep them all")  # fmt: skip
        self.inputs = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len, config.block_size, config.kv_role,
                                     handoff_refusal=refusal)  # fmt: skip
        self.outputs = OutputProcessor(self.connector)
        self.counters = EngineCounters()
        self._next_id = 0
        # --step-log: each step's shape, read from the plan (when `read_step_shapes`: the step log and
        # the in-process calibration), and its duration (record_step); rank 0 runs the steps
        self.read_step_shapes = bool(config.step_log)
        self.step_log = StepLog(config.step_log, step_log_header(self)) if config.step_log else None
        self.last_step_shape = None

    # ---- tensor parallelism: the ranks -------------------------------------------------

    def _abandon_ranks(self) -> None:
        """After a failed start: leave the group and end the ranks this process started (the
        group may be broken: no stop is sent)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            stop_ranks(self.tp, self._rank_procs, send_stop=False)
        self.tp = None

    def close(self) -> None:
        """Rank 0 stops the other ranks and waits for those it started; then leaves the group.
        Also run when the engine is collected or the interpreter exits, so no rank is left
        waiting for a step that will never come."""
        if self._finalizer is not None:
            self._finalizer()
        self.tp = None
        if self.step_log is not None:
            self.step_log.close()
            self.step_log = None

    # ---- requests in and out -----------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | dict | None = None,
    ) -> str:
        """Check, tokenize and add one request (the offline path; the server checks on its own
        side and adds with `add`); returns its id, a fresh one when `request_id` is None."""
        params = params or SamplingParams()
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        ids = self.inputs.tokenize(prompt, params)
        self.add(self.inputs.process(request_id, ids, params, prompt_text=prompt if isinstance(prompt, str) else None,
                                     arrival_time=arrival_time, cache_salt=cache_salt, kv_transfer=kv_transfer))  # fmt: skip
        return request_id

    def add(self, new: NewRequest) -> None:
        """A request the input processor checked: its n samples go to the scheduler."""
        if new.request_id in self.outputs:
            raise InvalidRequestError(f"request id {new.request_id!r} is already in use", "request_id")
        samples = self.inputs.fan_out(new)
        self.outputs.add(new, samples)
        for sample in samples:
            self.scheduler.add_request(sample)
        self.counters.prompt_tokens += len(new.prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free everything the request holds, at any point of its life; others are untouched."""
        samples = self.outputs.samples(request_id)
        if samples is None:
            return None
        for sample in samples:
            if not sample.is_finished:
                t = sample.kv_transfer
                if t is not None and t.waiting and self.connector is not None:
                    self.connector.transport.discard(t.transfer_id)  # a handoff already here goes too
                self.scheduler.finish(sample, RequestStatus.FINISHED_ABORTED)
                self.counters.finished["abort"] += 1
        return self.outputs.output(request_id)

    def abandon_handoff(self, transfer_id: str, reason: str, recompute: bool = False) -> None:
        """A decode request's handoff will not come (the router saw its prefill fail): it stops
        waiting at its next step, and computes its prompt here (`recompute`, or the failure
        policy says so) or ends with the reason."""
        if self.connector is None:
            raise InvalidRequestError("this instance takes no KV handoffs (tensor parallelism)", "transfer_id")
        self.connector.abandon(transfer_id, reason, recompute)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (and nothing done) while requests hold blocks."""
        return self.kv_cache.reset_prefix_cache()

    # ---- one step ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; one output per user request the step moved on."""
        plan = self.scheduler.schedule()
        if self.read_step_shapes:
            self.last_step_shape = self._shape_of(plan)
        if plan.is_empty:
            self._count(plan, None)
            if not plan.arrived and self.scheduler.has_unfinished():
                time.sleep(0.001)  # only requests waiting for their KV: poll again soon, without taking a core
            return self.outputs.outputs(plan.arrived)  # first tokens that came with their KV, handoffs that failed
        if self.connector is not None:
            self.connector.start_step(plan)  # prefill requests of a handoff: their KV goes out as the layers run
        # each layer's K/V of a handoff go out as the layer is done
        batch, sampled = self.runner.execute_model(plan, self.connector.save_layer if self.connector is not None else None)
        update = self.scheduler.update_from_output(plan, sampled)
        self.scheduler.record_prompt_logprobs(batch.prompt_logprobs)
        if self.connector is not None:
            self.connector.end_step(plan, update.finished)
        self._count(plan, update)
        self._count_kv_reads(batch)
        return self.outputs.outputs([*plan.arrived, *update.sampled])

    def _shape_of(self, plan: SchedulerOutput):
        if plan.is_empty:
            return None
        runner = self.runner
        return shape_of(plan, self.config.block_size, runner.shared_prefix_rule if runner.shared_prefix_attention == "auto" else None)

    def record_step(self, seconds: float, arrivals: int = 0) -> None:
        """--step-log: the last step took `seconds` from its start to its outputs delivered (the
        caller times it, since delivering is the caller's part), while `arrivals` new requests
        were handled beside it; an empty step is not recorded."""
        if self.step_log is not None and self.last_step_shape is not None:
            shape = self.last_step_shape
            self.step_log.record(dataclasses.replace(shape, arrivals=arrivals) if arrivals else shape, seconds)
            self.last_step_shape = None

    def _count(self, plan: SchedulerOutput, update: StepUpdate | None) -> None:
        counters = self.counters
        for r in plan.arrived:  # first tokens that came with their KV, and handoffs that failed
            counters.generation_tokens += r.num_output_tokens
            if r.is_finished:
                counters.finished[r.status.value] += 1
        if update is None:
            return
        counters.steps += 1
        counters.computed_tokens += sum(s.num_new_tokens for s in plan.scheduled)
        counters.generation_tokens += len(update.sampled)
        for req in update.finished:
            counters.finished[req.status.value] += 1
            if self.step_log is not None:
                self.step_log.record_request(req)

    def _count_kv_reads(self, batch) -> None:
        meta, c_kv = batch.meta, self.layout.kv_bytes_per_position
        counters = self.counters
        counters.attention_kv_bytes_read_without_sharing += meta.kv_positions_read * c_kv
        counters.attention_kv_bytes_read += meta.kv_positions_read_with_sharing() * c_kv
        if meta.shared_prefix is not None:  # built only where the step's attention runs it
            counters.shared_prefix_steps += 1

    # ---- introspection -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def uses_cpu_kernels(self) -> bool:
        return self.kernels.ops is not None

    def release(self) -> None:
        """Let go of the model and the KV pool (a failed engine, before a new one is built);
        the engine cannot step afterwards. Counters and the tokenizer stay readable."""
        self.model = None
        self.runner = None
