"""How many long requests a KV pool holds for a model with sliding-window layers: held to the
window (KV groups, engine/kv_groups.py) against every position kept (an instance started with
`--kv-role prefill`, whose pool keeps every layer's positions for handoffs).

    python -m benchmarks.window_capacity MODEL [--kv-cache-memory 1GiB] [--max-model-len 8192]

Prints each engine's start-up lines on the KV cache and the requests of max_model_len that fit.
Builds two engines (the model is loaded twice); no forward pass runs.
"""

from __future__ import annotations

import argparse

from kvserve.config import EngineConfig
from kvserve.engine.describe import describe
from kvserve.engine.engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args()
    for role, what in (("both", "held to the window"), ("prefill", "every position kept")):
        engine = LLMEngine(EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory,
                                        max_model_len=args.max_model_len, kv_role=role))  # fmt: skip
        lines = [line for line in describe(engine).splitlines()[:3] if "KV cache" in line or line.startswith("sliding")]
        print(f"== {what} (--kv-role {role})")
        print("\n".join(lines))
        print(f"requests of {engine.max_model_len} positions that fit: {engine.layout.requests_that_fit(engine.max_model_len)}; "
              f"positions of requests within the window: {engine.layout.num_tokens}")  # fmt: skip
        engine.release()


if __name__ == "__main__":
    main()
