"""Everything a plan is computed from, validated once (base units: bytes, seconds, FLOP/s).

A plan is a pure function of these inputs: change one field (`dataclasses.replace`)
and every dependent quantity is recomputed from scratch — the seed's §6 warning
against carrying a KV read time or a batch over from an old configuration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.errors import ConfigError
from kvserve.planner import checks
from kvserve.planner.hardware import Chip
from kvserve.planner.layout import KV_LAYOUTS, check_heads_layout
from kvserve.planner.models import PlannedModel

SHARED_PREFIX_READS = ("once", "per-request")


@dataclass(frozen=True)
class PlanInputs:
    model: PlannedModel
    chip: Chip
    num_chips: int = 1  # N
    bytes_per_weight: float = 2.0  # p_w (1 = int8)
    bytes_per_kv_element: float = 2.0  # p_kv
    kv_scale_bytes: float = 0.0  # s: a quantized KV cache's scale bytes per (position, KV head), each of K and V
    bytes_per_activation: float = 2.0  # p_a, what TP collectives move
    reserved_bytes_per_chip: float = 0.0  # R: workspace, activations, runtime
    kv_layout: str = "heads"
    exchange_s_per_step: float = 0.0  # Q/output reshuffle of the `requests` layout, all layers
    history_positions: int = 8192  # S: cached positions per request at the decode snapshot
    prompt_positions: int = 8192  # prefill length (and KV handed off when disaggregated)
    output_tokens: int = 512  # N_out, the first from prefill
    new_positions: int | None = None  # T for the attention-work section; default N_out − 1
    shared_prefix_positions: int = 0  # of S, shared exactly by every request in the batch
    # how a decode step reads that prefix: "once" (shared-prefix attention, the engine's
    # --shared-prefix-attention auto) or "per-request" (every request scans its whole history)
    shared_prefix_reads: str = "once"
    kv_block_positions: int = 16  # page size b; physical KV rounds each request up to whole blocks
    step_target_s: float = 0.05  # decode step (≈ ITL) target
    utilisation: float = 0.4  # η of prefill
    batch: int | None = None  # evaluate this decode batch instead of the largest meeting the target
    replica_chips: int | None = None  # chips per replica in the TP-vs-replicas comparison
    prefill_groups: int = 1  # G_p feeding one decode group
    handoff_bytes_per_s: float = 10e9  # link between prefill and decode pools
    target_rate_req_per_s: float | None = None  # for the handoff bandwidth needed
    arrival_rate_req_per_s: float | None = None  # for cost below full load
    # the engine format names p_w and p_kv came from (`--quantization`, `--kv-cache-dtype`); None: given as numbers
    weight_format: str | None = None
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, PlannedModel):
            raise ConfigError("model", f"must be a PlannedModel, got {type(self.model).__name__}")
        if not isinstance(self.chip, Chip):
            raise ConfigError("chip", f"must be a Chip, got {type(self.chip).__name__}")
        checks.integer("num_chips", self.num_chips, 1, 1_000_000)
        for field in ("bytes_per_weight", "bytes_per_kv_element", "bytes_per_activation"):
            checks.in_range(field, getattr(self, field), 0, 8, low_open=True)
        checks.in_range("kv_scale_bytes", self.kv_scale_bytes, 0, 64)
        checks.non_negative("reserved_bytes_per_chip", self.reserved_bytes_per_chip)
        if self.reserved_bytes_per_chip >= self.chip.hbm_bytes:
            raise ConfigError(
                "reserved_bytes_per_chip",
                f"must be below the chip's HBM ({self.chip.hbm_bytes:g} B), got {self.reserved_bytes_per_chip:g}",
            )
        checks.one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        checks.non_negative("exchange_s_per_step", self.exchange_s_per_step)
        checks.integer("history_positions", self.history_positions, 1)
        checks.integer("prompt_positions", self.prompt_positions, 1)
        checks.integer("output_tokens", self.output_tokens, 1)
        if self.new_positions is not None:
            checks.integer("new_positions", self.new_positions, 1)
        checks.integer("shared_prefix_positions", self.shared_prefix_positions, 0, self.history_positions)
        checks.one_of("shared_prefix_reads", self.shared_prefix_reads, SHARED_PREFIX_READS)
        checks.integer("kv_block_positions", self.kv_block_positions, 1)
        checks.positive("step_target_s", self.step_target_s)
        checks.in_range("utilisation", self.utilisation, 0, 1, low_open=True)
        if self.batch is not None:
            checks.integer("batch", self.batch, 1)
        if self.replica_chips is not None:
            checks.integer("replica_chips", self.replica_chips, 1, self.num_chips)
            if self.num_chips % self.replica_chips:
                raise ConfigError("replica_chips", f"must divide num_chips ({self.num_chips}), got {self.replica_chips}")
        checks.integer("prefill_groups", self.prefill_groups, 1)
        checks.positive("handoff_bytes_per_s", self.handoff_bytes_per_s)
        if self.target_rate_req_per_s is not None:
            checks.positive("target_rate_req_per_s", self.target_rate_req_per_s)
        if self.arrival_rate_req_per_s is not None:
            checks.positive("arrival_rate_req_per_s", self.arrival_rate_req_per_s)
        if self.kv_layout == "heads":
            check_heads_layout(self.num_chips, self.model.arch.num_heads, self.model.arch.num_kv_heads)

    @property
    def reads_shared_prefix_once(self) -> bool:
        return self.shared_prefix_reads == "once" and self.shared_prefix_positions > 0

    @property
    def attention_new_positions(self) -> int:
        return self.new_positions if self.new_positions is not None else max(self.output_tokens - 1, 1)

    def as_json(self) -> dict:
        data = asdict(self)
        data["model"] = self.model.as_json()
        data["chip"] = asdict(self.chip)
        return data
