"""The planner's exact per-chip weight bytes (kvserve/planner/weight_shares.py) are the
engine's: summed from the shape, they equal the tensors `shard_weights` leaves rank 0
(replicated norms, K/V projections duplicated past N_kv ranks, ⌈V/N⌉ vocabulary rows, int8 /
int4 codes and scales), and `kvserve plan run --num-chips N` prints what each rank's
start-up report prints. Without the full shape the planner keeps the seed's W/N."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM
from kvserve.cli import main
from kvserve.distributed.sharding import plan_shard
from kvserve.model.shard_weights import shard_weights
from kvserve.engine.describe import tensor_parallel_line
from kvserve.errors import ConfigError
from kvserve.kernels import cpu_ops, layouts
from kvserve.model import quant_formats
from kvserve.arch import ModelArchitecture
from kvserve.model.loader import _quantizer
from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS, PlanInputs, from_hf_config, make_plan, weight_shares
from kvserve.planner.weight_shares import ShareUnknown, WeightStorage

# quant_linear runs at every kernel level; only a machine without one (or without a compiler) lacks it
needs_quant_kernel = pytest.mark.skipif(
    cpu_ops() is None or "quant_linear" not in cpu_ops().families(), reason="no quant_linear kernels here"
)


def _arch(nq=8, nkv=2, d=128, ffn=256, vocab=1000, layers=2, tied=False, bias=False) -> ModelArchitecture:
    return ModelArchitecture("qwen2" if bias else "llama", vocab, d, ffn, layers, nq, nkv, d // nq, 1e-6, 1e4, 512,
                             tied, attention_bias=bias)  # fmt: skip


def _random_weights(arch: ModelArchitecture, dtype: torch.dtype) -> dict:
    """A checkpoint's tensors under their HF names (what the loaders hand the engine)."""
    g = torch.Generator().manual_seed(0)
    D, H, F, V = arch.hidden_size, arch.head_dim, arch.intermediate_size, arch.vocab_size

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    w = {"model.embed_tokens.weight": t(V, D), "model.norm.weight": t(D)}
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = t(V, D)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        w |= {f"{p}.input_layernorm.weight": t(D), f"{p}.post_attention_layernorm.weight": t(D),
              f"{p}.self_attn.q_proj.weight": t(arch.num_heads * H, D), f"{p}.self_attn.k_proj.weight": t(arch.num_kv_heads * H, D),
              f"{p}.self_attn.v_proj.weight": t(arch.num_kv_heads * H, D), f"{p}.self_attn.o_proj.weight": t(D, arch.num_heads * H),
              f"{p}.mlp.gate_proj.weight": t(F, D), f"{p}.mlp.up_proj.weight": t(F, D), f"{p}.mlp.down_proj.weight": t(D, F)}  # fmt: skip
        if arch.attention_bias:
            w |= {f"{p}.self_attn.q_proj.bias": t(arch.num_heads * H), f"{p}.self_attn.k_proj.bias": t(arch.num_kv_heads * H),
                  f"{p}.self_attn.v_proj.bias": t(arch.num_kv_heads * H)}  # fmt: skip
    return w


def _nbytes(weights: dict) -> int:
    return sum(x.nbytes if isinstance(x, quant_formats.QuantizedWeight) else x.numel() * x.element_size()
               for x in weights.values())  # fmt: skip


def _planner_share(arch: ModelArchitecture, world: int, storage: WeightStorage, rank: int = 0):
    return weight_shares.weight_share(arch, world, storage, rank=rank)


def _sharded(arch, world, rank, weights) -> dict:
    weights = dict(weights)
    shard_weights(weights, arch, plan_shard(arch, rank, world))
    return weights


def test_the_packed_grid_is_the_kernels_layouts():
    assert (weight_shares.GROUP_ROWS, weight_shares.BLOCK_COLS) == (layouts.GROUP, layouts.BLOCK)


SHAPES = {
    "gqa-vocab-1001": _arch(vocab=1001),  # ⌈1001/N⌉ rows on rank 0, fewer on the last
    "tied": _arch(nq=4, nkv=4, d=64, ffn=128, vocab=999, tied=True),  # one table, held once
    "qwen2-bias": _arch(nq=8, nkv=2, d=128, ffn=192, vocab=1003, bias=True),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float_share_is_the_sum_of_the_sliced_tensors(shape, world, dtype):
    arch = SHAPES[shape]
    weights = _random_weights(arch, dtype)
    storage = WeightStorage("float", torch.tensor([], dtype=dtype).element_size())
    for rank in range(world):
        sliced = _sharded(arch, world, rank, weights)
        share = _planner_share(arch, world, storage, rank)
        assert share.weight_bytes == _nbytes(sliced), (shape, world, rank)
        assert share.params == sum(x.numel() for x in sliced.values())
        s = weight_shares.rank_slices(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, arch.vocab_size, rank, world)
        engine = plan_shard(arch, rank, world)
        assert (s.q_heads, s.kv_heads, s.ffn, s.vocab, s.kv_replication) == (
            engine.q_heads, engine.kv_heads, engine.ffn, engine.vocab, engine.kv_replication)
    # rank 0 is the busiest, and past the KV heads (world 4 over 2) it holds more than W/N
    shares = [_planner_share(arch, world, storage, r).weight_bytes for r in range(world)]
    assert shares[0] == max(shares)
    assert shares[0] >= _nbytes(weights) / world


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_quantized_share_is_the_sum_of_the_packed_slices(quantization, world):
    # V = 1000 is off the packed grid (1000 % 16): the tables stay bf16, as the loader leaves them
    for arch in (_arch(vocab=320), _arch(vocab=1000), _arch(nq=8, nkv=2, d=128, ffn=256, vocab=320, tied=True)):
        transform = _quantizer(quantization)
        weights = {n: transform(n, t) for n, t in _random_weights(arch, torch.bfloat16).items()}
        for rank in range(world):
            share = _planner_share(arch, world, WeightStorage(quantization), rank)
            assert share.weight_bytes == _nbytes(_sharded(arch, world, rank, weights)), (arch.vocab_size, rank)


def test_a_quantized_cut_the_engine_refuses_is_unknown_to_the_planner():
    arch = _arch(ffn=224)  # down_proj's columns cut at 112: not whole blocks of 32
    weights = {n: _quantizer("int8")(n, t) for n, t in _random_weights(arch, torch.bfloat16).items()}
    with pytest.raises(ConfigError, match="cannot be split there"):
        _sharded(arch, 2, 0, weights)
    with pytest.raises(ShareUnknown, match="down_proj"):
        _planner_share(arch, 2, WeightStorage("int8"))
    with pytest.raises(ShareUnknown, match="query heads"):  # what plan_shard refuses
        _planner_share(arch, 3, WeightStorage("float", 2))


def test_plan_reports_the_share_and_capacity_uses_it(tiny_model_dirs):
    shape = from_hf_config(tiny_model_dirs["llama-8x2"])
    plans = {layout: make_plan(PlanInputs(shape, CHIP_PRESETS["h100"], num_chips=4, kv_layout=layout))
             for layout in ("heads", "requests")}  # fmt: skip
    share = plans["heads"]["weight_bytes_per_chip_sharded"]
    assert share == plans["requests"]["weight_bytes_per_chip_sharded"]  # both layouts split the weights alike
    assert share > plans["heads"]["weight_bytes_per_chip"]  # norms on every chip, K/V on 2 chips each
    h100 = CHIP_PRESETS["h100"]
    assert plans["heads"]["free_bytes_per_chip"] == h100.hbm_bytes - share
    # without the full shape (the seed's 70e9) the figure is n/a and capacity keeps W/N
    seed = make_plan(PlanInputs(MODEL_PRESETS["seed-70b"], h100, num_chips=8))
    assert seed["weight_bytes_per_chip_sharded"] is None
    assert seed["free_bytes_per_chip"] == h100.hbm_bytes - seed["weight_bytes_per_chip"]
    # the default model at 3 chips: 30·2 + 1 norms of 576 bf16 on every chip
    smol = make_plan(PlanInputs(MODEL_PRESETS["smollm2-135m"], h100, num_chips=3))
    assert smol["weight_bytes_per_chip_sharded"] - smol["weight_bytes_per_chip"] == pytest.approx((61 * 576 * 2) * 2 / 3)


def _quantizable_model(path):
    """llama-8x2's shape with F = 256, so every TP cut at 2 and 4 ranks falls on the packed grid
    (the tiny variants' F = 2D + 32 does not split into whole blocks of 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("world, quantization", [
    (2, None),
    (4, None),  # 4 ranks over 2 KV heads: K/V projections on 2 ranks each
    pytest.param(2, "int4", marks=needs_quant_kernel),  # int4 projections, int8 tables (world 4: the unit test)
])  # fmt: skip
def test_per_rank_weight_bytes_are_the_planners(tiny_model_dirs, tmp_path, capsys, world, quantization):
    """`kvserve plan run --num-chips N` gives the weight bytes each rank's start-up report
    gives: the weights in their format, one copy each. The CPU kernels' packed copies
    (oneDNN's for projections off the VNNI grid, AMX tiles beside the row-major weight on AMX
    machines) are machine-dependent: the report gives them apart, as bytes held, and with
    prepack_weights off (one copy of each weight) held and stored are the same."""
    model = tiny_model_dirs["llama-8x2"] if quantization is None else _quantizable_model(tmp_path / "llama-8x2-f256")
    extra = {} if quantization is None else {"quantization": quantization}
    llm = LLM(model, tensor_parallel_size=world, dtype="bfloat16", kv_cache_memory="2MiB", distributed_timeout_s=30,
              prepack_weights=quantization is None, **extra)  # fmt: skip
    try:
        engine = llm.engine
        S = engine.max_model_len
        held = engine.model.stored_weight_bytes()
        if quantization is not None:  # nothing packed beside the weights: held once
            assert engine.model.weight_bytes() == held
        flags = [] if quantization is None else ["--quantization", quantization]
        for layout in ("heads", "requests"):
            assert main(["plan", "run", "--model", model, "--chip", "h100", "--num-chips", str(world), "--kv-layout", layout,
                         "--history-positions", str(S), *flags, "--json"]) == 0  # fmt: skip
            q = json.loads(capsys.readouterr().out)["quantities"]
            assert q["weight_bytes_per_chip_sharded"]["value"] == held, layout
            assert q["weight_bytes_per_chip"]["value"] != held  # the seed's even split is not what a rank holds
        assert f"weights {held:,} bytes" in tensor_parallel_line(engine)
    finally:
        llm.engine.close()
