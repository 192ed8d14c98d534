"""The official `openai` client against a real `kvserve serve`: completions and chat,
streaming and not, n, logprobs, stop, seed."""

from __future__ import annotations

import math

EXACT = {"ignore_eos": True}  # vLLM extra: run to max_tokens, so lengths are known
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_completion_whole(client, http, server):
    out = client.completions.create(model=server.model_name, prompt="hello world", max_tokens=7, temperature=0, extra_body=EXACT)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == server.model_name
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length" and out.choices[0].text
    num_prompt = http.post("/tokenize", json={"prompt": "hello world"}).json()["count"]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (num_prompt, 7, num_prompt + 7)


def test_completion_stream_equals_whole(client, server):
    kwargs = dict(model=server.model_name, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body=EXACT)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_token_id_prompt(client, http, server):
    ids = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    by_ids = client.completions.create(model=server.model_name, prompt=ids, max_tokens=5, temperature=0, extra_body=EXACT)
    by_text = client.completions.create(model=server.model_name, prompt="hello world", max_tokens=5, temperature=0, extra_body=EXACT)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_whole(client, http, server):
    out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=EXACT)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    num_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, 6)


def test_chat_stream_equals_whole(client, server):
    kwargs = dict(model=server.model_name, messages=MESSAGES, max_completion_tokens=10, temperature=0, extra_body=EXACT)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_samples(client, server):
    out = client.completions.create(model=server.model_name, prompt="Once upon a time", n=3, max_tokens=8, seed=7, extra_body=EXACT)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    assert len({c.text for c in out.choices}) > 1  # three samples, not one copied

    stream = client.chat.completions.create(model=server.model_name, messages=MESSAGES, n=2, max_tokens=5, stream=True, extra_body=EXACT)
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]  # each choice ends exactly once


def test_completion_logprobs(client, server):
    out = client.completions.create(model=server.model_name, prompt="hello", max_tokens=6, temperature=0, logprobs=3, extra_body=EXACT)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert sampled <= 0 and 1 <= len(top) <= 3
        assert math.isclose(sampled, max(top.values()), abs_tol=1e-5)  # greedy takes the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(client, server):
    out = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, extra_body=EXACT
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-5)
        # a token that is part of a character is named by its bytes, as OpenAI does
        named = bytes(item.bytes).decode(errors="replace")
        assert item.token == named or item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in item.bytes)


def test_stop_string(client, server):
    kwargs = dict(model=server.model_name, prompt="The quick brown fox", max_tokens=40, temperature=0, extra_body=EXACT)
    text = client.completions.create(**kwargs).choices[0].text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2])
    out = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_seed_reproducible(client, server):
    def sample(seed):
        kw = dict(model=server.model_name, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed, extra_body=EXACT)
        return client.completions.create(**kw).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_models_list(client, server):
    assert [m.id for m in client.models.list()] == [server.model_name]
