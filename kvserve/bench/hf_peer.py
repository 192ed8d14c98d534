"""transformers as a peer engine on the same workload: its static batched `generate` and
its continuous-batching `generate_batch`.

Each peer runs in its own process (`python -m kvserve.bench.hf_peer SPEC OUT`), so its
peak RSS is its own. The model is the same weights kvserve runs: an HF directory loads
through `from_pretrained`; a GGUF (the default model) is built from kvserve's converted
weights, already in HF naming, which is fast (transformers' own GGUF path dequantizes
for ~25 s). Timed runs follow one untimed warm-up on small requests.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.workload import Workload

MODES = ("generate", "generate_batch")


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB.

    Linux's VmHWM belongs to the current address space. ru_maxrss would not do for a
    child: it carries the parent's peak across fork and exec, so every peer would report
    at least the kvserve run's memory.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _config_for(arch):
    from transformers import LlamaConfig, MistralConfig

    if arch.rope_scaling.rope_type != "default" or arch.architecture not in ("llama", "mistral"):
        raise ValueError(
            f"the transformers peer builds GGUF models of llama/mistral with default RoPE only, not "
            f"{arch.architecture} with {arch.rope_scaling.rope_type} RoPE; give an HF directory instead"
        )
    cls = LlamaConfig if arch.architecture == "llama" else MistralConfig
    extra = {"sliding_window": arch.sliding_window} if arch.architecture == "mistral" else {}
    return cls(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.attention_bias, bos_token_id=arch.bos_token_id,
        eos_token_id=list(arch.eos_token_ids) or None, **extra,
    )


def build_model(model: str | None, dtype: torch.dtype):
    """(transformers model in eval mode, kvserve architecture) for a kvserve model argument."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, MistralForCausalLM

    from kvserve.model.loader import load_model, resolve_model

    _, path = resolve_model(model)
    if path.is_dir():
        from kvserve.model.hf_loader import read_architecture

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return hf.eval(), read_architecture(path)
    loaded = load_model(model, dtype)
    config = _config_for(loaded.arch)
    cls = LlamaForCausalLM if loaded.arch.architecture == "llama" else MistralForCausalLM
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: random init is only slower
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        # _from_config with a dtype keeps the RoPE frequencies in fp32, as from_pretrained does
        hf = cls._from_config(config, dtype=dtype)
    result = hf.load_state_dict(loaded.weights, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if loaded.arch.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not match transformers' model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:3]}")
    hf.tie_weights()
    return hf.eval(), loaded.arch


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def run_static_generate(hf, arch, workload: Workload, batch_size: int) -> dict[str, Any]:
    """Batches of `batch_size` prompts, left-padded; every row generates the batch's longest
    output (min_new_tokens = max_new_tokens, so EOS cannot end it early)."""
    from transformers import GenerationConfig

    pad_id = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    generated = 0
    elapsed_s = 0.0
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[first:first + batch_size]
        new_tokens = max(workload.output_lens[first:first + batch_size])
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=pad_id, eos_token_id=list(arch.eos_token_ids) or None)
        ids, mask = _left_padded(prompts, pad_id)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        elapsed_s += time.perf_counter() - start
        generated += (out.shape[1] - ids.shape[1]) * len(prompts)
    return {"elapsed_s": elapsed_s, "generated_tokens": generated, "batch_size": batch_size}


def _cb_config(workload: Workload, max_batch_tokens: int):
    """Left alone, transformers sizes its KV cache to 90% of free memory (all of RAM on a
    CPU). Give it kvserve's token budget per step and room for the whole workload at once,
    as kvserve's pool has."""
    from transformers import ContinuousBatchingConfig

    page_size = ContinuousBatchingConfig.page_size
    blocks = sum(-(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens))
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max_batch_tokens)


def run_generate_batch(hf, workload: Workload, max_batch_tokens: int) -> dict[str, Any]:
    """transformers' continuous batching. Equal output lengths go through `generate_batch`
    itself; unequal ones through the manager it wraps, which takes a length per request."""
    from transformers import GenerationConfig

    # eos_token_id=-1 disables EOS in continuous batching: exact output lengths
    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1)
    cb_config = _cb_config(workload, max_batch_tokens)
    start = time.perf_counter()
    if len(set(workload.output_lens)) == 1:
        results = list(hf.generate_batch(inputs=workload.prompts, generation_config=config,
                                         continuous_batching_config=cb_config).values())
    else:
        results = []
        with hf.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                    block=True, timeout=5) as manager:
            for prompt, n in zip(workload.prompts, workload.output_lens):
                manager.add_request(input_ids=prompt, max_new_tokens=n, eos_token_id=-1)
            while len(results) < workload.num_requests:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results.append(result)
                elif result is None and not manager.is_running():
                    break
    wall_s = time.perf_counter() - start
    failed = [r.error for r in results if r.error is not None]
    if len(results) < workload.num_requests or failed:
        raise RuntimeError(f"{workload.num_requests - len(results) + len(failed)} requests failed: {failed[:1]}")
    # from the first request's creation to the last one's finish: without the manager's
    # start-up and shutdown, which a server would pay once
    span_s = max(r.lifespan[1] for r in results) - min(r.created_time for r in results)
    return {"elapsed_s": span_s, "wall_with_setup_s": wall_s, "generated_tokens": sum(len(r.generated_tokens) for r in results)}


def run_peer(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    hf, arch = build_model(spec["model"], dtype)
    workload = Workload.from_dict(spec["workload"])
    warmup = Workload.from_dict(spec["warmup"])
    mode = spec["mode"]
    if mode == "generate":
        run_static_generate(hf, arch, warmup, spec["batch_size"])
        result = run_static_generate(hf, arch, workload, spec["batch_size"])
    elif mode == "generate_batch":
        run_generate_batch(hf, warmup, spec["max_batch_tokens"])
        result = run_generate_batch(hf, workload, spec["max_batch_tokens"])
    else:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    try:
        result = run_peer(json.loads(spec_path.read_text()))
    except Exception as exc:  # reported by the parent as "could not run: …", then it carries on
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    out_path.write_text(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
