"""Tool calls on chat: `tools`, `tool_choice`, `parallel_tool_calls`, in and out.

In: the tools are offered through the chat template's own tool format when it has one (the
template reads `tools`); otherwise (ChatML, as the default model's) as a system-prompt
section in the Hermes format, which asks for `<tool_call>{"name", "arguments"}</tool_call>`.
History turns with tool calls and tool results are rendered the same way for such templates.

Out, by `tool_choice`:
- "none" (the default without tools): tools not offered; a plain answer.
- "auto" (the default with tools): decoding is free; the output is parsed for calls
  (`tool_parsers.AutoParser`), the text around them is the content.
- "required": decoding is constrained to a JSON array of `{"name", "arguments"}` calls, one
  of the tools each (at most one call if `parallel_tool_calls` is false), so it always parses.
- a named function: decoding is constrained to that function's `parameters` schema; the
  output is its arguments.
A request whose output had calls ends with finish_reason "tool_calls" instead of "stop".
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import uuid
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvserve.server.tool_parsers import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Arguments,
    ArgumentsParser,
    ArrayParser,
    AutoParser,
    CallStart,
    Content,
    Event,
)
from kvserve.structured.params import JSON_LAYOUT, StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# How a constrained call is written: the one JSON layout of kvserve/structured (no free
# whitespace, json.dumps' separators, as calls are written in training data), under
# llguidance's root-level "x-guidance" key; other validators ignore the unknown keyword.
CALL_JSON_OPTIONS: dict[str, Any] = JSON_LAYOUT
_TEMPLATE_READS_TOOLS = re.compile(r"\{[{%](?:(?![%}]\}).)*\btools\b", re.S)


@dataclasses.dataclass(frozen=True)
class ToolSetup:
    """A request's tools, validated, and what it asks of them."""

    tools: tuple[ChatTool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function, for choice "named"
    parallel: bool = True

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]

    def parameters(self, i: int) -> dict[str, Any]:
        return self.tools[i].function.parameters or EMPTY_PARAMETERS

    def constraint(self) -> StructuredOutputsParams | None:
        """What decoding must obey: the named function's arguments, or the array of calls."""
        if self.choice == "named":
            i = self.names.index(self.named)
            return StructuredOutputsParams(json=_compact(arguments_schema(self.parameters(i))), field=f"tools[{i}].function.parameters")
        if self.choice == "required":
            return StructuredOutputsParams(json=_compact(required_schema(self)), field="tools")
        return None

    def parser(self) -> "ChoiceParser | None":
        """A fresh parser for one sample's output; None when the output is plain content."""
        if self.choice == "named":
            return ChoiceParser(ArgumentsParser(self.named))
        if self.choice == "required":
            return ChoiceParser(ArrayParser(), limit=None if self.parallel else 1)
        if self.choice == "auto":
            return ChoiceParser(AutoParser(self.names, self.parallel))
        return None

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as OpenAI sends them (and as chat templates read them)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]


def tool_setup(request: ChatCompletionRequest) -> ToolSetup:
    """Validate tools, tool_choice and parallel_tool_calls (a 400 naming the field)."""
    tools = tuple(request.tools or ())
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequestError(f"tools[{i}].type must be 'function', got {tool.type!r}", f"tools[{i}].type")
        name = tool.function.name
        if not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if name in seen:
            raise InvalidRequestError(
                f"tools[{i}].function.name {name!r} is already the name of tools[{seen[name]}]; names must be unique",
                f"tools[{i}].function.name",
            )
        seen[name] = i
    choice = request.tool_choice
    if choice is None:
        return ToolSetup(tools, "auto" if tools else "none", parallel=request.parallel_tool_calls)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": {{\"name\": …}}}}; got {choice!r}",
                "tool_choice",
            )
        if choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolSetup(tools, choice, parallel=request.parallel_tool_calls)
    if choice.get("type") != "function":
        raise InvalidRequestError(f"tool_choice.type must be 'function', got {choice.get('type')!r}", "tool_choice.type")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("tool_choice.function.name must be a function's name", "tool_choice.function.name")
    if not tools:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, but the request has no tools", "tool_choice")
    if name not in seen:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(seen)})", "tool_choice"
        )
    return ToolSetup(tools, "named", named=name, parallel=request.parallel_tool_calls)


# ---- constraint ------------------------------------------------------------------------


def required_schema(setup: ToolSetup) -> dict[str, Any]:
    """A JSON array of calls, each {"name": one of the tools, "arguments": that tool's
    parameters}: at least one, at most one without parallel tool calls (as vLLM builds it).
    Each tool's own `$defs` and `$ref`s are moved to the root, where a `$ref` looks."""
    defs: dict[str, Any] = {}
    options = []
    for i, name in enumerate(setup.names):
        arguments = arguments_schema(setup.parameters(i))
        if _has_ref(arguments):
            arguments = _hoist(arguments, f"tool{i}", defs)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": options[0] if len(options) == 1 else {"anyOf": options},
    }
    if not setup.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """What a constrained call's arguments obey: the parameters schema, closed at its root
    (`additionalProperties: false`, as OpenAI's strict mode does) unless it says otherwise,
    so a model lists the declared arguments and stops instead of inventing more. A subset
    of what the schema accepts: the arguments still validate against it. Left open where
    the root combines schemas (allOf, $ref, …), which a closed root would break."""
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref", "if")
    if "properties" not in parameters or any(k in parameters for k in open_keys):
        return parameters
    return {**parameters, "additionalProperties": False}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if "x-guidance" in schema else {**schema, "x-guidance": CALL_JSON_OPTIONS}


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _hoist(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """`schema` as `{"$ref": "#/$defs/<prefix>"}`, it and its definitions put in `defs`, with
    every local `$ref` rewritten to where its target now is."""
    local_defs = {}
    body = copy.deepcopy(schema)
    for key in ("$defs", "definitions"):
        for name, sub in (body.pop(key, None) or {}).items():
            local_defs[(key, name)] = sub

    def target(ref: str) -> str:
        pointer = ref[1:]
        for key in ("$defs", "definitions"):
            for (k, name) in local_defs:
                head = f"/{key}/{_escape(name)}"
                if k == key and (pointer == head or pointer.startswith(head + "/")):
                    return f"#/$defs/{prefix}__{_escape(name)}{pointer[len(head):]}"
        return f"#/$defs/{prefix}{pointer}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (target(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    defs[prefix] = rewrite(body)
    for (_, name), sub in local_defs.items():
        defs[f"{prefix}__{name}"] = rewrite(sub)
    return {"$ref": f"#/$defs/{prefix}"}


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


# ---- prompt ------------------------------------------------------------------------------


def template_reads_tools(template: str | dict | None) -> bool:
    """Whether the chat template has a tool format of its own: its code reads `tools`."""
    if isinstance(template, dict):  # named templates; HF picks "tool_use" when tools are given
        return any(template_reads_tools(t) for t in template.values())
    return bool(template) and _TEMPLATE_READS_TOOLS.search(template) is not None


def system_prompt(setup: ToolSetup) -> str:
    """The Hermes tool section (as Qwen's and Hermes' templates write it), for templates
    without a tool format; what to answer follows tool_choice."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in setup.tool_dicts())
    head = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
    )
    if setup.choice == "named":
        return head + f"Call the function {setup.named} now: answer with only its arguments, as one JSON object."
    if setup.choice == "required":
        many = "one or more calls" if setup.parallel else "exactly one call"
        return head + (
            f"You must call a function now: answer with only a JSON array of {many}, "
            '[{"name": <function-name>, "arguments": <args-json-object>}].'
        )
    return head + (
        "For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def with_tools_offered(messages: list[dict[str, Any]], setup: ToolSetup) -> list[dict[str, Any]]:
    """`messages` with the tool section merged into the system message (one made if none)."""
    section = system_prompt(setup)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{section}" if first.get("content") else section
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def render_history(messages: list[dict[str, Any]], native: bool) -> list[dict[str, Any]]:
    """Tool turns of the history as the template reads them. `native`: the template has a
    tool format, and gets assistant `tool_calls` with their arguments as objects (as HF
    templates expect). Otherwise calls become `<tool_call>` text in the assistant turn and
    each run of tool results one user turn of `<tool_response>` blocks (Hermes' way)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            calls = _history_calls(calls, f"messages[{i}].tool_calls")
        if native:
            if calls is not None:
                message = {**message, "tool_calls": calls}
            out.append(message)
            continue
        if message.get("role") == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if calls is not None:
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            text = "\n".join(
                f"{TOOL_CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                for c in calls
            )
            message["content"] = f"{message['content']}\n{text}" if message.get("content") else text
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    return out


def _history_calls(calls: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{field}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", f"{field}[{j}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the text it is
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


# ---- output ------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceParser:
    """One sample's output as deltas (content, or a call's start and argument fragments),
    the same whether fed a step at a time or the whole text once."""

    def __init__(self, parser, limit: int | None = None):
        self._parser = parser
        self._limit = limit  # most calls reported (the array's maxItems, enforced again here)
        self._index = -1
        self._dropping = False

    @property
    def num_calls(self) -> int:
        return self._index + 1

    def feed(self, delta_text: str) -> list[DeltaMessage]:
        return self._deltas(self._parser.feed(delta_text))

    def finish(self) -> list[DeltaMessage]:
        return self._deltas(self._parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _deltas(self, events: list[Event]) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for event in events:
            if isinstance(event, Content):
                if self._dropping:
                    continue
                out.append(DeltaMessage(content=event.text))
            elif isinstance(event, CallStart):
                if self._limit is not None and self.num_calls >= self._limit:
                    self._dropping = True
                    continue
                self._dropping = False
                self._index += 1
                call = DeltaToolCall(index=self._index, id=new_call_id(), type="function", function=DeltaFunctionCall(name=event.name, arguments=""))
                out.append(DeltaMessage(tool_calls=[call]))
            elif isinstance(event, Arguments) and not self._dropping:
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=self._index, function=DeltaFunctionCall(arguments=event.text))]))
        return out


def merge(deltas: list[DeltaMessage]) -> tuple[str | None, list[ToolCall] | None]:
    """Deltas added up as a client does: (content, tool_calls); content is None beside calls
    when there is none, tool_calls None when there are no calls."""
    content = "".join(d.content for d in deltas if d.content)
    calls: list[dict[str, str]] = []
    for d in deltas:
        for c in d.tool_calls or ():
            if c.id is not None:
                calls.append({"id": c.id, "name": c.function.name, "arguments": ""})
            if c.function is not None and c.function.arguments:
                calls[c.index]["arguments"] += c.function.arguments
    if not calls:
        return content, None
    tool_calls = [ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=c["arguments"])) for c in calls]
    return content or None, tool_calls
