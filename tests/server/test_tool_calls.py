"""Tool calls through a real `kvserve serve` and the official `openai` client, streaming and
not: the wire shapes (tiny random model) and, on the default model, calls that parse and
validate against the function's parameters whatever the model would have written.

The tiny model's context is widened to 2048 positions (it is random; RoPE does not care):
the tool section of the system prompt takes ~400 of its byte-level tokens."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from kvserve.model.loader import DEFAULT_MODEL_NAME
from tests.server.conftest import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            # bounded, so a random model's arguments end well within max_tokens
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}},
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(temperature=0, max_tokens=120)


@pytest.fixture(scope="module")
def tool_server(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-server")
    model = root / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    proc = ServerProcess(str(model), root / "serve.log", "--max-model-len", "2048", "--kv-cache-memory", "16MiB")
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def client(tool_server):
    import openai

    return openai.OpenAI(base_url=tool_server.base_url, api_key="unused", max_retries=0, timeout=60)


def create(client, **kwargs):
    return client.chat.completions.create(model=DEFAULT_MODEL_NAME if "model" not in kwargs else kwargs.pop("model"), **kwargs)


def assert_valid_calls(tool_calls, expect_name: str | None = None):
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in PARAMETERS if expect_name is None else call.function.name == expect_name
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert len({c.id for c in tool_calls}) == len(tool_calls)


def streamed(chunks):
    """A stream added up as a client does: (content, {index: {id, name, arguments}}, finish_reasons)."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, calls, finishes


# ---- named function ---------------------------------------------------------------------


def test_named_function_whole(client, tool_server):
    out = create(client, model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, "get_weather")


def test_named_function_stream_equals_whole(client, tool_server):
    kwargs = dict(model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY)
    whole = create(client, **kwargs).choices[0].message.tool_calls[0]
    chunks = list(create(client, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content, calls, finishes = streamed(chunks)
    assert content == "" and finishes == ["tool_calls"]
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == whole.function.arguments
    fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].id is None]
    assert len(fragments) > 1  # the arguments are streamed as they are generated


def test_stream_wire_shapes_are_openais(tool_server):
    """The raw SSE: a call's first delta carries id, type, name and empty arguments; later
    ones only index and an arguments fragment; the last chunk finish_reason "tool_calls"."""
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{tool_server.base_url}/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    head = deltas[1]["tool_calls"][0]
    assert set(head) == {"index", "id", "type", "function"} and head["function"] == {"name": "get_weather", "arguments": ""}
    assert (head["index"], head["type"]) == (0, "function") and head["id"].startswith("call_")
    for delta in deltas[2:]:
        if delta:
            assert set(delta) == {"tool_calls"}
            (fragment,) = delta["tool_calls"]
            assert set(fragment) == {"index", "function"} and set(fragment["function"]) == {"arguments"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_whole_wire_shape_is_openais(tool_server):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, **GREEDY}
    choice = httpx.post(f"{tool_server.base_url}/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert set(message) == {"role", "content", "tool_calls"} and message["content"] is None
    (call,) = message["tool_calls"]
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert set(call["function"]) == {"name", "arguments"} and isinstance(call["function"]["arguments"], str)


# ---- required -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_makes_one_call(client, tool_server, stream):
    kwargs = dict(model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY)
    if not stream:
        choice = create(client, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls)
        return
    content, calls, finishes = streamed(create(client, stream=True, **kwargs))
    assert content == "" and finishes == ["tool_calls"] and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS[calls[0]["name"]])


def test_required_calls_stream_as_whole(client, tool_server):
    kwargs = dict(model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2, seed=3, temperature=1.0, max_tokens=200)
    whole = create(client, **kwargs)
    chunks = list(create(client, stream=True, **kwargs))
    for choice in whole.choices:
        if choice.finish_reason == "tool_calls":
            assert_valid_calls(choice.message.tool_calls)
        per_index = streamed([c for c in chunks if c.choices and c.choices[0].index == choice.index])
        names_args = [(c["name"], c["arguments"]) for c in per_index[1].values()]
        assert names_args == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        assert per_index[2] == [choice.finish_reason]


# ---- auto and none --------------------------------------------------------------------------


def test_none_is_a_plain_answer_with_no_tools_offered(client, tool_server):
    kwargs = dict(model=tool_server.model_name, messages=MESSAGES, **GREEDY)
    plain = create(client, **kwargs).choices[0]
    none = create(client, tools=TOOLS, tool_choice="none", **kwargs).choices[0]
    assert none.message.tool_calls is None and none.message.content == plain.message.content
    assert none.finish_reason == plain.finish_reason != "tool_calls"


def test_auto_offers_the_tools_in_the_prompt(client, tool_server):
    # the random model calls nothing: its answer is content, but the prompt grew by the tool section
    kwargs = dict(model=tool_server.model_name, messages=MESSAGES, temperature=0, max_tokens=8)
    auto = create(client, tools=TOOLS, **kwargs)
    plain = create(client, **kwargs)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    assert auto.choices[0].message.tool_calls is None and isinstance(auto.choices[0].message.content, str)
    content, calls, finishes = streamed(create(client, tools=TOOLS, stream=True, **kwargs))
    assert (content, calls, finishes) == (auto.choices[0].message.content, {}, [auto.choices[0].finish_reason])


# ---- history: calls and results sent back ---------------------------------------------------


def test_tool_results_are_accepted_back(client, tool_server):
    first = create(client, model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = create(client, model=tool_server.model_name, messages=history, tools=TOOLS, temperature=0, max_tokens=5)
    assert second.choices[0].message.role == "assistant" and second.usage.prompt_tokens > first.usage.prompt_tokens
    # the ChatML template has no tool format: the turns are rendered the Hermes way
    base = tool_server.url
    ids = httpx.post(f"{base}/tokenize", json={"messages": history}).json()["tokens"]
    prompt = httpx.post(f"{base}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in prompt


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages[0].tool_calls[0]"),
        # a schema feature the grammar library cannot honour names the tool it is in
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(tool_server, body, param):
    response = httpx.post(f"{tool_server.base_url}/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- the default model: calls that parse and validate -------------------------------------

REAL_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
REAL_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
REAL_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (REAL_WEATHER, REAL_TIME)}


@pytest.fixture(scope="module")
def default_client(tmp_path_factory):
    import openai

    server = ServerProcess("default", tmp_path_factory.mktemp("tools-default") / "serve.log", "--kv-cache-memory", "64MiB", dtype="auto")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    assert server.terminate() == 0


def validate_real(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, REAL_PARAMETERS[name])
    return args


@pytest.mark.default_model
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"])
def test_default_model_calls_parse_and_validate(default_client, tool_choice, stream):
    kwargs = dict(messages=MESSAGES, tools=[REAL_WEATHER, REAL_TIME], tool_choice=tool_choice, temperature=0, max_tokens=200)
    if stream:
        content, calls, finishes = streamed(create(default_client, stream=True, **kwargs))
        assert finishes == ["tool_calls"] and calls
        found = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = create(default_client, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for name, arguments in found:
        args = validate_real(name, arguments)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in found] == ["get_weather"] and "paris" in args["city"].lower()


@pytest.mark.default_model
def test_default_model_two_turns(default_client):
    first = create(default_client, messages=MESSAGES, tools=[REAL_WEATHER], tool_choice="required", temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    validate_real(call.function.name, call.function.arguments)
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})},
    ]
    second = create(default_client, messages=history, tools=[REAL_WEATHER], temperature=0, max_tokens=48)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
