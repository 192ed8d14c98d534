"""`kvserve router` over two real `kvserve serve` replicas, every one a process on a loopback
port: answers equal a replica's own (fp32 greedy, completions and chat, streaming and not,
n > 1), requests sharing a prompt prefix stay on one replica, errors keep the OpenAI format,
and a replica that dies is marked down, its requests retried, and taken back when it returns."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvserve.distributed.launch import free_port
from tests.support.servers import ServerProcess, metrics, wait_until_idle

_ADDRESS = re.compile(r"router \(\S+\) at (http://\S+)/v1")
SYSTEM_A = "You are a careful assistant for astronomy questions. " * 4  # 4 x 55 characters: 3 chunks of 64
SYSTEM_B = "You translate short English sentences into plain French. " * 4


class RouterProcess:
    def __init__(self, replicas: list[str], log_path, *flags: str):
        cmd = [sys.executable, "-m", "kvserve.cli", "router", "--port", "0", "--health-interval", "0.3", *flags]
        if replicas:
            cmd += ["--replica", *replicas]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            match = _ADDRESS.search(log_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kvserve router did not start:\n{log_path.read_text()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def _replica(model, tmp_path, name, port):
    return ServerProcess(model, tmp_path / f"{name}.log", "--port", str(port), "--kv-cache-memory", "4MiB",
                         "--max-model-len", "512", "--no-cpu-kernels", "--enable-kv-cache-events")  # fmt: skip


@pytest.fixture(scope="module")
def deployment(tiny_model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    model = tiny_model_dirs["llama-gqa"]
    ports = [free_port(), free_port()]
    replicas = [_replica(model, tmp, f"replica{i}", p) for i, p in enumerate(ports)]
    router = RouterProcess([r.url for r in replicas], tmp / "router.log")
    yield {"model": model, "tmp": tmp, "ports": ports, "replicas": replicas, "router": router}
    router.stop()
    for r in replicas:
        r.kill()


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _requests_per_replica(router) -> list[int]:
    return [r["requests"] for r in router.health()["replicas"]]


def test_answers_equal_a_replicas_own(deployment):
    router, replica = _client(deployment["router"].url), _client(deployment["replicas"][0].url)
    name = deployment["replicas"][0].model_name
    for client in (router, replica):  # the served name comes through /v1/models
        assert [m.id for m in client.models.list().data] == [name]
    kw = dict(model=name, max_tokens=12, temperature=0)
    want = replica.completions.create(prompt="The sky over the harbour", n=2, **kw)
    got = router.completions.create(prompt="The sky over the harbour", n=2, **kw)
    assert [c.text for c in got.choices] == [c.text for c in want.choices] and len(got.choices) == 2
    streamed = "".join(c.choices[0].text for c in router.completions.create(prompt="The sky over the harbour", stream=True, **kw))
    assert streamed == want.choices[0].text
    messages = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "What is a comet?"}]
    want = replica.chat.completions.create(messages=messages, **kw).choices[0].message.content
    assert router.chat.completions.create(messages=messages, **kw).choices[0].message.content == want
    chunks = router.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_requests_sharing_a_prefix_stay_on_the_replica_that_has_it(deployment):
    router = deployment["router"]
    client, name = _client(router.url), deployment["replicas"][0].model_name
    before = _requests_per_replica(router)
    for system, questions in ((SYSTEM_A, ["comets", "moons", "stars"]), (SYSTEM_B, ["the cat", "a house", "the sea"])):
        for q in questions:
            client.chat.completions.create(model=name, max_tokens=2, temperature=0,
                                           messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])  # fmt: skip
        after = _requests_per_replica(router)
        added = [a - b for a, b in zip(after, before)]
        assert sorted(added) == [0, 3], added  # all three on one replica
        before = after
    m = metrics(router.url)
    assert m["kvserve_router:prefix_matched_chars_total"] > 0


def test_replicas_publish_their_load_and_kv_cache_events(deployment):
    """What a router (this one, or an external one) follows: the load gauges in /metrics, and
    vLLM's BlockStored / BlockRemoved / AllBlocksCleared events at /v1/kv_events."""
    replica = deployment["replicas"][0]
    _client(replica.url).completions.create(model=replica.model_name, prompt=SYSTEM_A, max_tokens=2, temperature=0)
    page = httpx.get(f"{replica.url}/v1/kv_events", params={"since": 0}, timeout=10).json()
    stored = [e for e in page["events"] if e["type"] == "BlockStored"]
    assert stored and all(len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"]) for e in stored)
    assert page["next_seq"] == page["events"][-1]["seq"] + 1 and not page["dropped"]
    later = httpx.get(f"{replica.url}/v1/kv_events", params={"since": page["next_seq"]}, timeout=10).json()
    assert later["events"] == [] or later["events"][0]["seq"] >= page["next_seq"]
    m = metrics(replica.url)
    assert {"kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc"} <= set(m)


def test_errors_keep_the_openai_format(deployment, tmp_path):
    router = deployment["router"]
    r = httpx.post(f"{router.url}/v1/completions", json={"model": deployment["replicas"][0].model_name, "prompt": "x",
                                                          "temperature": -1}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"  # the replica's own answer
    r = httpx.post(f"{router.url}/v1/completions", content=b"not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    nobody = RouterProcess([f"http://127.0.0.1:{free_port()}"], tmp_path / "nobody.log", "--api-key", "k")
    try:
        assert httpx.post(f"{nobody.url}/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 401
        r = httpx.post(f"{nobody.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        assert httpx.get(f"{nobody.url}/health", timeout=10).status_code == 503
    finally:
        nobody.stop()


def test_a_dead_replica_is_marked_down_retried_around_and_taken_back(deployment):
    """Kill the replica that holds SYSTEM_B's prefix: its next requests go to the other one
    (retried before anything streamed), /health says which is down; started again on its
    port, it is marked up and serves again. Every replica ends with its KV free."""
    router, replicas, ports = deployment["router"], deployment["replicas"], deployment["ports"]
    client, name = _client(router.url), replicas[0].model_name
    ask = [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "the bridge"}]
    counts = _requests_per_replica(router)
    client.chat.completions.create(model=name, max_tokens=2, temperature=0, messages=ask)
    holder = max(range(2), key=lambda i: _requests_per_replica(router)[i] - counts[i])
    # a second router that will not poll again for a minute: only a request can find the death
    slow = RouterProcess([r.url for r in replicas], deployment["tmp"] / "slow-router.log", "--health-interval", "60",
                         "--policy", "round-robin")  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not all(r["polls"] and r["up"] for r in slow.health()["replicas"]):  # its first poll saw both alive, before the kill
            assert time.monotonic() < deadline, slow.health()
            time.sleep(0.1)
        replicas[holder].kill()
        for stream in (False, True):
            out = client.chat.completions.create(model=name, max_tokens=4, temperature=0, messages=ask, stream=stream)
            if stream:
                assert "".join(c.choices[0].delta.content or "" for c in out if c.choices)
            else:
                assert out.choices[0].message.content
        for _ in range(2):  # round-robin: one of the two goes to the dead replica first, then is retried
            assert _client(slow.url).completions.create(model=name, prompt="retry me", max_tokens=2, temperature=0).choices
        assert metrics(slow.url)["kvserve_router:retries_total"] >= 1
        assert slow.health()["replicas"][holder]["up"] is False
    finally:
        slow.stop()
    state = router.health()["replicas"]
    assert state[holder]["up"] is False and state[1 - holder]["up"] is True and state[holder]["last_error"]
    replicas[holder] = _replica(deployment["model"], deployment["tmp"], f"replica{holder}-again", ports[holder])
    deadline = time.monotonic() + 30
    while not router.health()["replicas"][holder]["up"]:
        assert time.monotonic() < deadline, router.health()
        time.sleep(0.2)
    for r in replicas:
        r_client = _client(r.url)
        assert r_client.completions.create(model=name, prompt="back", max_tokens=2, temperature=0).choices[0].text is not None
        wait_until_idle(r.url)


def test_a_client_that_disconnects_aborts_on_the_replica(deployment):
    router = deployment["router"]
    name = deployment["replicas"][0].model_name
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # leave after the first chunks
    for replica in deployment["replicas"]:
        wait_until_idle(replica.url, timeout_s=20)
