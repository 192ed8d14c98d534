"""Each architecture beyond Llama, Mistral and Qwen2 (Qwen3; Phi-3 with fused QKV and gate/up
weights, and with Phi-4-mini's partial rotary and LongRoPE; Gemma 2 with its soft-capping;
Gemma 3), and Mistral's sliding window, against transformers on the same weights
(tiny random models from transformers' own config classes, tests/support/tiny_models.py),
from its HF directory and from a GGUF of it: logits in fp32 to 1e-4 after the prefill and
each decode step, and 32 greedy tokens; chunked prefill, prefix hits and preemption change no
token; the GGUF's tensors as kvserve reads them equal the `gguf` package's own reading.
Every kernel level: tests/kernels/test_arch_levels.py; tensor parallelism:
tests/distributed/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.families import HF_TO_GGUF_ARCH
from tests.support.paged_driver import PagedDriver, assert_follows_reference
from tests.support.tiny_gguf import write_gguf
from tests.support.tiny_models import PHI3_LONGROPE, TINY_VARIANTS, load_reference, make_tiny_model

VARIANTS = {
    **{v: TINY_VARIANTS[v] for v in ("qwen3", "phi3")}, "phi3-longrope": PHI3_LONGROPE,
    # Gemma 3: the 6th of 7 layers global (llama.cpp's fixed pattern of 6, so the GGUF agrees); a
    # window of 8, which the 11-token prompt already passes, so every test here runs the local
    # layers within their window (attention/sliding_window.py)
    "gemma3": dict(model_type="gemma3_text", num_heads=4, num_kv_heads=2, hidden_size=64, head_dim=32, num_layers=7,
                   sliding_window=8),
    # Gemma 2: the even layers local (window 8, which the prompt passes), scores and final logits
    # soft-capped (at 5 and 3 here, low enough to bite on these weights)
    "gemma2": dict(model_type="gemma2", num_heads=4, num_kv_heads=2, hidden_size=64, head_dim=32, num_layers=3,
                   sliding_window=8),
    # Mistral v0.1: every layer within a window (8 here)
    "mistral-window": dict(model_type="mistral", num_heads=4, num_kv_heads=2, sliding_window=8),
}
ARCHITECTURES = list(VARIANTS)
# llama.cpp writes Mistral as `llama`, without its window: no GGUF of a windowed Mistral exists
HF_ONLY: set[str] = {"mistral-window"}
SOURCES = [pytest.param(v, s, id=f"{v}-{s}") for v in ARCHITECTURES for s in ("hf", "gguf") if s == "hf" or v not in HF_ONLY]
# served within the original context, LongRoPE takes the short factors, as transformers does
# for a sequence that short (tests/model/test_rope_scaling.py checks the long ones)
ENGINE_ARGS = {"phi3-longrope": {"max_model_len": 128}}
PROMPT = "What is the capital of France? The capital"
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("arch-hf")
    own = {v: str(make_tiny_model(root / v, **kw)) for v, kw in VARIANTS.items() if v not in tiny_model_dirs}
    return {v: own.get(v) or tiny_model_dirs[v] for v in VARIANTS}


@pytest.fixture(scope="module")
def ggufs(model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("arch-gguf")
    return {
        v: str(write_gguf(Path(model_dirs[v]), root / f"{v}.gguf", architecture=HF_TO_GGUF_ARCH[mt]))
        for v in ARCHITECTURES if v not in HF_ONLY for mt in [VARIANTS[v]["model_type"]]
    }


@pytest.fixture(scope="module")
def references(model_dirs):
    return {v: load_reference(Path(model_dirs[v])) for v in ARCHITECTURES}


def _source(model_dirs, ggufs, variant: str, source: str) -> str:
    return model_dirs[variant] if source == "hf" else ggufs[variant]


@pytest.mark.parametrize("variant, source", SOURCES)
def test_logits_follow_transformers_in_fp32(model_dirs, ggufs, references, variant, source):
    path = _source(model_dirs, ggufs, variant, source)
    for cpu_kernels in (False, True):
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory="8MiB", cpu_kernels=cpu_kernels,
                                        **ENGINE_ARGS.get(variant, {})))  # fmt: skip
        kw = VARIANTS[variant]
        assert engine.arch.architecture == kw["model_type"]
        assert engine.arch.head_dim == kw.get("head_dim", engine.arch.hidden_size // engine.arch.num_heads)
        assert engine.arch.rotary_dim == int(engine.arch.head_dim * kw.get("partial_rotary_factor", 1.0))
        prompt = engine.tokenizer.encode(PROMPT)
        assert_follows_reference(engine, references[variant], prompt, steps=6, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant, source", SOURCES)
def test_32_greedy_tokens_equal_transformers(model_dirs, ggufs, references, variant, source):
    llm = LLM(_source(model_dirs, ggufs, variant, source), dtype="float32", kv_cache_memory="8MiB", **ENGINE_ARGS.get(variant, {}))
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    tokens = list(prompt)  # transformers' greedy choice, EOS included (generate's min_new_tokens would mask it)
    with torch.no_grad():
        for _ in range(32):
            tokens.append(int(references[variant](torch.tensor([tokens])).logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == tokens[len(prompt):]


@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_chunked_prefill_prefix_hits_and_preemption_change_no_token(model_dirs, variant):
    """Requests sharing a prefix, run alone in a roomy engine, then together in one whose pool
    cannot hold them all (preemptions) with prefill in chunks of 8 and prefix caching on."""
    path, extra = model_dirs[variant], ENGINE_ARGS.get(variant, {})
    prefix = list(range(10, 34))
    prompts = [prefix + [40 + i, 41 + i, 42 + 2 * i] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(path, dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False, **extra)
    expected = [alone.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    # 20 blocks of 4 positions: a request needs 10, five share 6 of them; four at once do not fit.
    # A pool held to sliding windows keeps less of each request: 12 blocks' memory then
    c_kv = alone.engine.layout.kv_bytes_per_position
    blocks = 12 if alone.engine.layout.groups is not None else 20
    tight = LLM(path, dtype="float32", block_size=4, kv_cache_memory=blocks * 4 * c_kv, max_num_batched_tokens=16,
                long_prefill_token_threshold=8, max_model_len=64)  # fmt: skip
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy)]
    assert got == expected
    engine = tight.engine
    assert engine.layout.nbytes == blocks * 4 * c_kv  # in blocks of fewer layers where the pool holds KV groups
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.prefix_hits > 0


@pytest.mark.parametrize("variant", [v for v in ARCHITECTURES if v not in HF_ONLY])
def test_gguf_tensors_read_as_the_gguf_package_reads_them(ggufs, variant):
    """Every tensor kvserve takes from the GGUF equals gguf.GGUFReader's array of it, under
    the HF name kvserve maps it to (F32: no rounding on either side)."""
    import gguf

    from kvserve.model.gguf_loader import _hf_name, read_weights
    from kvserve.model.gguf_metadata import open_gguf, read_architecture

    header = open_gguf(ggufs[variant])
    arch = read_architecture(header, source=ggufs[variant])
    ours = read_weights(header, arch, torch.float32, path=Path(ggufs[variant]))
    theirs = gguf.GGUFReader(ggufs[variant])
    names = set()
    for tensor in theirs.tensors:
        name = _hf_name(tensor.name, arch.architecture)
        names.add(name)
        expected = np.asarray(tensor.data).reshape([int(d) for d in reversed(tensor.shape)])
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=tensor.name)
    assert names == set(ours)
    assert any(n.endswith("q_norm.weight") for n in names) == arch.qk_norm
    assert any(n.endswith("qkv_proj.weight") for n in names) == (arch.architecture == "phi3")
    if arch.architecture == "gemma3_text":  # llama.cpp's pattern: every 6th layer global
        assert arch.layer_types == tuple("full_attention" if i == 5 else "sliding_attention" for i in range(7))
    if arch.architecture == "gemma2":  # every other layer global; the caps from the file
        assert arch.layer_windows == (8, None, 8)
        assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (5.0, 3.0)


def test_fused_weights_of_a_quantized_gguf_are_cut_in_their_packed_format(model_dirs, tmp_path):
    """Phi-3's fused QKV and gate/up in Q8_0 are cut between packed groups at load and run on
    quant_linear (bf16), their logits those of the same file dequantized to within int8's noise."""
    path = str(write_gguf(Path(model_dirs["phi3"]), tmp_path / "phi3-q8_0.gguf", architecture="phi3", quant_type="Q8_0"))
    native = LLMEngine(EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="8MiB"))
    attn = native.model.layers[0].self_attn
    if native.model.kernels.quant_linear.enabled:
        assert attn.qkv.qweight is not None and native.model.layers[0].mlp.gate_up.qweight is not None
    plain = LLMEngine(EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="8MiB", quantization="none"))
    prompt = native.tokenizer.encode(PROMPT)
    logits = []
    for engine in (native, plain):
        driver = PagedDriver(engine)
        logits.append(driver.prefill(driver.new_request(prompt)).float())
    assert torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=0) > 0.99


@pytest.mark.parametrize("variant, kv_layout", [("gemma3", "heads"), ("gemma3", "requests"), ("gemma2", "heads")])
def test_gemma_at_tp_2_equals_one_process(model_dirs, variant, kv_layout):
    """Its extra norms act on the AllReduced branch outputs, whole on every rank, each layer
    kind's RoPE table is every rank's, and the local layers keep their window (the prompts pass
    it) with the KV split by heads or held by whole requests (Qwen3 and Phi-3:
    tests/distributed/test_tensor_parallel.py)."""
    from tests.support.tensor_parallel import greedy_tokens

    expected, _ = greedy_tokens(model_dirs[variant], 1)
    got, engine = greedy_tokens(model_dirs[variant], 2, kv_layout=kv_layout)
    assert got == expected and engine.shard.world == 2 and engine.requests_layout == (kv_layout == "requests")
