"""Greedy tokens of a tiny model under tensor parallelism, the way the distributed tests
compare layouts and world sizes: a prompt cached first, then the batch, the engine closed."""

from __future__ import annotations

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 40, 41, 42]]  # the third shares the first's prefix


def greedy_tokens(model, tp, prompts=PROMPTS, **config):
    """(token ids per prompt, the closed engine) in fp32 on the plain-torch path unless told."""
    config = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "2MiB", "block_size": 4, "cpu_kernels": False,
              "distributed_timeout_s": 60, **config}  # fmt: skip
    llm = LLM(model, tensor_parallel_size=tp, **config)
    try:
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # a prefix in the cache
        outs = llm.generate(prompts, GREEDY)
        return [o.outputs[0].token_ids for o in outs], llm.engine
    finally:
        llm.engine.close()
