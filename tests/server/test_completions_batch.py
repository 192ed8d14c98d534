"""Several prompts in one /v1/completions request, and echo, through the official client."""

from __future__ import annotations

import pytest

EXACT = {"ignore_eos": True}


def _one(client, server, prompt, **kw):
    return client.completions.create(model=server.model_name, prompt=prompt, temperature=0, extra_body=EXACT, **kw)


def test_list_of_prompts_equals_one_at_a_time(client, server):
    prompts = ["The quick brown fox", "hello world", "Once upon a time"]
    batch = _one(client, server, prompts, max_tokens=6, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = _one(client, server, prompt, max_tokens=6)
        # choice index = prompt index * n + sample index; greedy samples agree
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone.choices[0].text
    singles = [_one(client, server, p, max_tokens=6).usage for p in prompts]
    assert batch.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert batch.usage.completion_tokens == 2 * 6 * len(prompts)


def test_list_of_token_id_prompts(client, http, server):
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in ("hello world", "a b c")]
    batch = _one(client, server, ids, max_tokens=4)
    assert [c.text for c in batch.choices] == [_one(client, server, p, max_tokens=4).choices[0].text for p in ("hello world", "a b c")]


def test_batch_streams_every_choice_to_its_end(client, server):
    prompts = ["one two", "three four five"]
    whole = _one(client, server, prompts, max_tokens=5)
    texts = {0: "", 1: ""}
    finish = {}
    stream = _one(client, server, prompts, max_tokens=5, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 10 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_echo_repeats_the_prompt(client, http, server):
    plain = _one(client, server, "hello world", max_tokens=4)
    echoed = _one(client, server, "hello world", max_tokens=4, echo=True)
    assert echoed.choices[0].text == "hello world" + plain.choices[0].text
    ids = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    by_ids = _one(client, server, ids, max_tokens=4, echo=True)
    detok = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert by_ids.choices[0].text == detok + plain.choices[0].text


def test_echo_streamed_starts_with_the_prompt(client, server):
    chunks = list(_one(client, server, ["ab", "cd"], max_tokens=3, echo=True, stream=True))
    assert sorted((c.index, c.text) for c in chunks[0].choices) == [(0, "ab"), (1, "cd")]
    whole = _one(client, server, ["ab", "cd"], max_tokens=3, echo=True)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in whole.choices}


def test_one_bad_prompt_rejects_the_request(http, server):
    r = http.post("/v1/completions", json={"prompt": ["fine", "x " * 400], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt[1]"
    r = http.post("/v1/completions", json={"prompt": ["fine", ""], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"


def test_echo_with_logprobs_scores_the_prompt(client, http, server, tiny_llama):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 1. The prompt's logprobs are
    the engine's prompt_logprobs (tested against transformers in tests/engine)."""
    from kvserve import LLM, SamplingParams

    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    echoed = client.completions.create(
        model=server.model_name, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True, extra_body=EXACT
    )
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    offline = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="4MiB")
    ref = offline.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([e[t] for e, t in zip(ref, ids[1:])], abs=1e-4)
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])
    # streamed: the prompt's logprobs come with the first chunk
    chunks = list(client.completions.create(
        model=server.model_name, prompt=ids, max_tokens=2, temperature=0, logprobs=1, echo=True, stream=True, extra_body=EXACT
    ))  # fmt: skip
    first = chunks[0].choices[0].logprobs
    assert len(first.tokens) == len(ids) and first.token_logprobs[0] is None
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == len(ids) + 2


def test_unset_max_tokens_is_openais_16(client, server):
    out = client.completions.create(model=server.model_name, prompt="hello", temperature=0, extra_body=EXACT)
    assert out.usage.completion_tokens == 16


def test_structured_outputs_on_completions(client, server):
    # vLLM's extra, and the response_format both endpoints take
    out = client.completions.create(
        model=server.model_name, prompt=["pick:", "again:"], max_tokens=8, extra_body={"structured_outputs": {"choice": ["red", "green"]}}
    )
    assert [c.text for c in out.choices] and all(c.text in ("red", "green") for c in out.choices)
    out = client.completions.create(
        model=server.model_name, prompt="digits:", max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    assert len(out.choices[0].text) == 3 and out.choices[0].text.isdigit() and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=server.model_name, prompt="{", max_tokens=8,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"enum": [True, False]}}}},
    )  # fmt: skip
    assert out.choices[0].text in ("true", "false")
