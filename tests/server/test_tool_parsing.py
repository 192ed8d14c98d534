"""Tool calls and structured outputs without a model: the request checks, the schema that
`tool_choice: "required"` constrains to, the prompt and history rendering, and the parsers,
fed whole and a character at a time (a stream must add up to the whole answer)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, DeltaMessage
from kvserve.server.structured import structured_outputs_of
from kvserve.server.tool_parsers import AutoParser, JsonEnd, call_from_json
from kvserve.server.tools import (
    CALL_JSON_OPTIONS,
    arguments_schema,
    ChoiceParser,
    merge,
    render_history,
    required_schema,
    template_reads_tools,
    tool_setup,
    with_tools_offered,
)
from kvserve.structured.params import StructuredOutputsParams

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **body})


def invalid(fn, *args) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args)
    return info.value


# ---- structured outputs ---------------------------------------------------------------------


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True, field="response_format")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
            StructuredOutputsParams(json=SCHEMA, field="response_format.json_schema.schema"),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA, field="structured_outputs.json")),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=SCHEMA, field="structured_outputs.json")),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+", field="structured_outputs.regex")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=("yes", "no"), field="structured_outputs.choice")),
        ({"structured_outputs": {"grammar": "start: 'x'"}}, StructuredOutputsParams(grammar="start: 'x'", field="structured_outputs.grammar")),
        ({"structured_outputs": {"json_object": True, "backend": "x"}}, StructuredOutputsParams(json_object=True, field="structured_outputs.json_object")),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA, field="guided_json")),
        ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+", field="guided_regex")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"), field="guided_choice")),
        ({"guided_grammar": "g"}, StructuredOutputsParams(grammar="g", field="guided_grammar")),
    ],
)
def test_structured_outputs_of(body, expected):
    assert structured_outputs_of(chat(**body)) == expected
    # completions read the same fields
    assert structured_outputs_of(CompletionRequest.model_validate({"prompt": "x", **body})) == expected


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}, "response_format.json_schema.strict"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_structured_outputs_errors_name_the_field(body, param):
    assert invalid(structured_outputs_of, chat(**body)).param == param


# ---- tool request checks --------------------------------------------------------------------


def test_tool_choice_defaults():
    assert tool_setup(chat()).choice == "none"
    assert tool_setup(chat(tools=[WEATHER])).choice == "auto"
    assert tool_setup(chat(tool_choice="none")).choice == "none"  # harmless without tools
    named = tool_setup(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (named.choice, named.named) == ("named", "get_time")
    assert not tool_setup(chat(tools=[WEATHER], tool_choice="none")).offered


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "code"}}, "tool_choice.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{**WEATHER, "type": "retrieval"}]}, "tools[0].type"),
    ],
)
def test_tool_request_errors_name_the_field(body, param):
    assert invalid(tool_setup, chat(**body)).param == param


# ---- the constraint of tool_choice "required" ---------------------------------------------


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_schema(tool_setup(chat(tools=[WEATHER, TIME], tool_choice="required")))
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_arguments_are_closed_at_the_root_where_that_is_safe():
    closed = arguments_schema(WEATHER["function"]["parameters"])
    jsonschema.validate({"city": "Paris"}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "invented": 1}, closed)
    for kept in ({"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}, {"allOf": [{"properties": {}}]}, {"type": "object"}):
        assert arguments_schema(kept) == kept


def test_required_schema_without_parallel_calls_takes_one():
    schema = required_schema(tool_setup(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)))
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], schema)


def test_required_schema_moves_each_tools_defs_to_the_root():
    person = {
        "type": "function",
        "function": {
            "name": "add_person",
            "parameters": {
                "type": "object",
                "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "string"}}, "required": ["zip"]}},
                "properties": {"home": {"$ref": "#/$defs/Address"}, "friend": {"$ref": "#"}},
                "required": ["home"],
            },
        },
    }
    schema = required_schema(tool_setup(chat(tools=[person, TIME], tool_choice="required")))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate([{"name": "add_person", "arguments": {"home": {"zip": "1"}, "friend": {"home": {"zip": "2"}}}}], schema)
    for bad in ({"home": {}}, {"home": {"zip": "1"}, "friend": {"home": {}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "add_person", "arguments": bad}], schema)


def test_named_constraint_is_the_functions_parameters():
    setup = tool_setup(chat(tools=[TIME, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    # closed at the root, and no free whitespace
    compact = {**WEATHER["function"]["parameters"], "additionalProperties": False, "x-guidance": CALL_JSON_OPTIONS}
    assert setup.constraint() == StructuredOutputsParams(json=compact, field="tools[1].function.parameters")
    assert tool_setup(chat(tools=[WEATHER])).constraint() is None  # auto: free decoding


# ---- prompt and history ---------------------------------------------------------------------


def test_template_reads_tools():
    assert template_reads_tools("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% endfor %}")
    assert template_reads_tools({"default": "x", "tool_use": "{%- for tool in tools %}{% endfor %}"})
    assert not template_reads_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_reads_tools("You can use tools. {% for m in messages %}{% endfor %}")  # text, not code
    assert not template_reads_tools(None)


def test_tools_merge_into_the_system_message():
    setup = tool_setup(chat(tools=[WEATHER]))
    merged = with_tools_offered([{"role": "system", "content": "Be brief."}, *USER], setup)
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in merged[0]["content"] and "<tool_call>" in merged[0]["content"]
    fresh = with_tools_offered(USER, setup)
    assert [m["role"] for m in fresh] == ["system", "user"]


def test_history_rendered_hermes_style_for_templates_without_tools():
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    out = render_history(history, native=False)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert "tool_calls" not in out[1]
    assert out[1]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert out[2]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    native = render_history(history, native=True)
    assert [m["role"] for m in native] == ["user", "assistant", "tool", "tool"]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # templates read an object


def test_bad_history_call_names_its_place():
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]
    assert invalid(render_history, bad, False).param == "messages[0].tool_calls[0]"


# ---- parsers ---------------------------------------------------------------------------------


def parse(setup_body: dict, text: str, step: int | None = None) -> tuple[str | None, list[tuple[str, dict]] | None, list[DeltaMessage]]:
    """Parse `text` whole (step None) or fed `step` characters at a time."""
    parser: ChoiceParser = tool_setup(chat(**setup_body)).parser()
    if step is None:
        deltas = parser.feed(text) + parser.finish()
    else:
        deltas = [d for i in range(0, len(text), step) for d in parser.feed(text[i : i + step])] + parser.finish()
    content, calls = merge(deltas)
    return content, calls and [(c.function.name, json.loads(c.function.arguments)) for c in calls], deltas


AUTO = {"tools": [WEATHER, TIME]}
AUTO_CASES = {
    "plain answer": ("Hello there.\n", "Hello there.\n", None),
    "hermes call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [("get_weather", {"city": "Paris"})]),
    "text then call": (
        'Let me look.\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n',
        "Let me look.",
        [("get_time", {"tz": "UTC"})],
    ),
    "two calls, text between": (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nand\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        "and",
        [("get_time", {}), ("get_weather", {"city": "Rome"})],
    ),
    "unclosed call at the end": ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [("get_time", {})]),
    "not a call inside the tags": ("<tool_call>oops</tool_call> ok", "<tool_call>oops</tool_call> ok", None),
    "a tag-like text": ("a <tool and <tool_c", "a <tool and <tool_c", None),
    "bare llama-style call": ('  {"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    "bare calls separated by ;": (
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}',
        None,
        [("get_time", {}), ("get_weather", {"city": "X"})],
    ),
    "bare JSON that is not a call": ('{"name": "Bob", "age": 3} is a JSON', '{"name": "Bob", "age": 3} is a JSON', None),
    "bare call of an unknown function": ('{"name": "rm", "arguments": {}}', '{"name": "rm", "arguments": {}}', None),
    "JSON never closed": ('{"name": "get_time", "arguments": {', '{"name": "get_time", "arguments": {', None),
    "braces inside strings": ('{"name": "get_weather", "arguments": {"city": "}{\\"]"}}', None, [("get_weather", {"city": '}{"]'})]),
}


@pytest.mark.parametrize("step", [None, 1, 3])
@pytest.mark.parametrize("case", AUTO_CASES, ids=list(AUTO_CASES))
def test_auto_parsing(case, step):
    text, content, calls = AUTO_CASES[case]
    assert parse(AUTO, text, step)[:2] == (content, calls)


def test_auto_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
    assert parse({**AUTO, "parallel_tool_calls": False}, text)[1] == [("get_time", {})]


def test_auto_holds_back_a_possible_tag_then_streams_the_call_whole():
    parser = tool_setup(chat(**AUTO)).parser()
    assert parser.feed("Hi <tool") == [DeltaMessage(content="Hi")]
    assert parser.feed("_call>{\"name\": \"get_time\", ") == []
    first, rest = parser.feed('"arguments": {}}</tool_call>')
    assert first.tool_calls[0].id.startswith("call_") and first.tool_calls[0].function.arguments == ""
    assert first.model_dump() == {"tool_calls": [{"index": 0, "id": first.tool_calls[0].id, "type": "function", "function": {"name": "get_time", "arguments": ""}}]}
    assert rest.model_dump() == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert parser.finish() == [] and parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


def test_named_streams_the_arguments_as_they_come():
    body = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    text = ' {"city": "Paris", "unit": "c"}\n'
    content, calls, deltas = parse(body, text, step=2)
    assert content is None and calls == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert deltas[0].tool_calls[0].function.name == "get_weather" and len(deltas) > 5  # fragments, not one piece
    whole = merge(parse(body, text)[2])[1][0].function.arguments
    assert whole == merge(deltas)[1][0].function.arguments == text.strip()


@pytest.mark.parametrize("step", [None, 1, 4])
def test_required_array(step):
    body = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "]"}}]'
    content, calls, _ = parse(body, text, step)
    assert content is None and calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "]"})]
    # cut short before any call closed: the text is the content
    assert parse(body, '[{"name": "get_weather", "argu', step)[:2] == ('[{"name": "get_weather", "argu', None)
    one = parse({**body, "parallel_tool_calls": False}, text, step)[1]
    assert one == [("get_weather", {"city": "Paris"})]


def test_call_from_json_shapes():
    assert call_from_json({"name": "f", "arguments": {"x": 1}}).arguments == '{"x": 1}'
    assert call_from_json({"name": "f"}).arguments == "{}"
    assert call_from_json({"name": "f"}, need_arguments=True) is None
    assert call_from_json({"name": "f", "arguments": "[1]"}) is None
    assert call_from_json({"name": "f", "arguments": {}}, names={"g"}) is None
    assert call_from_json(["f"]) is None


def test_json_end_is_incremental():
    scanner, buffer = JsonEnd(), ""
    for piece in ['{"a": "}', '\\"', '", "b": [1, {}', "]}", " tail"]:
        buffer += piece
        end = scanner.scan(buffer)
        if end is not None:
            break
    assert buffer[:end] == '{"a": "}\\"", "b": [1, {}]}'
    assert AutoParser(["f"]).feed("") == []


# ---- the prompt, rendered ------------------------------------------------------------------

NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.model.tokenizer import Tokenizer
    from tests.support.tiny_models import build_tokenizer

    return Tokenizer(build_tokenizer())


def render(tokenizer, template: str | None = None, **body) -> str:
    from kvserve.server.chat import _render_prompt, _template_kwargs

    request = chat(**body)
    if template is not None:
        tokenizer.hf.chat_template, saved = template, tokenizer.hf.chat_template
    try:
        text, ids = _render_prompt(tokenizer, request, tool_setup(request), _template_kwargs(request))
    finally:
        if template is not None:
            tokenizer.hf.chat_template = saved
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    return text


def test_chatml_gets_the_hermes_system_section(tokenizer):
    text = render(tokenizer, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n") and "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert render(tokenizer, tools=[WEATHER], tool_choice="none") == render(tokenizer)


def test_a_template_with_a_tool_format_gets_tools(tokenizer):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    text = render(tokenizer, NATIVE_TEMPLATE, tools=[WEATHER, TIME], messages=history)
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather get_time<|im_end|>\n")
    assert "CALL get_weather Oslo" in text  # the arguments reach the template as an object
    assert "# Tools" not in text
