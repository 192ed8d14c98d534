"""An int8 KV cache (`kv_cache_dtype="int8"`): the pool holds about twice the positions,
the engine's outputs follow the float cache's, and prefix caching, preemption and chunked
prefill still give exactly the tokens of a roomy unchunked run."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.describe import describe
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_runner import plan_kv_pool
from kvserve.errors import ConfigError
from kvserve.arch import ModelArchitecture
from tests.support.paged_driver import PagedDriver

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHARED = "Once upon a time there was a small engine that served many requests at once. "
PROMPTS = [
    SHARED + "The quick brown fox",
    SHARED + "What is the capital of France?",
    "hello world",
    SHARED + SHARED + "Prefill computes the prompt",
    "0123456789 stop",
]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _llm(path, **kw):
    base = dict(dtype="bfloat16", device="cpu", kv_cache_memory="8MiB", block_size=4, kv_cache_dtype="int8")
    return LLM(path, **{**base, **kw})


def test_c_kv_counts_the_scales_and_the_pool_holds_about_twice_the_positions(tiny_model_dirs):
    # SmolLM2-135M (the default model): 30 layers, 3 KV heads of 64
    smol = ModelArchitecture("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 8192, True)
    assert smol.kv_bytes_per_position(2) == 23040  # bf16: 2·30·3·64·2
    assert smol.kv_int8_bytes_per_position() == smol.kv_bytes_per_position(1, 4) == 2 * 30 * 3 * (64 + 4) == 12240
    bf16, int8 = (plan_kv_pool(smol, dt, 2**30, 16) for dt in (torch.bfloat16, torch.int8))
    assert int8.kv_bytes_per_position == 12240 and int8.kv_dtype == torch.int8 and int8.quantized
    assert int8.nbytes <= 2**30 and 1.85 < int8.num_tokens / bf16.num_tokens < 1.9  # 2·64 / (64 + 4)

    path = tiny_model_dirs["llama-hd64"]  # 2 layers, 2 KV heads of 64
    engines = {kv: LLMEngine(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_memory="2MiB", kv_cache_dtype=kv))
               for kv in ("auto", "int8")}  # fmt: skip
    float_layout, int8_layout = engines["auto"].layout, engines["int8"].layout
    assert float_layout.kv_bytes_per_position == 2 * 2 * 2 * 64 * 2
    assert int8_layout.kv_bytes_per_position == 2 * 2 * 2 * (64 + 4)
    assert int8_layout.num_tokens >= 1.85 * float_layout.num_tokens
    runner = engines["int8"].runner
    assert runner.kv_pool.dtype == torch.int8 and runner.kv_scales.dtype == torch.float32
    assert runner.kv_scales.shape == runner.kv_pool.shape[:-1]
    assert runner.kv_pool.nbytes + runner.kv_scales.nbytes == int8_layout.nbytes
    report = describe(engines["int8"])
    assert "KV cache: int8" in report and f"c_kv {int8_layout.kv_bytes_per_position} bytes/position" in report
    assert "KV cache: bfloat16" in describe(engines["auto"])


def test_kv_cache_dtype_errors_name_the_field():
    with pytest.raises(ConfigError, match="kv_cache_dtype") as err:
        LLM(kv_cache_dtype="fp8")
    assert err.value.field == "kv_cache_dtype"
    with pytest.raises(ConfigError, match="kv_cache_dtype: bfloat16 needs a bfloat16 model"):
        EngineConfig(dtype="float32", device="cpu", kv_cache_dtype="bfloat16")
    assert EngineConfig(dtype="float32", device="cpu", kv_cache_dtype="int8").torch_kv_dtype == torch.int8
    assert EngineConfig(dtype="float32", device="cpu").torch_kv_dtype == torch.float32


def _teacher_forced(path, dtype, kv, cpu_kernels):
    """Logits after a chunked prefill and 4 decodes of fixed tokens (no greedy feedback, so
    one flipped token cannot send two runs down different paths)."""
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, device="cpu", kv_cache_memory="2MiB",
                                    kv_cache_dtype=kv, cpu_kernels=cpu_kernels))  # fmt: skip
    assert engine.layout.kv_dtype == (torch.int8 if kv == "int8" else getattr(torch, dtype))
    driver = PagedDriver(engine)
    req = driver.new_request(engine.tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    out = [driver.prefill(req, chunk=4)]  # later chunks read int8 history (S0 > 0)
    for token in (5, 9, 11, 40):
        out.append(driver.decode(req, token))
    return torch.stack(out)


def test_int8_logits_follow_the_float_cache_with_and_without_kernels(tiny_model_dirs):
    """Against the exact run (fp32 model, fp32 cache): int8 costs about what bf16 rounding
    does, and the kernels' int8 path (bf16: all of them, the fused step too) is no less
    accurate than the plain-torch one."""
    path, dtype = tiny_model_dirs["llama-hd64"], "bfloat16"  # head_dim 64: every int8 kernel's path
    exact = _teacher_forced(path, "float32", "auto", False)
    torch_int8 = _teacher_forced(path, dtype, "int8", False)
    kernel_int8 = _teacher_forced(path, dtype, "int8", True)
    float_error = (_teacher_forced(path, dtype, "auto", True) - exact).abs().max()
    torch_error, kernel_error = (torch_int8 - exact).abs().max(), (kernel_int8 - exact).abs().max()
    assert kernel_error <= 1.25 * torch_error + 1e-2, (kernel_error, torch_error)
    assert torch_error <= 2 * float_error + 0.1 * exact.abs().max(), (torch_error, float_error)
    assert (kernel_int8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8


def test_int8_greedy_tokens_mostly_agree_with_the_bf16_cache(tiny_model_dirs):
    path = tiny_model_dirs["llama-hd64"]
    int8 = _tokens(_llm(path, enable_prefix_caching=False).generate(PROMPTS, GREEDY))
    bf16 = _tokens(_llm(path, enable_prefix_caching=False, kv_cache_dtype="bfloat16").generate(PROMPTS, GREEDY))
    # a random tiny model's near-ties flip under any rounding, and a flip changes what follows:
    # every first token agrees, and most tokens overall
    assert sum(a[0] == b[0] for a, b in zip(int8, bf16)) >= 3
    assert sum(x == y for a, b in zip(int8, bf16) for x, y in zip(a, b)) >= 0.5 * 10 * len(PROMPTS)


@pytest.mark.parametrize(
    "variant, dtype, deterministic",
    [("llama-hd64", "bfloat16", True), ("llama-gqa", "float32", False)], ids=["kernels-bf16", "torch-fp32"],
)
def test_prefix_hits_preemption_and_chunks_give_the_tokens_of_a_roomy_unchunked_run(
    tiny_model_dirs, variant, dtype, deterministic
):
    """They only move block ids and split the same positions; int8 blocks hold the same bytes.
    On the kernels under --deterministic, the mode that promises it: otherwise a prefix hit
    that leaves one prompt position computes it as a decode row (the decode kernel, which
    weights int8 V rows by unrounded probabilities) where the roomy run's prefill kernel did,
    and the last bits differ (a tie of the tiny model's logits then breaks either way)."""
    path = tiny_model_dirs[variant]
    roomy = _llm(path, dtype=dtype, enable_prefix_caching=False, deterministic=deterministic)
    expected = _tokens(roomy.generate(PROMPTS, GREEDY))
    c_kv = roomy.engine.layout.kv_bytes_per_position
    # 150 positions: the longest request (~116) fits, not all ten at once
    llm = _llm(path, dtype=dtype, kv_cache_memory=150 * c_kv, max_num_batched_tokens=7, deterministic=deterministic)
    out = llm.generate(PROMPTS * 2, GREEDY)
    assert _tokens(out) == expected * 2
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and sum(o.num_cached_tokens for o in out) > 0
    assert engine.kv_cache.num_free_blocks() == engine.kv_cache.num_blocks
