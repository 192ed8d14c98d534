"""`kvserve bench quality`: what a weight or KV-cache format costs in output quality.

A candidate configuration (the engine flags given: `--quantization`, `--kv-cache-dtype`,
`--dtype`) is measured against a reference on the same model file (by default
`--dtype float32 --quantization none`: for a GGUF, the file's weights dequantized to fp32):

- perplexity of both on a fixed text shipped with kvserve (`bench/data/quality.txt`),
  in windows of `--ppl-window` positions (stride = window, context reset at each window),
  `--ppl-tokens` predicted positions in all;
- mean KL(ref ‖ cand) of the next-token distribution at those same positions,
  teacher-forced, in nats;
- greedy agreement on 20 fixed prompts (`bench/data/quality_prompts.json`), 64 tokens each:
  the share of positions before each prompt's first divergence, the plain position-wise
  match rate, and how many of the 20 continuations are identical.

Teacher-forced logits come from the engine's own parts, the way a prompt is computed:
a private request gets KV blocks from the engine's `KVCacheManager`, each chunk of the
step budget goes through `ModelRunner.prepare` (slot mapping, block tables, attention
metadata) and the model's forward, which writes the KV cache and attends through it, so a
quantized KV cache is measured too. Only the last step differs: `compute_logits` projects
every position's hidden state instead of the sampled ones. The greedy continuations run
through `LLM.generate` itself.

The two engines are never in memory together: the reference runs first and writes the
log-softmax of every evaluated position as float32 to a memory-mapped file in a temporary
directory (2048 positions x 49,152 vocab = 400 MB on disk for the default model, read
back one window at a time), then it is dropped and the candidate loads. float16 storage
would halve that, but its rounding of log-probabilities (~5e-4 relative) is the size of
the bf16-vs-fp32 KL it would measure, and the reference against itself must give 0.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.errors import ConfigError

GREEDY_PROMPTS_MAX = 20
_LOGITS_ROWS = 128  # positions projected to logits at a time: [128, V] fp32 is 25 MB for V = 49,152


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class QualitySettings:
    ppl_window: int = 512
    ppl_tokens: int = 2048
    greedy_tokens: int = 64
    num_greedy_prompts: int = GREEDY_PROMPTS_MAX
    text_path: str | None = None  # None: the shipped text


# ---- the shipped data ---------------------------------------------------------------------


def read_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from)."""
    if path is None:
        return resources.files("kvserve.bench").joinpath("data/quality.txt").read_text(encoding="utf-8"), "kvserve/bench/data/quality.txt"
    try:
        return Path(path).read_text(encoding="utf-8"), path
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--text", f"cannot read {path}: {exc}") from None


def read_prompts() -> list[str]:
    return json.loads(resources.files("kvserve.bench").joinpath("data/quality_prompts.json").read_text(encoding="utf-8"))


# ---- teacher-forced log-probabilities through the engine --------------------------------


def teacher_forced_logprobs(engine, token_ids: list[int], request_id: str) -> torch.Tensor:
    """log_softmax of the next-token logits at every position of `token_ids`: [n, V] float32 on the CPU.

    The positions are computed as the engine computes a prompt: KV blocks from its cache
    manager, chunks of at most the step budget (`--max-num-batched-tokens`, and
    `--long-prefill-token-threshold` where set) prepared by its model runner, the model's
    forward writing and reading the paged KV cache. The request never enters the
    scheduler, so the engine must be idle; its blocks are freed at the end.
    """
    from kvserve.engine.request import Request
    from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
    from kvserve.sampling_params import SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("teacher forcing needs an idle engine")
    config, kv, model = engine.config, engine.kv_cache, engine.model
    chunk = config.max_num_batched_tokens
    if config.long_prefill_token_threshold:
        chunk = min(chunk, config.long_prefill_token_threshold)
    req = Request(request_id, token_ids, SamplingParams(temperature=0.0, max_tokens=1), block_size=config.block_size)
    rows: list[torch.Tensor] = []
    try:
        while req.num_computed_tokens < req.num_tokens:
            m = min(chunk, req.num_tokens - req.num_computed_tokens)
            if not kv.allocate_slots(req, m):
                raise ConfigError("--kv-cache-memory", f"the KV pool cannot hold a window of {len(token_ids)} positions")
            tables, group_tables = kv.tables([req.request_id])
            plan = SchedulerOutput([ScheduledRequest(req, m)], tables, group_block_tables=group_tables)
            batch = engine.runner.prepare(plan)
            with torch.inference_mode():
                hidden = model(batch.input_ids, batch.positions, batch.meta)
                for i in range(0, m, _LOGITS_ROWS):
                    logits = model.compute_logits(hidden[i : i + _LOGITS_ROWS])
                    rows.append(torch.log_softmax(logits.float(), dim=-1).cpu())
            # what Scheduler.update_from_output does for a step that samples nothing
            req.num_computed_tokens += m
    finally:
        kv.free(req)
    return torch.cat(rows)


def windows(num_positions: int, window: int) -> list[tuple[int, int]]:
    """[start, end) of each window of predicted positions; the last may be shorter."""
    return [(s, min(s + window, num_positions)) for s in range(0, num_positions, window)]


def _target_logprobs(logp: torch.Tensor, targets: list[int]) -> torch.Tensor:
    return logp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1).double()


def kl_per_position(ref_logp: torch.Tensor, cand_logp: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ cand) = Σ_v p_ref (log p_ref − log p_cand) for each row, in float64."""
    out = []
    for i in range(0, ref_logp.shape[0], _LOGITS_ROWS):
        ref = ref_logp[i : i + _LOGITS_ROWS].double()
        cand = cand_logp[i : i + _LOGITS_ROWS].double()
        out.append((ref.exp() * (ref - cand)).sum(dim=-1))
    return torch.cat(out)


# ---- one engine's pass ------------------------------------------------------------------


def _describe_format(engine) -> dict[str, Any]:
    c = engine.config
    return {
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "quantization": c.quantization,
        "kv_cache_dtype": c.kv_cache_dtype,
        "label": f"{str(engine.model.dtype).removeprefix('torch.')}, quantization {c.quantization}, kv {c.kv_cache_dtype}",
    }


def check_fits(engine, settings: QualitySettings, prompt_lens: list[int]) -> None:
    limit = engine.max_model_len
    if settings.ppl_window > limit:
        raise ConfigError("--ppl-window", f"{settings.ppl_window} positions exceed max_model_len={limit}")
    longest = max(prompt_lens) + settings.greedy_tokens
    if longest > limit:
        raise ConfigError("--greedy-tokens", f"the longest prompt ({max(prompt_lens)}) + {settings.greedy_tokens} tokens exceed max_model_len={limit}")


def run_pass(engine, role: str, tokens: list[int], settings: QualitySettings, prompts: list[str],
             ref_store: np.ndarray | None, write_store: np.ndarray | None) -> dict[str, Any]:
    """One engine's perplexity windows (writing its log-probs to `write_store`, or comparing
    them with `ref_store`) and greedy continuations."""
    from kvserve.sampling_params import SamplingParams

    num_positions = len(tokens) - 1
    spans = windows(num_positions, settings.ppl_window)
    nll, kl, top1 = [], [], []
    start_s = time.perf_counter()
    for k, (s, e) in enumerate(spans):
        _progress(f"{role}: perplexity window {k + 1}/{len(spans)} (positions {s}-{e}) …")
        logp = teacher_forced_logprobs(engine, tokens[s:e], f"quality-{role}-{k}")
        nll.append(-_target_logprobs(logp, tokens[s + 1 : e + 1]))
        if write_store is not None:
            write_store[s:e] = logp.numpy()
        if ref_store is not None:
            ref = torch.from_numpy(np.asarray(ref_store[s:e]))
            kl.append(kl_per_position(ref, logp))
            top1.append((ref.argmax(dim=-1) == logp.argmax(dim=-1)).double())
        del logp
    ppl_s = time.perf_counter() - start_s

    _progress(f"{role}: greedy, {len(prompts)} prompts x {settings.greedy_tokens} tokens …")
    start_s = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=settings.greedy_tokens, ignore_eos=True)
    llm_outputs = _generate(engine, prompts, params)
    greedy_s = time.perf_counter() - start_s

    nll_all = torch.cat(nll)
    result: dict[str, Any] = {
        **_describe_format(engine),
        "perplexity": math.exp(float(nll_all.mean())),
        "mean_nll": float(nll_all.mean()),
        "positions": int(nll_all.numel()),
        "perplexity_seconds": ppl_s,
        "greedy_seconds": greedy_s,
        "greedy_tokens": llm_outputs,
    }
    if ref_store is not None:
        kl_all = torch.cat(kl)
        result["kl"] = {
            "mean": float(kl_all.mean()),
            "median": float(kl_all.median()),
            "p99": float(torch.quantile(kl_all, 0.99)),
            "max": float(kl_all.max()),
        }
        result["teacher_forced_top1_agreement"] = float(torch.cat(top1).mean())
    return result


def _generate(engine, prompts: list[str], params) -> list[list[int]]:
    """Greedy continuations through the engine's own loop (as `LLM.generate`)."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    final: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        for request_id in ids:
            if request_id not in final:
                engine.abort_request(request_id)
    return [final[i] for i in ids]


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, Any]:
    """Per prompt, the positions before the first divergence and the positions that match."""
    per_prompt, prefix_total, match_total, positions = [], 0, 0, 0
    for ref, cand in zip(reference, candidate):
        n = len(ref)
        prefix = next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), min(n, len(cand)))
        matches = sum(a == b for a, b in zip(ref, cand))
        per_prompt.append({"tokens": n, "first_divergence": None if prefix == n and len(cand) == n else prefix,
                           "matches": matches})
        prefix_total += prefix
        match_total += matches
        positions += n
    return {
        "prompts": len(reference),
        "positions": positions,
        "prefix_agreement": prefix_total / positions if positions else 1.0,
        "position_match": match_total / positions if positions else 1.0,
        "identical": sum(1 for p in per_prompt if p["first_divergence"] is None),
        "per_prompt": per_prompt,
    }


# ---- the benchmark ----------------------------------------------------------------------


def run_quality(ref_config, cand_config, settings: QualitySettings, engine_factory) -> dict[str, Any]:
    """`engine_factory(config, role)` builds an LLMEngine; the reference is built, measured
    and dropped before the candidate is built."""
    text, text_source = read_text(settings.text_path)
    prompts = read_prompts()[: settings.num_greedy_prompts]

    _progress(f"reference ({ref_config.dtype}, quantization {ref_config.quantization}, "
              f"kv {ref_config.kv_cache_dtype}): loading …")
    engine = engine_factory(ref_config, "reference")
    all_tokens = engine.tokenizer.encode(text)
    if len(all_tokens) < 2:
        raise ConfigError("--text", f"{text_source} has {len(all_tokens)} tokens; at least 2 are needed")
    num_positions = min(settings.ppl_tokens, len(all_tokens) - 1)
    tokens = all_tokens[: num_positions + 1]
    check_fits(engine, settings, [len(engine.inputs.tokenize_prompt(p)) for p in prompts])
    vocab = engine.arch.vocab_size
    notes = []
    if num_positions < settings.ppl_tokens:
        notes.append(f"the text has {len(all_tokens)} tokens: {num_positions} positions evaluated, not {settings.ppl_tokens}")

    with tempfile.TemporaryDirectory(prefix="kvserve-quality-") as tmp:
        store = np.lib.format.open_memmap(Path(tmp) / "reference_logprobs.npy", mode="w+", dtype=np.float32,
                                          shape=(num_positions, vocab))
        reference = run_pass(engine, "reference", tokens, settings, prompts, None, store)
        reference["model"] = engine.model_name
        store.flush()
        del engine
        gc.collect()

        _progress(f"candidate ({cand_config.dtype}, quantization {cand_config.quantization}, "
                  f"kv {cand_config.kv_cache_dtype}): loading …")
        engine = engine_factory(cand_config, "candidate")
        if engine.arch.vocab_size != vocab or engine.tokenizer.encode(text)[: num_positions + 1] != tokens:
            raise ConfigError("--model", "the reference and the candidate tokenize the text differently")
        candidate = run_pass(engine, "candidate", tokens, settings, prompts, store, None)
        model_name = engine.model_name
        del engine, store
        gc.collect()

    greedy = greedy_agreement(reference.pop("greedy_tokens"), candidate.pop("greedy_tokens"))
    for row, prompt in zip(greedy["per_prompt"], prompts):
        row["prompt"] = prompt
    return {
        "model": model_name,
        "settings": dataclasses.asdict(settings),
        "text": {
            "source": text_source,
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "tokens": len(all_tokens),
            "positions_evaluated": num_positions,
            "windows": len(windows(num_positions, settings.ppl_window)),
        },
        "reference": reference,
        "candidate": candidate,
        "kl": candidate.pop("kl"),
        "greedy": greedy,
        "notes": notes,
    }


# ---- reports ----------------------------------------------------------------------------


def print_quality(results: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        console = console if console.is_terminal else Console(width=180)
    t, ref, cand, kl, g = results["text"], results["reference"], results["candidate"], results["kl"], results["greedy"]
    s = results["settings"]
    console.print(f"[bold]{results['model']}[/]: {t['positions_evaluated']} positions of {t['source']} in "
                  f"{t['windows']} windows of {s['ppl_window']}; greedy {g['prompts']} prompts x {s['greedy_tokens']} tokens; "
                  f"reference {ref['label']}")
    table = Table(title="quality against the reference")
    for col in ("format", "perplexity", "ref perplexity", "mean KL (nats)", "p99 KL", "top-1 (forced)",
                "greedy agreement", "position match", "identical"):
        table.add_column(col, justify="left" if col == "format" else "right")
    table.add_row(cand["label"], f"{cand['perplexity']:.4f}", f"{ref['perplexity']:.4f}", f"{kl['mean']:.3e}",
                  f"{kl['p99']:.3e}", f"{100 * cand['teacher_forced_top1_agreement']:.2f}%",
                  f"{100 * g['prefix_agreement']:.1f}%", f"{100 * g['position_match']:.1f}%",
                  f"{g['identical']}/{g['prompts']}")
    console.print(table)
    console.print("greedy agreement: positions before each prompt's first divergence / all positions; "
                  "position match: positions where the tokens are equal / all positions")
    for note in results.get("notes", []):
        console.print(f"note: {note}")


def quality_table(r: dict[str, Any]) -> list[str]:
    """Markdown lines of the figures (for BENCHMARKS.md)."""
    ref, cand, kl, g, t = r["reference"], r["candidate"], r["kl"], r["greedy"], r["text"]
    return [
        f"{r['model']}: {t['positions_evaluated']} positions of `{t['source']}` in windows of {r['settings']['ppl_window']}, "
        f"greedy {g['prompts']} prompts x {r['settings']['greedy_tokens']} tokens; reference {ref['label']}.",
        "",
        "| format | perplexity | ref perplexity | mean KL (nats) | p99 KL | top-1 (forced) | greedy agreement | position match | identical |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {cand['label']} | {cand['perplexity']:.4f} | {ref['perplexity']:.4f} | {kl['mean']:.3e} | {kl['p99']:.3e} | "
        f"{100 * cand['teacher_forced_top1_agreement']:.2f}% | {100 * g['prefix_agreement']:.1f}% | "
        f"{100 * g['position_match']:.1f}% | {g['identical']}/{g['prompts']} |",
    ]
