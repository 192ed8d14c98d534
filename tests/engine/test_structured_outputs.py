"""Constrained decoding through the engine: the default model's outputs obey their schema,
regex or choice, greedy and sampled; unconstrained neighbours in the batch are untouched;
a tiny random model (which would write anything) is held to its grammar, through
preemption and n > 1; what cannot be enforced is refused before the request runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.sampler import Sampler
from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams as S

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "enum": ["pizza", "salad", "soup"]},
        "toppings": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "delivery": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "express": {"type": "boolean"}},
            "required": ["city", "express"],
            "additionalProperties": False,
        },
    },
    "required": ["item", "toppings", "delivery"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ASK = "Answer in JSON. "


@pytest.fixture(scope="module")
def default_llm():
    return LLM(kv_cache_memory="64MiB")


def _chat(llm, content: str, params: SamplingParams):
    return llm.chat([{"role": "user", "content": content}], params)[0]


@pytest.mark.default_model
@pytest.mark.parametrize(
    "schema, question",
    [(PERSON, "Describe a famous scientist."), (ORDER, "Order a pizza to Paris."), (TOOL_CALL, "Weather in Rome?")],
)
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_json_schema_outputs_validate(default_llm, schema, question, sampling):
    params = SamplingParams(max_tokens=300, structured_outputs=S(json=schema), **sampling)
    out = _chat(default_llm, ASK + question, params).outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.default_model
def test_json_object_and_n_samples_each_walk_their_own_grammar(default_llm):
    # temperature 0.7: at 1.0 a 135M model may run one string on to max_tokens, whatever the mask
    params = SamplingParams(n=3, temperature=0.7, seed=3, max_tokens=300, structured_outputs=S(json_object=True))
    outs = _chat(default_llm, ASK + "List three colours.", params).outputs
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    assert len({o.text for o in outs}) > 1  # three draws, not one copied


@pytest.mark.default_model
def test_regex_and_choice(default_llm):
    regex = SamplingParams(temperature=0, max_tokens=30, structured_outputs=S(regex=r"[0-9]{3}-[0-9]{4}"))
    choice = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs=S(choice=("Paris", "Rome")))
    a, b = default_llm.generate(["My phone number is ", "The capital of France is"], [regex, choice])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", a.outputs[0].text) and a.outputs[0].finish_reason == "stop"
    # ignore_eos cannot run a complete grammar on: it stops there
    assert b.outputs[0].text == "Paris" and b.outputs[0].finish_reason == "stop"


@pytest.mark.default_model
def test_unconstrained_neighbours_get_the_tokens_they_get_alone(default_llm):
    prompts = ["The quick brown fox", "Once upon a time", "The capital of France is"]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in default_llm.generate(prompts, plain)]
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(json=PERSON))
    mixed = default_llm.generate(prompts[:1] + ["Name: "] + prompts[1:] + ["Person: "], [plain, constrained, plain, plain, constrained])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3)] == alone


@pytest.mark.default_model
def test_what_cannot_be_enforced_is_refused_before_it_runs(default_llm):
    bad = SamplingParams(structured_outputs=S(json={"type": "array", "uniqueItems": True}, field="response_format"))
    with pytest.raises(InvalidRequestError) as err:
        default_llm.generate("hi", bad)
    assert "uniqueItems" in str(err.value) and err.value.param == "response_format"
    assert not default_llm.engine.has_unfinished_requests()


# ---- a tiny random model: it would write anything, so the grammar does all the work ----------


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    # a small pool and token budget: a dozen requests preempt each other
    return LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory=80 * 1024, block_size=4, max_num_batched_tokens=24)


def test_tiny_model_held_to_its_grammar_through_preemption(tiny_llm):
    engine = tiny_llm.engine
    before = engine.scheduler.num_preemptions
    pattern = r"(fox|dog) [0-9]{2,8}\."
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured_outputs=S(regex=pattern))
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[5 + i] * 40 for i in range(8)]
    outs = tiny_llm.generate(prompts, [constrained if i % 2 else plain for i in range(8)])
    assert engine.scheduler.num_preemptions > before
    for out in outs[1::2]:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_tiny_model_json_schema_and_greedy_path(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=S(json=PERSON))
    engine = tiny_llm.engine
    engine.add_request("c", "hello", params)
    requests = [r for r in engine.scheduler.waiting if r.request_id == "c"]
    assert requests[0].structured is not None and not Sampler.plain_greedy(requests)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    text = outs["c"].outputs[0].text
    if outs["c"].outputs[0].finish_reason == "stop":  # a random model may ramble in a string to max_tokens
        jsonschema.validate(json.loads(text), PERSON)
    else:
        assert text.startswith('{"name"') or text.startswith("{")


def test_a_matcher_that_rejects_aborts_only_its_request(tiny_llm):
    engine = tiny_llm.engine
    constrained = SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(choice=("fox",)))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("bad", "hello", constrained)
    engine.add_request("ok", "hello", plain)
    bad = next(r for r in engine.scheduler.waiting if r.request_id == "bad")
    bad.structured.accept(bad.structured.vocab_size - 1)  # force its error state, as a bug would
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["bad"].outputs[0].finish_reason == "abort"
    assert outs["ok"].outputs[0].finish_reason == "length" and len(outs["ok"].outputs[0].token_ids) == 6


def test_the_server_path_refuses_before_queueing(tiny_llama):
    from kvserve.config import EngineConfig
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="4MiB"))
    async_engine = AsyncLLMEngine(engine=engine)
    try:
        bad = SamplingParams(structured_outputs=S(json={"not": {"type": "string"}}, field="response_format"))
        with pytest.raises(InvalidRequestError) as err:
            async_engine.prepare_prompt("hello", bad)
        assert '"not"' in str(err.value) and err.value.param == "response_format"
        good = SamplingParams(structured_outputs=S(choice=("fox", "dog")))
        assert async_engine.prepare_prompt("hello", good)
    finally:
        async_engine.shutdown()
