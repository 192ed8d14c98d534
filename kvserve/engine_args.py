"""Command-line flags of the engine, shared by `serve`, `chat`, `generate` and `bench`."""

from __future__ import annotations

import argparse

from kvserve.kernels.isa import LEVELS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 where a kernel level runs or the CPU has it), bfloat16, float16, float32")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    g.add_argument("--kv-cache-memory", default="1GiB", help="bytes for the paged KV pool, e.g. 512MiB, 2GiB")
    g.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model context, capped by the pool)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most running requests")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, help="cap on one prompt's chunk per step (0 = none)")
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV of shared prompt prefixes"
    )
    g.add_argument("--enable-kv-cache-events", action="store_true",
                   help="record vLLM's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared); the server serves them at /v1/kv_events")
    g.add_argument("--threads", type=int, default=0, help="torch threads, per rank (0 = torch's default)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of one model over torch.distributed (gloo on CPU): started here on one host, or by torchrun")
    g.add_argument("--tp-allreduce", choices=["auto", "gloo"], default="auto",
                   help="auto: AllReduce through shared memory when every rank is on this host; gloo: the backend's always")
    g.add_argument("--kv-layout", choices=["heads", "requests"], default="heads",
                   help="under tensor parallelism: heads = each rank keeps its heads' KV for every request; requests = "
                        "each rank keeps whole requests' KV (no replication), Q and attention outputs exchanged per layer")
    g.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="seconds a collective may wait before a rank counts as dead (default 120)")
    g.add_argument(
        "--cpu-kernels", action=argparse.BooleanOptionalAction, default=True, help="kvserve's C++ CPU kernels where they build"
    )
    g.add_argument(
        "--cpu-isa", choices=LEVELS, default=None, metavar="LEVEL",
        help=f"run the CPU kernels at this ISA level ({', '.join(LEVELS)}) instead of the CPU's highest "
        "(also $KVSERVE_CPU_ISA); a level the CPU lacks is an error",
    )
    g.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU bf16: pack each projection for its kernels (AMX tiles up to 1024 rows and oneDNN's layout past that; "
        "without AMX a VNNI-tile copy for the GEMV and oneDNN's for the rest, and the row-major weight goes); "
        "--no-prepack-weights keeps only the row-major weights",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="a request's tokens never depend on the batch, chunking, prefix-cache hits or preemption: every attention "
        "row through the decode kernel, projections with one summation order (costs prefill speed; docs/deterministic.md)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weight format: auto (a GGUF's quantized tensors run in their own format, float weights in --dtype), "
        "int8 / int4 (quantize float weights at load), none (dequantize everything to --dtype)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "int8"],
        help="KV cache element type: auto (the model's dtype), bfloat16, int8 (a scale per position and KV head)",
    )
    g.add_argument(
        "--shared-prefix-attention",
        default="auto",
        choices=["auto", "off"],
        help="auto: decode requests sharing cached prefix blocks read that prefix once per group, where the cost rule "
        "says so (the parts merged through their log-sum-exp); off: every request reads its whole history",
    )
    g.add_argument(
        "--shared-prefix-min-positions",
        type=int,
        default=1024,
        help="shortest shared prefix read once per group (default 1024; shorter ones are read per request)",
    )
    g.add_argument(
        "--shared-prefix-min-group",
        type=int,
        default=16,
        help="fewest requests sharing a prefix for it to be read once (default 16)",
    )
    g.add_argument(
        "--step-log",
        metavar="FILE",
        default=None,
        help="append every step's shape and duration to FILE as JSON lines (what `kvserve plan calibrate --engine` "
        "fits the simulator's step model from)",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides):
    from kvserve.config import EngineConfig  # imports torch: only once a command runs

    values = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_kv_cache_events=getattr(args, "enable_kv_cache_events", False),
        num_threads=args.threads,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        distributed_timeout_s=getattr(args, "distributed_timeout", 120.0),
        tensor_parallel_allreduce=getattr(args, "tp_allreduce", "auto"),
        kv_layout=getattr(args, "kv_layout", "heads"),
        cpu_kernels=args.cpu_kernels,
        cpu_isa=getattr(args, "cpu_isa", None),
        prepack_weights=args.prepack_weights,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        shared_prefix_attention=getattr(args, "shared_prefix_attention", "auto"),
        shared_prefix_min_positions=getattr(args, "shared_prefix_min_positions", 1024),
        shared_prefix_min_group=getattr(args, "shared_prefix_min_group", 16),
        deterministic=getattr(args, "deterministic", False),
        step_log=getattr(args, "step_log", None),
    )
    values.update(overrides)
    return EngineConfig(**values)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )
