"""Log-probabilities in OpenAI's two shapes.

The engine hands, per output token, a dict {token id: logprob} holding the sampled token
and the top-k alternatives. Completions want parallel lists (`tokens`, `token_logprobs`,
`top_logprobs` as {text: logprob}, `text_offset`); chat wants one object per token with
its UTF-8 `bytes` and a ranked `top_logprobs` list.
"""

from __future__ import annotations

import re

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as a printable character; this undoes it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece's byte tokens


class TokenTexts:
    """Each token's own text and UTF-8 bytes, decoded once per token id.

    A token holding part of a multi-byte character decodes to U+FFFD, and so would
    its neighbours: such a token is shown OpenAI's way, as "bytes:\\xe2\\x80", with its
    true bytes, so no two alternatives share a name and `bytes` can be reassembled."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self._entry(token_id)[1])

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entry = (text, text.encode())
            if "\ufffd" in text:
                raw = self._raw_bytes(token_id)
                if raw is not None:
                    entry = ("bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw)
            self._cache[token_id] = entry
        return entry

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens([token_id])[0]
        if not isinstance(piece, str):
            return None
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None


def _ranked(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    # the entry may hold num_top + 1 tokens when the sampled one is not among the top
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], num_top: int, texts: TokenTexts, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The logprobs of these tokens, and the text offset just past them (for the next chunk)."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        text = texts(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry[token_id])
        top: dict[str, float] = {}
        for t, lp in _ranked(entry, num_top):
            top.setdefault(texts(t), lp)  # two tokens of one text: keep the likelier
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result, text_offset


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], num_top: int, texts: TokenTexts) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = texts(token_id)
        content.append(
            TokenLogprob(
                token=text,
                logprob=entry[token_id],
                bytes=texts.bytes(token_id),
                top_logprobs=[TopLogprob(token=texts(t), logprob=lp, bytes=texts.bytes(t)) for t, lp in _ranked(entry, num_top)],
            )
        )
    return ChatLogprobs(content=content)
