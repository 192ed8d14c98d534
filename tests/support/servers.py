"""Real `kvserve serve` processes on loopback ports, for the server and router tests.

The server picks a free port itself (--port 0) and prints it; the helper reads it from
the log, so two test runs never race for a port.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
_ADDRESS = re.compile(r"serving (\S+) at (http://\S+)/v1")
_ROOT = Path(__file__).resolve().parents[2]  # the repository: `python -m tests.…` imports from here


class ServerProcess:
    """`module`: the program run as `python -m MODULE serve …`; tests/support/faulty_server.py
    builds the server with a fault in its engine."""

    def __init__(self, model: str, log_path: Path, *flags: str, dtype: str = "float32", module: str = "kvserve.cli"):
        self.log_path = log_path
        cmd = [sys.executable, "-m", module, "serve", "--model", model, "--port", "0", "--dtype", dtype]
        cmd += ["--device", "cpu", "--threads", "1", *flags]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=_ROOT)
        self.url, self.model_name = self._wait_for_address(timeout_s=120)

    def _wait_for_address(self, timeout_s: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _ADDRESS.search(self.log())
            if match:
                return match.group(2), match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"kvserve serve did not start:\n{self.log()}")

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Signal it (SIGTERM by default), then the exit status."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def metrics(url: str) -> dict[str, float]:
    """/metrics as {'name{label=value,…}': value}, parsed by prometheus_client's own parser."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text  # keyed, where a key is set
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_until_idle(url: str, timeout_s: float = 10) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        idle = m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
        if idle and m["kvserve:kv_cache_blocks_free"] == m["kvserve:kv_cache_blocks_total"]:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle: {m}")
        time.sleep(0.02)
