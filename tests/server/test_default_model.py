"""The real default model through the server: it knows the capital of France."""

from __future__ import annotations

import pytest

from kvserve.model.loader import DEFAULT_MODEL_NAME
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.default_model


def test_chat_answers_paris(tmp_path):
    import openai

    server = ServerProcess("default", tmp_path / "serve.log", "--kv-cache-memory", "64MiB", dtype="auto")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            # one word: the bare question's first token has a margin bf16 rounding flips at some
            # kernel levels (tests/model/test_default_model.py test_capital_of_france)
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            temperature=0,
            max_tokens=32,
        )
        assert "Paris" in out.choices[0].message.content
    finally:
        assert server.terminate() == 0
