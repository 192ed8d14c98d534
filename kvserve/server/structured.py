"""From a request's structured-output fields to the one constraint its output obeys.

Both generation endpoints read the same fields (all on `SamplingRequest`):

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}` (JSON valid against `schema`);
- vLLM's `structured_outputs` extra: exactly one of `json` (a schema, or its JSON text),
  `json_object`, `regex`, `choice`, `grammar`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them may ask for a constraint. Shapes are checked here, with a 400 naming the
field; whether the grammar library can honour a schema is decided when the engine compiles it
(`AsyncLLMEngine.prepare_prompt`), whose error names `StructuredOutputsParams.field`.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import SamplingRequest
from kvserve.structured.params import StructuredOutputsParams

# vLLM's structured_outputs keys that pick the constraint; its other keys (backend choice,
# whitespace options, …) tune how a backend compiles and are accepted and ignored here
_CONSTRAINT_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_UNSUPPORTED_KEYS = ("structural_tag",)
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_of(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint `request` asks for, or None; InvalidRequestError (a 400) naming the field
    when a field is malformed or two fields both ask for one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if request.response_format is not None:
        params = _from_response_format(request.response_format.type, request.response_format.json_schema)
        if params is not None:
            found.append(("response_format", params))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(request.structured_outputs)))
    for name in _GUIDED:
        value = getattr(request, name, None)
        if value is not None:
            found.append((name, _from_guided(name, value)))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise InvalidRequestError(
            f"{' and '.join(names)} each ask for a structured output; give only one of them", names[1]
        )
    return found[0][1] if found else None


def _from_response_format(type_: str, json_schema: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if type_ == "text":
        if json_schema is not None:
            raise InvalidRequestError("response_format.json_schema goes with type 'json_schema', not 'text'", "response_format.json_schema")
        return None
    if type_ == "json_object":
        if json_schema is not None:
            raise InvalidRequestError(
                "response_format.json_schema goes with type 'json_schema', not 'json_object'", "response_format.json_schema"
            )
        return StructuredOutputsParams(json_object=True, field="response_format")
    if type_ == "json_schema":
        if json_schema is None:
            raise InvalidRequestError(
                "response_format of type 'json_schema' needs a json_schema object: {\"name\": …, \"schema\": {…}}",
                "response_format.json_schema",
            )
        return StructuredOutputsParams(json=_json_schema(json_schema), field="response_format.json_schema.schema")
    raise InvalidRequestError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {type_!r}", "response_format.type"
    )


def _json_schema(spec: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's json_schema object: name (required), schema, strict, description."""
    field = "response_format.json_schema"
    name = spec.get("name")
    if name is None:
        raise InvalidRequestError(f"{field}.name is required", f"{field}.name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{field}.name must be a non-empty string", f"{field}.name")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError(f"{field}.strict must be a boolean", f"{field}.strict")
    if "description" in spec and spec["description"] is not None and not isinstance(spec["description"], str):
        raise InvalidRequestError(f"{field}.description must be a string", f"{field}.description")
    schema = spec.get("schema")
    if schema is None:  # OpenAI lets it out: any JSON object
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{field}.schema must be a JSON schema object, got {_kind(schema)}", f"{field}.schema")
    return schema


def _from_structured_outputs(spec: dict[str, Any]) -> StructuredOutputsParams:
    field = "structured_outputs"
    for key in _UNSUPPORTED_KEYS:
        if spec.get(key) is not None:
            raise InvalidRequestError(f"{field}.{key} is not supported; use one of {', '.join(_CONSTRAINT_KEYS)}", f"{field}.{key}")
    given = [k for k in _CONSTRAINT_KEYS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(
            f"{field} needs exactly one of {', '.join(_CONSTRAINT_KEYS)}; got {', '.join(given) or 'none'}", field
        )
    key = given[0]
    value = spec[key]
    where = f"{field}.{key}"
    if key == "json":
        return StructuredOutputsParams(json=_schema_value(value, where), field=where)
    if key == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{where} must be true", where)
        return StructuredOutputsParams(json_object=True, field=where)
    if key == "choice":
        return StructuredOutputsParams(choice=_choices(value, where), field=where)
    _string(value, where)
    return StructuredOutputsParams(**{key: value}, field=where)


def _from_guided(name: str, value: Any) -> StructuredOutputsParams:
    if name == "guided_json":
        return StructuredOutputsParams(json=_schema_value(value, name), field=name)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=_choices(value, name), field=name)
    _string(value, name)
    return StructuredOutputsParams(**{name.removeprefix("guided_"): value}, field=name)


def _schema_value(value: Any, field: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{field} is not valid JSON: {exc}", field) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field} must be a JSON schema object, got {_kind(value)}", field)
    return value


def _choices(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequestError(f"{field} must be a non-empty list of strings", field)
    return tuple(value)


def _string(value: Any, field: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{field} must be a non-empty string", field)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )
