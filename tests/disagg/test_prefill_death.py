"""A prefill instance killed in the middle of a handoff, at process level: a real decode server
(torch.distributed transport) with a request waiting, its blocks allocated, and a real
process sending the handoff through kvserve's transport that is SIGKILLed after its first
layer. The decode side sees the pair break, frees the blocks, and recomputes the prompt or
answers 502, as --kv-transfer-failure says, long before --kv-transfer-timeout."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import ServerProcess, metrics, wait_until_idle

PROMPT = list(range(10, 40))
TIMEOUT_S = 120  # the decode side's --kv-transfer-timeout: far more than the test may take

# one layer of the handoff, then SIGKILL (the test sends it once "sent" is printed)
_SENDER = """
import json, sys, time, torch
from kvserve.disagg.torch_transport import TorchDistributedTransport
address, tid, layers, positions, kv_heads, head_dim = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
send = TorchDistributedTransport().open_send(tid, address, torch.zeros(2, layers, positions, kv_heads, head_dim), None)
send.layer_ready(0)
while not send.messages.empty():
    time.sleep(0.01)
time.sleep(0.2)
print("sent", flush=True)
time.sleep(600)
"""


def _shape(model: str) -> tuple[int, int, int]:
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads


@pytest.mark.parametrize("failure", ["recompute", "fail"])
def test_a_prefill_process_killed_mid_handoff(tiny_llama, tmp_path, failure):
    decode = ServerProcess(tiny_llama, tmp_path / "decode.log", "--role", "decode", "--kv-transport", "torch", "--no-cpu-kernels",
                           "--kv-cache-memory", "4MiB", "--max-model-len", "512", "--kv-transfer-failure", failure,
                           "--kv-transfer-timeout", str(TIMEOUT_S))  # fmt: skip
    sender = None
    try:
        body = {"model": decode.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        want = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        address = httpx.get(f"{decode.url}/health", timeout=10).json()["kv_transfer"]["address"]
        answer: dict = {}

        def waiting_request():
            start = time.monotonic()
            r = httpx.post(f"{decode.url}/v1/completions", timeout=TIMEOUT_S + 30,
                           json={**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "killed-mid-way"}})  # fmt: skip
            answer.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - start)

        thread = threading.Thread(target=waiting_request)
        thread.start()
        deadline = time.monotonic() + 30
        while metrics(decode.url)["kvserve:kv_cache_blocks_free"] == metrics(decode.url)["kvserve:kv_cache_blocks_total"]:
            assert time.monotonic() < deadline, "the decode request never allocated its blocks"
            time.sleep(0.05)
        layers, kv_heads, head_dim = _shape(tiny_llama)
        sender = subprocess.Popen([sys.executable, "-c", _SENDER, address, "killed-mid-way", str(layers), str(len(PROMPT)),
                                   str(kv_heads), str(head_dim)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert sender.stdout.readline().strip() == "sent"
        sender.send_signal(signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the decode request still waits after its prefill process died"
        assert answer["seconds"] < TIMEOUT_S / 2
        if failure == "recompute":
            assert answer["status"] == 200 and answer["body"]["choices"][0]["text"] == want
            params = answer["body"]["kv_transfer_params"]
            assert params["recomputed"] and not params["loaded"] and "broke off" in params["error"]
        else:
            assert answer["status"] == 502 and answer["body"]["error"]["code"] == "kv_transfer_failed"
            assert "broke off" in answer["body"]["error"]["message"]
        wait_until_idle(decode.url)  # its blocks are free again
    finally:
        if sender is not None and sender.poll() is None:
            sender.kill()
        decode.kill()
