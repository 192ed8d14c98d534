"""`kvserve serve --disaggregation 1P1D`: a prefill server, a decode server and the router in
front, every one a real process on loopback. Through it, fp32 greedy answers equal a colocated
server's (completions and chat, streaming and not, n > 1),
the handoff is measured, and every instance ends with its KV free."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.support.servers import ServerProcess, metrics, wait_until_idle

_ROUTER = re.compile(r"router \(\S+\) at (http://\S+)/v1")
_SERVER = re.compile(r"(prefill|decode) server \d+ at (http://\S+)")
FLAGS = ["--dtype", "float32", "--device", "cpu", "--threads", "1", "--no-cpu-kernels", "--kv-cache-memory", "4MiB",
         "--max-model-len", "512"]  # fmt: skip


def _launch(model, log, *extra):
    """`kvserve serve --disaggregation 1P1D`: (process, router URL, {role: server URL})."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", model, *FLAGS, "--disaggregation", "1P1D",
                             "--port", "0", *extra], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 180
    while not _ROUTER.search(log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    text = log.read_text()
    return proc, _ROUTER.search(text).group(1), {role: url for role, url in _SERVER.findall(text)}


def _stop(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def pd(tiny_model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    model = tiny_model_dirs["llama-gqa"]
    proc, router, servers = _launch(model, tmp / "pd.log")
    reference = ServerProcess(model, tmp / "colocated.log", "--no-cpu-kernels", "--kv-cache-memory", "4MiB", "--max-model-len", "512")
    yield {"router": router, "servers": servers, "reference": reference, "model": model}
    reference.kill()
    _stop(proc)


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_answers_equal_a_colocated_servers(pd):
    router, ref = _client(pd["router"]), _client(pd["reference"].url)
    name = pd["reference"].model_name
    kw = dict(model=name, max_tokens=10, temperature=0)
    for prompt in ("The sky over the harbour", "A list of prime numbers:"):
        want = ref.completions.create(prompt=prompt, **kw).choices[0].text
        assert router.completions.create(prompt=prompt, **kw).choices[0].text == want
        assert "".join(c.choices[0].text for c in router.completions.create(prompt=prompt, stream=True, **kw)) == want
    messages = [{"role": "user", "content": "What is a comet?"}]
    want = ref.chat.completions.create(messages=messages, **kw).choices[0].message.content
    assert router.chat.completions.create(messages=messages, **kw).choices[0].message.content == want
    chunks = router.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    raw = httpx.post(f"{pd['router']}/v1/completions", json={"prompt": "The sky over the harbour", **kw}, timeout=60).json()
    assert raw["kv_transfer_params"]["loaded"], raw["kv_transfer_params"]
    assert raw["choices"][0]["text"] == ref.completions.create(
        prompt="The sky over the harbour", **kw).choices[0].text  # the decode server's answer, from the handed-over KV
    both = router.completions.create(prompt="Two samples", n=2, **kw)  # n > 1: one handoff, the second sample from its prompt
    want = [c.text for c in ref.completions.create(prompt="Two samples", n=2, **kw).choices]
    assert [c.text for c in both.choices] == want
    raw = httpx.post(f"{pd['router']}/v1/completions", json={"prompt": "Two samples", "n": 2, **kw}, timeout=60).json()
    assert raw["kv_transfer_params"]["loaded"] and [c["text"] for c in raw["choices"]] == want
    texts = ["", ""]
    for c in router.completions.create(prompt="Two samples", n=2, stream=True, **kw):
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == want


def test_the_handoff_is_measured_and_nothing_leaks(pd):
    _client(pd["router"]).completions.create(model=pd["reference"].model_name, prompt="Measure me " * 8, max_tokens=4, temperature=0)
    m = metrics(pd["router"])
    assert m["kvserve_router:kv_handoff_bytes_count"] >= 1 and m["kvserve_router:kv_handoff_bytes_sum"] > 0
    assert m["kvserve_router:first_to_second_token_seconds_count"] >= 1
    health = httpx.get(f"{pd['router']}/health", timeout=10).json()
    assert sorted(r["pool"] for r in health["replicas"]) == ["decode", "prefill"]
    for url in pd["servers"].values():
        wait_until_idle(url)
    decode = metrics(pd["servers"]["decode"])
    assert decode["kvserve:prompt_tokens_total"] > 0


def test_without_a_prefill_instance_the_decode_server_computes_the_prompt(pd, tmp_path):
    """A router whose only prefill instance is dead marks it down and sends the request to a
    decode instance plainly: the same answer, computed there."""
    from kvserve.distributed.launch import free_port
    from tests.router.test_router import RouterProcess

    dead = f"http://127.0.0.1:{free_port()}"
    front = RouterProcess([], tmp_path / "fallback.log", "--prefill", dead, "--decode", pd["servers"]["decode"])
    try:
        kw = dict(model=pd["reference"].model_name, max_tokens=6, temperature=0)
        want = _client(pd["reference"].url).completions.create(prompt="Fall back", **kw).choices[0].text
        assert _client(front.url).completions.create(prompt="Fall back", **kw).choices[0].text == want
        assert [r["up"] for r in front.health()["replicas"]] == [False, True]  # the dead prefill instance, marked down
    finally:
        front.stop()


def test_over_torch_distributed_point_to_point(pd, tmp_path):
    """--kv-transport torch: the decode server listens (its /health gives the address), the
    router passes it to the prefill server, which sends over gloo; same answers."""
    proc, router, servers = _launch(pd["model"], tmp_path / "torch.log", "--kv-transport", "torch")
    try:
        health = httpx.get(f"{servers['decode']}/health", timeout=10).json()
        assert health["kv_transfer"]["transport"] == "torch" and health["kv_transfer"]["address"].startswith("127.0.0.1:")
        kw = dict(model=pd["reference"].model_name, max_tokens=8, temperature=0)
        ref = _client(pd["reference"].url)
        for prompt in ("Over the wire", "Twice over the same pair"):
            want = ref.completions.create(prompt=prompt, **kw).choices[0].text
            raw = httpx.post(f"{router}/v1/completions", json={"prompt": prompt, **kw}, timeout=60).json()
            assert raw["kv_transfer_params"]["loaded"] and raw["choices"][0]["text"] == want
            streamed = _client(router).completions.create(prompt=prompt, stream=True, **kw)
            assert "".join(c.choices[0].text for c in streamed) == want
    finally:
        _stop(proc)


def _launch_stalled(model, tmp_path, stall_s):
    """1P1D as `--disaggregation` starts it, but the decode server's every handoff held back
    `stall_s` (the stalling test transport, tests/support/faulty_server.py): (processes, router URL)."""
    from tests.router.test_router import RouterProcess

    flags = FLAGS[6:]  # FLAGS but what ServerProcess passes itself
    prefill = ServerProcess(model, tmp_path / "prefill.log", *flags, "--role", "prefill")
    decode = ServerProcess(model, tmp_path / "decode.log", *flags, "--role", "decode", "--kv-stall-s", str(stall_s),
                           module="tests.support.faulty_server")  # fmt: skip
    front = RouterProcess([], tmp_path / "router.log", "--prefill", prefill.url, "--decode", decode.url)
    return [front.stop, prefill.kill, decode.kill], front.url


def test_a_stream_gets_its_first_token_before_the_handoff_arrives(pd, tmp_path):
    """Every handoff held back 3 s on the decode side (the stalling test transport): a
    streaming client still gets its first token as soon as the prefill instance has it, then
    the rest, the same text as a colocated server's, in one completion's chunks."""
    stall = 3.0
    stops, router = _launch_stalled(pd["model"], tmp_path, stall)
    try:
        kw = dict(model=pd["reference"].model_name, max_tokens=8, temperature=0)
        ref = _client(pd["reference"].url)
        want = ref.completions.create(prompt="Early bird", **kw).choices[0].text
        start = time.monotonic()
        chunks, times = [], []
        for c in _client(router).completions.create(prompt="Early bird", stream=True, logprobs=1, **kw):
            chunks.append(c)
            times.append(time.monotonic() - start)
        assert times[0] < stall - 1 and times[-1] >= stall  # the first token came ahead of the handoff
        assert "".join(c.choices[0].text for c in chunks) == want
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert len(tokens) == 8 and len({c.id for c in chunks}) == 1  # each token once, one completion
        messages = [{"role": "user", "content": "Early bird"}]
        want = ref.chat.completions.create(messages=messages, **kw).choices[0].message.content
        start = time.monotonic()
        stream = _client(router).chat.completions.create(messages=messages, stream=True, **kw)
        first = next(iter(stream))
        assert time.monotonic() - start < stall - 1 and first.choices[0].delta.role == "assistant"
        rest = [c for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices) == want
        assert sum(1 for c in rest if c.choices and c.choices[0].delta.role) == 0  # one role chunk
    finally:
        for stop in stops:
            stop()


def test_a_server_refuses_the_half_its_role_does_not_take(pd):
    r = httpx.post(f"{pd['servers']['decode']}/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "abc"}})
    assert r.status_code == 400 and "decode instance" in r.json()["error"]["message"]
    abandon = "/v1/kv_transfer/abandon"
    r = httpx.post(pd["servers"]["prefill"] + abandon, json={"transfer_id": "abc"}, timeout=30)
    assert r.status_code == 400 and "receives no KV handoffs" in r.json()["error"]["message"]
    r = httpx.post(pd["servers"]["decode"] + abandon, json={"transfer_id": "../etc"}, timeout=30)
    assert r.status_code == 400 and "transfer_id" in r.json()["error"]["message"]
    r = httpx.post(pd["servers"]["decode"] + abandon, json={"transfer_id": 5}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(pd["servers"]["decode"] + abandon, json={"transfer_id": "nobody-waits", "reason": "test"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"transfer_id": "nobody-waits", "abandoned": True}
