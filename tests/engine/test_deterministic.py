"""--deterministic: a request's greedy tokens and their logprobs, to the bit, never depend on
what else is in the batch, the order requests arrive in, how its prompt was chunked,
prefix-cache hits or preemption. In bf16 with the CPU kernels, on the default model, in its
native Q4_1 weights, dequantized to bf16 (the VNNI-tile GEMV and tiles), and with an int8 KV
cache."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.describe import describe
from kvserve.errors import ConfigError
from kvserve.kernels import unavailable_reason

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"CPU kernels: {unavailable_reason()}"),
]

SYSTEM = "You are a helpful assistant. Answer briefly and precisely, with facts only. " * 3
PROMPTS = [SYSTEM + f"Question {i}: tell me about the number {i * 7} and the colour of item {i}." for i in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True, logprobs=0)


def _llm(quantization: str, **kw) -> LLM:
    kv_dtype = "int8" if quantization == "auto+int8-kv" else "auto"
    quantization = quantization.split("+")[0]
    return LLM(dtype="bfloat16", deterministic=True, quantization=quantization, kv_cache_dtype=kv_dtype,
               **{"kv_cache_memory": "64MiB", **kw})  # fmt: skip


def _result(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted(d.items())) for d in c.logprobs)


def _together(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[tuple]:
    return [_result(o) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["auto", "none", "auto+int8-kv"], ids=["q4_1-native", "bf16", "int8-kv"])
def case(request):
    llm = _llm(request.param)
    return {"quantization": request.param, "llm": llm, "want": _together(llm)}


def test_one_at_a_time_equals_all_together(case):
    llm = case["llm"]
    assert "deterministic: every attention row through the decode kernel" in describe(llm.engine)
    alone = []
    for p in PROMPTS:
        llm.engine.reset_prefix_cache()  # nothing cached from the others either
        alone.append(_result(llm.generate([p], GREEDY)[0]))
    assert alone == case["want"]


def test_random_arrival_orders(case):
    """Requests added in a shuffled order, a few at a time between steps: each one's bits are
    the same as in one batch."""
    engine = case["llm"].engine
    for seed in (1, 2):
        order = list(range(len(PROMPTS)))
        random.Random(seed).shuffle(order)
        done = {}
        pending = list(order)
        rng = random.Random(seed)
        while pending or engine.has_unfinished_requests():
            arriving = rng.randint(0 if engine.has_unfinished_requests() else 1, 3)
            for _ in range(arriving):
                if pending:
                    i = pending.pop(0)
                    engine.add_request(f"arrival{seed}-{i}", PROMPTS[i], GREEDY)
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id.rsplit("-", 1)[1])] = _result(out)
        assert [done[i] for i in range(len(PROMPTS))] == case["want"]


def test_a_pool_that_forces_preemption(case):
    small = _llm(case["quantization"], kv_cache_memory="2.5MiB")
    assert _together(small) == case["want"]
    assert small.engine.scheduler.num_preemptions > 0  # recomputed what it had decoded, same bits


@pytest.mark.parametrize("chunking", [dict(long_prefill_token_threshold=16), dict(max_num_batched_tokens=64)])
def test_prompts_in_chunks(case, chunking):
    """A 64-token prompt in chunks of 16 ends in a chunk of one row, which the engine treats as
    a decode: the same bits as the whole prompt in one step."""
    assert _together(_llm(case["quantization"], **chunking)) == case["want"]


def test_prefix_caching_off(case):
    assert _together(_llm(case["quantization"], enable_prefix_caching=False)) == case["want"]


def test_the_same_prompt_twice(case):
    llm = case["llm"]
    twice = _together(llm, prompts=[PROMPTS[3], PROMPTS[3]])  # together, the second one hitting the first's blocks
    again = _together(llm, prompts=[PROMPTS[3]])  # later, from the prefix cache
    assert twice == [case["want"][3]] * 2 and again == [case["want"][3]]


def test_seeded_sampling_does_not_depend_on_the_batch(case):
    llm = case["llm"]
    together = _together(llm, SEEDED)
    alone = [_result(llm.generate([p], SEEDED)[0]) for p in PROMPTS]
    assert alone == together


def test_refused_where_it_cannot_hold(tiny_llama):
    with pytest.raises(ConfigError, match="deterministic.*CPU kernels"):
        LLM(tiny_llama, deterministic=True, cpu_kernels=False)
    with pytest.raises(ConfigError, match="deterministic.*tensor parallelism"):
        LLM(tiny_llama, deterministic=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="deterministic.*projections"):  # fp32 projections go through F.linear
        LLM(tiny_llama, deterministic=True, dtype="float32", kv_cache_memory="1MiB")
