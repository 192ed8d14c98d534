"""The KV pool held to sliding windows (engine/kv_groups.py, engine/kv_cache.py): a request
past its window gives blocks back as it decodes, counted step by step against the formula the
start-up report, the planner and the simulator use, its tokens still transformers'; a prefix
hit past the window is exact; a pool too small for a request's every position serves it; and
the arithmetic of a real Gemma 3 shape (global layers × S + local layers × W)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.arch_presets import PRESETS
from kvserve.config import EngineConfig
from kvserve.engine.describe import describe
from kvserve.engine.engine import LLMEngine
from kvserve.engine.kv_groups import KVGroups
from tests.support.tiny_models import load_reference, make_tiny_model

WINDOW, BS = 8, 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    """Gemma 3's pattern on 7 layers: the 6th global, the others local with a window of 8."""
    path = tmp_path_factory.mktemp("swkv") / "gemma3"
    return str(make_tiny_model(path, model_type="gemma3_text", num_heads=4, num_kv_heads=2, hidden_size=64, head_dim=32,
                               num_layers=7, sliding_window=WINDOW))  # fmt: skip


def _transformers_tokens(path: str, prompt: list[int], n: int) -> list[int]:
    ref, tokens = load_reference(Path(path)), list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(ref(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_a_request_past_its_window_gives_blocks_back_as_it_decodes(gemma3):
    engine = LLMEngine(EngineConfig(model=gemma3, dtype="float32", kv_cache_memory="2MiB", block_size=BS))
    groups, kv = engine.layout.groups, engine.kv_cache
    assert groups is not None and groups.group_windows.count(None) == 1 and groups.num_groups == 7
    prompt = list(range(5, 45))  # 40 positions, five windows
    engine.add_request("r", prompt, GREEDY)
    held, frees, reads = [], [], []
    c_kv = engine.layout.kv_bytes_per_position
    while engine.has_unfinished_requests():
        before = engine.counters.attention_kv_bytes_read_without_sharing
        engine.step()
        req = next((r for r in engine.scheduler.running if r.request_id == "r"), None)
        if req is not None:
            held.append((req.num_computed_tokens, kv.num_blocks_held("r")))
            frees.append(kv.num_window_frees)
            reads.append(engine.counters.attention_kv_bytes_read_without_sharing - before)
    # KV read per decode step, averaged over the layers: the global layer its n positions, each
    # of the 6 local ones its window's 8
    for (n, _), read in list(zip(held, reads))[1:]:
        assert read == (n + 6 * min(n, WINDOW)) // 7 * c_kv, (n, read)
    # every decode step: exactly what the report's, the planner's and the simulator's formula holds
    for n, blocks in held[1:]:
        assert blocks == groups.blocks_held(n, BS), (n, blocks)
    # and far less than every position of every layer: the global group's ceil(n/4), each local one's ~3
    n, blocks = held[-1]
    assert blocks <= -(-n // BS) + 6 * (-(-WINDOW // BS) + 1) < 7 * -(-n // BS)
    # the prompt in one step holds every position; the first decode step gives the local groups'
    # old blocks back, and each later one as its window moves on past a block
    assert frees[0] == 0 < frees[1] < frees[-1]
    assert kv.num_free_blocks() == kv.num_blocks  # all back once it finished


def test_tokens_equal_transformers_and_a_prefix_hit_past_the_window_is_exact(gemma3):
    prompt = list(range(5, 45))
    want = _transformers_tokens(gemma3, prompt, GREEDY.max_tokens)
    llm = LLM(gemma3, dtype="float32", kv_cache_memory="2MiB", block_size=BS)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    # the same prompt again: its global group's blocks from the start and each local group's
    # last window are found; the rest is computed from there
    kv = llm.engine.kv_cache
    hits = kv.prefix_hits
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert kv.prefix_hits - hits >= 32  # at least 8 of the 9 full blocks before the last token
    # a longer prompt sharing it: a hit past the window, then more positions past it
    longer = prompt + list(range(60, 70))
    hits = kv.prefix_hits
    got = llm.generate([longer], GREEDY)[0].outputs[0].token_ids
    assert kv.prefix_hits - hits >= 32
    assert got == _transformers_tokens(gemma3, longer, GREEDY.max_tokens)


def test_a_pool_too_small_for_every_position_serves_the_request(gemma3):
    """128 blocks of 4 positions x 1 layer: a 200-position request keeping every layer would need
    7 x 50 = 350; held to the window it needs the global group's 50 and at most 7 per local group
    (its window and a chunk of 16)."""
    c_layer = LLMEngine(EngineConfig(model=gemma3, dtype="float32", kv_cache_memory="1MiB")).layout.kv_bytes_per_position // 7
    llm = LLM(gemma3, dtype="float32", kv_cache_memory=128 * BS * c_layer, block_size=BS, max_num_batched_tokens=16,
              max_model_len=256)  # fmt: skip
    assert llm.engine.layout.num_blocks == 128
    prompt = list(range(5, 45)) * 4 + list(range(5, 25))  # 180 positions, 20 more decoded
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert got == _transformers_tokens(gemma3, prompt, 20)
    report = describe(llm.engine)
    assert "KV held to the window: 7 KV groups (1 global group, 6 window-8 groups of 1 layers)" in report


def test_gemma_3_1b_arithmetic_at_8192_positions():
    """The issue's bound, global layers x 8192 + local layers x window, in the engine's groups,
    the planner's KV per request and the blocks a request holds."""
    from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS, PlanInputs, make_plan

    arch = PRESETS["gemma-3-1b"]
    groups = KVGroups.for_windows(arch.layer_windows)
    assert (groups.layers_per_block, groups.group_windows) == (4, (None,) + (512,) * 6)
    assert groups.empty_slots == 2  # 22 local layers in 6 groups of 4
    bound = 4 * 8192 + 22 * 512
    assert groups.positions_held(8192) == bound
    # in blocks of 16 positions x 4 layers: the global group's 512, each local group's 32
    assert groups.blocks_held(8192, 16) == 512 + 6 * 32
    plan = make_plan(PlanInputs(MODEL_PRESETS["gemma-3-1b"], CHIP_PRESETS["h100"], history_positions=8192))
    c_layer = plan["kv_bytes_per_position"] / arch.num_layers
    assert plan["kv_bytes_per_request"] == pytest.approx(bound * c_layer)
    assert plan["kv_bytes_per_request_every_position"] == pytest.approx(8192 * 26 * c_layer)


def test_the_simulator_holds_the_same_windows():
    """A simulated instance of a Gemma-3-1B datasheet model: its pool in the engine's KV groups,
    a request of 8,192 positions holding the blocks the engine's formula says."""
    from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS
    from kvserve.sim.instance import InstanceSpec, SimInstance
    from kvserve.sim.step_model import TensorParallel, from_datasheet

    arch = PRESETS["gemma-3-1b"]
    c_kv = arch.kv_bytes_per_position(2)
    model = from_datasheet(MODEL_PRESETS["gemma-3-1b"], CHIP_PRESETS["h100"], 2, c_kv, 0.4, model_len=32768)
    assert model.layer_windows == arch.layer_windows
    inst = SimInstance("a", "both", InstanceSpec(kv_cache_memory="1GiB"), model, TensorParallel(1), c_kv, 32768, lambda: 0.0)
    groups = inst.kv.groups
    assert groups == KVGroups.for_windows(arch.layer_windows)
    # 1 GiB in blocks of 16 positions x 4 layers; a request of 8,192 holds 704 of them, not 7 x 512
    assert inst.kv.num_blocks == 2**30 // (16 * 4 * (c_kv // 26)) - 1
    assert groups.blocks_held(8192, 16) == 704
    assert inst.max_model_len == 32768  # the whole context fits alone, held to the windows


def test_a_hit_needs_only_the_window_of_a_sliding_group():
    """One global and one sliding group (window 8, blocks of 4): after a 40-position request
    decodes once, the sliding group's blocks 0-7 are given back, and another request evicts
    them; a request continuing the same 40 positions still hits all of them, from the global
    group every block, from the sliding group only blocks 8 and 9 (the positions 33-39 the
    query at 40 sees)."""
    from kvserve.engine.kv_cache import KVCacheManager
    from kvserve.engine.request import Request

    groups = KVGroups.for_windows((None, WINDOW))
    kv = KVCacheManager(1 + 30, BS, groups=groups)  # block 0 reserved
    prompt = list(range(100, 140))
    a = Request("a", prompt, SamplingParams(temperature=0, max_tokens=4), block_size=BS)
    assert kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1)  # the decode step at 40: the sliding group keeps blocks 8-10
    assert kv.num_blocks_held("a") == 11 + 3 and kv.num_window_frees == 8
    kv.free(a)
    # 16 blocks: the 6 never used, the 8 given back first, then a's last block in each group
    filler = Request("f", list(range(500, 532)), SamplingParams(temperature=0, max_tokens=1), block_size=BS)
    assert kv.allocate_slots(filler, 32)
    kv.free(filler)
    again = Request("b", prompt + [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4), block_size=BS)
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 40
    assert len(hits[0]) == 10 and all(b is not None for b in hits[0])
    assert [b is not None for b in hits[1]] == [False] * 8 + [True] * 2
    # and a prompt that stops at 36 cannot hit its last 9 blocks: the query at 36 would see
    # positions 29-35, and block 7 of the sliding group is gone; it hits nothing shorter either
    shorter = Request("c", prompt[:37], SamplingParams(temperature=0, max_tokens=4), block_size=BS)
    assert kv.get_computed_blocks(shorter)[1] == 0


def test_a_later_groups_hit_is_never_handed_out_as_an_earlier_groups_new_block():
    """A request's sliding-group block given back early sits at the head of the free queue; a
    new request hitting it must take it out before the global group draws its new block, or
    the two groups would share one block and overwrite each other's KV."""
    from kvserve.engine.kv_cache import KVCacheManager
    from kvserve.engine.request import Request

    kv = KVCacheManager(1 + 8, BS, groups=KVGroups.for_windows((None, WINDOW)))
    prompt = list(range(100, 112))
    a = Request("a", prompt, SamplingParams(temperature=0, max_tokens=4), block_size=BS)
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1)  # at 12 the sliding group's block 0 goes back: the queue's head
    assert kv.num_window_frees == 1 and kv.num_free_blocks() == 1
    kv.free(a)
    b = Request("b", prompt[:4] + [1, 2], SamplingParams(temperature=0, max_tokens=4), block_size=BS)
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 4 and hits[1][0] is not None
    assert kv.allocate_slots(b, 2, hits)
    tables = kv.group_block_ids("b")
    assert tables[1][0] == hits[1][0].block_id
    assert not set(tables[0]) & set(tables[1])  # no block in both groups
