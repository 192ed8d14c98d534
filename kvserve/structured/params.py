"""What a request asks its output to obey. Exactly one constraint per request.

The server builds these from OpenAI's `response_format` (json_object, json_schema) and
from vLLM's `structured_outputs` extra (json, regex, choice, grammar); tool calls with
`tool_choice` `required` or a named function build a `json` one. Validated here for
shape only; whether the grammar library can honour a schema is decided when it compiles
(`kvserve.structured.backend`), which names the feature it cannot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvserve.errors import InvalidRequestError

# How constrained JSON is laid out: on one line with json.dumps's separators. llguidance's
# default (any whitespace anywhere) let the 135M default model run on with newlines and
# spaces until max_tokens, never closing the object; a fixed layout always can close.
# The backend compiles every JSON schema with it (llguidance's `defaults`); tool-call schemas
# also carry it under their root-level "x-guidance" key (server/tools.py).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings, exactly
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or GBNF
    # the field the constraint came from, named in errors ("response_format", "tool_choice", …)
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [
            name
            for name, set_ in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if set_
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.field} needs exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}",
                self.field,
            )
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(f"{self.field}: a JSON schema must be an object", self.field)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(f"{self.field}: choice must be a non-empty list of strings", self.field)
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{self.field}: {name} must be a non-empty string", self.field)
