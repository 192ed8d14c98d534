"""Structured outputs on chat through a real `kvserve serve` and the official `openai` client:
`response_format` (json_object, json_schema), vLLM's `structured_outputs` and `guided_*`
extras, streaming and not; a 400 naming the field for each malformed one. The tiny random
model shows the constraint holds whatever a model would write; the default model that a
schema-following answer comes out whole with room to finish."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve.model.loader import DEFAULT_MODEL_NAME
from tests.server.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Describe a cat as JSON."}]
# bounded, so a random model's document ends well within max_tokens
SMALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "indoor": {"type": "boolean"},
        "color": {"type": "string", "enum": ["black", "white", "tabby"]},
    },
    "required": ["name", "indoor", "color"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SMALL, "strict": True}}


def chat(client, server, **kwargs):
    return client.chat.completions.create(**{"model": server.model_name, "messages": MESSAGES, "temperature": 0, "max_tokens": 100, **kwargs})


def test_json_schema_whole(client, server):
    choice = chat(client, server, response_format=SCHEMA_FORMAT).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SMALL)


def test_json_schema_stream_equals_whole(client, server):
    whole = chat(client, server, response_format=SCHEMA_FORMAT).choices[0].message.content
    chunks = list(chat(client, server, response_format=SCHEMA_FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_json_schema_with_sampling_still_validates(client, server):
    out = chat(client, server, response_format=SCHEMA_FORMAT, n=3, seed=11, temperature=1.5)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SMALL)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda text: text in ("yes", "no", "maybe")),
        ({"guided_choice": ["red", "green"]}, lambda text: text in ("red", "green")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        ({"guided_regex": "(ab)+c"}, lambda text: re.fullmatch("(ab)+c", text)),
        ({"structured_outputs": {"json": SMALL}}, lambda text: jsonschema.validate(json.loads(text), SMALL) is None),
        ({"guided_json": json.dumps(SMALL)}, lambda text: jsonschema.validate(json.loads(text), SMALL) is None),
        ({"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}}, lambda text: text in ("xy", "xz")),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_extras(client, server, extra, check, stream):
    if stream:
        chunks = list(chat(client, server, stream=True, extra_body=extra))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = chat(client, server, extra_body=extra).choices[0].message.content
    assert check(text), text


def test_text_is_unconstrained(client, server):
    plain = chat(client, server).choices[0].message.content
    assert chat(client, server, response_format={"type": "text"}).choices[0].message.content == plain


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SMALL}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": "cat"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_json": "{oops"}, "guided_json"),
        # what the grammar library cannot honour is named where the schema came from
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ],
)
def test_malformed_is_400_naming_the_field(http, body, param):
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


# ---- the default model ------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_client(tmp_path_factory):
    import openai

    server = ServerProcess("default", tmp_path_factory.mktemp("format-default") / "serve.log", "--kv-cache-memory", "64MiB", dtype="auto")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    assert server.terminate() == 0


@pytest.mark.default_model
@pytest.mark.parametrize("stream", [False, True])
def test_default_model_json_schema_validates(default_client, stream):
    kwargs = dict(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Invent a person: their name, age and hobbies."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=400,
    )
    if stream:
        chunks = list(default_client.chat.completions.create(stream=True, seed=1, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = default_client.chat.completions.create(seed=1, **kwargs).choices[0]
        text, finishes = choice.message.content, [choice.finish_reason]
    assert finishes == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.default_model
def test_default_model_json_object(default_client):
    out = default_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat with its name and age."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
