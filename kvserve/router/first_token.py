"""A handed-over stream's first token, sent to the client from the prefill instance's answer.

Without this, a streaming client of a prefill/decode pair sees nothing until the decode
instance has the KV and has run a step: TTFT would include the handoff. Instead the router
sends the first token as soon as the prefill instance answers (`first_chunks`), then relays
the decode instance's stream with that token taken out (`FirstTokenSplice`): its text, its
logprobs entry, and the chat role chunk already sent; every chunk carries the first chunk's
id and creation time, so the client sees one completion.

Only for one sample (n = 1), and where the first token's text cannot be held back: no stop strings (a stop string may
span the first two tokens, and the prefill answer, finished at one token, shows text an
unfinished stream would hold back), no tool parsing (the decode side's parser must see the
text from its start), no echo, and a first token that is whole UTF-8 text (`early_eligible`,
`first_text_is_whole`). Otherwise the decode instance's stream is relayed as it is.
"""

from __future__ import annotations

import json


def early_eligible(path: str, payload: dict) -> bool:
    """Whether a streamed handoff request may get its first token from the prefill answer."""
    if not payload.get("stream") or payload.get("stop") or (payload.get("n") or 1) != 1:
        return False
    if path.endswith("/chat/completions"):
        return not payload.get("tools") or payload.get("tool_choice") == "none"
    return not payload.get("echo")


def first_text(path: str, answer: dict) -> str:
    choice = answer["choices"][0]
    if path.endswith("/chat/completions"):
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def first_text_is_whole(text: str) -> bool:
    """A token ending inside a multi-byte character decodes to U+FFFD until the next one
    completes it: the decode side's stream gives that character whole later."""
    return not text.endswith("\ufffd")


def sse_event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def first_chunks(path: str, answer: dict) -> bytes:
    """The stream's opening from the prefill instance's whole answer: the role chunk (chat)
    and the first token, not finished (the decode instance says how it ends)."""
    choice = answer["choices"][0]
    head = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}
    if path.endswith("/chat/completions"):
        head["object"] = "chat.completion.chunk"
        role = sse_event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                          "finish_reason": None}]})  # fmt: skip
        return role + sse_event({**head, "choices": [{"index": 0, "delta": {"content": first_text(path, answer)},
                                                 "logprobs": choice.get("logprobs"), "finish_reason": None}]})  # fmt: skip
    head["object"] = "text_completion"
    return sse_event({**head, "choices": [{"index": 0, "text": first_text(path, answer), "logprobs": choice.get("logprobs"),
                                      "finish_reason": None}]})  # fmt: skip


class FirstTokenSplice:
    """Relays the decode instance's SSE stream minus what `first_chunks` already sent."""

    def __init__(self, path: str, answer: dict):
        self.chat = path.endswith("/chat/completions")
        self.id, self.created = answer["id"], answer["created"]
        self.text_left = len(first_text(path, answer))  # characters of the first token still to drop
        self.logprob_left = answer["choices"][0].get("logprobs") is not None
        self.role_left = self.chat
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        """Bytes of the decode stream in, whole events out (rewritten where needed)."""
        self._buffer += data
        out = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            out.append(self._event(event))
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event + b"\n\n"
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict) or "choices" not in chunk:  # an error event, as it is
            return event + b"\n\n"
        chunk["id"], chunk["created"] = self.id, self.created
        kept = []
        for choice in chunk["choices"]:
            if self._strip(choice):
                kept.append(choice)
        if chunk["choices"] and not kept:
            return b""
        chunk["choices"] = kept
        return sse_event(chunk)

    def _strip(self, choice: dict) -> bool:
        """Take the first token out of one choice's delta; whether anything is left to send."""
        finishing = choice.get("finish_reason") is not None
        if self.chat:
            delta = choice.get("delta") or {}
            if self.role_left and delta.get("role") and not delta.get("content"):
                self.role_left = False
                return finishing
            content = delta.get("content") or ""
            if self.text_left and content:
                cut = min(self.text_left, len(content))
                self.text_left -= cut
                delta["content"] = content[cut:] or None
            logprobs = choice.get("logprobs")
            if self.logprob_left and logprobs and logprobs.get("content"):
                logprobs["content"] = logprobs["content"][1:]
                self.logprob_left = False
                if not logprobs["content"]:
                    choice["logprobs"] = None
            return finishing or bool(delta.get("content")) or bool(delta.get("tool_calls")) or choice.get("logprobs") is not None
        text = choice.get("text") or ""
        if self.text_left and text:
            cut = min(self.text_left, len(text))
            self.text_left -= cut
            choice["text"] = text[cut:]
        logprobs = choice.get("logprobs")
        if self.logprob_left and logprobs and logprobs.get("tokens"):
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if isinstance(logprobs.get(key), list):
                    logprobs[key] = logprobs[key][1:]
            self.logprob_left = False
            if not logprobs["tokens"]:
                choice["logprobs"] = None
        return finishing or bool(choice["text"]) or choice.get("logprobs") is not None
