"""Each architecture beyond Llama, Mistral and Qwen2 against transformers on the same weights
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
from tests.support.paged_driver import assert_follows_reference
from tests.support.tiny_gguf import write_gguf
from tests.support.tiny_models import TINY_VARIANTS, load_reference

ARCHITECTURES = ["qwen3"]  # TINY_VARIANTS of the architectures this file checks
PROMPT = "What is the capital of France? The capital"
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def ggufs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("arch-gguf")
    return {
        v: str(write_gguf(Path(tiny_model_dirs[v]), root / f"{v}.gguf", architecture=TINY_VARIANTS[v]["model_type"]))
        for v in ARCHITECTURES
    }


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    return {v: load_reference(Path(tiny_model_dirs[v])) for v in ARCHITECTURES}


def _source(tiny_model_dirs, ggufs, variant: str, source: str) -> str:
    return tiny_model_dirs[variant] if source == "hf" else ggufs[variant]


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_logits_follow_transformers_in_fp32(tiny_model_dirs, ggufs, references, variant, source):
    path = _source(tiny_model_dirs, ggufs, variant, source)
    for cpu_kernels in (False, True):
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory="8MiB", cpu_kernels=cpu_kernels))
        assert engine.arch.architecture == TINY_VARIANTS[variant]["model_type"]
        assert engine.arch.head_dim == TINY_VARIANTS[variant].get("head_dim", engine.arch.hidden_size // engine.arch.num_heads)
        prompt = engine.tokenizer.encode(PROMPT)
        assert_follows_reference(engine, references[variant], prompt, steps=6, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_32_greedy_tokens_equal_transformers(tiny_model_dirs, ggufs, references, variant, source):
    llm = LLM(_source(tiny_model_dirs, ggufs, variant, source), dtype="float32", kv_cache_memory="8MiB")
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        ref = references[variant].generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_chunked_prefill_prefix_hits_and_preemption_change_no_token(tiny_model_dirs, variant):
    """Requests sharing a prefix, run alone in a roomy engine, then together in one whose pool
    cannot hold them all (preemptions) with prefill in chunks of 8 and prefix caching on."""
    path = tiny_model_dirs[variant]
    prefix = list(range(10, 34))
    prompts = [prefix + [40 + i, 41 + i, 42 + 2 * i] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(path, dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    expected = [alone.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    # 20 blocks of 4 positions: a request needs 10, five share 6 of them; four at once do not fit
    c_kv = alone.engine.layout.kv_bytes_per_position
    tight = LLM(path, dtype="float32", block_size=4, kv_cache_memory=20 * 4 * c_kv, max_num_batched_tokens=16,
                long_prefill_token_threshold=8)  # fmt: skip
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy)]
    assert got == expected
    engine = tight.engine
    assert engine.layout.num_blocks == 20
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.prefix_hits > 0


@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_gguf_tensors_read_as_the_gguf_package_reads_them(tiny_model_dirs, ggufs, variant):
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
        name = _hf_name(tensor.name)
        names.add(name)
        expected = np.asarray(tensor.data).reshape([int(d) for d in reversed(tensor.shape)])
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=tensor.name)
    assert names == set(ours)
    assert any(n.endswith("q_norm.weight") for n in names) == arch.qk_norm
