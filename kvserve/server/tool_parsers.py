"""Tool calls out of generated text, fed a delta at a time (streaming) or all at once.

Three shapes, one parser each, all incremental so a stream and a whole answer parse alike:

- `AutoParser` (tool_choice "auto": the model wrote what it liked): Hermes blocks
  `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, and a bare JSON call
  `{"name": …, "arguments" | "parameters": {…}}` (Llama 3's way) at the start of the output
  or right after another bare call (`;` may separate them). Text outside calls is content.
  Text that may be the start of `<tool_call>` is held back, as a stop string is; a call is
  reported whole once it closes.
- `ArgumentsParser` (a named function: decoding was constrained to its arguments object):
  the output is the arguments; fragments pass straight through.
- `ArrayParser` (tool_choice "required": constrained to `[{"name", "arguments"}, …]`): each
  call is reported once its object closes.

Events are `Content(text)`, `CallStart(name)` (a new call, arguments to follow), and
`Arguments(text)` (a fragment of the current call's arguments, JSON text).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    name: str


@dataclasses.dataclass(frozen=True)
class Arguments:
    text: str


Event = Content | CallStart | Arguments


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


def call_from_json(obj: Any, names: Iterable[str] | None = None, need_arguments: bool = False) -> ParsedCall | None:
    """`{"name": str, "arguments" | "parameters": object-or-its-JSON-text}` as a call, else None.
    `names`: the functions that may be called (others are not calls); `need_arguments`: a
    missing arguments key means not a call (for bare JSON, where a plain answer may look alike)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        if need_arguments:
            return None
        args: Any = {}
    else:
        args = obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class JsonEnd:
    """Where a JSON object or array ends, scanned incrementally over a growing buffer."""

    def __init__(self) -> None:
        self.pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def scan(self, buffer: str) -> int | None:
        """Scan buffer[pos:]; the index just past the closing bracket, or None if not yet."""
        for i in range(self.pos, len(buffer)):
            ch = buffer[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(buffer)
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class _Parser:
    def __init__(self) -> None:
        self.num_calls = 0

    def _call(self, call: ParsedCall) -> list[Event]:
        self.num_calls += 1
        return [CallStart(call.name), Arguments(call.arguments)]


class AutoParser(_Parser):
    def __init__(self, names: Iterable[str], parallel: bool = True):
        super().__init__()
        self.names = frozenset(names)
        self.parallel = parallel
        self._buffer = ""
        self._state = "text"  # "text" | "call" (inside <tool_call>) | "bare" (inside a leading JSON value)
        self._bare_ok = True  # a bare JSON call may start here: the output's start, or after a bare call
        self._skip_ws = False  # just after a call: its trailing whitespace is not content
        self._pending_ws = ""  # content's trailing whitespace, held until content follows it
        self._scanner = JsonEnd()
        self._content_seen = False

    def feed(self, delta: str) -> list[Event]:
        self._buffer += delta
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        events = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._state == "call":
            call = self._parse_block(rest)  # closed by the end of the output, not by the tag
            if call is not None:
                events += self._emit_call(call)
            else:
                events += self._content(TOOL_CALL_OPEN + rest)
        elif rest:
            events += self._content(rest)
        if self._pending_ws and not self.num_calls:
            events.append(Content(self._pending_ws))
        self._pending_ws = ""
        return events

    def _step(self, events: list[Event]) -> bool:
        """Consume what the buffer allows; True while progress can continue."""
        if self._state == "text":
            if self._skip_ws:
                stripped = self._buffer.lstrip()
                if self._bare_ok:
                    stripped = stripped.lstrip(";").lstrip()
                if not stripped:
                    self._buffer = ""
                    return False
                self._buffer, self._skip_ws = stripped, False
            if self._bare_ok:
                stripped = self._buffer.lstrip()
                if not stripped:
                    self._pending_ws += self._buffer
                    self._buffer = ""
                    return False
                self._pending_ws += self._buffer[: len(self._buffer) - len(stripped)]
                self._buffer = stripped
                self._bare_ok = False
                if stripped[0] in "{[" and self.names:
                    self._state, self._scanner = "bare", JsonEnd()
                    return True
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                before = self._buffer[:start]
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
                events += self._content(before)
                self._pending_ws = ""  # whitespace before a call is not content
                self._state = "call"
                return True
            keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
            ready = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(ready) :]
            events += self._content(ready)
            return False
        if self._state == "call":
            end = self._buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return False
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE) :]
            self._state = "text"
            call = self._parse_block(body)
            if call is not None:
                events += self._emit_call(call)
            else:  # not a call after all: the block is text
                events += self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
            return True
        # "bare"
        end = self._scanner.scan(self._buffer)
        if end is None:
            return False
        value, self._buffer = self._buffer[:end], self._buffer[end:]
        self._state = "text"
        calls = self._parse_bare(value)
        if calls:
            for call in calls:
                events += self._emit_call(call)
            self._bare_ok = True
        else:
            events += self._content(value)
        return True

    def _parse_block(self, body: str) -> ParsedCall | None:
        try:
            return call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return None

    def _parse_bare(self, value: str) -> list[ParsedCall]:
        try:
            obj = json.loads(value)
        except json.JSONDecodeError:
            return []
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from_json(item, self.names, need_arguments=True) for item in items]
        return calls if calls and all(calls) else []

    def _emit_call(self, call: ParsedCall) -> list[Event]:
        self._pending_ws = ""
        self._skip_ws = True
        if self.num_calls and not self.parallel:
            return []  # parallel_tool_calls false: the first call only
        return self._call(call)

    def _content(self, text: str) -> list[Event]:
        """Content, less any trailing whitespace (held: a call may follow it)."""
        if not text:
            return []
        full = self._pending_ws + text
        stripped = full.rstrip()
        self._pending_ws = full[len(stripped) :]
        if not stripped:
            return []
        self._content_seen = True
        return [Content(stripped)]


class ArgumentsParser(_Parser):
    """The whole output is one call's arguments (decoding was constrained to them)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._started = False
        self._pending_ws = ""
        self._begun = False

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        self.num_calls = 1
        return [CallStart(self.name)]

    def feed(self, delta: str) -> list[Event]:
        events = self._start()
        if not self._begun:
            delta = delta.lstrip()
            if not delta:
                return events
            self._begun = True
        full = self._pending_ws + delta
        stripped = full.rstrip()
        self._pending_ws = full[len(stripped) :]
        if stripped:
            events.append(Arguments(stripped))
        return events

    def finish(self) -> list[Event]:
        return self._start()


class ArrayParser(_Parser):
    """`[{"name": …, "arguments": {…}}, …]`: a call per element, reported as each closes.
    Output that is not such an array (cut short, say) is content, if no call came of it."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._seen = ""  # everything fed, for the fallback
        self._opened = False
        self._closed = False
        self._scanner: JsonEnd | None = None

    def feed(self, delta: str) -> list[Event]:
        self._buffer += delta
        self._seen += delta
        events: list[Event] = []
        while not self._closed:
            if self._scanner is None:
                stripped = self._buffer.lstrip()
                if not self._opened:
                    if not stripped:
                        break
                    if stripped[0] != "[":
                        self._closed = True  # not an array; finish() makes it content
                        break
                    self._opened, self._buffer = True, stripped[1:]
                    continue
                stripped = stripped.lstrip(",").lstrip()
                self._buffer = stripped
                if not stripped:
                    break
                if stripped[0] == "]":
                    self._closed = True
                    break
                self._scanner = JsonEnd()
            end = self._scanner.scan(self._buffer)
            if end is None:
                break
            element, self._buffer, self._scanner = self._buffer[:end], self._buffer[end:], None
            try:
                call = call_from_json(json.loads(element))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                events += self._call(call)
        return events

    def finish(self) -> list[Event]:
        events = self.feed("")
        if not self.num_calls and self._seen.strip():
            events.append(Content(self._seen))
        return events
