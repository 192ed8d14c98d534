"""Engine configuration, validated once at the edge; inner code trusts it."""

from __future__ import annotations

import dataclasses
import re

import torch

from kvserve.errors import ConfigError
from kvserve.kernels.isa import cpu_supports_bf16

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(field: str, value: str | int) -> int:
    """'1GiB', '512MiB', '2e9'/'2000000000' → bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        try:
            return int(float(value))
        except ValueError:
            raise ConfigError(field, f"expected a size in bytes such as 1GiB or 512MiB, got {value!r}") from None
    number, unit = match.groups()
    unit = (unit or "").lower().rstrip("b")
    return int(float(number) * _UNITS[unit])


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but torch sees no CUDA device")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError("device", f"must be auto, cpu or cuda[:N], got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, kernel_level: str | None = None) -> torch.dtype:
    """`kernel_level`: the ISA level kvserve's CPU kernels run at here (None: they don't)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        # bf16 halves the weight bytes read per decode step: wherever a kernel level runs (its
        # kernels widen bf16 in registers, AVX2 included) or the CPU computes bf16 natively
        return torch.bfloat16 if kernel_level is not None or cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError("dtype", f"must be auto, bfloat16, float16 or float32, got {dtype!r}")
    return _DTYPES[dtype]


QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
KV_LAYOUTS = ("heads", "requests")
KV_ROLES = ("both", "prefill", "decode")  # the planner's --kv-layout names the same two (planner/layout.py)
SHARED_PREFIX_ATTENTION = ("auto", "off")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pools' element type. int8 works with every model dtype (the pools are quantized
    on write and dequantized on read, in plain torch on any device; a float32 model's int8
    path is the reference for the kernels). A float pool must be the model's own dtype: the
    attention reads it with the queries' dtype, and nothing converts between them."""
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "bfloat16" and model_dtype != torch.bfloat16:
        raise ConfigError(
            "kv_cache_dtype",
            f"bfloat16 needs a bfloat16 model, this one runs {str(model_dtype).removeprefix('torch.')} "
            "(use auto for a KV cache in the model's dtype, or int8)",
        )
    return model_dtype


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None  # None = the default model
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory: int | str = "1GiB"  # bytes of K/V pool
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # running requests at most
    long_prefill_token_threshold: int = 0  # cap on one prompt's chunk per step; 0 = none
    enable_prefix_caching: bool = True
    # record vLLM's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) for routers (engine/kv_events.py)
    enable_kv_cache_events: bool = False
    max_waiting_requests: int = 0  # samples (n counts n) not yet started; 0 = unbounded
    # prompt tokens of requests not yet started; None = derived (AsyncLLMEngine), 0 = unbounded
    max_waiting_tokens: int | None = None
    num_threads: int = 0  # torch intra-op threads (per rank under tensor parallelism); 0 = torch's default
    # ranks of one model (distributed/): one process each over torch.distributed (gloo on CPU,
    # NCCL on CUDA); started here on one host, or by torchrun across hosts (env://)
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 120.0  # a collective waiting longer fails: a dead or hung rank
    # auto: AllReduce through shared memory when every rank is on this host (else gloo/NCCL); gloo: always the backend
    tensor_parallel_allreduce: str = "auto"
    # where KV lives under tensor parallelism (seed §5): heads = each rank keeps its query heads'
    # KV heads for every request; requests = each rank keeps every KV head of its share of the
    # requests (no replication), Q and attention outputs moved by all-to-all every layer
    kv_layout: str = "heads"
    # prefill/decode disaggregation (disagg/): which halves of a handoff this instance takes
    # (both: either, per request; prefill: only sends; decode: only receives), what a failed
    # or late handoff does on the decode side, and how long it may take to arrive
    kv_role: str = "both"
    kv_transfer_failure: str = "recompute"
    kv_transfer_timeout_s: float = 60.0
    # how handoffs travel (disagg/): shm = files in /dev/shm (instances on one host); torch =
    # torch.distributed point-to-point over gloo (between hosts), the decode side listening at
    # kv_transfer_listen (HOST:PORT; port 0 = any free one)
    kv_transport: str = "shm"
    kv_transfer_listen: str | None = None
    cpu_kernels: bool = True  # use kvserve's C++ CPU kernels where they can be built
    # the kernels' ISA level (kvserve/kernels/isa.py): None = $KVSERVE_CPU_ISA, else the CPU's highest
    cpu_isa: str | None = None
    prepack_weights: bool = True  # CPU bf16: pack projections for their kernels (KernelSupport.plan_projection)
    # weight format: auto = a GGUF's quantized tensors in their own format, float weights in
    # `dtype`; int8 / int4 = quantize float weights at load; none = dequantize everything
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; bfloat16; int8 (scales per position and KV head)
    # auto: decode requests whose block tables start with the same cached blocks read that
    # shared prefix once per group where the rule says so (kvserve/attention/shared_prefix_plan.py); off: never
    shared_prefix_attention: str = "auto"
    # the rule's thresholds: a shared level shorter than this many positions, or shared by
    # fewer requests, is read per request. Measured on AMD Zen 4 (2 cores, the default model,
    # decode steps alternating off/on in one run, step time off / on; issue 17's note): with
    # the plan inside the fused decode step, 16 requests gain from 1,024 positions (512: 1.01,
    # 1,024: 1.09, 2,048: 1.12; 4 x 16 x 1,024: 1.11); 2 to 8 requests lose at every length
    # (0.84-1.01): a group's n·g query rows fill 16-lane vectors, so few rows waste lanes,
    # and the shared read saved is small
    shared_prefix_min_positions: int = 1024
    shared_prefix_min_group: int = 16
    # a request's tokens never depend on what else is in the batch, on how its prompt was
    # chunked, on prefix-cache hits or on preemption: every attention row through the decode
    # kernel (one KV order, one softmax accumulation), every projection on a kernel whose sums
    # have one order for every row count, shared-prefix attention off (docs/deterministic.md)
    deterministic: bool = False
    # a JSONL file to append every step's shape and duration to (kvserve/engine/step_log.py), for
    # fitting the simulator's step model from real serving; None: not recorded
    step_log: str | None = None

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes("kv_cache_memory", self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory", f"must be > 0 bytes, got {self.kv_cache_memory}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError("block_size", f"must be a power of two in [1, 256], got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold", f"must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests", f"must be >= 0, got {self.max_waiting_requests}")
        if self.max_waiting_tokens is not None and self.max_waiting_tokens < 0:
            raise ConfigError("max_waiting_tokens", f"must be >= 0, got {self.max_waiting_tokens}")
        if self.num_threads < 0:
            raise ConfigError("num_threads", f"must be >= 0, got {self.num_threads}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_allreduce not in ("auto", "gloo"):
            raise ConfigError("tensor_parallel_allreduce", f"must be auto or gloo, got {self.tensor_parallel_allreduce!r}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_transfer_failure not in ("recompute", "fail"):
            raise ConfigError("kv_transfer_failure", f"must be recompute or fail, got {self.kv_transfer_failure!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ConfigError("kv_transfer_timeout_s", f"must be > 0 seconds, got {self.kv_transfer_timeout_s}")
        if self.kv_transport not in ("shm", "torch"):
            raise ConfigError("kv_transport", f"must be shm or torch, got {self.kv_transport!r}")
        if self.kv_transfer_listen is not None:
            host, _, port = self.kv_transfer_listen.rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ConfigError("kv_transfer_listen", f"expected HOST:PORT, got {self.kv_transfer_listen!r}")
        if self.kv_role != "both" and self.tensor_parallel_size > 1:
            raise ConfigError("kv_role", "prefill/decode roles under tensor parallelism are not supported yet")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError("kv_layout", f"must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if not self.distributed_timeout_s > 0:
            raise ConfigError("distributed_timeout_s", f"must be > 0 seconds, got {self.distributed_timeout_s}")
        self.torch_device = resolve_device(self.device)
        # the level the kernels run at (None where they don't): a level this CPU lacks is refused here
        self.kernel_level = None
        if self.cpu_kernels and self.torch_device.type == "cpu":
            from kvserve.kernels import kernels_disabled
            from kvserve.kernels.isa import chosen_level

            self.kernel_level = None if kernels_disabled() else chosen_level(self.cpu_isa)
        elif self.cpu_isa:
            from kvserve.kernels.isa import check_level

            check_level(self.cpu_isa, "cpu_isa")
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device, self.kernel_level)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.shared_prefix_attention not in SHARED_PREFIX_ATTENTION:
            raise ConfigError(
                "shared_prefix_attention",
                f"must be one of {', '.join(SHARED_PREFIX_ATTENTION)}, got {self.shared_prefix_attention!r}",
            )
        if not isinstance(self.deterministic, bool):
            raise ConfigError("deterministic", f"must be true or false, got {self.deterministic!r}")
        if self.deterministic:
            if not self.cpu_kernels:
                raise ConfigError("deterministic", "needs the CPU kernels (--cpu-kernels): the plain-torch path's matmuls "
                                  "choose their summation order by row count")  # fmt: skip
            if self.tensor_parallel_size > 1:
                raise ConfigError("deterministic", "is not built for tensor parallelism yet (docs/distributed.md says what TP changes in the bits)")
        for field, lo in (("shared_prefix_min_positions", 1), ("shared_prefix_min_group", 2)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(field, f"must be an integer >= {lo}, got {value!r}")
        if self.quantization in ("int8", "int4") and self.torch_dtype == torch.float32:
            # auto resolves to float32 only where no kernel level runs and torch has no bf16 matmuls
            why = ("--dtype auto is float32 here (no CPU kernels, and no bf16 matmuls on this CPU)" if self.dtype == "auto"
                   else "--dtype float32 is the float reference path")
            raise ConfigError(
                "quantization",
                f"{self.quantization} computes with bf16 activations; {why} (use --quantization auto or none with it)",
            )
        self.torch_kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)
