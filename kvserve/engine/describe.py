"""What an engine is, in words and figures: the start-up report the server and the commands
print, its tensor-parallel line, and the step log's header (engine/step_log.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine


def describe(engine: LLMEngine) -> str:
    """The start-up report: model, dtype, KV pool size and c_kv, then which kernel runs each
    part of the model and why (KernelSupport), and each projection's linear method."""
    arch, layout, config = engine.arch, engine.layout, engine.config
    return (
        f"model {engine.model_name} ({arch.architecture}, {arch.num_layers} layers, "
        f"{arch.num_heads} query / {arch.num_kv_heads} KV heads, g={arch.queries_per_kv_head}) "
        f"dtype {str(engine.model.dtype).removeprefix('torch.')} on {config.torch_device}"
        f"{' (kvserve CPU kernels)' if engine.uses_cpu_kernels else ''}; "
        f"KV cache: {str(layout.kv_dtype).removeprefix('torch.')}"
        f"{' (fp32 scale per position and KV head)' if layout.quantized else ''}, "
        + (f"{layout.num_blocks} blocks x {layout.block_size} = {layout.num_tokens} tokens, " if layout.groups is None else
           f"{layout.num_blocks} blocks of {layout.block_size} positions x {layout.groups.layers_per_block} layers "
           f"(KV groups, below), ")
        + f"c_kv {layout.kv_bytes_per_position} bytes/position, {layout.nbytes / 2**20:.1f} MiB; "
        f"max_model_len {engine.max_model_len}; loaded in {engine.load_seconds:.1f}s"
        f"{' (cached weights)' if engine.loaded_from_cache else ''}\n"
        f"{tensor_parallel_line(engine)}{sliding_window_line(engine)}"
        + ("deterministic: every attention row through the decode kernel, projections in one summation order, "
           "shared-prefix attention off (docs/deterministic.md)\n" if config.deterministic else "")
        + f"{engine.kernels.describe()}\n{engine.model.describe_projections()}"
        + "".join(f"\n  note: {note}" for note in engine.format_notes)
    )


def sliding_window_line(engine: LLMEngine) -> str:
    """The layers that attend within a sliding window, c_kv per layer kind, and what the pool
    keeps of them: held to the window (engine/kv_groups.py), the capacity for a request of
    max_model_len and for short ones; else nothing."""
    windows = engine.arch.layer_windows
    sizes = sorted({w for w in windows if w is not None})
    if not sizes:
        return ""
    layout = engine.layout
    c_layer = layout.kv_bytes_per_position // len(windows)
    kinds = [(None, sum(w is None for w in windows))] + [(w, sum(x == w for x in windows)) for w in sizes]
    c_kv = ", ".join(f"{'global' if w is None else f'window {w}'} {n} layers {n * c_layer:,}" for w, n in kinds if n)
    line = f"sliding window: c_kv per layer kind (bytes/position): {c_kv}; "
    groups = layout.groups
    if groups is None:
        why = "the requests KV layout" if engine.requests_layout else f"--kv-role {engine.config.kv_role}"
        return line + f"the pool keeps every position's KV in every layer ({why}: KV moves by whole blocks)\n"
    n = engine.max_model_len
    held = groups.blocks_held(n, layout.block_size)
    return line + (
        f"KV held to the window: {groups.num_groups} KV groups ({groups.describe()}), blocks of "
        f"{layout.block_size} positions x {groups.layers_per_block} layers ({layout.block_bytes:,} bytes); "
        f"a request of {n} positions holds {held} blocks ({groups.positions_held(n):,} layer-positions), "
        f"{layout.requests_that_fit(n)} such requests fit; requests within the window: {layout.num_tokens} positions\n"
    )


def tensor_parallel_line(engine: LLMEngine) -> str:
    """Under tensor parallelism, this rank's share: heads, KV heads (and how many ranks hold
    each, or the requests layout's whole requests), FFN columns, vocabulary rows, weight
    bytes and c_kv per rank; else nothing."""
    sh = engine.shard
    if sh.world == 1:
        return ""
    c_kv = engine.layout.kv_bytes_per_position
    stored, resident = engine.model.stored_weight_bytes(), engine.model.weight_bytes()
    held = "" if resident == stored else f" ({resident:,} held, with the kernels' packed copies)"
    if engine.requests_layout:
        kv = (f"KV layout requests: all {engine.arch.num_kv_heads} KV heads of the requests placed on this rank "
              "(none replicated; Q and attention outputs exchanged per layer)")  # fmt: skip
    else:
        kv = (f"KV heads [{sh.kv_heads[0]}, {sh.kv_heads[1]}) (each held by {sh.kv_replication} rank"
              f"{'s' if sh.kv_replication > 1 else ''})")  # fmt: skip
    return (
        f"tensor parallel rank {sh.rank} of {sh.world}: query heads [{sh.q_heads[0]}, {sh.q_heads[1]}), {kv}, "
        f"FFN [{sh.ffn[0]}, {sh.ffn[1]}), vocabulary [{sh.vocab[0]}, {sh.vocab[1]}); "
        f"per rank: weights {stored:,} bytes{held}, KV {c_kv:,} bytes/position, "
        f"{c_kv * engine.max_model_len:,} bytes per request of max_model_len\n"
    )


def step_log_header(engine: LLMEngine) -> dict:
    """What a step model fitted from this engine's steps needs to know of it."""
    arch, config = engine.arch, engine.config
    return {
        "model": engine.model_name, "num_layers": arch.num_layers, "d_model": arch.hidden_size, "num_kv_heads": arch.num_kv_heads,
        "vocab_size": arch.vocab_size, "kv_bytes_per_position": engine.layout.kv_bytes_per_position,
        "model_len": engine.context_len, "max_model_len": engine.max_model_len,
        "num_kv_positions": engine.layout.num_tokens, "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens, "dtype": str(config.torch_dtype).removeprefix("torch."),
        "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
        "threads": torch.get_num_threads(),
        # sliding windows held by the pool (engine/kv_groups.py): the simulator holds them too
        "layer_windows": list(arch.layer_windows) if engine.layout.groups is not None else [],
    }  # fmt: skip
