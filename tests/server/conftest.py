"""A real `kvserve serve` process on a loopback port, on the tiny model (tests/support/servers.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.servers import API_KEY, ServerProcess, metrics, wait_until_idle  # noqa: F401  (the tests import them from here)


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    """The shared server: API key on, max_model_len 256, a 64 KiB body limit."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    proc = ServerProcess(
        tiny_llama, log, "--api-key", API_KEY, "--max-model-len", "256", "--kv-cache-memory", "4MiB", "--max-request-bytes", "64KiB"
    )
    yield proc
    proc.terminate()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c
