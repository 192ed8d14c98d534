"""Head shapes the CPU kernels must serve beyond the stock tiny models: many query heads on
one KV head (a group of 32), and head_dim 128 with QKV bias (Qwen2's shape).

Tiny random models through the engine with kernels on, prefill then decode steps, against
transformers on the same weights: in fp32 to the suite's model tolerance
(tests/model/test_model_logits.py), in bf16 held to fp32 as tests/kernels/test_kernels.py
does (no less accurate than torch's own bf16 path).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels import cpu_ops, unavailable_reason
from kvserve.sampling_params import SamplingParams
from tests.support.paged_driver import PagedDriver, assert_follows_reference
from tests.support.tiny_models import load_reference, make_tiny_model

# as tests/kernels/test_kernels.py: skipped only where the kernels cannot apply
pytestmark = pytest.mark.skipif(
    cpu_ops() is None and unavailable_reason() is not None, reason=f"CPU kernels unavailable: {unavailable_reason()}"
)

SHAPES = {
    # 32 query heads share 1 KV head; head_dim 32 (the kernels' multiple) -> hidden 1024. One
    # layer: at this width the wide random init makes bf16 noise large, and two layers bring
    # the kernels' bf16 error within 4% of the bound below (a real shape bug is far above it)
    "llama-g32": dict(model_type="llama", num_heads=32, num_kv_heads=1, hidden_size=1024, num_layers=1),
    # head_dim 128 (the decode kernel's largest) with Qwen2's QKV bias; 2 query heads per KV head
    "qwen2-hd128": dict(model_type="qwen2", num_heads=4, num_kv_heads=2, hidden_size=512),
}
PROMPT = "What is the capital of France? The capital"
DECODE_STEPS = 4
ATOL, RTOL = 2e-4, 1e-4  # tests/model/test_model_logits.py's, for fp32


@pytest.fixture(scope="module")
def shape_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kernel-shapes")
    return {name: str(make_tiny_model(root / name, **kw)) for name, kw in SHAPES.items()}


@pytest.fixture(scope="module")
def references(shape_dirs):
    return {name: load_reference(path) for name, path in shape_dirs.items()}


def _engine(path: str, dtype: str, cpu_kernels: bool = True) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, device="cpu", kv_cache_memory="4MiB", cpu_kernels=cpu_kernels))
    assert engine.uses_cpu_kernels == cpu_kernels
    return engine


def test_shapes_are_the_intended_ones(shape_dirs):
    g32 = _engine(shape_dirs["llama-g32"], "bfloat16")
    assert (g32.arch.num_heads, g32.arch.num_kv_heads, g32.arch.queries_per_kv_head, g32.arch.head_dim) == (32, 1, 32, 32)
    hd128 = _engine(shape_dirs["qwen2-hd128"], "bfloat16")
    assert (hd128.arch.head_dim, hd128.arch.attention_bias) == (128, True)
    assert hd128.model.layers[0].self_attn.qkv.bias.float().abs().sum() > 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_engine_loads_and_decodes_with_kernels_on(shape_dirs, shape):
    """bf16, kernels on, through the real step (scheduler, runner, fused decode): a prefill
    and several decode steps run without raising and produce every token."""
    engine = _engine(shape_dirs[shape], "bfloat16")
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True))
    tokens = []
    for _ in range(4 * DECODE_STEPS):
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert len(tokens) == DECODE_STEPS + 1
    assert engine.kv_cache.num_free_blocks() == engine.kv_cache.num_blocks


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_kernels_follow_transformers(shape_dirs, references, shape):
    engine = _engine(shape_dirs[shape], "float32")
    prompt = engine.tokenizer.encode(PROMPT)
    assert_follows_reference(engine, references[shape], prompt, steps=DECODE_STEPS, atol=ATOL, rtol=RTOL)


def _trajectory(engine: LLMEngine, reference, prompt: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits (as fp32) and the reference's after the prefill and each decode step, the
    reference's greedy token fed back to both (as assert_follows_reference does)."""
    driver = PagedDriver(engine)
    req = driver.new_request(prompt)
    ours = [driver.prefill(req)]
    tokens = list(prompt)
    expected = []
    for i in range(steps + 1):
        with torch.no_grad():
            expected.append(reference(torch.tensor([tokens])).logits[0, -1])
        if i == steps:
            break
        tokens.append(int(expected[-1].argmax()))
        ours.append(driver.decode(req, tokens[-1]))
    driver.free(req)
    return torch.stack(ours).cpu().float(), torch.stack(expected)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_kernels_follow_transformers(shape_dirs, references, shape):
    """bf16 rounds differently in the kernels than in torch, so both bf16 paths are held to
    transformers' fp32 logits; the kernels may not be less accurate than torch's bf16 path
    (the bound of tests/kernels/test_kernels.py)."""
    path, ref = shape_dirs[shape], references[shape]
    kernels = _engine(path, "bfloat16", cpu_kernels=True)
    prompt = kernels.tokenizer.encode(PROMPT)
    ours, expected = _trajectory(kernels, ref, prompt, DECODE_STEPS)
    torch_bf16, expected_again = _trajectory(_engine(path, "bfloat16", cpu_kernels=False), ref, prompt, DECODE_STEPS)
    assert torch.equal(expected, expected_again)
    kernel_error = (ours - expected).abs().max()
    torch_error = (torch_bf16 - expected).abs().max()
    assert kernel_error <= 1.25 * torch_error + 1e-2, (kernel_error, torch_error)
