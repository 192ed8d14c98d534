"""Sliding-window attention (attention/sliding_window.py) past the window: the kernels' path
(every row on the decode kernel's ranged form) and the reference path (decode rows gathered
over their range, prompt chunks in query tiles) against attention with transformers' sliding
mask written out, over float and int8 pools, in steps that mix decodes with prompt chunks; and
--deterministic holding with windowed layers. (Whole models against transformers:
tests/model/test_architectures.py, tests/kernels/test_arch_levels.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.attention.kv_pool import gather, write_kv
from kvserve.attention.metadata import AttentionMetadata, PrefillSegment, context_slots
from kvserve.attention.paged import paged_attention
from kvserve.attention.sliding_window import WindowedRows
from kvserve.kernels import cpu_ops, unavailable_reason
from tests.support.tiny_models import make_tiny_model

ops = cpu_ops()  # rebound per level where tests/kernels' conftest runs it; here the native level
BS, N_Q, N_KV, H = 4, 4, 2, 32
# (context before the step, new positions): three decodes, one of them inside the window, and
# two prompt chunks, one over a cached history past the window, one fresh and longer than it
ROWS = [(20, 1), (3, 1), (9, 1), (14, 11), (0, 13)]


def _step(window: int, kv_dtype: torch.dtype, on_kernels: bool, seed: int = 0):
    """Pools holding every row's history and new K/V, the step's metadata and queries."""
    g = torch.Generator().manual_seed(seed)
    tables, next_block = [], 0
    for cached, new in ROWS:
        n = -(-(cached + new) // BS)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    shape = (next_block, BS, N_KV, H)
    int8 = kv_dtype == torch.int8
    k_pool = torch.zeros(shape, dtype=kv_dtype)
    v_pool = torch.zeros(shape, dtype=kv_dtype)
    k_scale = torch.zeros(shape[:3]) if int8 else None
    v_scale = torch.zeros(shape[:3]) if int8 else None
    qdtype = torch.bfloat16
    for table, (cached, new) in zip(tables, ROWS):
        slots = context_slots(table, cached + new, BS)
        kv = torch.randn(2, cached + new, N_KV, H, generator=g).to(qdtype if not int8 else torch.float32)
        if not int8:
            kv = kv.to(kv_dtype)
        write_kv(k_pool, v_pool, slots, kv[0], kv[1], k_scale, v_scale)
    decodes = [(t, r) for t, r in zip(tables, ROWS) if r[1] == 1]
    prefills, query_start = [], len(decodes)
    for table, (cached, new) in zip(tables, ROWS):
        if new > 1:
            prefills.append(PrefillSegment(query_start, new, cached, context_slots(table, cached + new, BS), None))
            query_start += new
    lens = [c + 1 for _, (c, _) in decodes]
    width = max(len(t) for t in tables)
    row_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t, (c, m) in zip(tables, ROWS) for _ in range(m)], dtype=torch.int32
    )
    row_lens = torch.tensor([c + j + 1 for c, m in ROWS for j in range(m)], dtype=torch.int32)
    if on_kernels:
        rows = WindowedRows.for_kernels(window, row_tables, row_lens)
    else:
        rows = WindowedRows.for_reference(window, [t for t, _ in decodes], lens, BS, torch.device("cpu"))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(decodes), decode_slots=None, decode_mask=None,
        decode_context_lens=None, decode_block_tables=None, prefills=prefills, windowed={window: rows},
    )  # fmt: skip
    q = torch.randn(int(row_lens.numel()), N_Q, H, generator=g).to(qdtype)
    return q, k_pool, v_pool, k_scale, v_scale, meta, tables, row_lens


def _expected(q, k_pool, v_pool, k_scale, v_scale, tables, row_lens, window, scale):
    """Every row alone over its whole history with transformers' sliding mask (key > p - W)."""
    out, r = torch.empty(q.shape, dtype=torch.float32), 0
    table_of_row = [t for t, (c, m) in zip(tables, ROWS) for _ in range(m)]
    for table, n in zip(table_of_row, row_lens.tolist()):
        slots = context_slots(table, n, BS)
        k = gather(k_pool, slots, k_scale, torch.float32).float().transpose(0, 1).repeat_interleave(N_Q // N_KV, 0)
        v = gather(v_pool, slots, v_scale, torch.float32).float().transpose(0, 1).repeat_interleave(N_Q // N_KV, 0)
        visible = torch.arange(n) > n - 1 - window
        out[r] = F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k, v, attn_mask=visible, scale=scale)[:, 0]
        r += 1
    return out


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
@pytest.mark.parametrize("on_kernels", [False, True], ids=["reference", "kernels"])
@pytest.mark.parametrize("window", [1, 8, 12])
def test_each_row_sees_only_its_window(window, on_kernels, kv_dtype):
    if on_kernels and ops is None:
        pytest.skip(f"CPU kernels unavailable: {unavailable_reason()}")
    scale = H**-0.5
    q, k_pool, v_pool, k_scale, v_scale, meta, tables, row_lens = _step(window, kv_dtype, on_kernels)
    got = paged_attention(q, k_pool, v_pool, meta, scale, ops if on_kernels else None, None, k_scale, v_scale, window)
    want = _expected(q, k_pool, v_pool, k_scale, v_scale, tables, row_lens, window, scale)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")
def test_deterministic_holds_with_windowed_layers(tmp_path):
    """--deterministic with every layer windowed (Mistral v0.1's kind, a window of 8): a
    request's tokens and logprobs, to the bit, alone or batched with prompts in chunks of 8."""
    path = str(make_tiny_model(tmp_path / "mistral", model_type="mistral", num_heads=4, num_kv_heads=2, hidden_size=256,
                               sliding_window=8))  # fmt: skip
    prompts = [list(range(10 + i, 40 + 2 * i)) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def result(o):
        c = o.outputs[0]
        return tuple(c.token_ids), tuple(tuple(sorted(d.items())) for d in c.logprobs)

    llm = LLM(path, dtype="bfloat16", deterministic=True, kv_cache_memory="4MiB")
    alone = [result(llm.generate([p], greedy)[0]) for p in prompts]
    chunked = LLM(path, dtype="bfloat16", deterministic=True, kv_cache_memory="4MiB", max_num_batched_tokens=16,
                  long_prefill_token_threshold=8)  # fmt: skip
    assert [result(o) for o in chunked.generate(prompts, greedy)] == alone


@pytest.mark.parametrize("config, windows", [
    # Mistral v0.1: every layer within its window
    (dict(model_type="mistral", sliding_window=4096), (4096,) * 4),
    # Mistral v0.2 and later: no window
    (dict(model_type="mistral", sliding_window=None), (None,) * 4),
    # Qwen2 under use_sliding_window, without `layer_types`: the layers from max_window_layers on
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2), (None, None, 32, 32)),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=32), (None,) * 4),
    # Gemma 3 without `layer_types`: every sliding_window_pattern-th layer global
    (dict(model_type="gemma3_text", sliding_window=512, sliding_window_pattern=2), (512, None, 512, None)),
    # the config's own kinds win
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2,
          layer_types=["sliding_attention", "full_attention"] * 2), (32, None, 32, None)),
])  # fmt: skip
def test_each_layers_window_is_read_from_the_config(config, windows):
    from kvserve.arch import ModelArchitecture

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    arch = ModelArchitecture.from_hf_config({**base, **config})
    assert arch.layer_windows == windows
    # Gemma 3's local layers turn with the local RoPE base; no other model has one
    assert [arch.layer_is_local(i) for i in range(4)] == [w is not None and config["model_type"] == "gemma3_text" for w in windows]
