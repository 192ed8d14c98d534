"""This rank's share of the model, ready to run: loaded, sharded, its KV pool laid out, its
kernels chosen, its runner built.

Rank 0's engine (engine/engine.py) and every other tensor-parallel rank (engine/tp_worker.py)
build it the same way, so the ranks hold matching shares of every layer; the last step of the
build checks that they do. In one process the share is the whole model.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from kvserve.attention.shared_prefix_plan import SharedPrefixRule
from kvserve.config import EngineConfig
from kvserve.distributed.fingerprint import model_fingerprint
from kvserve.distributed.launch import check_ranks_agree
from kvserve.distributed.request_layout import RequestHeads
from kvserve.distributed.sharding import TensorParallelShard, plan_shard
from kvserve.engine.kv_groups import KVGroups
from kvserve.engine.model_runner import KVPoolLayout, ModelRunner, plan_kv_pool
from kvserve.errors import ConfigError
from kvserve.kernels.support import KernelSupport
from kvserve.memory import release_free_memory, tune_malloc
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.quantization import resolve_quantization
from kvserve.model.shard_weights import shard_weights

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelShare:
    loaded: LoadedModel  # name, architecture, tokenizer, notes, ... (its weights now the model's)
    shard: TensorParallelShard  # this rank's heads, KV heads, FFN columns and vocabulary rows
    requests_layout: bool  # --kv-layout requests: this rank's pool holds whole requests (all KV heads)
    layout: KVPoolLayout
    context_len: int  # the longest context, before the pool caps it
    max_model_len: int  # ... and after: one request always fits the pool alone
    kernels: KernelSupport
    model: LlamaForCausalLM
    runner: ModelRunner


def use_process_settings(config: EngineConfig) -> None:
    """Threads and malloc thresholds, before anything is loaded."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif config.tensor_parallel_size > 1:
        # the ranks of one host share its cores: more threads than cores make every
        # AllReduce wait on a rank whose threads are descheduled
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    tune_malloc()  # before the weights are loaded: every later buffer follows the same rule


def build_model_share(config: EngineConfig, tp, loaded: LoadedModel | None, tp_notes: list[str]) -> ModelShare:
    """`tp`: this process's TensorParallelGroup (None: one process). `loaded`: weights already
    loaded (else `config.model` is loaded here). `tp_notes`: start-up notes on the group."""
    ops = None
    if config.cpu_kernels and config.torch_device.type == "cpu":
        from kvserve.kernels import cpu_ops

        ops = cpu_ops(config.kernel_level) if config.kernel_level else None
        if tp is not None and ops is not None:
            tp_notes.append("tensor parallel: each rank runs the CPU kernels on its share, layer by layer "
                            "(the fused all-layers step has no AllReduce between layers)")  # fmt: skip
    if loaded is None:
        # the weights' format depends on what this machine can run, so it is settled first
        notes: list[str] = list(tp_notes)
        quant_kernel = KernelSupport.quant_linear_choice(config.torch_dtype, config.torch_device, ops)
        mode = resolve_quantization(config.quantization, quant_kernel, notes)
        loaded = load_model(config.model, config.torch_dtype, mode)
        loaded.notes[:0] = notes
    for note in loaded.notes:
        logger.info("weights: %s", note)
    arch = loaded.arch
    # this rank's share of the model (the whole of it in one process): its layers' heads
    # and FFN columns, the KV heads its pool holds, its rows of the vocabulary
    rank, world = (tp.rank, tp.world) if tp is not None else (0, 1)
    shard = plan_shard(arch, rank, world)
    shard_weights(loaded.weights, arch, shard)
    local_arch = shard.local_arch(arch)
    # the requests KV layout: this rank's pool holds every KV head of the requests placed
    # on it, and its attention runs with all heads (distributed/request_layout.py)
    requests_layout = config.kv_layout == "requests" and world > 1
    attention_arch = dataclasses.replace(local_arch, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads) \
        if requests_layout else local_arch  # fmt: skip

    layout = plan_kv_pool(attention_arch, config.torch_kv_dtype, config.kv_cache_memory, config.block_size,
                          kv_groups(config, arch, requests_layout))  # fmt: skip
    context_len = _context_len(config, arch, layout)
    # one request must always fit the pool alone, so preemption can always make progress
    max_model_len = min(context_len, layout.max_request_positions(_chunk_bound(config)))
    # which kernel runs each part of this model, decided once; the model only follows it
    kernels = KernelSupport.decide(
        attention_arch, config.torch_dtype, config.torch_device, ops, config.prepack_weights, kv_dtype=layout.kv_dtype,
        deterministic=config.deterministic,
    )
    shards = [plan_shard(arch, r, world) for r in range(world)]
    model = LlamaForCausalLM(
        local_arch, loaded.weights, max_positions=max_model_len + 1, kernels=kernels, tp=tp,
        vocab=shard.vocab, vocab_sizes=[s.vocab[1] - s.vocab[0] for s in shards],
        request_heads=RequestHeads.from_shards(shards, arch.num_heads, arch.num_kv_heads, arch.head_dim)
        if requests_layout else None, kv_replication=shard.kv_replication,
    )  # fmt: skip
    loaded.weights.clear()
    release_free_memory()  # the load's freed transients, before the pools are allocated
    model = model.to(config.torch_device)
    model.process_weights_after_loading()
    if config.deterministic:
        _check_deterministic(kernels, model)
    rule = SharedPrefixRule(
        min_shared_blocks=-(-config.shared_prefix_min_positions // config.block_size), min_group_size=config.shared_prefix_min_group
    )
    runner = ModelRunner(
        # --deterministic: a decode row read in parts (shared prefix, then suffix, merged) has other bits than read whole
        model, layout, config.torch_device, "off" if config.deterministic else config.shared_prefix_attention, rule,
        tp, pool_kv_heads=arch.num_kv_heads if requests_layout else None, deterministic=config.deterministic,
    )  # fmt: skip
    share = ModelShare(loaded, shard, requests_layout, layout, context_len, max_model_len, kernels, model, runner)
    if tp is not None:
        check_ranks_agree(tp, _what_ranks_agree_on(config, share))
    return share


def kv_groups(config: EngineConfig, arch, requests_layout: bool) -> KVGroups | None:
    """The pool's KV groups (engine/kv_groups.py): sliding-window layers held to their window,
    for one process or the heads layout of tensor parallelism; None (every position kept) under
    the requests layout and for an instance of a prefill/decode pair, whose KV moves between
    pools by whole blocks of every layer."""
    if not any(w is not None for w in arch.layer_windows) or requests_layout or config.kv_role != "both":
        return None
    return KVGroups.for_windows(arch.layer_windows)


def _chunk_bound(config: EngineConfig) -> int:
    """The most positions one request computes in a step (the scheduler's chunk)."""
    threshold = config.long_prefill_token_threshold or config.max_num_batched_tokens
    return min(config.max_num_batched_tokens, threshold)


def _context_len(config: EngineConfig, arch, layout: KVPoolLayout) -> int:
    """The longest context served: the model's (dynamic NTK's original context), or
    max_model_len if it fits. A sliding window does not cap it: those layers attend within
    their window however long the sequence (attention/sliding_window.py)."""
    if layout.num_blocks < 1:
        need = layout.kv_bytes_per_position * config.block_size
        raise ConfigError("kv_cache_memory", f"{config.kv_cache_memory} bytes hold no block; at least {need} needed")
    model_len = arch.max_position_embeddings
    scaling = arch.rope_scaling
    if scaling.rope_type == "dynamic" and scaling.original_max_position_embeddings < model_len:
        # dynamic NTK rescales RoPE's base once a sequence passes the original context, by its
        # length: K already cached would need rotating again. Up to there it is plain RoPE
        model_len = scaling.original_max_position_embeddings
    if config.max_model_len is None:
        return model_len
    if config.max_model_len > model_len:
        raise ConfigError("max_model_len", f"{config.max_model_len} exceeds the model's context of {model_len}")
    fits = layout.max_request_positions(_chunk_bound(config))
    if config.max_model_len > fits:
        raise ConfigError(
            "max_model_len",
            f"{config.max_model_len} positions do not fit the KV pool, which holds a request of {fits} at most "
            f"({config.kv_cache_memory} bytes); raise kv_cache_memory or lower max_model_len",
        )
    return config.max_model_len


def _check_deterministic(kernels: KernelSupport, model: LlamaForCausalLM) -> None:
    """--deterministic holds only where every path a row can take sums in one order: the
    decode attention kernel (every attention row goes through it) and batch-invariant
    projections. Anything else is refused, named, rather than silently not deterministic."""
    problems = []
    if not kernels.decode_attention.enabled:
        problems.append(f"the decode attention kernel is off ({kernels.decode_attention.reason})")
    odd = sorted({kind for kind, lins in model.projection_kinds().items() for lin in lins
                  if not lin.method.batch_invariant(lin)})  # fmt: skip
    if odd:
        problems.append(f"these projections run where the summation order depends on the row count: {', '.join(odd)} "
                        "(off the kernels' tile grid, or not bf16/quantized)")  # fmt: skip
    if problems:
        raise ConfigError("deterministic", "cannot hold for this model here: " + "; ".join(problems))


def _what_ranks_agree_on(config: EngineConfig, share: ModelShare) -> dict:
    c, loaded, layout = config, share.loaded, share.layout
    return {
        "model": str(loaded.name), "model files": model_fingerprint(loaded.source), "arch": loaded.arch,
        "dtype": str(c.torch_dtype), "kv_dtype": str(layout.kv_dtype),
        "blocks": layout.num_blocks, "block_size": c.block_size, "max_model_len": share.max_model_len,
        "prefix_caching": c.enable_prefix_caching, "shared_prefix_attention": c.shared_prefix_attention, "kv_layout": c.kv_layout,
    }  # fmt: skip
