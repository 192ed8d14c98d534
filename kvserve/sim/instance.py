"""One simulated kvserve instance: the engine's real Scheduler and KVCacheManager on modelled time.

Nothing of the scheduling policy is re-implemented here. The instance builds the same
`Scheduler` (token budget, chunked prefill, preemption by recompute, prefix caching through
`KVCacheManager`, the connector's allocate-before-receive for a decode instance) and feeds
it what a step would have produced: a token for every sampling row, at the time the step
model says the step ends. The scheduler's clock is the simulator's, so every timestamp a
request collects (first scheduled, tokens, finished) is modelled time.
"""

from __future__ import annotations

import dataclasses

from kvserve.attention.shared_prefix_plan import SharedPrefixRule
from kvserve.config import EngineConfig, parse_bytes
from kvserve.disagg.connector import KVTransferParams
from kvserve.disagg.handoff import KVHandoff
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.kv_groups import KVGroups
from kvserve.engine.request import Request
from kvserve.engine.sampler import SamplerOutput
from kvserve.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
from kvserve.errors import ConfigError
from kvserve.sampling_params import SamplingParams
from kvserve.sim.step_model import StepTimeModel, TensorParallel
from kvserve.engine.step_shape import StepShape, shape_of

SAMPLED_TOKEN = 1  # what every simulated step samples: requests run with ignore_eos to their length


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """The engine flags that shape scheduling, as `kvserve serve` takes them."""

    kv_cache_memory: int | str = "1GiB"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    shared_prefix_attention: str = "auto"
    shared_prefix_min_positions: int = 1024
    shared_prefix_min_group: int = 16
    max_model_len: int | None = None

    def engine_config(self) -> EngineConfig:
        """Validated as the engine validates them (the CPU device: nothing here is placed on it)."""
        return EngineConfig(
            kv_cache_memory=self.kv_cache_memory, block_size=self.block_size, device="cpu",
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold, enable_prefix_caching=self.enable_prefix_caching,
            shared_prefix_attention=self.shared_prefix_attention, shared_prefix_min_positions=self.shared_prefix_min_positions,
            shared_prefix_min_group=self.shared_prefix_min_group,
        )  # fmt: skip


class SimConnector:
    """The scheduler half of the KV connector (disagg/connector.py) for a simulated decode
    instance: a handoff arrives when the simulator says its link has delivered it."""

    failure = "recompute"

    def __init__(self):
        self._delivered: dict[str, bool] = {}

    def deliver(self, transfer_id: str) -> None:
        self._delivered[transfer_id] = True

    def get_num_new_matched_tokens(self, request, num_computed: int) -> int:
        t = request.kv_transfer
        return request.num_prompt_tokens - num_computed if t is not None and t.waiting else 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_computed: int) -> None:
        request.kv_transfer.allocated = True

    def request_waits(self, request) -> bool:
        t = request.kv_transfer
        if t is None or not t.waiting or t.arrived is not None:
            return False
        if not self._delivered.pop(t.transfer_id, False):
            return True
        t.arrived = KVHandoff(request.prompt_token_ids, SAMPLED_TOKEN, kv=None)
        t.loaded = t.into_blocks = True
        return False

    def request_released(self, request) -> None:
        self._delivered.pop(request.kv_transfer.transfer_id, None)


class SimInstance:
    def __init__(self, name: str, role: str, spec: InstanceSpec, model: StepTimeModel, tp: TensorParallel,
                 kv_bytes_per_position: float, model_len: int, clock):  # fmt: skip
        self.name, self.role, self.model, self.tp = name, role, model, tp
        self.config = config = spec.engine_config()
        memory = parse_bytes("kv_cache_memory", spec.kv_cache_memory)
        # the engine's pool: as many blocks as the memory holds at c_kv per position (model_runner.plan_kv_pool);
        # under tensor parallelism each rank holds its KV heads' share of every position (past N_kv ranks, one head).
        # Sliding-window layers held to their window as the engine holds them (one instance, no handoffs):
        # blocks of U layer slots in KV groups (engine/kv_groups.py)
        groups = None
        per_block = kv_bytes_per_position * config.block_size
        if model.layer_windows and role == "both":
            groups = KVGroups.for_windows(model.layer_windows)
            per_block = per_block * groups.layers_per_block / groups.num_layers
        num_blocks = int(memory * tp.attention_split(model) // per_block)
        if num_blocks < 1:
            raise ConfigError("kv_cache_memory", f"{memory} bytes hold no block of {config.block_size} positions")
        fits = num_blocks * config.block_size
        if groups is not None:
            chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or config.max_num_batched_tokens)
            fits = groups.max_request_positions(num_blocks, config.block_size, chunk)
        self.max_model_len = min(model_len, fits, spec.max_model_len or model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, groups=groups)
        self.connector = SimConnector() if role == "decode" else None
        self.scheduler = Scheduler(config, self.kv, self.connector, clock=clock)
        self.rule = SharedPrefixRule(
            min_shared_blocks=-(-config.shared_prefix_min_positions // config.block_size), min_group_size=config.shared_prefix_min_group
        ) if config.shared_prefix_attention == "auto" else None  # fmt: skip
        self.step: SchedulerOutput | None = None  # the step in flight
        self.step_started = 0.0
        self.step_ends = 0.0
        self.step_version = 0  # moves on when the step in flight is lengthened (a request arrived meanwhile)
        self.busy_s = 0.0
        self.steps = 0
        self.max_running = 0

    @property
    def busy(self) -> bool:
        return self.step is not None

    def add(self, request_id: str, prompt: list[int], output_len: int, arrival_s: float, transfer_id: str | None = None) -> Request:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        request = Request(request_id, prompt, params, arrival_time=arrival_s, block_size=self.config.block_size,
                          max_model_len=self.max_model_len)  # fmt: skip
        if transfer_id is not None:
            request.kv_transfer = KVTransferParams(transfer_id, do_remote_prefill=True, request_id=request_id, since=arrival_s)
        self.scheduler.add_request(request)
        return request

    def start_step(self, now: float) -> tuple[list[Request], float | None, StepShape | None]:
        """Schedule a step if there is work: (requests whose KV arrived or failed at schedule
        time, the step's modelled seconds or None if nothing runs, its shape)."""
        if self.step is not None or not self.scheduler.has_unfinished():
            return [], None, None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return plan.arrived, None, None
        shape = shape_of(plan, self.config.block_size, self.rule)
        seconds = self.tp.step_s(self.model, shape)
        self.step, self.step_started, self.step_ends = plan, now, now + seconds
        self.step_version += 1
        self.max_running = max(self.max_running, len(self.scheduler.running))
        return plan.arrived, seconds, shape

    def lengthen_step(self, seconds: float) -> None:
        """A request arrived while the step runs: the server's event loop takes its share of the cores."""
        self.step_ends += seconds
        self.step_version += 1

    def finish_step(self, now: float) -> StepUpdate:
        plan, self.step = self.step, None
        n = len(plan.sampling)
        sampled = SamplerOutput([SAMPLED_TOKEN] * n, [None] * n, [None] * n) if n else None
        self.busy_s += now - self.step_started
        self.steps += 1
        return self.scheduler.update_from_output(plan, sampled)

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)
