"""vLLM's KV cache events (engine/kv_events.py): what becomes findable, what is evicted, and
the reset, in the order they happened, with the fields vLLM gives them."""

from __future__ import annotations

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_events import KVEventLog


def _llm(model, **kw):
    return LLM(model, dtype="float32", cpu_kernels=False, block_size=4, enable_kv_cache_events=True, **kw)


def test_stored_blocks_carry_their_hashes_parents_and_tokens(tiny_llama):
    llm = _llm(tiny_llama, kv_cache_memory="1MiB")
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks of the prompt
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    events = llm.engine.kv_events.since(0)["events"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == 4
    hashes = [h for e in stored for h in e["block_hashes"]]
    tokens = [t for e in stored for t in e["token_ids"]]
    assert tokens == (prompt + tokens[10:])[: len(tokens)] and len(tokens) == 4 * len(hashes)
    for a, b in zip(stored, stored[1:]):  # each run's parent is the block before it
        assert b["parent_block_hash"] == a["block_hashes"][-1]
    assert [e["seq"] for e in events] == list(range(len(events)))


def test_eviction_and_reset_are_reported(tiny_llama):
    llm = _llm(tiny_llama, kv_cache_memory=8 * 4 * 512)  # 8 blocks of 4 positions (c_kv 512 B): new prompts evict the old
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(6):
        llm.generate([[30 + 7 * i + j for j in range(12)]], params)
    kinds = [e["type"] for e in llm.engine.kv_events.since(0)["events"]]
    assert "BlockRemoved" in kinds and kinds.index("BlockStored") < kinds.index("BlockRemoved")
    assert llm.engine.reset_prefix_cache()
    assert llm.engine.kv_events.since(0)["events"][-1]["type"] == "AllBlocksCleared"


def test_the_log_is_bounded_and_says_when_a_reader_fell_behind():
    log = KVEventLog(max_events=3)
    for i in range(5):
        log.removed([bytes([i])])
    page = log.since(0)
    assert page["dropped"] and [e["seq"] for e in page["events"]] == [2, 3, 4] and page["next_seq"] == 5
    assert log.since(5) == {"events": [], "next_seq": 5, "dropped": False}


def test_off_by_default(tiny_llama):
    assert LLM(tiny_llama, dtype="float32", cpu_kernels=False).engine.kv_events is None
