"""Prefill/decode handoff between two engines (disagg/): the prefill engine runs the prompt
to its first token and sends the prompt's KV through the shared-memory transport; the decode
engine loads it and goes on. fp32 greedy tokens equal one colocated engine's; failures
recompute or fail as configured, and no block leaks on either side."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from kvserve import LLM, SamplingParams
from tests.support.faults import FaultyTransport

PROMPTS = [list(range(10, 31)), [5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(40, 47))]
_ids = itertools.count()


def _engine(model, role, **kw):
    return LLM(model, dtype="float32", cpu_kernels=False, block_size=4, kv_cache_memory="1MiB", kv_role=role, **kw).engine


def _run(engine, requests, timeout_s=60):
    """Add (request id, prompt, params, kv_transfer) and step until all finish; final outputs by id."""
    for rid, prompt, params, transfer in requests:
        engine.add_request(rid, prompt, params, kv_transfer=transfer)
    done, deadline = {}, time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _disaggregated(prefill, decode, prompts, params):
    tids = [f"test-{next(_ids)}" for _ in prompts]
    first = _run(prefill, [(f"p{i}", p, params, {"do_remote_decode": True, "transfer_id": t})
                           for i, (p, t) in enumerate(zip(prompts, tids))])  # fmt: skip
    rest = _run(decode, [(f"d{i}", p, params, {"do_remote_prefill": True, "transfer_id": t})
                         for i, (p, t) in enumerate(zip(prompts, tids))])  # fmt: skip
    return [first[f"p{i}"] for i in range(len(prompts))], [rest[f"d{i}"] for i in range(len(prompts))]


def _idle(engine):
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks() == engine.kv_cache.num_blocks  # nothing held


@pytest.mark.parametrize("logprobs", [None, 2])
def test_tokens_equal_one_colocated_engine(tiny_llama, logprobs):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=logprobs)
    want = _run(_engine(tiny_llama, "both"), [(str(i), p, params, None) for i, p in enumerate(PROMPTS)])
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode")
    first, rest = _disaggregated(prefill, decode, PROMPTS, params)
    for i in range(len(PROMPTS)):
        w = want[str(i)].outputs[0]
        assert first[i].outputs[0].token_ids == w.token_ids[:1]  # the prefill side stops at its first token
        assert first[i].kv_transfer_params["num_positions"] == len(PROMPTS[i]) and first[i].kv_transfer_params["bytes"] > 0
        got = rest[i].outputs[0]
        assert got.token_ids == w.token_ids and got.text == w.text
        assert rest[i].kv_transfer_params["loaded"] and rest[i].kv_transfer_params["error"] is None
        if logprobs:
            assert [list(d) for d in got.logprobs] == [list(d) for d in w.logprobs]
            assert got.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    assert prefill.connector.sent == decode.connector.received == len(PROMPTS)
    _idle(decode)
    assert prefill.kv_cache.num_free_blocks() == prefill.kv_cache.num_blocks  # freed, its prompts kept as prefix cache


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=3)], ids=["greedy", "seeded"])
def test_n_samples_start_from_one_handoff(tiny_llama, params):
    """n > 1 on the decode side: the first sample takes the handoff (and the prefill side's
    first token, sampled as one sample), the others start from its loaded prompt blocks and
    sample their own first tokens; the same samples as a colocated engine's."""
    want = _run(_engine(tiny_llama, "both"), [("x", PROMPTS[0], params, None)])["x"]
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode")
    tid = f"n-{next(_ids)}"
    _run(prefill, [("p", PROMPTS[0], dataclasses.replace(params, n=1), {"do_remote_decode": True, "transfer_id": tid})])
    got = _run(decode, [("d", PROMPTS[0], params, {"do_remote_prefill": True, "transfer_id": tid})])["d"]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert got.kv_transfer_params["loaded"] and decode.counters.computed_tokens < 2 * len(PROMPTS[0])
    _idle(decode)


def test_a_failed_handoff_under_fail_ends_every_sample(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    decode = _engine(tiny_llama, "decode", kv_transfer_failure="fail")
    decode.add_request("d", PROMPTS[1], params, kv_transfer={"do_remote_prefill": True, "transfer_id": "never-n"})
    decode.abandon_handoff("never-n", "the prefill instance answered 500")
    done = _run(decode, [])
    assert [o.finish_reason for o in done["d"].outputs] == ["abort", "abort"] and decode.counters.computed_tokens == 0
    _idle(decode)


def test_a_decode_side_prefix_hit_is_kept_and_only_the_rest_loaded(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode")
    _run(decode, [("warm", PROMPTS[0][:12] + [99], params, None)])  # 3 blocks of its prompt cached here
    _, rest = _disaggregated(prefill, decode, [PROMPTS[0]], params)
    assert rest[0].num_cached_tokens == 12
    want = _run(_engine(tiny_llama, "both"), [("x", PROMPTS[0], params, None)])["x"]
    assert rest[0].outputs[0].token_ids == want.outputs[0].token_ids


def test_a_stop_on_the_first_token_ends_the_decode_request_at_once(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=1)
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode")
    first, rest = _disaggregated(prefill, decode, [PROMPTS[1]], params)
    assert rest[0].outputs[0].token_ids == first[0].outputs[0].token_ids and rest[0].outputs[0].finish_reason == "length"
    _idle(decode)


@pytest.mark.parametrize("failure", ["recompute", "fail"])
def test_a_failed_handoff_recomputes_or_fails_as_configured(tiny_llama, failure):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _run(_engine(tiny_llama, "both"), [("x", PROMPTS[0], params, None)])["x"].outputs[0].token_ids
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode", kv_transfer_failure=failure)
    decode.connector.transport = FaultyTransport(decode.connector.transport, fail_receive=True)
    _, rest = _disaggregated(prefill, decode, [PROMPTS[0]], params)
    out = rest[0]
    assert "failed the receive" in out.kv_transfer_params["error"] and not out.kv_transfer_params["loaded"]
    if failure == "recompute":
        assert out.outputs[0].token_ids == want and out.kv_transfer_params["recomputed"]
    else:
        assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    _idle(decode)
    prefill.connector.transport.discard(out.kv_transfer_params["transfer_id"])


def test_a_handoff_that_never_comes_times_out_and_frees_its_blocks(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    decode = _engine(tiny_llama, "decode", kv_transfer_failure="fail", kv_transfer_timeout_s=0.5)
    decode.add_request("lost", PROMPTS[0], params, kv_transfer={"do_remote_prefill": True, "transfer_id": "never-sent"})
    done = _run(decode, [("other", PROMPTS[1], params, None)])
    assert done["other"].outputs[0].num_tokens == 4
    assert done["other"].timings[0].finished < done["lost"].timings[0].finished  # others ran while it waited
    assert "did not arrive within 0.5 s" in done["lost"].kv_transfer_params["error"]
    assert done["lost"].outputs[0].finish_reason == "abort"
    _idle(decode)


def _waiting_for_kv(decode, rid, prompt, params, tid):
    """A decode request added before its handoff exists, stepped once: its blocks are allocated."""
    decode.add_request(rid, prompt, params, kv_transfer={"do_remote_prefill": True, "transfer_id": tid})
    decode.step()
    request = decode.scheduler.waiting[0]
    assert request.request_id == rid and request.kv_transfer.allocated
    return request


def test_blocks_are_allocated_before_the_handoff_and_findable_only_once_loaded(tiny_llama):
    """The decode side holds every prompt position's block (and the first token's) while it
    waits, computes nothing, and its blocks join the prefix cache only once the KV is in them."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = _run(_engine(tiny_llama, "both"), [("x", PROMPTS[0], params, None)])["x"].outputs[0].token_ids
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode")
    tid = f"early-{next(_ids)}"
    request = _waiting_for_kv(decode, "d", PROMPTS[0], params, tid)
    held = decode.kv_cache.num_blocks - decode.kv_cache.num_free_blocks()
    assert held == -(-(len(PROMPTS[0]) + 1) // 4) and decode.counters.computed_tokens == 0
    assert all(decode.kv_cache.pool.get_cached_block(h) is None for h in request.block_hashes)  # not loaded: nobody finds them
    _run(prefill, [("p", PROMPTS[0], params, {"do_remote_decode": True, "transfer_id": tid})])
    done = _run(decode, [])
    assert done["d"].outputs[0].token_ids == want and done["d"].kv_transfer_params["loaded"]
    assert decode.counters.computed_tokens == len(want) - 1  # the prompt came whole: only decode steps ran here
    hashes = request.block_hashes[: len(PROMPTS[0]) // 4]
    assert all(decode.kv_cache.pool.get_cached_block(h) is not None for h in hashes)  # loaded: a later prompt hits them
    _idle(decode)


@pytest.mark.parametrize("failure", ["recompute", "fail"])
def test_an_abandoned_handoff_stops_waiting_at_once(tiny_llama, failure):
    """The router's word that a handoff will not come (its prefill failed): the waiting request
    frees its blocks and follows the failure policy, long before the timeout; `recompute=True`
    (no prefill instance tried) computes it here whatever the policy."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = _run(_engine(tiny_llama, "both"), [("x", PROMPTS[1], params, None)])["x"].outputs[0].token_ids
    decode = _engine(tiny_llama, "decode", kv_transfer_failure=failure, kv_transfer_timeout_s=60)
    _waiting_for_kv(decode, "a", PROMPTS[1], params, "gone-a")
    decode.abandon_handoff("gone-a", "the prefill instance answered 500")
    decode.abandon_handoff("gone-b", "no prefill instance is up", recompute=True)  # before its request even arrives
    decode.add_request("b", PROMPTS[1], params, kv_transfer={"do_remote_prefill": True, "transfer_id": "gone-b"})
    start = time.monotonic()
    done = _run(decode, [])
    assert time.monotonic() - start < 30
    assert "will not come: the prefill instance answered 500" in done["a"].kv_transfer_params["error"]
    if failure == "recompute":
        assert done["a"].outputs[0].token_ids == want and done["a"].kv_transfer_params["recomputed"]
    else:
        assert done["a"].outputs[0].finish_reason == "abort"
    assert done["b"].outputs[0].token_ids == want and done["b"].kv_transfer_params["recomputed"]
    _idle(decode)


def test_a_stalled_transport_delays_but_delivers(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefill, decode = _engine(tiny_llama, "prefill"), _engine(tiny_llama, "decode")
    decode.connector.transport = FaultyTransport(decode.connector.transport, stall_s=0.3)
    start = time.monotonic()
    _, rest = _disaggregated(prefill, decode, [PROMPTS[2]], params)
    assert time.monotonic() - start >= 0.3 and rest[0].kv_transfer_params["loaded"]


def test_roles_refuse_the_other_half(tiny_llama):
    from kvserve.errors import InvalidRequestError

    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="decode instance"):
        _engine(tiny_llama, "decode").add_request("a", [1, 2, 3], params, kv_transfer={"do_remote_decode": True, "transfer_id": "x"})
    with pytest.raises(InvalidRequestError, match="prefill instance"):
        _engine(tiny_llama, "prefill").add_request("a", [1, 2, 3], params, kv_transfer={"do_remote_prefill": True, "transfer_id": "x"})
    with pytest.raises(InvalidRequestError, match="transfer_id"):
        _engine(tiny_llama, "both").add_request("a", [1, 2, 3], params, kv_transfer={"do_remote_prefill": True, "transfer_id": "../x"})


def test_the_torch_distributed_transport_between_two_engines(tiny_llama):
    """gloo point to point: the decode engine listens on a free loopback port, the prefill
    engine connects on its first handoff (a pair of ranks of their own) and sends layer by
    layer; the tokens are a colocated engine's, and a second handoff reuses the pair."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    want = _run(_engine(tiny_llama, "both"), [(str(i), p, params, None) for i, p in enumerate(PROMPTS[:2])])
    decode = _engine(tiny_llama, "decode", kv_transport="torch")
    prefill = _engine(tiny_llama, "prefill", kv_transport="torch")
    address = decode.connector.transport.address
    assert address.startswith("127.0.0.1:") and prefill.connector.transport.address is None
    for i, prompt in enumerate(PROMPTS[:2]):
        tid = f"torch-{next(_ids)}"
        first = _run(prefill, [("p", prompt, params, {"do_remote_decode": True, "transfer_id": tid, "remote_address": address})])
        assert first["p"].kv_transfer_params["error"] is None and first["p"].kv_transfer_params["transport"] == "torch"
        rest = _run(decode, [("d", prompt, params, {"do_remote_prefill": True, "transfer_id": tid})])
        assert rest["d"].kv_transfer_params["loaded"]
        assert rest["d"].outputs[0].token_ids == want[str(i)].outputs[0].token_ids
    assert len(prefill.connector.transport._pairs) == 1  # one pair, kept
    _idle(decode)


def test_the_torch_transport_writes_layers_straight_into_the_allocated_blocks(tiny_llama):
    """A decode request waiting first (blocks allocated): each layer arrives into its blocks,
    nothing staged; an aborted waiting request lets its blocks go before anything is written."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _run(_engine(tiny_llama, "both"), [("x", PROMPTS[0], params, None)])["x"].outputs[0].token_ids
    decode = _engine(tiny_llama, "decode", kv_transport="torch")
    prefill = _engine(tiny_llama, "prefill", kv_transport="torch")
    address = decode.connector.transport.address
    tid = f"torch-{next(_ids)}"
    _waiting_for_kv(decode, "d", PROMPTS[0], params, tid)
    assert tid in decode.connector.transport._sinks
    _run(prefill, [("p", PROMPTS[0], params, {"do_remote_decode": True, "transfer_id": tid, "remote_address": address})])
    done = _run(decode, [])
    assert done["d"].kv_transfer_params["into_blocks"] and done["d"].outputs[0].token_ids == want
    assert not decode.connector.transport._sinks
    _waiting_for_kv(decode, "gone", PROMPTS[1], params, "aborted-first")
    decode.abort_request("gone")
    assert not decode.connector.transport._sinks
    _idle(decode)


def test_a_torch_handoff_to_nobody_fails_the_send(tiny_llama):
    from kvserve.disagg.torch_transport import TorchDistributedTransport
    from kvserve.distributed.launch import free_port

    prefill = _engine(tiny_llama, "prefill", kv_transport="torch")
    prefill.connector.transport = TorchDistributedTransport(connect_timeout_s=1.0)
    params = SamplingParams(temperature=0, max_tokens=2)
    out = _run(prefill, [("p", PROMPTS[1], params,
                          {"do_remote_decode": True, "transfer_id": "nobody", "remote_address": f"127.0.0.1:{free_port()}"})])  # fmt: skip
    assert "to 127.0.0.1" in out["p"].kv_transfer_params["error"]
    assert prefill.kv_cache.num_free_blocks() == prefill.kv_cache.num_blocks


def test_handoffs_nobody_takes_are_swept(tiny_llama, tmp_path):
    """A handoff whose decode request never comes (the router died between the two) does not
    stay in /dev/shm: the decode side sweeps files older than twice its timeout as its
    requests poll; the torch transport forgets such handoffs the same way."""
    import os

    from kvserve.disagg.torch_transport import TorchDistributedTransport
    from kvserve.disagg.transport import SharedMemoryTransport

    shm = SharedMemoryTransport(tmp_path)
    old, fresh = tmp_path / "old.kv", tmp_path / "fresh.kv"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert shm.sweep(50) == 1 and not old.exists() and fresh.exists()

    decode = _engine(tiny_llama, "decode", kv_transfer_timeout_s=0.2)
    decode.connector.transport = SharedMemoryTransport(tmp_path)
    os.utime(fresh, (time.time() - 100, time.time() - 100))
    time.sleep(0.25)
    decode.add_request("w", PROMPTS[1], SamplingParams(max_tokens=2), kv_transfer={"do_remote_prefill": True, "transfer_id": "w"})
    decode.step()  # polls, and sweeps what is older than 0.4 s
    assert not fresh.exists()

    torch_side = TorchDistributedTransport()
    torch_side._untaken["gone"] = (time.monotonic() - 100, "the prefill request was aborted")
    assert torch_side.sweep(50) == 1 and "gone" not in torch_side._untaken
    torch_side.close()
