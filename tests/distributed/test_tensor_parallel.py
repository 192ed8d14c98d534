"""Tensor parallelism over real torch.distributed process groups (gloo, ranks started by the
engine on this host): fp32 greedy tokens equal one process's, with KV heads split or
replicated, prefix caching and preemption; the shard plan; failures that name the problem."""

from __future__ import annotations

import os
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.distributed.launch import free_port
from kvserve.distributed.sharding import plan_shard
from kvserve.engine.describe import describe, tensor_parallel_line
from kvserve.errors import ConfigError
from kvserve.arch import ModelArchitecture
from tests.support.tensor_parallel import GREEDY, PROMPTS
from tests.support.tensor_parallel import greedy_tokens as _tokens



def _arch(num_heads, num_kv_heads, ffn=256, vocab=1000) -> ModelArchitecture:
    return ModelArchitecture("LlamaForCausalLM", vocab, 128, ffn, 2, num_heads, num_kv_heads, 16, 1e-6, 1e4, 512, False)


def test_shard_plan_splits_heads_and_replicates_kv_heads_past_their_count():
    a = _arch(8, 2)
    shards = [plan_shard(a, r, 2) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 8)] and [s.kv_heads for s in shards] == [(0, 1), (1, 2)]
    assert all(s.kv_replication == 1 for s in shards)
    shards = [plan_shard(a, r, 4) for r in range(4)]  # 4 ranks over 2 KV heads: each held twice
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)] and shards[0].kv_replication == 2
    assert [s.ffn for s in shards] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert [s.vocab for s in shards] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    # the seed's example: 16 chips over 8 KV heads keep 1/8 of the logical KV each
    s16 = plan_shard(_arch(32, 8, ffn=512), 5, 16)
    assert s16.num_kv_heads == 1 and s16.kv_replication == 2 and s16.q_heads == (10, 12) and s16.kv_heads == (2, 3)
    uneven = [plan_shard(_arch(8, 2, vocab=1001), r, 4).vocab for r in range(4)]
    assert uneven == [(0, 251), (251, 502), (502, 753), (753, 1001)]


@pytest.mark.parametrize("num_heads, num_kv_heads, world, match", [
    (9, 3, 2, "cannot split 9 query heads"),
    (12, 4, 3, "neither divides the other"),
])  # fmt: skip
def test_shard_plan_refuses_what_would_cut_a_head(num_heads, num_kv_heads, world, match):
    with pytest.raises(ConfigError, match=match):
        plan_shard(_arch(num_heads, num_kv_heads, ffn=240), 0, world)


@pytest.mark.parametrize("variant, worlds", [("llama-8x2", (2, 4)), ("llama-12x4", (2, 4)), ("qwen3", (2,)), ("phi3", (2,))])
def test_greedy_tokens_equal_one_process(tiny_model_dirs, variant, worlds):
    model = tiny_model_dirs[variant]
    expected, _ = _tokens(model, 1)
    for world in worlds:
        got, engine = _tokens(model, world)
        assert got == expected, f"TP {world}"
        assert engine.shard.world == world


def test_shared_memory_and_gloo_allreduce_give_the_same_tokens(tiny_model_dirs):
    """On one host the AllReduce goes through shared memory (auto); `gloo` forces the backend.
    Both equal one process, and the start-up notes say which ran."""
    model = tiny_model_dirs["llama-12x4"]
    expected, _ = _tokens(model, 1)
    for mode, shown in (("auto", "AllReduce: shared memory"), ("gloo", "AllReduce: gloo")):
        got, engine = _tokens(model, 2, tensor_parallel_allreduce=mode)
        assert got == expected and shown in describe(engine), mode


def test_with_preemption_and_chunked_prefill(tiny_model_dirs):
    model = tiny_model_dirs["llama-8x2"]
    prompts = [[3 + (i * 7 + j) % 200 for j in range(20)] for i in range(6)]
    # 24 blocks of 4 positions: six 30-position requests cannot all stay, so some are preempted
    # kv_cache_memory is per rank, and a rank of 2 holds half the KV heads: half the bytes
    # give both the same blocks, so the same schedule, preemptions included
    c_kv = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    chunked = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}
    expected, eng1 = _tokens(model, 1, prompts, kv_cache_memory=24 * 4 * c_kv, **chunked)
    got, eng2 = _tokens(model, 2, prompts, kv_cache_memory=24 * 4 * c_kv // 2, **chunked)
    assert got == expected
    assert eng1.layout.num_blocks == eng2.layout.num_blocks == 24
    assert eng1.scheduler.num_preemptions > 0 and eng2.scheduler.num_preemptions == eng1.scheduler.num_preemptions


@pytest.mark.parametrize("formats", [
    dict(dtype="float32", quantization="none", cpu_kernels=False),  # fp32, the plain-torch path: the check
    dict(),  # as served by default: its GGUF's Q4_1 weights, each rank's shard in that format, on the CPU kernels
], ids=["fp32", "q4_1-native"])  # fmt: skip
def test_default_model_at_tp_3(formats):
    """SmolLM2: 9 query heads, 3 KV heads, FFN 1536, a vocabulary of 49,152 over 3 ranks. In
    fp32 the tokens are one process's; in the file's Q4_1 each rank's partial sums of a
    row-parallel projection meet in one fp32 all-reduce, an order of additions one process
    does not take, so there the prompt's logprobs agree to a bf16 model's rounding (a near-tie
    of a later greedy token can go either way: on Zen 4, at avx2 and at avx512-bf16, the first
    prompt's 12 tokens parted after 5)."""
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)
    texts, logprobs, engines = [], [], []
    for tp in (1, 3):
        llm = LLM(None, tensor_parallel_size=tp, kv_cache_memory="32MiB", distributed_timeout_s=60, **formats)
        try:
            outs = llm.generate(prompts, params)
            texts.append([o.outputs[0].text for o in outs])
            logprobs.append([lp[tok] for o in outs for lp, tok in zip(o.prompt_logprobs, o.prompt_token_ids[1:])])
            engines.append(describe(llm.engine))
        finally:
            llm.engine.close()
    if formats:
        assert texts[0] == texts[1]
    else:
        assert [t[:7] for t in texts[0]] == [t[:7] for t in texts[1]]  # " Paris." and the first line of code
        # bf16 hidden states through 30 layers: the prompt's logprobs moved by up to 0.26 (at
        # avx2 and avx512-bf16 on Zen 4), as much as one bf16 step of a logit near 30
        assert max(abs(a - b) for a, b in zip(*logprobs)) <= 0.35
    if not formats:  # the shards kept the file's format (no float copy)
        assert "Q4_1 (native)" in engines[1] and "tensor parallel rank 0 of 3" in engines[1]


def test_a_model_that_does_not_split_is_refused_with_the_reason(tiny_model_dirs):
    with pytest.raises(ConfigError, match="3 ranks cannot split 8 query heads"):
        LLM(tiny_model_dirs["llama-8x2"], tensor_parallel_size=3, dtype="float32", cpu_kernels=False, kv_cache_memory="2MiB",
            distributed_timeout_s=20)  # fmt: skip


def test_a_dead_rank_fails_the_next_step_instead_of_hanging(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama-8x2"], tensor_parallel_size=2, dtype="float32", cpu_kernels=False,
              kv_cache_memory="2MiB", distributed_timeout_s=10)  # fmt: skip
    try:
        (worker,) = llm.engine._rank_procs
        os.kill(worker.pid, 9)
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(Exception):
            llm.generate([PROMPTS[0]], GREEDY)
        assert time.monotonic() - start < 30
    finally:
        try:
            llm.engine.close()
        except Exception:
            pass


def test_start_up_report_gives_each_ranks_share(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama-8x2"], tensor_parallel_size=4, dtype="float32", cpu_kernels=False,
              kv_cache_memory="2MiB", distributed_timeout_s=30)  # fmt: skip
    try:
        line = tensor_parallel_line(llm.engine)
        # rank 0 of 4 over 2 KV heads: 2 of the 8 query heads, KV head 0 held by 2 ranks
        assert "rank 0 of 4: query heads [0, 2), KV heads [0, 1) (each held by 2 ranks)" in line
        c_kv = 2 * 2 * 1 * 16 * 4  # K and V, 2 layers, 1 KV head, head_dim 16, fp32
        assert f"KV {c_kv:,} bytes/position" in line and line in describe(llm.engine)
    finally:
        llm.engine.close()


def _torchrun_serve(torchrun, node, rdzv, http, model, log, *extra):
    import subprocess

    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
           "--master-port", str(rdzv), "-m", "kvserve.cli", "serve", "--model", model, "--dtype", "float32",
           "--tensor-parallel-size", "2", "--port", str(http), "--no-cpu-kernels", "--distributed-timeout", "30", *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _torchrun():
    import shutil
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    return torchrun


def _both_refuse(torchrun, tmp_path, nodes: list[tuple[str, str]]) -> str:
    """Two torchrun "nodes", each with its (model, KV pool size): both must exit non-zero;
    rank 0's log, which says why."""
    rdzv, http = free_port(), free_port()
    procs = [_torchrun_serve(torchrun, node, rdzv, http, model, tmp_path / f"node{node}.log", "--kv-cache-memory", mem)
             for node, (model, mem) in enumerate(nodes)]  # fmt: skip
    for p in procs:
        p.wait(timeout=120)
    assert all(p.returncode != 0 for p in procs)
    return (tmp_path / "node0.log").read_text()


def test_ranks_started_with_different_flags_refuse_to_start(tiny_model_dirs, tmp_path):
    """torchrun gives each rank its own command line: a rank whose KV pool differs from rank 0's
    makes every rank refuse, with a message naming the rank and what differs."""
    torchrun, model = _torchrun(), tiny_model_dirs["llama-8x2"]
    log = _both_refuse(torchrun, tmp_path, [(model, "2MiB"), (model, "4MiB")])
    assert "rank 1 differs from rank 0 in blocks" in log, log[-3000:]


def test_ranks_given_different_model_files_refuse_to_start(tiny_model_dirs, tmp_path):
    """Two hosts' copies of "the same" model that differ in their weights (same name, same
    shape, one tensor's bytes changed): the fingerprint of the files differs, and every rank
    refuses with the rank and the files named."""
    import shutil

    torchrun, model = _torchrun(), tiny_model_dirs["llama-8x2"]
    copy = tmp_path / "other" / "llama-8x2"
    shutil.copytree(model, copy)
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # the last tensor's last values become 0.0: still a loadable file
    weights.write_bytes(bytes(data))
    log = _both_refuse(torchrun, tmp_path, [(model, "2MiB"), (str(copy), "2MiB")])
    assert "rank 1 differs from rank 0 in model files" in log, log[-3000:]


def test_two_node_torchrun_launch_serves_the_same_tokens(tiny_model_dirs, tmp_path):
    """Two torchrun "nodes" on this machine (one rank each, a static rendezvous on loopback):
    rank 0 serves the OpenAI API, rank 1 follows its steps; the official client gets the
    tokens one process gives."""
    import signal
    import subprocess

    import openai

    torchrun, model = _torchrun(), tiny_model_dirs["llama-8x2"]
    rdzv, http = free_port(), free_port()
    procs = [_torchrun_serve(torchrun, node, rdzv, http, model, tmp_path / f"node{node}.log", "--kv-cache-memory", "2MiB")
             for node in (0, 1)]  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 90
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-3000:]
                assert all(p.poll() is None for p in procs), (tmp_path / "node0.log").read_text()[-3000:]
                time.sleep(0.5)
        got = client.completions.create(model="llama-8x2", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        llm = LLM(model, dtype="float32", device="cpu", kv_cache_memory="2MiB", cpu_kernels=False)
        want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        assert got.choices[0].text == want
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_bench_latency_prints_collective_time_beside_the_step(tiny_model_dirs, tmp_path, capsys):
    import json

    from kvserve.cli import main

    out = tmp_path / "lat.json"
    code = main(["bench", "latency", "--model", tiny_model_dirs["llama-8x2"], "--dtype", "float32", "--tensor-parallel-size", "2",
                 "--no-cpu-kernels", "--kv-cache-memory", "2MiB", "--prompt-lens", "8", "--decode-context-len", "16",
                 "--decode-steps", "4", "--decode-warmup-steps", "1", "--read-mib", "8", "--gemm-size", "64",
                 "--calibration-seconds", "0.05", "--distributed-timeout", "30", "--json", str(out)])  # fmt: skip
    assert code == 0
    decode = json.loads(out.read_text())["results"]["decode"]
    comm = decode["comm_ms_per_step"]
    assert decode["tensor_parallel_size"] == 2 and set(comm) == {"all_reduce", "all_gather", "broadcast"}
    assert all(v > 0 for v in comm.values())
    assert "tensor parallel, 2 ranks" in capsys.readouterr().out


def test_each_rank_runs_the_cpu_kernels_on_its_share(tiny_model_dirs):
    """head_dim 64: the kernels take each rank's heads (KV heads replicated at TP 4 too); the
    fused all-layers step is off under TP (no AllReduce between its layers)."""
    model = tiny_model_dirs["llama-8x2-hd64"]
    expected, engine1 = _tokens(model, 1, cpu_kernels=True, kv_cache_memory="8MiB")
    for world in (2, 4):
        got, engine = _tokens(model, world, cpu_kernels=True, kv_cache_memory="8MiB")
        assert got == expected, f"TP {world}"
        if engine1.kernels.decode_attention.enabled:
            assert engine.kernels.decode_attention.enabled and engine.model.fused_decode_rows() == 0


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_kv_bytes_are_the_planners(tiny_model_dirs, capsys, world):
    """`kvserve plan run --num-chips N --kv-layout heads` for the same model gives the KV heads
    per chip and the KV bytes per request per chip that each rank's start-up report gives
    (at 4 ranks over 2 KV heads, with the replication both count)."""
    import json

    from kvserve.cli import main

    model = tiny_model_dirs["llama-8x2"]
    llm = LLM(model, tensor_parallel_size=world, dtype="bfloat16", kv_cache_memory="2MiB", distributed_timeout_s=30)
    try:
        engine = llm.engine
        S = engine.max_model_len
        assert main(["plan", "run", "--model", model, "--chip", "h100", "--num-chips", str(world), "--kv-layout", "heads",
                     "--history-positions", str(S), "--json"]) == 0  # fmt: skip
        q = json.loads(capsys.readouterr().out)["quantities"]
        assert q["kv_heads_per_chip"]["value"] == engine.shard.num_kv_heads
        assert q["kv_bytes_per_request_per_chip"]["value"] == engine.layout.kv_bytes_per_position * S
        assert f"{engine.layout.kv_bytes_per_position * S:,} bytes per request" in tensor_parallel_line(engine)
    finally:
        llm.engine.close()
