"""Work counts behind the roofline, checked against transformers' own parameter count."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.roofline import decode_bytes_per_step, layer_params, prefill_flops, total_params
from kvserve.model.hf_loader import read_architecture
from tests.support.tiny_models import load_reference


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied", "qwen2-bias"])
def test_param_count_matches_transformers(tiny_model_dirs, variant):
    path = Path(tiny_model_dirs[variant])
    reference = load_reference(path)
    assert total_params(read_architecture(path)) == sum(p.numel() for p in reference.parameters())


def test_decode_reads_layers_head_and_kv(tiny_model_dirs):
    arch = read_architecture(Path(tiny_model_dirs["llama-tied"]))
    head = arch.vocab_size * arch.hidden_size
    kv_per_position = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    expected = (layer_params(arch) + arch.hidden_size + head) * 2 + kv_per_position * 10
    assert decode_bytes_per_step(arch, weight_bytes=2, kv_bytes=2, context_len=10) == expected


def test_prefill_flops_terms(tiny_model_dirs):
    arch = read_architecture(Path(tiny_model_dirs["llama-gqa"]))
    flops = prefill_flops(arch, 4)
    assert flops["linear"] == 2 * layer_params(arch) * 4
    # causal: 4·5/2 = 10 (query, key) pairs per head and layer, QKᵀ and PV at 2 FLOPs per multiply-add
    assert flops["attention"] == 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim * 10
    assert flops["total"] == flops["linear"] + flops["attention"] + flops["lm_head"]
