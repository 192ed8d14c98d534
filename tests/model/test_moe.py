"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers on the same
weights (tiny random models from transformers' own config classes, tests/support/tiny_models.py
MOE_VARIANTS), from the HF directory and from a GGUF of it (experts stacked per layer as
llama.cpp writes them): logits in fp32 to 1e-4 after the prefill and each decode step, 32
greedy tokens, batched with chunked prefill, prefix hits and preemption; only the chosen experts
run (counted), a quantized expert's row does not depend on how many tokens share the expert, and
TP 2 gives one process's tokens. Every kernel level: tests/kernels/test_arch_levels.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.model.moe import SparseMoE
from tests.support.paged_driver import PagedDriver, assert_follows_reference
from tests.support.tiny_gguf import write_gguf
from tests.support.tiny_models import MOE_VARIANTS, load_reference, make_tiny_model

VARIANTS = list(MOE_VARIANTS)
# llama.cpp writes Mixtral as `llama` with experts
GGUF_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe", "olmoe": "olmoe"}
SOURCES = [pytest.param(v, s, id=f"{v}-{s}") for v in VARIANTS for s in ("hf", "gguf")]
PROMPT = "What is the capital of France? The capital"
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-hf")
    return {v: str(make_tiny_model(root / v, **kw)) for v, kw in MOE_VARIANTS.items()}


@pytest.fixture(scope="module")
def ggufs(model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-gguf")
    return {v: str(write_gguf(Path(model_dirs[v]), root / f"{v}.gguf", architecture=GGUF_ARCH[v])) for v in VARIANTS}


@pytest.fixture(scope="module")
def references(model_dirs):
    return {v: load_reference(Path(model_dirs[v])) for v in VARIANTS}


def _source(model_dirs, ggufs, variant: str, source: str) -> str:
    return model_dirs[variant] if source == "hf" else ggufs[variant]


@pytest.mark.parametrize("variant, source", SOURCES)
def test_logits_follow_transformers_in_fp32(model_dirs, ggufs, references, variant, source):
    path = _source(model_dirs, ggufs, variant, source)
    kw = MOE_VARIANTS[variant]
    for cpu_kernels in (False, True):
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory="8MiB", cpu_kernels=cpu_kernels))
        arch = engine.arch
        assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
            8, kw.get("num_experts_per_tok", 2), 32)
        assert arch.dense_layers == tuple(kw.get("mlp_only_layers", ()))
        assert arch.norm_topk_prob == (variant in ("mixtral", "qwen3-moe"))
        assert bool(arch.shared_expert_intermediate_size) == (variant == "qwen2-moe")
        sparse = [isinstance(layer.mlp, SparseMoE) for layer in engine.model.layers]
        assert sparse == [i not in arch.dense_layers for i in range(arch.num_layers)]
        assert engine.model.fused_decode_rows() == 0  # fp32: the fused step is bf16's (KernelSupport says so)
        prompt = engine.tokenizer.encode(PROMPT)
        assert_follows_reference(engine, references[variant], prompt, steps=6, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant, source", SOURCES)
def test_32_greedy_tokens_equal_transformers(model_dirs, ggufs, references, variant, source):
    llm = LLM(_source(model_dirs, ggufs, variant, source), dtype="float32", kv_cache_memory="8MiB")
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(32):
            tokens.append(int(references[variant](torch.tensor([tokens])).logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == tokens[len(prompt):]


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_chunked_prefix_hits_and_preemption_change_no_token(model_dirs, variant):
    """Requests sharing a prefix, run alone, then together in an engine whose pool cannot hold
    them all, prefill in chunks of 8, prefix caching on: the same tokens."""
    path = model_dirs[variant]
    prefix = list(range(10, 34))
    prompts = [prefix + [40 + i, 41 + i, 42 + 2 * i] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(path, dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    expected = [alone.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    c_kv = alone.engine.layout.kv_bytes_per_position
    tight = LLM(path, dtype="float32", block_size=4, kv_cache_memory=20 * 4 * c_kv, max_num_batched_tokens=16,
                long_prefill_token_threshold=8, max_model_len=64)  # fmt: skip
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv_cache.prefix_hits > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_experts_read_as_the_gguf_package_reads_them(ggufs, variant):
    """Every tensor of the GGUF as kvserve reads it equals gguf.GGUFReader's array; a stack of
    experts [E, rows, cols] is read as E weights, expert e's the stack's slice e."""
    import gguf

    from kvserve.model.gguf_loader import _hf_name, read_weights
    from kvserve.model.gguf_metadata import open_gguf, read_architecture

    header = open_gguf(ggufs[variant])
    arch = read_architecture(header, source=ggufs[variant])
    ours = read_weights(header, arch, torch.float32, path=Path(ggufs[variant]))
    names = set()
    for tensor in gguf.GGUFReader(ggufs[variant]).tensors:
        name = _hf_name(tensor.name, arch.architecture)
        expected = np.asarray(tensor.data).reshape([int(d) for d in reversed(tensor.shape)])
        if name.endswith("shared_expert_gate.weight"):
            expected = expected.reshape(1, -1)
        if "{e}" in name:
            assert expected.shape[0] == arch.num_experts
            for e in range(arch.num_experts):
                names.add(name.format(e=e))
                np.testing.assert_array_equal(ours[name.format(e=e)].numpy(), expected[e], err_msg=f"{tensor.name}[{e}]")
        else:
            names.add(name)
            if not (arch.architecture == "llama" and (".q_proj." in name or ".k_proj." in name)):  # llama.cpp's row order undone
                np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=tensor.name)
    assert names == set(ours)


def _moe_layer(engine) -> SparseMoE:
    return next(layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoE))


@pytest.mark.parametrize("variant", ["qwen2-moe", "olmoe"])
def test_a_step_runs_only_the_chosen_experts(model_dirs, variant):
    """A decode step of one request runs k experts per sparse layer and reads their bytes only;
    a step of several tokens runs each chosen expert once (the count is the distinct experts
    the router chose), and the counters say so."""
    engine = LLMEngine(EngineConfig(model=model_dirs[variant], dtype="float32", kv_cache_memory="8MiB"))
    model, arch = engine.model, engine.arch
    moe = _moe_layer(engine)
    calls: list[int] = []
    for e, mlp in enumerate(moe.experts):
        mlp.register_forward_hook(lambda m, args, out, e=e: calls.append(e))
    driver = PagedDriver(engine)
    req = driver.new_request(engine.tokenizer.encode(PROMPT))
    driver.prefill(req)
    assert len(calls) == len(set(calls)) > 0  # the prefill ran each chosen expert once, for all its tokens
    before = model.expert_counts.snapshot()
    calls.clear()
    driver.decode(req, 5)
    touched, nbytes, passes = (a - b for a, b in zip(model.expert_counts.snapshot(), before))
    assert passes == arch.num_sparse_layers
    assert touched == arch.num_sparse_layers * arch.num_experts_per_tok
    assert len(calls) == arch.num_experts_per_tok  # this layer's share of them
    per_expert = moe.expert_bytes(0)
    assert per_expert == 3 * arch.hidden_size * arch.moe_intermediate_size * 4  # fp32 gate, up and down
    assert nbytes == touched * per_expert
    # a batch of tokens: each distinct chosen expert once
    x = torch.randn(16, arch.hidden_size)
    _, chosen = moe.route(x)
    calls.clear()
    moe(x)
    assert sorted(calls) == sorted(set(chosen.flatten().tolist()))


@pytest.mark.parametrize("variant, quant_type", [("qwen2-moe", "Q8_0"), ("qwen2-moe", "Q4_0"), ("qwen3-moe", "Q4_0")])
def test_a_quantized_experts_row_is_the_same_however_many_tokens_share_it(model_dirs, tmp_path, variant, quant_type):
    """Quantized experts on quant_linear (bf16): a token's output alone (one C++ call,
    kernels/moe_token.cpp) equals its row in a batch where other tokens share its experts, and
    the Python one-token path, bit for bit; and near the plain-torch reference of the same
    quantized weights (the file dequantized, fp32). Qwen2-MoE: a shared expert, no
    renormalisation; Qwen3-MoE: the top k renormalised."""
    path = str(write_gguf(Path(model_dirs[variant]), tmp_path / f"m-{quant_type}.gguf", GGUF_ARCH[variant], quant_type))
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="8MiB"))
    if not engine.model.kernels.quant_linear.enabled:
        pytest.skip(f"quant_linear is off here: {engine.model.kernels.quant_linear.reason}")
    moe = _moe_layer(engine)
    assert all(m.gate_up.qweight is not None and m.down.qweight is not None for m in moe.experts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, engine.arch.hidden_size, generator=g).bfloat16()
    batched = moe(x)
    alone = torch.cat([moe(x[i : i + 1]) for i in range(x.shape[0])])
    _, chosen = moe.route(x)
    assert len(set(chosen.flatten().tolist())) < chosen.numel()  # experts shared between tokens
    assert torch.equal(batched, alone)
    assert moe._token_kernel() is not None  # the alone rows ran moe_token
    counted = moe.counts.snapshot()
    moe._token_experts = False  # the Python one-token path: the same ops, one at a time
    python = torch.cat([moe(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(python, alone)
    after = moe.counts.snapshot()
    assert after[0] - counted[0] == x.shape[0] * engine.arch.num_experts_per_tok  # both paths count alike
    plain = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory="8MiB", quantization="none", cpu_kernels=False))
    reference = _moe_layer(plain)(x.float())
    cos = torch.nn.functional.cosine_similarity(batched.float().flatten(), reference.flatten(), dim=0)
    assert cos > 0.99, cos


@pytest.mark.parametrize("variant, kv_layout", [("mixtral", "heads"), ("qwen2-moe", "heads"), ("olmoe", "heads"),
                                                ("olmoe", "requests"), ("qwen3-moe", "requests")])  # fmt: skip
def test_moe_at_tp_2_equals_one_process(model_dirs, variant, kv_layout):
    """Each expert's FFN (and the shared one) split over the ranks as a dense FFN, the router
    whole on each; OLMoE's norms over the whole projections take every rank's statistics."""
    from tests.support.tensor_parallel import greedy_tokens

    expected, _ = greedy_tokens(model_dirs[variant], 1)
    got, engine = greedy_tokens(model_dirs[variant], 2, kv_layout=kv_layout)
    assert got == expected and engine.shard.world == 2


def test_the_planners_expert_reads_match_the_engines_counter_under_uniform_routing(model_dirs):
    """A router whose rows are orthonormal, fed independent Gaussian tokens, routes uniformly:
    the distinct experts a pass of B tokens runs, and their bytes, average what the planner's
    E·(1 − (1 − k/E)^B) predicts, within 5% (planner/moe.py)."""
    from kvserve.planner.moe import expert_shape

    engine = LLMEngine(EngineConfig(model=model_dirs["olmoe"], dtype="float32", kv_cache_memory="8MiB"))
    arch, counts = engine.arch, engine.model.expert_counts
    moe = _moe_layer(engine)
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(arch.hidden_size, arch.num_experts, generator=g))
    moe.router.data.copy_(q.T * 4)  # orthonormal rows: every expert's logit the same law, independent
    shape = expert_shape(arch)
    for batch in (1, 2, 4, 8):
        before = counts.snapshot()
        passes = 300
        for _ in range(passes):
            moe(torch.randn(batch, arch.hidden_size, generator=g))
        touched = (counts.experts_touched - before[0]) / passes
        nbytes = (counts.expert_weight_bytes - before[1]) / passes
        assert touched == pytest.approx(shape.experts_touched(batch), rel=0.05), batch
        planned = shape.experts_touched(batch) * shape.expert_params * 4  # fp32 weights
        assert nbytes == pytest.approx(planned, rel=0.05), batch
    assert shape.experts_touched(1) == arch.num_experts_per_tok


def test_the_metrics_count_the_experts_a_served_request_ran(model_dirs, tmp_path):
    """A real server on the tiny OLMoE: /metrics' expert counters move with a completion, bytes
    the experts run times their size, beside the every-expert equivalent."""
    import httpx

    from tests.support.servers import API_KEY, ServerProcess, metrics

    proc = ServerProcess(model_dirs["olmoe"], tmp_path / "serve.log", "--api-key", API_KEY, "--kv-cache-memory", "4MiB")
    try:
        before = metrics(proc.url)
        body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(f"{proc.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert r.status_code == 200
        after = metrics(proc.url)
        stats = httpx.get(f"{proc.url}/v1/engine/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    finally:
        proc.terminate()

    # /v1/engine/stats carries the same totals (a dense model's "experts" is null)
    experts = stats["experts"]
    assert experts["layer_passes"] == after["kvserve:moe_layer_passes_total"]
    assert experts["experts_touched"] == after["kvserve:moe_experts_touched_total"]
    assert experts["experts_per_layer"] == experts["experts_touched"] / experts["layer_passes"]
    assert experts["weight_bytes_read"] == after["kvserve:moe_expert_weight_bytes_read_total"]
    assert experts["weight_bytes_dense_equivalent"] == after["kvserve:moe_expert_weight_bytes_dense_equivalent_total"]

    def moved(name: str) -> float:
        return after[f"kvserve:{name}_total"] - before[f"kvserve:{name}_total"]

    # the variant's shape: 2 layers, 8 experts of 64 x 32, the top 4; a prompt, then 3 decode steps
    passes, touched = moved("moe_layer_passes"), moved("moe_experts_touched")
    assert passes == 2 * 4  # 2 sparse layers x (one prefill step + 3 decode steps)
    assert 4 * passes <= touched <= 8 * passes  # at least k per pass (a decode step: exactly k), at most E
    per_expert = 3 * 64 * 32 * 4  # gate, up and down of 64 x 32, fp32
    assert moved("moe_expert_weight_bytes_read") == touched * per_expert
    assert moved("moe_expert_weight_bytes_dense_equivalent") == passes * 8 * per_expert


def test_mixtral_experts_quantize_at_load_and_hold_deterministic(tmp_path):
    """Mixtral's w1/w3/w2 are renamed as they are read, so `--quantization int8` quantizes every
    expert; under `--deterministic` a batch's tokens equal each request's alone (head_dim 32,
    the decode attention kernel's)."""
    from kvserve.kernels import cpu_ops, unavailable_reason

    if cpu_ops() is None:
        pytest.skip(f"the CPU kernels are unavailable: {unavailable_reason()}")
    path = str(make_tiny_model(tmp_path / "mixtral-hd32", **{**MOE_VARIANTS["mixtral"], "hidden_size": 128}))
    llm = LLM(path, dtype="bfloat16", quantization="int8", kv_cache_memory="8MiB", deterministic=True)
    moe = _moe_layer(llm.engine)
    assert all(m.gate_up.qweight is not None and m.down.qweight is not None for m in moe.experts)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(10, 30)), list(range(40, 47)), list(range(60, 73))]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert together == [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_batch_1_step_of_quantized_experts_is_one_call_with_the_layer_by_layer_bits(tmp_path, variant, monkeypatch):
    """bf16 with Q4_0 experts at head_dim 32: a batch-1 decode step runs every layer in one C++
    call (kernels/fused_decode.cpp: the sparse layers' experts by moe_token, Qwen2-MoE's shared
    expert, OLMoE's whole-projection q/k norms, Qwen3-MoE's dense first layer), its logits and
    expert counts the layer-by-layer path's, bit for bit; a batch of several rows decodes layer
    by layer (tokens grouped by expert) and its requests' tokens do not change with the fused step."""
    from kvserve.kernels import cpu_ops, unavailable_reason

    if cpu_ops() is None:
        pytest.skip(f"the CPU kernels are unavailable: {unavailable_reason()}")
    src = make_tiny_model(tmp_path / variant, **{**MOE_VARIANTS[variant], "hidden_size": 128})
    path = str(write_gguf(src, tmp_path / f"{variant}.gguf", GGUF_ARCH[variant], "Q4_0"))
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="8MiB")
    engine = llm.engine
    model = engine.model
    if not model.kernels.quant_linear.enabled:
        pytest.skip(f"quant_linear is off here: {model.kernels.quant_linear.reason}")
    assert model.fused_decode_rows() == 1, model.kernels.describe()
    assert all(moe._token_kernel() is not None for moe in model.sparse_layers())  # moe_token's experts
    module, batches = model.kernels.ops, []
    step = module.decode_layers

    def counted(*a):
        batches.append(a[1].shape[0])
        return step(*a)

    monkeypatch.setattr(module, "decode_layers", counted)
    prompt = engine.tokenizer.encode(PROMPT)
    runs = []
    for fused in (True, False):
        model.fused_decode = fused
        before = model.expert_counts.snapshot()
        driver = PagedDriver(engine)
        req = driver.new_request(prompt)
        logits = [driver.prefill(req)]
        for _ in range(4):
            logits.append(driver.decode(req, int(logits[-1].argmax())))
        driver.free(req)
        runs.append((torch.stack(logits), tuple(a - b for a, b in zip(model.expert_counts.snapshot(), before))))
    assert batches == [1] * 4
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    # three requests of different lengths: steps of 3, 2 and then 1 row (the last fused)
    prompts = [prompt, prompt[:5], prompt[:9]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    tokens = []
    for fused in (True, False):
        model.fused_decode = fused
        batches.clear()
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert (bool(batches) and set(batches) == {1}) == fused
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_in_transformers_stacked_expert_layout_loads(model_dirs, references, tmp_path, variant):
    """transformers 5 holds a layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2F, d],
    `down_proj` [E, d, F]) and its save_pretrained writes them back per expert; a checkpoint
    saved from the model's own state dict keeps them stacked. kvserve reads it as the
    per-expert one (families/experts.py unstack_experts): logits to transformers' in fp32, and
    `--quantization int8` quantizes every expert (the cut comes before quantization)."""
    import shutil

    from safetensors.torch import save_file

    from kvserve.kernels import cpu_ops

    ref = references[variant]
    state = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state) and not any(".experts.0." in k for k in state)
    stacked = tmp_path / variant
    shutil.copytree(model_dirs[variant], stacked, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file(state, str(stacked / "model.safetensors"))
    engine = LLMEngine(EngineConfig(model=str(stacked), dtype="float32", kv_cache_memory="8MiB"))
    prompt = engine.tokenizer.encode(PROMPT)
    assert_follows_reference(engine, ref, prompt, steps=4, atol=ATOL, rtol=RTOL)
    if cpu_ops() is not None:
        llm = LLM(str(stacked), dtype="bfloat16", quantization="int8", kv_cache_memory="8MiB")
        moe = _moe_layer(llm.engine)
        assert all(m.gate_up.qweight is not None and m.down.qweight is not None for m in moe.experts)


def test_stacked_experts_are_cut_per_expert_and_a_wrong_shape_is_named():
    from kvserve.errors import ModelLoadError
    from kvserve.families.experts import unstack_experts

    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # 2 experts, width 3, hidden 3
    parts = dict(unstack_experts("model.layers.4.mlp.experts.gate_up_proj", gate_up))
    assert sorted(parts) == [f"model.layers.4.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up")]
    assert torch.equal(parts["model.layers.4.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    down = dict(unstack_experts("model.layers.4.mlp.experts.down_proj", gate_up.transpose(1, 2)))
    assert torch.equal(down["model.layers.4.mlp.experts.0.down_proj.weight"], gate_up[0].T)
    assert unstack_experts("model.layers.4.mlp.experts.0.down_proj.weight", gate_up[0]) is None
    with pytest.raises(ModelLoadError, match=r"gate_up_proj: stacked experts must be .*got shape \[5, 3\]"):
        unstack_experts("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(5, 3))


@pytest.mark.parametrize("variant, quant_type", [("qwen2-moe", None), ("olmoe", "Q8_0"), ("qwen3-moe", "Q4_0")])
def test_a_gguf_with_fused_gate_up_experts_reads_as_the_split_one(model_dirs, tmp_path, variant, quant_type):
    """llama.cpp may write a layer's experts' gate and up as one `ffn_gate_up_exps` stack
    [E, 2F, d] (gate rows, then up rows): kvserve cuts each expert's rows in two, quantized
    blocks intact, and the model's weights and logits equal those of the same file written with
    `ffn_gate_exps` and `ffn_up_exps`, bit for bit."""
    src = Path(model_dirs[variant])
    split = write_gguf(src, tmp_path / "split.gguf", GGUF_ARCH[variant], quant_type)
    fused = write_gguf(src, tmp_path / "fused.gguf", GGUF_ARCH[variant], quant_type, fused_gate_up=True)
    import gguf

    assert any(t.name.endswith("ffn_gate_up_exps.weight") for t in gguf.GGUFReader(str(fused)).tensors)
    dtype = "float32" if quant_type is None else "bfloat16"
    runs = []
    for path in (split, fused):
        engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, kv_cache_memory="8MiB"))
        driver = PagedDriver(engine)
        req = driver.new_request(engine.tokenizer.encode(PROMPT))
        logits = [driver.prefill(req)]
        for _ in range(3):
            logits.append(driver.decode(req, int(logits[-1].argmax())))
        runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])
