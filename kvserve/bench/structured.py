"""`kvserve bench structured`: what constrained decoding costs, on the engine's model.

Prints (1) the grammar compile time of a few JSON schemas, cold and from the cache, and
(2) the token-mask cost per decode step at each batch size: computing the masks of every
row (llguidance, in parallel) plus applying them to a [batch, vocab] logits tensor, as
µs per step and as a fraction of an unconstrained decode step of the same batch. The
masks are those of a tool-call schema walked token by token along a valid call, the
batch's matchers all constrained (the worst case of a mixed batch). (3) The decode step of
`batch` unconstrained requests, alone and with one of them constrained (a regex that never
completes), alternated twice: one constrained row takes the whole step off the greedy-only
path (the LM head's fused argmax), which is what the unconstrained rows could pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

# the schemas compiled, and a valid document of each that the mask figures walk (also what
# benchmarks/structured_choice.py compared llguidance and xgrammar on)
SCHEMAS: dict[str, dict | None] = {
    "simple object": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested arrays+enums": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
            "owner": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "roles": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                },
                "required": ["id", "roles"],
                "additionalProperties": False,
            },
            "score": {"type": "number"},
        },
        "required": ["title", "tags", "owner", "score"],
        "additionalProperties": False,
    },
    "tool call": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather", "search_web", "send_email"]},
            "arguments": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        },
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                        "required": ["query"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "to": {"type": "string"},
                            "subject": {"type": "string"},
                            "body": {"type": "string"},
                        },
                        "required": ["to", "subject", "body"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
    "json_object": None,  # any JSON object
}

DOCUMENTS = {
    "simple object": {"name": "Ada Lovelace", "age": 36},
    "nested arrays+enums": {
        "title": "A report on the state of the engine",
        "tags": ["red", "blue", "green"],
        "owner": {"id": 42, "roles": ["admin", "writer"]},
        "score": 0.75,
    },
    "tool call": {
        "name": "send_email",
        "arguments": {"to": "bob@example.com", "subject": "Lunch", "body": "Are we still on for noon tomorrow?"},
    },
    "json_object": {"answer": "Paris", "confidence": 0.9, "sources": ["atlas", "encyclopedia"], "ok": True},
}


def register(sub) -> None:
    from kvserve.engine_args import add_engine_args

    p = sub.add_parser("structured", help="constrained decoding: grammar compile time, mask cost per step at batch 1 and 64")
    p.add_argument("--batch-sizes", default="1,64", help="batch sizes of the mask and decode-step figures (default 1,64)")
    p.add_argument("--steps", type=int, default=32, help="timed steps per batch size (default 32)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the figures as JSON")
    add_engine_args(p)
    p.set_defaults(func=run)


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def measure_compile(tokenizer, vocab_size: int) -> dict[str, Any]:
    from kvserve.structured.backend import StructuredBackend
    from kvserve.structured.params import StructuredOutputsParams

    t0 = time.perf_counter()
    backend = StructuredBackend(tokenizer, vocab_size)  # a fresh one: nothing cached yet
    setup_s = time.perf_counter() - t0
    rows = {}
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
        t0 = time.perf_counter()
        backend.compile(params)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend.compile(params)
        rows[name] = {"compile_ms": cold * 1e3, "cached_us": (time.perf_counter() - t0) * 1e6}
    return {"tokenizer_setup_ms": setup_s * 1e3, "schemas": rows, "backend": backend}


def measure_masks(backend, hf_tokenizer, vocab_size: int, batch: int, steps: int) -> dict[str, float]:
    import torch

    from kvserve.structured.mask import bitmask_to_bias, fill_bitmasks
    from kvserve.structured.params import StructuredOutputsParams

    compiled = backend.compile(StructuredOutputsParams(json=SCHEMAS["tool call"]))
    doc = json.dumps(DOCUMENTS["tool call"], separators=(", ", ": "))  # the grammar's layout
    tokens = list(hf_tokenizer.encode(doc, add_special_tokens=False))
    logits = torch.randn(batch, vocab_size)
    fill_s, apply_s = [], []
    matchers, pos = None, 0
    for _ in range(steps):
        if matchers is None or pos == len(tokens):  # start a new call once one is complete
            matchers, pos = [compiled.new_matcher() for _ in range(batch)], 0
        work = logits.clone()
        t0 = time.perf_counter()
        bitmask = fill_bitmasks(matchers, vocab_size)
        t1 = time.perf_counter()
        work.add_(bitmask_to_bias(bitmask, vocab_size))  # as the sampler does (structured/mask.py)
        t2 = time.perf_counter()
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        for m in matchers:
            if not m.accept(tokens[pos]):
                raise RuntimeError(f"the grammar rejected its own document at token {pos}: {m.error}")
        pos += 1
    total = [a + b for a, b in zip(fill_s, apply_s)]
    return {"mask_us": _median_us(total), "fill_us": _median_us(fill_s), "apply_us": _median_us(apply_s)}


def measure_decode_step(engine, batch: int, steps: int, constrained: int = 0) -> float:
    """Median seconds of a greedy decode step of `batch` requests, the first `constrained`
    of them held to a regex that never completes."""
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.params import StructuredOutputsParams

    free = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="[a-z ]*"))
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(32)] for i in range(batch)]
    ids = [engine.add_request(None, p, held if i < constrained else free) for i, p in enumerate(prompts)]
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill until every request decodes
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for request_id in ids:
        engine.abort_request(request_id)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args
    from kvserve.errors import ConfigError

    if args.steps < 1:
        raise ConfigError("--steps", f"must be >= 1, got {args.steps}")
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ConfigError("--batch-sizes", f"expected comma-separated integers, got {args.batch_sizes!r}") from None
    if not batches or min(batches) < 1:
        raise ConfigError("--batch-sizes", f"expected integers >= 1, got {args.batch_sizes!r}")

    engine = LLMEngine(engine_config_from_args(args))
    vocab = engine.arch.vocab_size
    comp = measure_compile(engine.tokenizer, vocab)
    backend = comp.pop("backend")
    print(f"structured outputs on {engine.model_name} (vocab {vocab}), llguidance")
    print(f"tokenizer set-up (once per model): {comp['tokenizer_setup_ms']:.0f} ms")
    print(f"{'schema':<22} {'compile ms':>10} {'cached µs':>10}")
    for name, row in comp["schemas"].items():
        print(f"{name:<22} {row['compile_ms']:>10.2f} {row['cached_us']:>10.1f}")

    masks = {}
    print(f"\nmask per decode step (tool-call schema, every row constrained), median of {args.steps} steps")
    print(
        f"{'batch':>5} {'mask µs':>9} {'fill µs':>9} {'apply µs':>9} {'decode ms':>10} {'of a step':>9}"
        f" {'1 constrained ms':>17}"
    )
    for batch in batches:
        row = measure_masks(backend, engine.tokenizer.hf, vocab, batch, args.steps)
        free, mixed = [], []
        for _ in range(2):  # alternated: the machine's speed drifts
            free.append(measure_decode_step(engine, batch, args.steps) * 1e3)
            mixed.append(measure_decode_step(engine, batch, args.steps, constrained=1) * 1e3)
        row["decode_step_ms"] = statistics.median(free)
        row["decode_step_one_constrained_ms"] = statistics.median(mixed)
        row["fraction_of_step"] = row["mask_us"] / 1e3 / row["decode_step_ms"]
        masks[batch] = row
        print(
            f"{batch:>5} {row['mask_us']:>9.1f} {row['fill_us']:>9.1f} {row['apply_us']:>9.1f}"
            f" {row['decode_step_ms']:>10.2f} {row['fraction_of_step']:>8.1%} {row['decode_step_one_constrained_ms']:>17.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "structured", "model": engine.model_name, "vocab_size": vocab,
                       "compile": comp, "masks": {str(b): r for b, r in masks.items()}}, f, indent=2)
    return 0
