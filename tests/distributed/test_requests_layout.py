"""The requests KV layout (`--kv-layout requests`): each rank keeps whole requests' KV, every
KV head, and the heads of each row move to its request's rank and back per layer (all-to-all).
Real gloo process groups on this host; fp32 greedy tokens equal one process's. Placement and
per-rank prefix caching are also tested on their own, without processes."""

from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.describe import tensor_parallel_line
from kvserve.engine.kv_placement import RequestShardedKVCache
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.errors import ConfigError
from tests.support.tensor_parallel import GREEDY, PROMPTS, greedy_tokens

def _run(model, tp, layout="requests", prompts=PROMPTS, **config):
    return greedy_tokens(model, tp, prompts, kv_layout=layout, **config)


@pytest.mark.parametrize("variant", ["llama-8x2", "llama-12x4"])
def test_greedy_tokens_equal_one_process(tiny_model_dirs, variant):
    """TP 2 and TP 4 (4 ranks over 2 KV heads: the heads layout would replicate them; here each
    rank keeps both KV heads of its own requests), prefix hits as many as one process's."""
    model = tiny_model_dirs[variant]
    expected, one = _run(model, 1, "heads")
    for world in (2, 4):
        got, engine = _run(model, world)
        assert got == expected, f"TP {world}"
        assert engine.requests_layout and engine.kv_cache.prefix_hits == one.kv_cache.prefix_hits > 0
        assert "KV layout requests" in tensor_parallel_line(engine)


def test_requests_spread_over_the_ranks_and_each_rank_caches_its_own_prefixes(tiny_model_dirs):
    """Over gloo's all-to-all (the other tests go through the shared-memory one)."""
    prompts = [[3 + (i * 11 + j) % 150 for j in range(9)] for i in range(8)]  # no common prefix
    expected, _ = _run(tiny_model_dirs["llama-8x2"], 1, "heads", prompts)
    got, engine = _run(tiny_model_dirs["llama-8x2"], 2, prompts=prompts, tensor_parallel_allreduce="gloo")
    assert got == expected
    cached = [m.pool.num_cached_blocks for m in engine.kv_cache.ranks]
    assert all(c > 0 for c in cached), cached  # both ranks held requests, each caching them in its own pool


def test_with_preemption_and_chunked_prefill(tiny_model_dirs):
    model = tiny_model_dirs["llama-8x2"]
    prompts = [[3 + (i * 7 + j) % 200 for j in range(20)] for i in range(6)]
    c_kv = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32: every KV head on each rank
    chunked = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}
    expected, _ = _run(model, 1, "heads", prompts, kv_cache_memory=24 * 4 * c_kv, **chunked)
    # 12 blocks per rank: six 30-position requests over two ranks cannot all stay
    got, engine = _run(model, 2, prompts=prompts, kv_cache_memory=12 * 4 * c_kv, **chunked)
    assert got == expected
    assert engine.layout.num_blocks == 12 and engine.scheduler.num_preemptions > 0


def test_on_the_cpu_kernels(tiny_model_dirs):
    """head_dim 64: each rank's attention runs the kernels with all heads of its rows."""
    model = tiny_model_dirs["llama-8x2-hd64"]
    expected, engine1 = _run(model, 1, "heads", cpu_kernels=True, kv_cache_memory="8MiB")
    got, engine = _run(model, 4, cpu_kernels=True, kv_cache_memory="8MiB")
    assert got == expected
    assert engine.kernels.decode_attention.enabled == engine1.kernels.decode_attention.enabled


def test_per_rank_kv_bytes_are_the_planners(tiny_model_dirs, capsys):
    """`kvserve plan run --kv-layout requests`: c_kv and the KV of one request on the rank that
    holds it are the whole request's (no head split, no replication), as the start-up line says.
    In bf16 on the CPU kernels the exchange moves bf16, and the tokens are the heads layout's:
    the projections and their AllReduces are the same, and each head's attention is the same
    computation on whichever rank it runs."""
    from kvserve.cli import main

    model = tiny_model_dirs["llama-8x2"]
    llm = LLM(model, tensor_parallel_size=4, kv_layout="requests", dtype="bfloat16", kv_cache_memory="2MiB",
              distributed_timeout_s=30)  # fmt: skip
    try:
        engine = llm.engine
        S = engine.max_model_len
        assert main(["plan", "run", "--model", model, "--chip", "h100", "--num-chips", "4", "--kv-layout", "requests",
                     "--history-positions", str(S), "--json"]) == 0  # fmt: skip
        q = json.loads(capsys.readouterr().out)["quantities"]
        assert q["kv_bytes_per_position"]["value"] == engine.layout.kv_bytes_per_position
        assert q["kv_bytes_per_request"]["value"] == engine.layout.kv_bytes_per_position * S
        assert q["kv_replication_factor"]["value"] == 1
        assert f"{engine.layout.kv_bytes_per_position * S:,} bytes per request" in tensor_parallel_line(engine)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()
    heads = LLM(model, tensor_parallel_size=4, dtype="bfloat16", kv_cache_memory="2MiB", distributed_timeout_s=30)
    try:
        assert got == [o.outputs[0].token_ids for o in heads.generate(PROMPTS, GREEDY)]
    finally:
        heads.engine.close()


def test_bench_latency_prints_the_all_to_all(tiny_model_dirs, tmp_path, capsys):
    from kvserve.cli import main

    out = tmp_path / "lat.json"
    code = main(["bench", "latency", "--model", tiny_model_dirs["llama-8x2"], "--dtype", "float32", "--tensor-parallel-size", "2",
                 "--kv-layout", "requests", "--no-cpu-kernels", "--kv-cache-memory", "2MiB", "--prompt-lens", "8",
                 "--decode-context-len", "16", "--decode-steps", "4", "--decode-warmup-steps", "1", "--read-mib", "8",
                 "--gemm-size", "64", "--calibration-seconds", "0.05", "--distributed-timeout", "30", "--json", str(out)])  # fmt: skip
    assert code == 0
    decode = json.loads(out.read_text())["results"]["decode"]
    assert decode["kv_layout"] == "requests" and decode["comm_ms_per_step"]["all_to_all"] > 0
    assert "KV layout requests" in capsys.readouterr().out


def test_an_unknown_layout_is_refused():
    with pytest.raises(ConfigError, match="kv_layout"):
        EngineConfig(kv_layout="rows")


# ---- placement, without processes ----------------------------------------------------------


def _request(rid: str, tokens: list[int], block_size: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), block_size=block_size)


def _admit(kv: RequestShardedKVCache, req: Request) -> int:
    blocks, cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - cached, blocks)
    req.num_computed_tokens = req.num_tokens
    return kv.ranks_of([req.request_id])[req.request_id]


def test_placement_balances_blocks_without_shared_prefixes():
    kv = RequestShardedKVCache(2, 64, 4)
    ranks = [_admit(kv, _request(str(i), [100 + 10 * i + j for j in range(8)])) for i in range(6)]
    assert ranks == [0, 1, 0, 1, 0, 1]
    assert [m.num_free_blocks() for m in kv.ranks] == [58, 58]


def test_placement_follows_the_prefix_cache_within_the_bound():
    """Requests sharing a 16-token prompt go to the rank that has it cached until that rank
    holds an eighth of a pool (8 blocks here) more than the other; the other then computes
    the prefix once and hits it from then on."""
    kv = RequestShardedKVCache(2, 64, 4)
    prefix = list(range(1, 17))
    ranks = [_admit(kv, _request(str(i), prefix + [200 + i, 201 + i])) for i in range(12)]
    assert ranks[0] == 0 and ranks[1] == 0  # the second hits the first's four blocks
    assert 1 in ranks  # the bound moved some to rank 1
    used = [m.num_blocks - m.num_free_blocks() for m in kv.ranks]
    assert abs(used[0] - used[1]) <= 8 + 5
    hits_per_rank = [sum(1 for b in m.pool.blocks if b.ref_cnt > 1) for m in kv.ranks]
    assert all(h == 4 for h in hits_per_rank)  # the prefix stored once on each rank, shared by its requests


def test_preemption_takes_a_victim_from_the_same_rank():
    """Freeing another rank's blocks cannot make room: when rank 0's pool runs out, the
    scheduler preempts the latest admitted request on rank 0, not the latest of all (on rank 1)."""
    config = EngineConfig(kv_cache_memory="1MiB", block_size=4, max_num_batched_tokens=64)
    sched = Scheduler(config, RequestShardedKVCache(2, 4, 4))
    a, b, c = (_request(x, [10 * i + j + 1 for j in range(7)]) for i, x in enumerate("abc"))  # 2 blocks each
    d = _request("d", [90, 91])  # 1 block
    for r in (a, b, c, d):
        sched.add_request(r)

    def step():
        out = sched.schedule()
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            s.request.append_output_token(1)
        return out

    placed = step().kv_ranks
    assert placed == {"a": 0, "b": 1, "c": 0, "d": 1}  # rank 0 full (4 blocks), rank 1 has one free
    assert not step().preempted  # position 7 fits the second blocks
    out = step()  # a's position 8 needs a third block on rank 0
    assert [r.request_id for r in out.preempted] == ["c"]
    assert {s.request.request_id for s in out.scheduled} == {"a", "b", "d"}
